"""Flat-buffer layout: parameters of one group laid end to end, padded, and partitioned.

One contiguous buffer per group (module parameters are views into it) makes communication one
call per bucket and optimizer kernels one call per group.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from framework.comm.distributed import Dist


# Pad every flat buffer to a multiple of this many elements per rank: 128 elements keeps
# each rank's partition 256-byte aligned for 16-bit dtypes and 512-byte for fp32 (NCCL and
# vectorised CPU kernels both prefer aligned starts).
ALIGN = 128


@dataclass(frozen=True)
class Slot:
    name: str
    shape: torch.Size
    offset: int
    numel: int


@dataclass(frozen=True)
class Layout:
    """Where each parameter of a group sits in its flat buffer, and the rank partitions."""

    slots: tuple[Slot, ...]
    numel: int        # real elements
    padded: int       # buffer length: a multiple of world * ALIGN
    world: int

    @property
    def shard(self) -> int:
        return self.padded // self.world

    def partition(self, rank: int) -> tuple[int, int]:
        return rank * self.shard, (rank + 1) * self.shard

    def names_in(self, start: int, end: int) -> list[str]:
        """Parameters that overlap elements [start, end) of the flat buffer."""
        return [s.name for s in self.slots if s.offset < end and s.offset + s.numel > start]


def make_layout(named: list[tuple[str, nn.Parameter]], world: int) -> Layout:
    slots, offset = [], 0
    for name, p in named:
        slots.append(Slot(name, p.shape, offset, p.numel()))
        offset += p.numel()
    unit = world * ALIGN
    return Layout(tuple(slots), offset, -(-max(offset, 1) // unit) * unit, world)


def param_groups(module: nn.Module) -> list[tuple[str, list[tuple[str, nn.Parameter]]]]:
    """Trainable parameters as ('decay', >=2-D) and ('no_decay', 1-D) groups; tied ones appear once,
    empty groups are dropped (the optimizer's weight-decay mask follows the returned kinds)."""
    decay, no_decay = [], []
    for name, p in module.named_parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append((name, p))
    return [(kind, g) for kind, g in (("decay", decay), ("no_decay", no_decay)) if g]


def param_count(module: nn.Module) -> int:
    """Elements of the module's distinct parameters at their logical size: a ZeRO-3 parameter
    (empty between uses) counts its full shape, as in every report (summary, logs)."""
    return sum(getattr(p, "logical_shape", p.shape).numel() for p in module.parameters())


def views(flat: torch.Tensor, layout: Layout) -> list[torch.Tensor]:
    return [flat[s.offset:s.offset + s.numel].view(s.shape) for s in layout.slots]


@runtime_checkable
class ParameterInit(Protocol):
    """A model that can initialise any one parameter by name (order-independent init)."""

    def init_parameter(self, name: str, t: torch.Tensor) -> None: ...


def initial_values(init: ParameterInit, name: str, p: torch.Tensor, device: torch.device,
                   scratch: torch.Tensor | None = None) -> torch.Tensor:
    """Parameter ``name``'s initial values (its own dtype) on ``device``; a meta one is initialised by
    ``init``, one at a time, into ``scratch`` when given (so repeated temporaries cannot fragment the heap)."""
    if not p.is_meta:
        return p.detach().to(device)
    full = (torch.empty(p.shape, dtype=p.dtype, device=device) if scratch is None
            else scratch[:p.numel()].view(p.shape))
    with torch.no_grad():
        init.init_parameter(name, full)
    return full


def bind_group(module: nn.Module, named: list[tuple[str, nn.Parameter]], world: int, dtype: torch.dtype,
               dist: Dist, init: ParameterInit) -> tuple[Layout, torch.Tensor, list[nn.Parameter]]:
    """Make each parameter of ``named`` a view into a new flat buffer laid out for ``world`` ranks,
    holding rank 0's initial values on every rank; returns the layout, the buffer and the parameters
    (a meta one is replaced by a new Parameter everywhere it is registered)."""
    layout = make_layout(named, world)
    flat = torch.zeros(layout.padded, dtype=dtype, device=dist.device)
    params = []
    for (name, p), v in zip(named, views(flat, layout)):
        v.copy_(initial_values(init, name, p, flat.device))
        if p.is_meta:  # .data cannot move a meta tensor to a real device
            new = nn.Parameter(v, requires_grad=p.requires_grad)
            replace_parameter(module, p, new)
            p = new
        else:
            p.data = v
        params.append(p)
    dist.broadcast(flat, what="initial parameter broadcast")
    return layout, flat, params


def replace_parameter(module: nn.Module, old: nn.Parameter, new: nn.Parameter) -> None:
    """Register ``new`` wherever ``old`` is registered (tied weights stay tied)."""
    for sub in module.modules():
        for key, value in sub._parameters.items():
            if value is old:
                sub._parameters[key] = new

