"""A zero3 unit's output with some of its tensors replaced (a parameter it returns, by a view of it)."""
from __future__ import annotations

import copy
import dataclasses

import torch


def replace_tensors(obj, fn):
    """``obj`` (a module's output) with each tensor ``t`` replaced by ``fn(t)`` (containers as ``tensors_in``)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):   # a copy keeps what its type's constructor may not take (a defaultdict's factory)
        new = copy.copy(obj)
        for k, v in obj.items():
            new[k] = replace_tensors(v, fn)
        return new
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):   # a NamedTuple
        return type(obj)(*(replace_tensors(v, fn) for v in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(replace_tensors(v, fn) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        new = copy.copy(obj)
        for f in dataclasses.fields(obj):
            if hasattr(obj, f.name):
                object.__setattr__(new, f.name, replace_tensors(getattr(obj, f.name), fn))
        return new
    return obj
