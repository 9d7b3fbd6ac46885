"""Small helpers shared across layers."""
from __future__ import annotations

import dataclasses
from typing import Any, Iterator

import torch


def tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside nested tuples, lists, dicts and dataclass instances (Hugging Face's ModelOutput)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from tensors_in(v)
    elif isinstance(obj, (tuple, list)):
        for v in obj:
            yield from tensors_in(v)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from tensors_in(getattr(obj, f.name, None))


def few(items, n: int = 5, show=repr) -> str:
    """The first ``n`` of ``items`` for a message, then how many more there are."""
    items = list(items)
    return ", ".join(map(show, items[:n])) + (f" and {len(items) - n} more" if len(items) > n else "")


def counted(n: int, word: str, plural: str | None = None) -> str:
    """``n`` and ``word``, plural (``plural``, by default ``word`` + s) unless n is 1 (``1 step``, ``2 steps``)."""
    return f"{n} {word if n == 1 else plural or word + 's'}"


def under(key: str, roots) -> bool:
    """``key`` (dotted) is one of ``roots`` or a key below one (``dist.backend`` is under ``dist``)."""
    return any(key == r or key.startswith(f"{r}.") for r in roots)


def plain_text(doc: str) -> str:
    """A docstring as a terminal prints it (``--help``): without reST's double backticks around literals."""
    return doc.replace("``", "")


def dtype_name(dtype: torch.dtype) -> str:
    """``float32`` for ``torch.float32``: a dtype as files and messages name it."""
    return str(dtype).removeprefix("torch.")


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


# Elements per row of the CPU reduction in ``sq_norm`` (see there; tests/unit/test_step.py
# derives its error bound from this value).
SQ_NORM_ROW = 256


def sq_norm(tensors, device: torch.device) -> torch.Tensor:
    """Sum of squares of every element, as a float64 scalar on ``device``. No host sync.

    Per tensor, never per fixed chunk, so the result does not depend on how a partition is cut into pieces.
    On an accelerator one ``torch._foreach_norm`` covers every tensor (a dot per 65536 elements made 43k
    launches, 89 ms, for 1.4 B params). On the CPU one fp32 norm loses digits with length, so rows of
    ``SQ_NORM_ROW`` elements are reduced and their norms summed in float64: on 10 M elements rows of 256
    erred by 3.7e-8 in 1.7 ms, one fp32 vector_norm by 1.3e-3, float64 by 3e-14 in 23 ms (Xeon, one thread).
    """
    flat = [t.reshape(-1) for t in tensors if t.numel()]
    parts = [_host_sq_norm(t) for t in flat if t.device.type == "cpu"]
    parts += _device_sq_norms([t for t in flat if t.device.type != "cpu"])
    if not parts:
        return torch.zeros((), dtype=torch.float64, device=device)
    return torch.stack([p.to(device, non_blocking=True) for p in parts]).sum()


def sq_norm_part(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The term ``sq_norm`` adds for non-empty ``t``, on ``device`` (stacked in order, they sum as ``sq_norm``)."""
    t = t.reshape(-1)
    part = _host_sq_norm(t) if t.device.type == "cpu" else _device_sq_norms([t])[0]
    return part if part.device == torch.device(device) else part.to(device, non_blocking=True)


def _host_sq_norm(t: torch.Tensor) -> torch.Tensor:
    if t.dtype not in (torch.float32, torch.float64):
        block = SQ_NORM_ROW << 14  # whole rows, so the rows are those of the unblocked tensor
        return torch.stack([_host_sq_norm(b.float()) for b in t.split(block)]).sum()
    m = t.numel() - t.numel() % SQ_NORM_ROW
    rows = torch.linalg.vector_norm(t[:m].reshape(-1, SQ_NORM_ROW), dim=1)  # [m / ROW] fp32 norms
    tail = t[m:]
    return rows.double().square().sum() + torch.dot(tail, tail).double()


def _device_sq_norms(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Squared norms, summed in float64, of same-device tensors: one fused launch per dtype class."""
    out = []
    for wide in (False, True):
        group = [t for t in tensors if (t.dtype == torch.float64) == wide]
        if group:  # 16-bit tensors accumulate and return their norm in fp32, not in 16 bits
            # (no public multi-tensor norm: clip_grad_norm_ calls this same private op)
            norms = torch._foreach_norm(group, 2, dtype=torch.float64 if wide else torch.float32)
            out.append(torch.stack(norms).double().square().sum())
    return out


def to_device(obj: Any, device: torch.device) -> Any:
    """Move every tensor inside nested tuples (named ones too), lists, dicts and dataclass instances (no copy when
    already there)."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, (tuple, list)):
        items = [to_device(v, device) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: to_device(getattr(obj, f.name), device)
                                           for f in dataclasses.fields(obj) if f.init})
    return obj
