"""Gradient buckets: a static plan of contiguous flat ranges and an in-order launcher.

Buckets are planned once, from the expected order in which backward produces gradients
(reverse registration order), as contiguous ranges of one group's flat buffer. A bucket is
launched as soon as all its gradients have arrived *and* every earlier bucket has been
launched, so all ranks issue the same collectives in the same order even when hooks fire in
a different order or some parameters get no gradient (those buckets go out at ``flush``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from framework.distributed import Dist


@dataclass(frozen=True)
class Bucket:
    group: int
    start: int        # flat range [start, end) of the group's buffer
    end: int
    params: tuple[int, ...]   # stage-wide parameter ids whose gradients fill it

    @property
    def numel(self) -> int:
        return self.end - self.start


def plan_buckets(order: list[tuple[int, int, int, int]], bucket_size: int) -> list[Bucket]:
    """``order``: (param id, group, offset, numel) in expected gradient order.

    Each group keeps one open bucket that grows downwards through its flat buffer (gradients
    arrive in reverse layout order); a parameter larger than the room left is split, so no
    bucket exceeds ``bucket_size`` and a huge embedding never forces a huge buffer. The
    global bucket order is the order in which buckets close.
    """
    open_: dict[int, tuple[int, int, list[int]]] = {}  # group -> (start, end, param ids)
    out: list[Bucket] = []

    def close(g: int) -> None:
        start, end, pids = open_.pop(g)
        out.append(Bucket(g, start, end, tuple(pids)))

    for pid, g, offset, numel in order:
        top = offset + numel
        while top > offset:
            start, end, pids = open_.get(g, (top, top, []))
            if start != top:  # not adjacent (cannot happen for one group's layout): start anew
                close(g)
                start, end, pids = top, top, []
            take = min(top - offset, bucket_size - (end - start))
            open_[g] = (start - take, end, pids + [pid])
            top -= take
            if end - (start - take) >= bucket_size:
                close(g)
    for g in sorted(open_):
        close(g)
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


def reduce_to_owners(dist: Dist, buf: torch.Tensor, start: int, shard: int, reduce_scatter: bool,
                     what: str) -> list:
    """Sum ``buf`` (mirroring flat range [start, start + len)) across ranks so that each rank
    ends up with the summed values of the part that falls in its own partition.

    reduce_scatter=True: one ``reduce`` to each owner whose partition the bucket touches
    (a bucket need not align with partitions, so a tensor reduce-scatter does not fit; on
    gloo these reduces also beat reduce_scatter_tensor, 0.57 GB/s, measured in REFERENCE
    §10). reduce_scatter=False: DeepSpeed's all-reduce fallback (every rank gets it all).
    """
    if dist.world == 1:
        return []
    if not reduce_scatter:
        return [dist.all_reduce(buf, what=what, async_op=True)]
    if dist.backend == "gloo" and dist.world == 2:
        # Two gloo ranks: the ring all-reduce beats two reduces, and two halves in flight keep
        # both of gloo's worker threads busy (42 MB, median of 15 here: 2 reduces 31-34 ms,
        # all-reduce 30 ms, 2 all-reduce halves 25 ms). Every rank gets the whole sum and
        # reads its own part. At 4 ranks per-owner reduces win (47 vs 62 ms), as on NCCL.
        return [dist.all_reduce(c, what=what, async_op=True) for c in buf.chunk(2)]
    works, end = [], start + buf.numel()
    for r in range(start // shard, (end - 1) // shard + 1):
        lo, hi = max(start, r * shard), min(end, (r + 1) * shard)
        works.append(dist.reduce(buf[lo - start:hi - start], dst=r, what=what, async_op=True))
    return works


def own_overlap(start: int, end: int, lo: int, hi: int) -> tuple[int, int] | None:
    """The part of flat range [start, end) inside partition [lo, hi), or None."""
    a, b = max(start, lo), min(end, hi)
    return (a, b) if a < b else None
