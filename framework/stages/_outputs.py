"""A zero3 unit's forward output made ready for its backward; its tensors (or its arguments') replaced."""
from __future__ import annotations

import copy
import dataclasses

import torch

from framework.core.errors import TrainingError
from framework.core.utils import tensors_in


def replace_tensors(obj, fn, mutable: bool = True):
    """``obj`` (a module's output) with each tensor ``t`` replaced by ``fn(t)`` (containers as ``tensors_in``).
    Not ``mutable``: only tuples are rebuilt; dicts, lists and dataclasses stay as they are, tensors and all."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if not mutable and not isinstance(obj, tuple):
        return obj
    if isinstance(obj, dict):   # a copy keeps what its type's constructor may not take (a defaultdict's factory)
        new = copy.copy(obj)
        for k, v in obj.items():
            new[k] = replace_tensors(v, fn, mutable)
        return new
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):   # a NamedTuple
        return type(obj)(*(replace_tensors(v, fn, mutable) for v in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(replace_tensors(v, fn, mutable) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        new = copy.copy(obj)
        for f in dataclasses.fields(obj):
            if hasattr(obj, f.name):
                object.__setattr__(new, f.name, replace_tensors(getattr(obj, f.name), fn, mutable))
        return new
    return obj


def announce_backward(unit, out, hook) -> tuple:
    """``out`` of ``unit``'s forward with a returned parameter replaced by a view (the release empties it; a hook
    on a leaf stays for good), each of its tensors that needs a gradient given ``hook`` (gathers the unit for its
    backward), and a gathered buffer an output shares lent to it (given it at the release; no host sync).
    Returns ``out`` and False where the unit's backward would go unannounced (``unannounced``)."""
    own = {id(p) for p in unit.params}
    if any(id(t) in own for t in tensors_in(out)):
        out = replace_tensors(out, lambda t: t.view_as(t) if id(t) in own else t)
    hooked = [t for t in tensors_in(out) if t.requires_grad and not t.is_leaf] if torch.is_grad_enabled() else []
    for t in hooked:
        t.register_hook(hook)
    outputs = {t.untyped_storage().data_ptr() for t in tensors_in(out)}
    for g in unit.groups:
        if g.full is not None and g.full is not g.shard and g.full.untyped_storage().data_ptr() in outputs:
            g.lent = True
    return out, not (torch.is_grad_enabled() and not hooked and any(p.requires_grad for p in unit.params))


def unannounced(unit, out) -> TrainingError:
    """Its backward would find its parameters released (a raw size mismatch deep in autograd)."""
    return TrainingError(
        f"zero3: gather unit {unit.name!r} returned a {type(out).__name__} in which no tensor requires "
        f"grad, so its backward cannot be announced: return its tensors in a tensor, tuple, list, dict "
        f"or dataclass, or call it under torch.no_grad() where it is not trained")
