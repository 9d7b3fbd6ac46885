"""C++ CPU optimizer kernels (csrc/cpu_optim), built on first use (``_loader``), with a pure-PyTorch fallback.

Where the build or import fails, ONE line on stderr says why and the optimizers keep their transforms;
``python -m framework.ops [status|build]`` reports, or builds ahead of time. Each kernel is one in-place
step (torch.optim semantics; ``step`` counts from 1) over equal-length lists of contiguous CPU fp32
tensors, writing ``out16`` (bf16/fp16 copies) in the same pass; ``decay_mask`` None decays all. A tensor
that does not fit raises TypeError/ValueError naming it (``strict=False``: returns False, nothing
changed). Under FRAMEWORK_OPS=0 (read on every call) nothing is built or imported.
"""
from __future__ import annotations

from types import ModuleType
from typing import Any, Iterable, Sequence

import torch
from torch import Tensor

from framework.ops import _loader
from framework.ops._loader import BuildUnavailable, check_environment

KERNELS = ("adam_step", "lion_step", "adagrad_step")

__all__ = ["BuildUnavailable", "KERNELS", "adagrad_step", "adam_step", "available", "build", "check_environment",
           "cpu_optim", "in_use", "lion_step", "status", "unavailable_reason", "usable"]


OFF = "off (FRAMEWORK_OPS turns them off: 0, false, no or off)"


def cpu_optim() -> ModuleType | None:
    """The extension (built or imported on the first call), or None (after one warning line unless FRAMEWORK_OPS=0)."""
    return _loader.status().module if _loader.kernels_enabled() else None


def available() -> bool:
    return cpu_optim() is not None


def unavailable_reason() -> str | None:
    """Why ``cpu_optim`` is None (the failed build's or import's reason, or OFF); builds as ``cpu_optim`` does."""
    return _loader.status().reason if _loader.kernels_enabled() else OFF


def build(force: bool = True) -> ModuleType:
    """Compile now, also over a finished build and a recorded failure (perhaps transient: a full disk);
    ``force=False``: import a finished build where there is one. Raises BuildUnavailable with the reason."""
    return _loader.load(build=True, force=force, retry=True)


def in_use() -> str | None:
    """Which path this process's optimizer steps on CPU fp32 tensors took (for a run's summary; builds nothing):
    ``kernels (isa NAME, N threads)``, ``fallback (REASON)`` or OFF; None where no step asked for the kernels."""
    if not _loader.kernels_enabled():
        return OFF
    if not _loader.status.cache_info().currsize:   # (status is cached: asked for once a step could use them)
        return None
    module, reason = _loader.status()
    return f"kernels (isa {module.isa()}, {torch.get_num_threads()} threads)" if module else f"fallback ({reason})"


def _cpu(tensors: Iterable[Tensor], dtypes: tuple) -> bool:
    return all(t.device.type == "cpu" and t.dtype in dtypes and t.is_contiguous() for t in tensors)


def usable(*tensor_lists: Sequence[Tensor], out16: Sequence[Tensor] | None = None) -> bool:
    """Whether the kernels can run on these tensors (checked before any build is triggered)."""
    return (_loader.kernels_enabled() and all(_cpu(ts, (torch.float32,)) for ts in tensor_lists)
            and (out16 is None or _cpu(out16, (torch.bfloat16, torch.float16))) and available())


def _run(kernel: str, tensors: tuple, out16: Sequence[Tensor] | None, scalars: tuple,
         decay_mask: Sequence[bool] | None, strict: bool) -> bool:
    module = cpu_optim()
    if module is None:
        raise BuildUnavailable(f"C++ CPU optimizer kernels unavailable: {unavailable_reason()}")
    mask = [] if decay_mask is None else [bool(m) for m in decay_mask]   # empty: decay every tensor
    return getattr(module, kernel)(*map(list, tensors), list(out16 or []), *scalars, mask, bool(strict))


def adam_step(params: Sequence[Tensor], grads: Sequence[Tensor], exp_avgs: Sequence[Tensor],
              exp_avg_sqs: Sequence[Tensor], *, step: int, lr: float, beta1: float = 0.9,
              beta2: float = 0.999, eps: float = 1e-8, weight_decay: float = 0.0, decoupled: bool = True,
              bias_correction: bool = True, out16: Sequence[Tensor] | None = None,
              decay_mask: Sequence[bool] | None = None, strict: bool = True) -> bool:
    return _run("adam_step", (params, grads, exp_avgs, exp_avg_sqs), out16,
                (int(step), float(lr), float(beta1), float(beta2), float(eps), float(weight_decay), bool(decoupled),
                 bool(bias_correction)), decay_mask, strict)


def lion_step(params: Sequence[Tensor], grads: Sequence[Tensor], exp_avgs: Sequence[Tensor], *, lr: float,
              beta1: float = 0.9, beta2: float = 0.99, weight_decay: float = 0.0,
              out16: Sequence[Tensor] | None = None, decay_mask: Sequence[bool] | None = None,
              strict: bool = True) -> bool:
    return _run("lion_step", (params, grads, exp_avgs), out16,
                (float(lr), float(beta1), float(beta2), float(weight_decay)), decay_mask, strict)


def adagrad_step(params: Sequence[Tensor], grads: Sequence[Tensor], state_sums: Sequence[Tensor], *, step: int,
                 lr: float, lr_decay: float = 0.0, weight_decay: float = 0.0, eps: float = 1e-10,
                 out16: Sequence[Tensor] | None = None, decay_mask: Sequence[bool] | None = None,
                 strict: bool = True) -> bool:
    return _run("adagrad_step", (params, grads, state_sums), out16,
                (int(step), float(lr), float(lr_decay), float(weight_decay), float(eps)), decay_mask, strict)


def status() -> dict[str, Any]:
    """What ``python -m framework.ops`` prints; never fails, imports a finished build but never compiles."""
    try:
        where = str(_loader.build_dir())
    except (OSError, BuildUnavailable):   # unreadable sources, a cache folder that cannot be: load says why
        where = "-"
    module, reason = _loader.attempt(build=False) if _loader.kernels_enabled() else (None, OFF)
    capability = torch.backends.cpu.get_cpu_capability()
    detected = module.detected_isa() if module is not None else {
        "AVX512": "avx512", "AVX2": "avx2", "DEFAULT": "scalar"}.get(capability, str(capability).lower())
    return {"built": module is not None, "reason": reason, "build_dir": where,
            "kernels": list(KERNELS) if module is not None else [],
            "isa": module.isa() if module is not None else None, "detected_isa": detected,
            "prefetch": module.prefetch_distance() if module is not None else None,
            "threads": torch.get_num_threads()}
