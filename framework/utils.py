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
