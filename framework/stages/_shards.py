"""ZeRO-3's sharded parameters and the gather units that hold them: the data ``_gather`` moves through
its lifecycle (a unit is SHARDED, GATHERING or GATHERED, in that cycle)."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

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


def read_hint(name: str, error: str) -> str:
    """The fix for a parameter read where it is an empty shard (``error``: what showed it)."""
    return (f"zero3: loss_fn read parameter {name!r} outside its module's forward, where it is an empty shard "
            f"({error}): a parameter is gathered only while its own module's forward (or backward) runs; call "
            f"that module in loss_fn, or compute the term (a weight penalty, a tied output head) inside a module's "
            f"forward")


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
