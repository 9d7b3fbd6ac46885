"""ZeRO-3's sharded parameters and the gather units that hold them: the data ``_gather`` moves through
its lifecycle (a unit is SHARDED, GATHERING or GATHERED, in that cycle)."""
from __future__ import annotations

import enum
import inspect
import sys
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from framework.core.errors import FrameworkError
from framework.stages._flat import Layout


class UnitState(enum.Enum):
    SHARDED = "sharded"
    GATHERING = "gathering"
    GATHERED = "gathered"


NEXT = {UnitState.SHARDED: UnitState.GATHERING, UnitState.GATHERING: UnitState.GATHERED,
        UnitState.GATHERED: UnitState.SHARDED}


class ShardedParameter(nn.Parameter):
    """Empty between uses; inside its unit's forward/backward or ``framework.gathered`` a view of
    the gathered full tensor. Saving it is an error."""

    logical_shape: torch.Size
    unit_name: str
    shard_range: tuple[int, int]   # this rank's elements of the parameter, [start, end) (may be empty)

    def __repr__(self) -> str:
        state = "gathered" if self.numel() == self.logical_shape.numel() else "sharded"
        a, b = self.shard_range
        return (f"ShardedParameter(shape={tuple(self.logical_shape)}, dtype={self.dtype}, unit={self.unit_name!r}, "
                f"{state}, this rank holds elements [{a}, {b}) of {self.logical_shape.numel()})")

    def __reduce_ex__(self, proto):
        raise FrameworkError(f"cannot save a ZeRO-3 sharded parameter (shape {tuple(self.logical_shape)}, unit "
                             f"{self.unit_name!r}): use engine.consolidated_state_dict() or framework.gathered()")


def read_hint(p: ShardedParameter, error: str, reader: str | None = None) -> str:
    """The fix for a read of ``p`` where it is an empty shard (``error``: what showed it). ``reader``: the frame
    that read it, ``Class.forward`` or ``loss_fn``; None where only the backward pass showed it."""
    head = f"zero3: {reader or 'loss_fn or a module forward'} read parameter {p.zero3_names[0]!r} (of gather unit " \
           f"{p.unit_name!r}) outside its module's forward, where it is an empty shard ({error}): a parameter is " \
           f"gathered only while its own unit's forward (or backward) runs, or inside framework.gathered; "
    tie = "hold the weight in the module that uses it (an nn.Linear sharing the Parameter, head.weight = emb.weight, " \
          "as a tied output head)"
    if reader == "loss_fn":
        return head + f"call that module in loss_fn, or compute the term (a weight penalty, a tied output head) " \
                      f"in the module's forward; {tie}"
    if p.zero3_unit.split:   # (a gather_unit class stays a unit without split_root)
        return head + f"{tie}, or set stage.split_root=false (the root's children are then gathered with the root " \
                      f"for its whole forward)"
    return head + tie


def _first_argument(frame):
    """A frame's first argument (a method's self, whatever its name), else None."""
    code = frame.f_code
    return frame.f_locals.get(code.co_varnames[0]) if code.co_argcount else None


def forward_of(frame) -> nn.Module | None:
    """The module whose own ``forward`` ``frame`` runs (its first argument), else None; a decorated forward
    (``functools.wraps``, ``@torch.no_grad()``) is matched through its ``__wrapped__`` chain."""
    code, owner = frame.f_code, _first_argument(frame)
    if not isinstance(owner, nn.Module):
        return None
    # (Read statically: a ScriptModule's class forward is a descriptor that raises when read from the class.)
    forward = inspect.getattr_static(type(owner), "forward", None)
    while forward is not None:
        if code is getattr(forward, "__code__", None):
            return owner
        forward = getattr(forward, "__wrapped__", None)
    return None


def reader_of(frames) -> str:
    """``Class.forward`` of the innermost module forward among ``frames`` (innermost first), else loss_fn. A
    function named forward whose first argument is a module (one wrapped without ``functools.wraps``) counts."""
    frames = list(frames)
    owner = next((m for m in map(forward_of, frames) if m is not None), None)
    if owner is None:
        owner = next((m for f in frames if f.f_code.co_name == "forward"
                      and isinstance(m := _first_argument(f), nn.Module)), None)
    return "loss_fn" if owner is None else f"{type(owner).__name__}.forward"


# Tensor properties that read the values (views of them); every other property is metadata or a setter.
_READING_PROPERTIES = frozenset({"T", "mT", "H", "mH", "data", "real", "imag"})
# Operations that read only metadata, by name so that torch.X and Tensor.X both match (the framework's hooks
# and models' own code call them on released parameters: Hugging Face's ``model.dtype`` calls
# is_floating_point on the first parameter, whichever unit it belongs to). Every ``is_*`` predicate is metadata
# (dtype, device, storage kind) except those below, which compare values or storages; ``type`` is metadata only
# without a dtype argument (with one it converts).
_METADATA = frozenset({"numel", "nelement", "size", "dim", "ndimension", "stride", "storage_offset", "element_size",
                       "untyped_storage", "data_ptr", "get_device", "dim_order", "__len__", "register_hook",
                       "register_post_accumulate_grad_hook", "requires_grad_", "__repr__", "__format__",
                       "__reduce_ex__", "__hash__", "new_empty", "new_empty_strided", "new_zeros", "new_ones",
                       "new_full"})
_READING_PREDICATES = frozenset({"is_nonzero", "is_same_size", "is_set_to"})


def _reads_values(func, args: tuple, kwargs: dict) -> bool:
    """Whether the torch operation ``func`` reads its tensor arguments' values (not only their metadata)."""
    name = getattr(func, "__name__", None)
    if name == "__get__":
        return func.__self__.__name__ in _READING_PROPERTIES
    if name == "__set__" or name in _METADATA:
        return False
    if name is not None and name.startswith("is_"):
        return name in _READING_PREDICATES
    if name == "type":
        return len(args) > 1 or len(kwargs) > 0   # (with a dtype it converts)
    return True


class ShardReads(TorchFunctionMode):
    """Pushed while a pass records its trace (and under the checking accelerator): an operation given a sharded
    parameter that is released (empty: not in its unit's forward or backward, nor in framework.gathered) raises
    ``read_hint`` naming the frame that read it, where torch would compute on zero elements (a sum of 0, a detached norm
    of 0) without an error. A scan of every operation's arguments: not for the steady state's passes."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _reads_values(func, args, kwargs):
            for a in (*args, *kwargs.values()):
                for t in a if type(a) in (list, tuple) else (a,):
                    if isinstance(t, ShardedParameter) and t.numel() == 0 and t.logical_shape.numel():
                        _refuse(t, _op_name(func))
        return func(*args, **kwargs)


def _refuse(p: ShardedParameter, op: str) -> None:
    frames = [frame for frame, _ in traceback.walk_stack(sys._getframe(2))]
    owner = next((m for m in map(forward_of, frames) if m is not None), None)
    if owner is not None and any(q is p for q in owner.parameters(recurse=False)):
        # A module's forward on its own parameters, called without its unit (a part of it called directly): the
        # stage's error path names the unit to call instead, as for torch's own error.
        raise RuntimeError(f"{op} got parameter {p.zero3_names[0]!r} as an empty shard")
    raise FrameworkError(read_hint(p, f"{op} got it with 0 elements", reader_of(frames)))


def _op_name(func) -> str:
    if getattr(func, "__name__", None) in ("__get__", "__set__"):
        return f"Tensor.{func.__self__.__name__}"
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
    return name.replace("TensorBase.", "Tensor.")


def zero3_sharded(module: nn.Module) -> bool:
    """Whether a zero3 stage sharded ``module``'s parameters (they stay empty shards after its engine: no
    other engine can be built on them)."""
    return any(isinstance(p, ShardedParameter) for p in module.parameters())


@dataclass
class UnitGroup:
    kind: str                        # 'decay' | 'no_decay'
    index: int                       # its position in the stage's groups (and partitions)
    layout: Layout
    params: list[ShardedParameter]
    shard: torch.Tensor              # this rank's partition of the working (param dtype) buffer
    part_grad: torch.Tensor          # this rank's partition of the reduced gradients (empty until first used)
    # The gathered buffer: its storage holds layout.padded elements while the unit is gathering/gathered and
    # zero bytes otherwise; a release after the unit's backward leaves it to autograd's views (a new one next).
    full: torch.Tensor | None = None
    # An output of the unit's forward shares ``full``'s bytes (a view of a parameter): the release leaves the
    # buffer to it and the next gather takes a new one (a local memory decision: no collective changes).
    lent: bool = False
    pieces: list = field(default_factory=list)  # master pieces of the shard (see offload.base.Piece)
    # Where a non-resident partition comes from (gradients in the swap file); None: zeros, kept.
    load_grad: Callable[[], torch.Tensor] | None = None

    def astray(self, empty: torch.Tensor, gathered: bool) -> list[ShardedParameter]:
        """Its parameters not as gathers and releases leave them, views of ``full`` (``gathered``) or ``empty``:
        ``module.half()`` or ``.to(...)`` gave them storage of their own (dtype, and device or address, compared:
        metadata only, no tensor read; a parameter of no elements has no address)."""
        if not gathered:
            return [p for p in self.params if p.dtype != empty.dtype or p.device != empty.device]
        base, size = self.full.data_ptr(), self.full.element_size()
        return [p for p, s in zip(self.params, self.layout.slots)
                if p.dtype != self.full.dtype or p.device != self.full.device
                or (s.numel and p.data_ptr() != base + s.offset * size)]

    def grad(self) -> torch.Tensor:
        """The gradient partition, allocated on first use (construction holds only the shards)."""
        if self.part_grad.numel() != self.shard.numel():
            self.part_grad = self.load_grad() if self.load_grad is not None else torch.zeros(
                self.shard.numel(), dtype=self.part_grad.dtype, device=self.part_grad.device)
        return self.part_grad


@dataclass
class Unit:
    uid: int
    name: str
    groups: list[UnitGroup]
    state: UnitState = UnitState.SHARDED
    works: list = field(default_factory=list)      # in-flight gather collectives
    # Parameters whose gradient arrived in this backward pass (reentrant checkpointing may send one twice).
    arrived: set = field(default_factory=set)
    reduced: bool = False                           # reduced (and released) in this backward pass
    in_backward: bool = False                       # gathered for this backward, not yet reduced
    active: int = 0                                 # forwards of this unit currently running
    # framework.gathered blocks holding it: the hooks release it only when none does.
    held: int = 0
    gatherer: Any = None   # its _gather.Gatherer (set by it)
    split: bool = False    # made by stage.split_root (a child of the root, no stage.gather_unit class)

    @property
    def numel(self) -> int:
        return sum(g.layout.padded for g in self.groups)

    @property
    def params(self) -> list[ShardedParameter]:
        return [p for g in self.groups for p in g.params]

    @property
    def idle(self) -> bool:
        """No forward of it running, no framework.gathered block holding it, no backward waiting for it."""
        return self.active == 0 and not self.held and not self.in_backward

    def to(self, new: UnitState) -> None:
        if new is not NEXT[self.state]:
            raise FrameworkError(f"zero3 unit {self.name!r}: illegal transition {self.state.value} -> {new.value}")
        self.state = new
