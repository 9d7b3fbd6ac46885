"""Small helpers shared across layers."""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import re
import warnings
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

import torch


_ABSENT = object()   # a dataclass field never set (its instance has no such attribute)


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``obj`` with each tensor ``t`` inside nested tuples (named ones too), lists, mappings and dataclass instances
    (Hugging Face's ModelOutput and BatchEncoding) replaced by ``fn(t)``. A container holding a replaced tensor is
    copied as its own type (a defaultdict keeps its factory, a frozen dataclass its class, a mapping its attributes);
    one holding none is returned as it is, so ``fn`` returning ``t`` copies nothing."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, Mapping):
        pairs = [(k, v, map_tensors(v, fn)) for k, v in obj.items()]
        if all(new is v for _, v, new in pairs):
            return obj
        out = copy.copy(obj) if isinstance(obj, MutableMapping) else {}   # (its type's constructor may take no pairs)
        for k, _, new in pairs:
            out[k] = new
        return out
    if isinstance(obj, (tuple, list)):
        items = [map_tensors(v, fn) for v in obj]
        if all(new is v for new, v in zip(items, obj)):
            return obj
        return type(obj)(*items) if isinstance(obj, tuple) and hasattr(obj, "_fields") else type(obj)(items)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        pairs = [(f.name, v, map_tensors(v, fn)) for f in dataclasses.fields(obj)
                 if (v := getattr(obj, f.name, _ABSENT)) is not _ABSENT]
        if all(new is v for _, v, new in pairs):
            return obj
        out = copy.copy(obj)   # (no __init__ run: a field it derives, or one with init=False, stays as it was)
        for name, _, new in pairs:
            object.__setattr__(out, name, new)
        return out
    return obj


def tensors_in(obj: Any) -> list[torch.Tensor]:
    """Every tensor inside nested containers, as ``map_tensors`` walks them."""
    found: list[torch.Tensor] = []
    map_tensors(obj, lambda t: found.append(t) or t)
    return found


_PLAIN = (bool, int, float, complex, str, bytes, torch.dtype, torch.device)   # values that hold no tensor


def hidden_in(obj: Any) -> type | None:
    """The type of the first object inside ``obj`` that ``map_tensors`` does not look into and that is not a plain
    value (None, a number, a string, a dtype, a device): an object of its own that may hold tensors; else None."""
    if obj is None or isinstance(obj, (torch.Tensor, *_PLAIN)):
        return None
    if isinstance(obj, Mapping):
        items = list(obj.values())
    elif isinstance(obj, (tuple, list)):
        items = obj
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        items = [getattr(obj, f.name, None) for f in dataclasses.fields(obj)]
    else:
        return type(obj)
    return next((t for v in items if (t := hidden_in(v)) is not None), None)


def few(items, n: int = 5, show=repr) -> str:
    """The first ``n`` of ``items`` for a message, then how many more there are."""
    items = list(items)
    return ", ".join(map(show, items[:n])) + (f" and {len(items) - n} more" if len(items) > n else "")


def counted(n: int, word: str, plural: str | None = None) -> str:
    """``n`` and ``word``, plural (``plural``, by default ``word`` + s) unless n is 1 (``1 step``, ``2 steps``)."""
    return f"{n} {word if n == 1 else plural or word + 's'}"


def yaml_spelling(value: Any) -> str:
    """``value`` as a config file spells it (null, true/false; anything else as ``str`` gives it)."""
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def under(key: str, roots) -> bool:
    """``key`` (dotted) is one of ``roots`` or a key below one (``dist.backend`` is under ``dist``)."""
    return any(key == r or key.startswith(f"{r}.") for r in roots)


def plain_text(doc: str) -> str:
    """A docstring as a terminal prints it (``--help``): without reST's double backticks around literals."""
    return doc.replace("``", "")


def finite_fp32(value: float) -> bool:
    """Whether ``value`` is finite as the fp32 optimizer state meets it: 1e39 is finite as a Python float but
    inf there, and an update by it is inf (NaN from the next step on)."""
    return bool(torch.tensor(value, dtype=torch.float32, device="cpu").isfinite())   # host sync: no (a host tensor)


def fp32_inf(value: float) -> str:
    """The end of a refusal of ``value`` (finite as a Python float) that ``finite_fp32`` refuses: the exact bound."""
    return f"got {value}, which is inf there; give at most {torch.finfo(torch.float32).max!r}"


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

    Per tensor, never per fixed chunk, so the result does not depend on how a partition is cut into pieces;
    it does on where the partitions end (their rows and per-tensor norms are rounded in fp32): zero3's
    partitions give a norm that differs from zero1/zero2's in the last bits (about 1e-8 relative).
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
    """Every tensor inside nested containers (as ``map_tensors`` walks them) on ``device`` (no copy when there)."""
    return map_tensors(obj, lambda t: t.to(device, non_blocking=True))


COMPILED = "_orig_mod."   # what torch.compile's wrapper puts before every name of the module it wraps


def unwrapped(module):
    """The module a ``torch.compile`` wrapper holds (its ``_orig_mod``), else ``module``: where the names a
    plain model of the same class has come from (weights saved for it, loaded from it)."""
    inner = getattr(module, "_orig_mod", None) if type(module).__name__ == "OptimizedModule" else None
    return inner if isinstance(inner, torch.nn.Module) else module


def replace_parameters(module: torch.nn.Module, new_of: dict[int, torch.nn.Parameter]) -> None:
    """Register ``new_of[id(old)]`` wherever each ``old`` is registered (tied weights stay tied), in one walk over
    the modules. ``new_of`` maps the id of each parameter to replace (alive in ``module``) to its replacement."""
    for sub in module.modules():
        # (the slots themselves: setattr would run the registration hooks and checks of a new parameter)
        for key, value in sub._parameters.items():
            if value is not None and id(value) in new_of:
                sub._parameters[key] = new_of[id(value)]


def replace_parameter(module: torch.nn.Module, old: torch.nn.Parameter,
                      new: torch.nn.Parameter) -> torch.nn.Parameter:
    """Register ``new`` wherever ``old`` is registered (tied weights stay tied)."""
    replace_parameters(module, {id(old): new})
    return new


@contextlib.contextmanager
def ignoring(message: str, category: type[Warning] = UserWarning):
    """The warnings that start with ``message`` dropped inside the block only. Not for a hot path or a block other
    threads run beside: ``catch_warnings`` restores the whole filter list on leaving (another thread's filter added
    meanwhile included) and each filter change resets every module's once-per-place warning registry."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=re.escape(message), category=category)
        yield
