"""Small helpers shared across rooms."""
from __future__ import annotations

from typing import Any, Iterator

import torch


def tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside nested tuples, lists, dicts and NamedTuples."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from tensors_in(v)
    elif isinstance(obj, (tuple, list)):
        for v in obj:
            yield from tensors_in(v)


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


SQ_NORM_CHUNK = 1 << 16


def sq_norm(tensors, device: torch.device) -> torch.Tensor:
    """Sum of squares of every element, as a float64 scalar on ``device``.

    One fp32 dot over millions of elements is off by ~4e-5 relative (measured: 10.8 M
    elements), enough to move clipping and make ranks or stages disagree in the 5th digit.
    Dots over 65536-element chunks, added in float64, are within ~1e-8 and cost the same
    (2.0 vs 1.9 ms for 10.8 M elements on one core).
    """
    parts = [torch.dot(c, c).double()
             for t in tensors for c in t.reshape(-1).split(SQ_NORM_CHUNK)
             for c in [c if c.dtype in (torch.float32, torch.float64) else c.float()]]
    if not parts:
        return torch.zeros((), dtype=torch.float64, device=device)
    return torch.stack(parts).sum()


def to_device(obj: Any, device: torch.device) -> Any:
    """Move every tensor inside nested tuples, lists and dicts (no copy when already there)."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, (tuple, list)):
        return type(obj)(to_device(v, device) for v in obj)
    return obj


def atomic_save(obj: Any, path) -> None:
    """torch.save to a temporary name, then rename: a crash never leaves a half-written file."""
    import os
    from pathlib import Path

    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
