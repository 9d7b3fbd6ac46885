"""Flat-buffer layout: parameters of one group laid end to end, padded, and partitioned.

Every stage keeps a parameter group as one contiguous buffer (module parameters become
views into it), which makes communication one call per bucket and optimizer kernels one
call per group. Partition math for the ZeRO stages lives here too, so it is tested once.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

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
    """Split trainable parameters into ('decay', >=2-D) and ('no_decay', 1-D) groups.

    Tied parameters appear once (named_parameters de-duplicates shared tensors). Empty
    groups are dropped, so the optimizer's weight-decay mask follows the returned kinds.
    """
    decay, no_decay = [], []
    for name, p in module.named_parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append((name, p))
    return [(kind, g) for kind, g in (("decay", decay), ("no_decay", no_decay)) if g]


def views(flat: torch.Tensor, layout: Layout) -> list[torch.Tensor]:
    return [flat[s.offset:s.offset + s.numel].view(s.shape) for s in layout.slots]


def bind(params: list[nn.Parameter], flat: torch.Tensor, layout: Layout, copy: bool = True) -> None:
    """Make each parameter a view into ``flat`` (optionally copying its current values in)."""
    for p, v in zip(params, views(flat, layout)):
        if copy:
            v.copy_(p.data)
        p.data = v

