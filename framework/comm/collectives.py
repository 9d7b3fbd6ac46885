"""The collectives the stages use, one small object per backend, chosen once from the Dist.

    comm = dist.comm                     # Local (world 1), Gloo or Nccl; never chosen in stage code
    p = comm.all_gather_into(full, shard, "zero3 gather of 'h.0'")   # async; this rank's slice in place
    comm.wait(p, "zero3 gather of 'h.0'")

Every operation is asynchronous and returns a ``Pending``; ``wait`` completes it, naming what it waits
for. ``shard`` is one rank's partition length; an *aligned* buffer is ``world`` equal chunks, chunk r
rank r's. On gloo the tensor collectives are slow (0.57-0.75 GB/s against 0.95 for all_reduce on a
2-core CPU), so Gloo keeps its measured paths.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch
import torch.distributed as tdist
from torch import Tensor

SUM = tdist.ReduceOp.SUM


@dataclass
class Pending:
    """Collectives in flight for one call, and copies to run once they are done."""

    works: list = field(default_factory=list)
    after: list[Callable[[], None]] = field(default_factory=list)

    @staticmethod
    def of(items: Iterable["Pending"]) -> "Pending":
        items = list(items)
        return Pending([w for p in items for w in p.works], [fn for p in items for fn in p.after])


def owner_slices(start: int, end: int, shard: int) -> list[tuple[int, int, int]]:
    """(owner rank, lo, hi) for each partition that flat range [start, end) touches."""
    return [(r, max(start, r * shard), min(end, (r + 1) * shard))
            for r in range(start // shard, (end - 1) // shard + 1)] if end > start else []


def adjacent(chunks: list[Tensor]) -> bool:
    """True when the chunks are consecutive in one storage (then they are one aligned buffer)."""
    n = chunks[0].numel()
    return all(c.is_contiguous() and c.numel() == n and c.untyped_storage().data_ptr() ==
               chunks[0].untyped_storage().data_ptr() and c.storage_offset() == chunks[0].storage_offset() + k * n
               for k, c in enumerate(chunks))


class Collectives:
    def __init__(self, dist, ops=tdist):
        # ``ops``: the module providing the primitives (torch.distributed; a recording fake in tests).
        self.dist, self.ops = dist, ops
        self.rank, self.world = dist.rank, dist.world

    def _go(self, what: str, fn, *args, **kwargs):
        return self.dist._issue(what, fn, *args, async_op=True, **kwargs)

    def wait(self, pending: Pending | Iterable[Pending], what: str) -> None:
        p = pending if isinstance(pending, Pending) else Pending.of(pending)
        self.dist.wait(p.works, what)
        for fn in p.after:
            fn()

    def all_reduce(self, t: Tensor, what: str, op=SUM) -> Pending:
        return Pending([self._go(what, self.ops.all_reduce, t, op=op)])

    def broadcast(self, t: Tensor, src: int, what: str) -> Pending:
        return Pending([self._go(what, self.ops.broadcast, t, src=src)])

    def all_gather_into(self, full: Tensor, shard: int, what: str, chunk: int | None = None) -> Pending:
        """Every rank's partition ``full[r * shard:(r + 1) * shard]`` -> everywhere (this rank's already in
        place). ``chunk``: at most this many elements per call where the backend splits calls."""
        raise NotImplementedError

    def reduce_scatter(self, chunks: list[Tensor], what: str) -> Pending:
        """Sum across ranks of ``world`` equal-length chunks, chunk r going to rank r: after ``wait``,
        ``chunks[rank]`` holds the sum of every rank's ``chunks[rank]`` (the others are scratch)."""
        raise NotImplementedError

    def reduce_to_owners(self, buf: Tensor, start: int, shard: int, what: str) -> Pending:
        """``buf`` mirrors flat range [start, start + len) of a buffer partitioned in ``shard``s: after ``wait``,
        its part in this rank's partition holds the sum across ranks. Here a reduce to each owner (the fallback)."""
        return Pending([self._go(what, self.ops.reduce, buf[lo - start:hi - start], dst=r, op=SUM)
                        for r, lo, hi in owner_slices(start, start + buf.numel(), shard)])


class Local(Collectives):
    """World size 1: every collective is a no-op, yet the checking accelerator sees each issued and waited
    for, so a world-1 run checks the stream order that more ranks need."""

    def _none(self, what: str, *tensors: Tensor) -> Pending:
        token = self.dist.acc.collective(tensors, what)
        return Pending() if token is None else Pending([CheckedWork(None, token, self.dist.acc)])

    def all_reduce(self, t, what, op=SUM):
        return self._none(what, t)

    def broadcast(self, t, src, what):
        return self._none(what, t)

    def all_gather_into(self, full, shard, what, chunk=None):
        return self._none(what, full)

    def reduce_scatter(self, chunks, what):
        return self._none(what, *chunks)

    def reduce_to_owners(self, buf, start, shard, what):
        return self._none(what, buf)


class CheckedWork:
    """A collective's work (None: a world-1 no-op) whose ``wait`` also orders the checked current stream after it."""

    def __init__(self, work, token, acc):
        self.work, self.token, self.acc = work, token, acc

    def wait(self, *args, **kwargs):
        out = self.work.wait(*args, **kwargs) if self.work is not None else True
        self.acc.collective_done(self.token)
        return out


class Gloo(Collectives):
    """gloo on CPU: broadcasts and reduces, measured faster here than its tensor collectives."""

    def all_gather_into(self, full, shard, what, chunk=None):
        # One broadcast per owner (and chunk), all in flight at once. Measured on 2 ranks (43 MB):
        # 12 ms, against 81 ms for all_gather_into_tensor and 97 ms for list all_gather.
        step = chunk or shard
        return Pending([self._go(what, self.ops.broadcast, full[a:min(a + step, (r + 1) * shard)], src=r)
                        for r in range(self.world) for a in range(r * shard, (r + 1) * shard, step)])

    def reduce_scatter(self, chunks, what):
        if self.world == 2:
            # Two gloo ranks: an all-reduce per chunk beats a reduce per chunk, and two in flight
            # keep both of gloo's worker threads busy (42 MB, median of 15: 2 reduces 31-34 ms,
            # one all-reduce 30 ms, 2 all-reduce halves 25 ms). Every rank gets all the sums.
            return Pending([self._go(what, self.ops.all_reduce, c, op=SUM) for c in chunks])
        # 3+ ranks: per-owner reduces win (47 vs 62 ms at 4 ranks), as on NCCL.
        return Pending([self._go(what, self.ops.reduce, c, dst=r, op=SUM) for r, c in enumerate(chunks)])

    def reduce_to_owners(self, buf, start, shard, what):
        if self.world == 2:  # the all-reduce halves of reduce_scatter, whatever the alignment
            return self.reduce_scatter(list(buf.chunk(2)), what)
        return super().reduce_to_owners(buf, start, shard, what)


class Nccl(Collectives):
    """NCCL: tensor all-gather and reduce-scatter on aligned buffers, per-owner reduce otherwise."""

    def __init__(self, dist, ops=tdist):
        super().__init__(dist, ops)
        # torch 2.13 renamed the tensor collectives and deprecates the old names (a FutureWarning per call);
        # older torch has only the old ones.
        self._all_gather = getattr(ops, "all_gather_single", None) or ops.all_gather_into_tensor
        self._reduce_scatter = getattr(ops, "reduce_scatter_single", None) or ops.reduce_scatter_tensor

    def all_gather_into(self, full, shard, what, chunk=None):
        # In place (the input is this rank's chunk of the output): one call, no staging buffer. The
        # chunk bound is not needed here: an in-place all-gather allocates nothing.
        mine = full[self.rank * shard:(self.rank + 1) * shard]
        return Pending([self._go(what, self._all_gather, full, mine)])

    def reduce_scatter(self, chunks, what):
        c, n = chunks[0], chunks[0].numel()
        if adjacent(chunks):   # one aligned buffer: reduce-scatter a view of it
            return self._reduce_scatter_in_place(c.as_strided((n * len(chunks),), (1,), c.storage_offset()), what)
        # Stripes of a larger buffer: gather them into one aligned staging buffer (one copy kernel),
        # reduce-scatter it in place, and copy this rank's sum back once the collective is done.
        staging = torch.cat(chunks)
        p = self._reduce_scatter_in_place(staging, what)
        p.after.append(lambda: chunks[self.rank].copy_(staging[self.rank * n:(self.rank + 1) * n]))
        return p

    def _reduce_scatter_in_place(self, buf: Tensor, what: str) -> Pending:
        n = buf.numel() // self.world
        # In place: NCCL reduce-scatters in place when the output is the input's chunk ``rank``.
        return Pending([self._go(what, self._reduce_scatter, buf[self.rank * n:(self.rank + 1) * n], buf,
                                 op=SUM)])

    def reduce_to_owners(self, buf, start, shard, what):
        if start == 0 and buf.numel() == self.world * shard:   # aligned
            return self._reduce_scatter_in_place(buf, what)
        return super().reduce_to_owners(buf, start, shard, what)


def collectives_for(dist, ops=tdist) -> Collectives:
    kind = Local if dist.world == 1 else {"nccl": Nccl, "gloo": Gloo}.get(dist.backend)
    if kind is None:
        raise ValueError(f"no collectives for backend {dist.backend!r} (gloo and nccl are supported)")
    return kind(dist, ops)
