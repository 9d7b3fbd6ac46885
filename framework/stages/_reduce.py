"""Gradient buckets: a static plan of flat ranges, and their reduction.

Buckets are planned once from the expected gradient order (reverse registration) and launched
in plan order (``_grads.Arrivals``). For the ZeRO stages buckets lie on partition boundaries: each
is one collective.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from framework.comm.collectives import Collectives, Pending
from framework.stages._flat import ALIGN


@dataclass(frozen=True)
class Bucket:
    """Flat ranges ``[start + k * stride, end + k * stride)`` for k < count of one group's buffer.
    count == world, stride == the partition length: a *striped* bucket, the same range of every
    partition, whose wire buffer (the ranges end to end) is exactly one reduce-scatter."""

    group: int
    start: int        # first range [start, end) of the group's buffer
    end: int
    params: tuple[int, ...]   # stage-wide parameter ids whose gradients fill it
    stride: int = 0
    count: int = 1

    @property
    def numel(self) -> int:
        return (self.end - self.start) * self.count

    @property
    def ranges(self) -> list[tuple[int, int]]:
        return [(self.start + k * self.stride, self.end + k * self.stride) for k in range(self.count)]

    @property
    def contiguous(self) -> bool:
        """The ranges are one flat range [start, start + numel)."""
        return self.count == 1 or self.end - self.start == self.stride


def plan_buckets(order: list[tuple[int, int, int, int]], bucket_size: int,
                 shards: dict[int, int] | None = None, world: int = 1, cap: int | None = None) -> list[Bucket]:
    """Contiguous buckets in the order they close. ``order``: (param id, group, offset, numel) in
    expected gradient order; ``shards``: group -> partition length, for the ZeRO stages.

    Each partition's open bucket grows downwards through its group's flat buffer; a parameter larger
    than the room left is split, so no bucket exceeds ``cap`` (default ``bucket_size``) elements or
    crosses a partition boundary (one reduce). A group buffer that fits in ``bucket_size`` is one
    striped bucket (one reduce-scatter), closed with the group's last gradient.
    """
    shards, cap = shards or {}, cap or bucket_size
    whole = {g for g, s in shards.items() if s * world <= bucket_size}
    left = {g: sum(1 for _, gg, _, _ in order if gg == g) for g in whole}   # parameters not yet seen
    seen: dict[int, list[int]] = {}
    open_: dict[tuple[int, int], tuple[int, int, list[int]]] = {}   # (group, partition start) -> (start, end, ids)
    out: list[Bucket] = []

    def close(key: tuple[int, int]) -> None:
        start, end, pids = open_.pop(key)
        out.append(Bucket(key[0], start, end, tuple(pids)))

    for pid, g, offset, numel in order:
        if g in whole:
            seen.setdefault(g, []).append(pid)
            left[g] -= 1
            if not left[g]:
                out.append(Bucket(g, 0, shards[g], tuple(seen[g]), stride=shards[g], count=world))
            continue
        top = offset + numel
        while top > offset:
            bottom = (top - 1) // shards[g] * shards[g] if g in shards else 0   # of the partition holding top
            key = (g, bottom)
            if key in open_ and open_[key][0] != top:   # not adjacent below the open bucket
                close(key)
            start, end, pids = open_.get(key, (top, top, []))
            take = min(top - max(offset, bottom), cap - (end - start))
            open_[key] = (start - take, end, pids + [pid])
            top -= take
            if end - (start - take) >= cap or (g in shards and start - take == bottom):
                close(key)
    # ddp: each group's lowest bucket; round-robin layouts: buckets ended by a gap, highest first
    for key in sorted(open_, reverse=len(shards) > 0):
        close(key)
    return out


def plan_round_robin(order: list[tuple[int, int, int, int]], bucket_size: int, shards: dict[int, int],
                     world: int) -> list[Bucket]:
    """Buckets for a round-robin layout (``sharded.round_robin``): each partition fills buckets of
    its own of at most ``bucket_size // world`` elements (the waiting gradients stay within one
    ``bucket_size``), so owners take turns while backward runs."""
    return plan_buckets(order, bucket_size, shards, world, cap=max(1, bucket_size // world))


def plan_stripes(order: list[tuple[int, int, int, int]], bucket_size: int, shards: dict[int, int],
                 world: int) -> list[Bucket]:
    """Striped buckets, for gradients all present when reduction starts (zero1 without overlap_comm):
    a group that fits in one bucket is one bucket, else stripes of ``bucket_size // world`` elements
    (ALIGN-rounded when that large, at least 1) from the partitions' ends downwards. Not for
    reduction during backward: every stripe would wait for partition 0's gradients, which come last.
    """
    out = []
    for g, shard in sorted(shards.items()):
        mine = [(pid, off, n) for pid, gg, off, n in order if gg == g]
        width = shard if shard * world <= bucket_size else max(1, bucket_size // world)
        if ALIGN <= width < shard:
            width -= width % ALIGN
        for b in range(shard, 0, -width):
            a = max(0, b - width)
            pids = tuple(pid for pid, off, n in mine
                         if any(off < r * shard + b and off + n > r * shard + a for r in range(world)))
            out.append(Bucket(g, a, b, pids, stride=shard, count=world))
    return out


def expected_order(entries: list[tuple[int, object]]) -> list[tuple[int, int, int, int]]:
    """(param id, group, offset, numel) in reverse registration order, from (group, slot) pairs."""
    return [(pid, g, s.offset, s.numel) for pid, (g, s) in reversed(list(enumerate(entries)))]


def reduce_to_owners(comm: Collectives, buf: torch.Tensor, start: int, shard: int, reduce_scatter: bool,
                     what: str) -> Pending:
    """Sum ``buf`` (flat range [start, start + len)) so each rank gets the sums of its own partition's
    part (reduce_scatter=False: DeepSpeed's all-reduce fallback, every rank gets it all)."""
    return comm.reduce_to_owners(buf, start, shard, what) if reduce_scatter else comm.all_reduce(buf, what)


def reduce_bucket(comm: Collectives, wire: list[torch.Tensor], b: Bucket, shard: int, reduce_scatter: bool,
                  what: str) -> Pending:
    """Reduce bucket ``b`` to its owners. ``wire``: its values, one tensor if contiguous, else one per
    range (chunk r is rank r's); each rank's sums are then in ``own_parts``."""
    if len(wire) == 1:
        return reduce_to_owners(comm, wire[0], b.start, shard, reduce_scatter, what)
    if not reduce_scatter:
        return Pending.of(comm.all_reduce(t, what) for t in wire)
    return comm.reduce_scatter(wire, what)


def own_parts(b: Bucket, lo: int, hi: int) -> list[tuple[int, int, int]]:
    """(flat start, flat end, offset in the bucket's buffer) of each part of ``b`` inside [lo, hi)."""
    out, base = [], 0
    for start, end in b.ranges:
        own = own_overlap(start, end, lo, hi)
        if own is not None:
            out.append((own[0], own[1], base + own[0] - start))
        base += end - start
    return out


def own_overlap(start: int, end: int, lo: int, hi: int) -> tuple[int, int] | None:
    """The part of flat range [start, end) inside partition [lo, hi), or None."""
    a, b = max(start, lo), min(end, hi)
    return (a, b) if a < b else None
