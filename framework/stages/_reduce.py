"""Gradient buckets: a static plan of flat ranges and an in-order launcher.

Buckets are planned once, from the expected order in which backward produces gradients
(reverse registration order), as contiguous ranges of one group's flat buffer. A bucket is
launched as soon as all its gradients have arrived *and* every earlier bucket has been
launched, so all ranks issue the same collectives in the same order even when hooks fire in
a different order or some parameters get no gradient (those buckets go out at ``flush``).

For the ZeRO stages buckets lie on partition boundaries, so each is one collective: a bucket
reduced during backward lies inside one rank's partition (one reduce to its owner) or is a
whole group buffer (aligned: one reduce-scatter); gradients that are all present before any
is reduced (zero1 without overlap_comm) go out in stripes, the same range of every partition,
each one reduce-scatter. Which primitive carries them is the collectives object's business.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from framework.comm.collectives import Collectives, Pending


@dataclass(frozen=True)
class Bucket:
    """Flat ranges ``[start + k * stride, end + k * stride)`` for k < count of one group's buffer.

    count == 1: one contiguous range (planned in gradient order). count == world, stride == the
    partition length: a *striped* bucket, the same relative range of every rank's partition; its
    wire buffer is the ranges laid end to end, i.e. ``world`` equal chunks with chunk r owned by
    rank r, which is exactly one reduce-scatter.
    """

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
                 shards: dict[int, int] | None = None, world: int = 1) -> list[Bucket]:
    """Contiguous buckets in gradient order. ``order``: (param id, group, offset, numel) in expected
    gradient order; ``shards``: group -> partition length, for the ZeRO stages.

    Each group keeps one open bucket that grows downwards through its flat buffer (gradients
    arrive in reverse layout order); a parameter larger than the room left is split, so no
    bucket exceeds ``bucket_size`` and a huge embedding never forces a huge buffer. The
    global bucket order is the order in which buckets close.

    With ``shards`` buckets are planned on partition boundaries: a bucket lies inside one rank's
    partition (one owner: one reduce), except that a group whose whole padded buffer fits in a
    bucket is one bucket over that whole buffer (aligned: one reduce-scatter). A bucket never
    straddles partitions otherwise, so no bucket needs a reduce per owner.
    """
    shards = shards or {}
    open_: dict[int, tuple[int, int, list[int]]] = {}  # group -> (start, end, param ids)
    out: list[Bucket] = []
    whole = {g for g, s in shards.items() if s * world <= bucket_size}

    def close(g: int) -> None:
        start, end, pids = open_.pop(g)
        if g in whole:  # the whole buffer, padding included: world equal partitions
            out.append(Bucket(g, 0, shards[g], tuple(pids), stride=shards[g], count=world))
        else:
            out.append(Bucket(g, start, end, tuple(pids)))

    for pid, g, offset, numel in order:
        top = offset + numel
        while top > offset:
            start, end, pids = open_.get(g, (top, top, []))
            if start != top:  # not adjacent (cannot happen for one group's layout): start anew
                close(g)
                start, end, pids = top, top, []
            room = bucket_size - (end - start)
            if g in whole:
                room = top - offset
            elif g in shards:  # down to the start of the partition holding the bucket's top element
                room = min(room, start - (end - 1) // shards[g] * shards[g])
            take = min(top - offset, room)
            if take == 0:  # at a partition boundary: this bucket is complete
                close(g)
                continue
            open_[g] = (start - take, end, pids + [pid])
            top -= take
            if start - take == 0 if g in whole else (end - (start - take) >= bucket_size or
                                                     (g in shards and (start - take) % shards[g] == 0)):
                close(g)
    for g in sorted(open_):
        close(g)
    return out


def plan_round_robin(order: list[tuple[int, int, int, int]], bucket_size: int, shards: dict[int, int],
                     world: int) -> list[Bucket]:
    """Buckets for a round-robin layout (``_sharded.round_robin``), where gradients adjacent in
    backward order lie in different partitions: each partition fills a bucket of its own (one
    owner: one reduce), of at most ``bucket_size // world`` elements so that the gradients waiting
    for reduction stay within one ``bucket_size``. Owners then take turns bucket by bucket, so
    every rank adds (and, with offload, copies to the host) its share while backward runs. A group
    whose whole buffer fits in a bucket is one reduce-scatter, as in ``plan_buckets``."""
    whole = {g for g, s in shards.items() if s * world <= bucket_size}
    cap = max(1, bucket_size // world)
    open_: dict[tuple[int, int], tuple[int, int, list[int]]] = {}   # (group, partition) -> (start, end, ids)
    out: list[Bucket] = []

    def close(key: tuple[int, int]) -> None:
        start, end, pids = open_.pop(key)
        out.append(Bucket(key[0], start, end, tuple(pids)))

    left = {g: sum(1 for _, gg, _, _ in order if gg == g) for g in whole}   # parameters not yet seen
    seen: dict[int, list[int]] = {}
    for pid, g, offset, numel in order:
        if g in whole:   # closes with the group's last gradient
            seen.setdefault(g, []).append(pid)
            left[g] -= 1
            if not left[g]:
                out.append(Bucket(g, 0, shards[g], tuple(seen[g]), stride=shards[g], count=world))
            continue
        shard, top = shards[g], offset + numel
        while top > offset:
            part = (top - 1) // shard
            key = (g, part)
            if key in open_ and open_[key][0] != top:   # not adjacent below the open bucket
                close(key)
            start, end, pids = open_.get(key, (top, top, []))
            take = min(top - max(offset, part * shard), cap - (end - start))
            open_[key] = (start - take, end, pids if pids and pids[-1] == pid else pids + [pid])
            top -= take
            if end - (start - take) >= cap or start - take == part * shard:
                close(key)
    for key in sorted(open_, reverse=True):
        close(key)
    return out


def plan_stripes(order: list[tuple[int, int, int, int]], bucket_size: int, shards: dict[int, int],
                 world: int) -> list[Bucket]:
    """Striped buckets, for gradients that are all present when reduction starts (zero1 without
    overlap_comm): each bucket is the same relative range [a, b) of every rank's partition, so on
    NCCL it is one reduce-scatter. ``order`` as for ``plan_buckets``; ``shards``: group ->
    partition length. A group that fits in one bucket is one bucket over its whole buffer (no
    staging copy); otherwise stripes of ``bucket_size // world`` elements (a multiple of ALIGN
    when that large; at least 1, so a bucket smaller than ``world`` elements holds ``world``),
    from the partitions' ends downwards.

    Not for gradients reduced during backward: partition 0's gradients come last, so every stripe
    would wait for the end of backward and (zero2) hold nearly all gradients until then.
    """
    from framework.stages._flat import ALIGN

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


class OrderedLauncher:
    """Calls ``launch(bucket index)`` once per armed backward, strictly in bucket order."""

    def __init__(self, buckets: list[Bucket], launch: Callable[[int], None]):
        self.buckets, self.launch = buckets, launch
        self.owners: dict[int, list[int]] = {}  # param id -> buckets holding a piece of it
        for i, b in enumerate(buckets):
            for pid in b.params:
                self.owners.setdefault(pid, []).append(i)
        self.pending: list[int] = []
        self.next = len(buckets)  # nothing armed

    def arm(self) -> None:
        self.pending = [len(b.params) for b in self.buckets]
        self.next = 0

    def ready(self, pid: int) -> None:
        if self.next >= len(self.buckets):
            return  # not armed (a non-boundary micro step)
        for i in self.owners[pid]:
            self.pending[i] -= 1
        while self.next < len(self.buckets) and self.pending[self.next] == 0:
            self.next += 1
            self.launch(self.next - 1)

    def flush(self) -> None:
        while self.next < len(self.buckets):
            self.next += 1
            self.launch(self.next - 1)


def expected_order(entries: list[tuple[int, object]]) -> list[tuple[int, int, int, int]]:
    """(param id, group, offset, numel) in reverse registration order, from (group, slot) pairs."""
    return [(pid, g, s.offset, s.numel) for pid, (g, s) in reversed(list(enumerate(entries)))]


def reduce_to_owners(comm: Collectives, buf: torch.Tensor, start: int, shard: int, reduce_scatter: bool,
                     what: str) -> Pending:
    """Sum ``buf`` (mirroring flat range [start, start + len)) across ranks so that each rank
    ends up with the summed values of the part that falls in its own partition.

    reduce_scatter=False: DeepSpeed's all-reduce fallback (every rank gets it all).
    """
    return comm.reduce_to_owners(buf, start, shard, what) if reduce_scatter else comm.all_reduce(buf, what)


def reduce_bucket(comm: Collectives, wire: list[torch.Tensor], b: Bucket, shard: int, reduce_scatter: bool,
                  what: str) -> Pending:
    """Reduce bucket ``b`` to the owners of its elements. ``wire``: its values in the wire dtype, one
    tensor for a contiguous bucket, else one per range (a stripe: chunk r is rank r's). Each rank's
    sums are then in its own parts (``own_parts``)."""
    if len(wire) == 1:
        return reduce_to_owners(comm, wire[0], b.start, shard, reduce_scatter, what)
    if not reduce_scatter:
        return Pending.of(comm.all_reduce(t, what) for t in wire)
    return comm.reduce_scatter(wire, what)


def own_parts(b: Bucket, lo: int, hi: int) -> list[tuple[int, int, int]]:
    """(flat start, flat end, offset in the bucket's buffer) of each part of bucket ``b`` inside
    partition [lo, hi)."""
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
