"""Gradient buckets shared by ddp, zero1 and zero2: planned once from the expected gradient order (reverse
registration; for the ZeRO stages on partition boundaries), launched in plan order (``Arrivals``);
``FlatGrads`` (ddp, zero1) holds the gradients in flat buffers and reduces them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from framework.comm.accelerator import Accelerator
from framework.comm.collectives import Collectives, Pending
from framework.core.errors import ConfigError, TrainingError
from framework.core.footprint import Footprint
from framework.core.utils import counted, few, tensor_bytes
from framework.stages._flat import ALIGN

Entry = tuple[nn.Parameter, str]   # a parameter and its name


@dataclass(frozen=True)
class Bucket:
    """Flat ranges ``[start + k * stride, end + k * stride)`` for k < count of one group's buffer; count ==
    world, stride == the partition length: a *striped* bucket, exactly one reduce-scatter on the wire."""

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
    def contiguous(self) -> bool:   # the ranges are one flat range [start, start + numel)
        return self.count == 1 or self.end - self.start == self.stride


def plan_buckets(order: list[tuple[int, int, int, int]], bucket_size: int,
                 shards: dict[int, int] | None = None, world: int = 1, cap: int | None = None) -> list[Bucket]:
    """Contiguous buckets in the order they close. ``order``: (param id, group, offset, numel) in expected gradient
    order; ``shards``: group -> partition length (ZeRO stages). Each partition's open bucket grows downwards through its
    group's buffer, splitting parameters, so no bucket exceeds ``cap`` (default ``bucket_size``) or crosses a partition
    boundary. A group that fits in ``bucket_size`` is one striped bucket, closed with the group's last gradient."""
    shards, cap = shards or {}, cap or bucket_size
    whole = {g for g, s in shards.items() if s * world <= bucket_size}
    last = {g: i for i, (_, g, _, _) in enumerate(order) if g in whole}   # where each whole group closes
    open_: dict[tuple[int, int], tuple[int, int, list[int]]] = {}   # (group, partition start) -> (start, end, ids)
    out: list[Bucket] = []

    def close(key: tuple[int, int]) -> None:
        start, end, pids = open_.pop(key)
        out.append(Bucket(key[0], start, end, tuple(pids)))

    for i, (pid, g, offset, numel) in enumerate(order):
        if g in whole:
            if i == last[g]:
                out.append(Bucket(g, 0, shards[g], tuple(p for p, gg, _, _ in order if gg == g), stride=shards[g],
                                  count=world))
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


def plan_stripes(order: list[tuple[int, int, int, int]], bucket_size: int, shards: dict[int, int],
                 world: int) -> list[Bucket]:
    """Striped buckets for gradients all present when reduction starts (zero1 without overlap_comm): a group
    that fits is one bucket, else stripes of ``bucket_size // world`` elements (ALIGN-rounded when that large,
    at least 1) from the partitions' ends down. (During backward every stripe would wait for partition 0.)"""
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


def bucket_buffers(buckets: list[Bucket], overlap: bool, contiguous: bool) -> tuple[int, int]:
    """(how many, elements each) of zero2's bucket buffers (none without ``contiguous``): two in flight with
    ``overlap`` (a third launch completes the oldest), else one."""
    return (min(2 if overlap else 1, len(buckets)) if contiguous else 0), max(b.numel for b in buckets)


def expected_order(entries: list[tuple[int, object]]) -> list[tuple[int, int, int, int]]:
    """(param id, group, offset, numel) in reverse registration order, from (group, slot) pairs."""
    return [(pid, g, s.offset, s.numel) for pid, (g, s) in reversed(list(enumerate(entries)))]


def check_buckets(node, stage: str, nodes):
    """Refuse a bucket of no elements (the stage configs' ``*_bucket_size`` keys; a ``Component`` check)."""
    for key in ("reduce_bucket_size", "allgather_bucket_size"):
        if getattr(node, key, 1) < 1:
            raise ConfigError(f"stage.{key} must be >= 1 element, got {getattr(node, key)}")
    return node


def reduce_to_owners(comm: Collectives, buf: torch.Tensor, start: int, shard: int, reduce_scatter: bool,
                     what: str) -> Pending:
    """Sum ``buf`` (flat range [start, start + len)) so each rank gets its own partition's part
    (reduce_scatter=False: DeepSpeed's all-reduce fallback, every rank gets it all)."""
    return comm.reduce_to_owners(buf, start, shard, what) if reduce_scatter else comm.all_reduce(buf, what)


def reduce_bucket(comm: Collectives, wire: list[torch.Tensor], b: Bucket, shard: int, reduce_scatter: bool,
                  what: str) -> Pending:
    """Reduce bucket ``b`` to its owners. ``wire``: its values, one tensor if contiguous, else one per range
    (chunk r is rank r's)."""
    if len(wire) == 1:
        return reduce_to_owners(comm, wire[0], b.start, shard, reduce_scatter, what)
    return comm.reduce_scatter(wire, what) if reduce_scatter else Pending.of(comm.all_reduce(t, what) for t in wire)


def own_parts(b: Bucket, lo: int, hi: int) -> list[tuple[int, int, int]]:
    """(flat start, flat end, offset in the bucket's buffer) of each part of ``b`` inside [lo, hi)."""
    return [(*own, k * (b.end - b.start) + own[0] - start)   # (the ranges lie end to end in the buffer)
            for k, (start, end) in enumerate(b.ranges) if (own := own_overlap(start, end, lo, hi)) is not None]


def own_overlap(start: int, end: int, lo: int, hi: int) -> tuple[int, int] | None:   # [start, end) in [lo, hi)
    a, b = max(start, lo), min(end, hi)
    return (a, b) if a < b else None


def check_no_grads(entries: list[Entry], stage: str) -> None:
    """Raise if a parameter has a gradient before train_step's backward (and clear them all)."""
    if stray := [name for p, name in entries if p.grad is not None]:
        for p, _ in entries:
            p.grad = None
        raise TrainingError(
            f"{stage}: {few(stray, 4)} already had a gradient when train_step started its backward pass: a backward "
            f"pass ran outside train_step's (in loss_fn, or on the module's output between steps: loss.backward() or "
            f"torch.autograd.backward, e.g. with create_graph=True). loss_fn must only return the loss (train_step "
            f"runs the backward pass); between steps, call module.zero_grad(set_to_none=True) after your own "
            f"backward pass, or take gradients with torch.autograd.grad(out, inputs), which leaves .grad alone")


def late_gradient(who: str) -> TrainingError:
    """A second gradient in one backward pass. Refused at every stage, world size and bucket layout (with
    bucketed reduction it may arrive after its bucket went out, and be lost), so a one-process test finds it."""
    return TrainingError(f"{who} received a second gradient in one backward pass (a weight used in two segments "
                         f"of reentrant activation checkpointing?); use torch.utils.checkpoint with "
                         f"use_reentrant=False")


def sparse_gradient(stage: str, name: str) -> TrainingError:
    """A sparse gradient (``F.embedding(..., sparse=True)``, which setup cannot see) met a dense flat buffer."""
    return TrainingError(f"{stage}: parameter {name!r} got a sparse gradient, and {stage}'s flat gradient buffers cannot "
                         f"take sparse gradients: use sparse=False (ddp and zero1 accumulate them into a dense buffer)")


def backward_or_reset(backward: Callable[[], None], reset: Callable[[bool], None], what: str) -> None:
    """Run a stage's ``backward``; if it raises, ``reset(wait)`` puts the stage back as between passes and
    the error is raised. ``wait`` for the launched reductions on an error (ranks fail at the same point as a
    rule), not on Ctrl-C or SIGTERM (a peer interrupted elsewhere may never join them)."""
    try:
        backward()
    except BaseException as e:
        try:
            reset(isinstance(e, Exception))
        except Exception as failed:
            e.add_note(f"{what} could not reset its gradient state after it: {type(failed).__name__}: {failed} "
                       f"(if the ranks' backward passes failed at different points, this process group cannot "
                       f"go on: restart, from a checkpoint)")
        raise


class FlatGrads:
    """ddp's and zero1's gradients: buckets go to their owners (``bounds``: this rank's [lo, hi) per group;
    ddp: the whole buffer, all-reduced) from the hooks of the step's last backward (``overlap``) or after it.

    .grad are views into one flat buffer per group, bound only during train_step's backward, so
    ``module.zero_grad()`` in loss_fn touches nothing and a backward inside loss_fn is an error, not a silent
    zero. With a wider grad_accum_dtype earlier micro batches go into an accumulator, the last one is added
    range by range as it is reduced (``_final``). A wire wider than the gradients, with no accumulator in the
    step, lands this rank's sums in a buffer of the accumulator's dtype (``owned``), so the update reads the
    wire's sums as under zero2 and zero3. Under loss scaling that wider sum goes on the wire divided
    by the micro batch count and is multiplied back (exact for powers of two), so the wire carries one micro
    batch's magnitude, as under zero2 and zero3, and every stage overflows at the same loss scale."""

    def __init__(self, entries: list, flats: list[torch.Tensor], layouts: list, bounds: list[tuple[int, int]],
                 buckets: list[Bucket], dist, policy, *, reduce_scatter: bool, overlap: bool, stage: str, what: str):
        """``entries``: (parameter, (group, slot)) in registration order, groups in order."""
        self.grads = [torch.zeros_like(f) for f in flats]
        # each parameter's view from its own slot, so no ordering of entries and layouts can pair them wrongly
        self.views = [self.grads[g][s.offset:s.offset + s.numel].view(s.shape) for _, (g, s) in entries]
        self.entries: list[Entry] = [(p, s.name) for p, (_, s) in entries]
        self.layouts, self.bounds, self.dist, self.stage, self.what = layouts, bounds, dist, stage, what
        self.accum_dtype, self.reduce_dtype = policy.grad_accum_dtype, policy.reduce_dtype
        self.reduce_scatter = reduce_scatter
        self.scaled = policy.scaler is not None   # gradients are scaled up to the edge of the wire's range
        self.acc: list[torch.Tensor] | None = None   # the wider sums, once a step has accumulated
        self.micro = 0   # how many earlier micro batches of this step acc holds
        # where the sums of a wire wider than the gradients land when acc holds none (``owned``)
        w = self.grads[0].dtype
        self.widen = dist.world > 1 and self.reduce_dtype != w and self.accum_dtype != w
        self.landing: list[torch.Tensor] | None = None
        self.work: list = []   # (bucket, pending, wire buffer or None, micro batches divided out) of launched buckets
        self.abandoned: list | None = None   # those of an interrupted pass, not waited for
        self.launcher = Arrivals(buckets, self._launch, [n for _, n in self.entries], stage)
        self.overlap = dist.world > 1 and overlap
        # attached at every world size: a second gradient is refused as under overlap (a Python call, no sync)
        self.hook_handles = self.launcher.attach([p for p, _ in self.entries], dist.acc)

    def backward(self, loss: torch.Tensor, *, sync: bool) -> None:
        """One micro batch's backward into the bound views; ``sync``: the step's last one. Gradients
        are summed across ranks, so each rank contributes 1/world of the mean."""
        check_no_grads(self.entries, self.stage)
        for (p, _), v in zip(self.entries, self.views):
            p.grad = v
        self.launcher.arm(launch=sync and self.overlap)
        try:
            backward_or_reset(lambda: (loss / self.dist.world).backward(), self.abort_backward, self.stage)
        finally:
            self.launcher.disarm()   # arrivals after this backward are ignored
            replaced = [name for (p, name), v in zip(self.entries, self.views) if p.grad is not v and p.grad is not None]
            for p, _ in self.entries:
                p.grad = None
        if replaced:
            raise TrainingError(
                f"{self.stage}: the gradient of {replaced[0]!r} was replaced during backward instead of being "
                f"accumulated in place (a backward with create_graph=True, or a hook assigning .grad): "
                f"{counted(len(replaced), 'parameter')} affected; gradients must accumulate into the stage's buffers")
        if not sync and self.accum_dtype != self.grads[0].dtype:
            if self.acc is None:
                self.acc = [torch.zeros_like(g, dtype=self.accum_dtype) for g in self.grads]
            for a, g in zip(self.acc, self.grads):
                a.add_(g)
                g.zero_()
            self.micro += 1

    def abort_backward(self, wait: bool) -> None:
        """A pass cut short: its reductions are waited for (unless not ``wait``: then kept referenced, their
        buffers alive) and dropped; the caller zeroes the buffers next."""
        self.launcher.reset()
        work, self.work = self.work, []
        self.abandoned = None if wait else work   # (their wire buffers must outlive the collectives)
        for _b, pending, _buf, _n in work if wait else ():
            self.dist.comm.wait(pending, self.what)

    def _final(self, g: int, start: int, end: int) -> torch.Tensor:
        """Range [start, end) of group ``g`` summed over the step's micro batches (adds the last one: call once)."""
        if not self.micro:
            return self.grads[g][start:end]
        out = self.acc[g][start:end]
        out.add_(self.grads[g][start:end])
        return out

    def _launch(self, i: int) -> None:
        b = self.launcher.buckets[i]
        ranges = [(b.start, b.start + b.numel)] if b.contiguous else b.ranges
        finals = [self._final(b.group, lo, hi) for lo, hi in ranges]
        n, buf, wire = 1, None, finals   # in the wire dtype already: reduced in place in the gradient buffer
        if finals[0].dtype != self.reduce_dtype:
            buf = torch.empty(b.numel, dtype=self.reduce_dtype, device=finals[0].device)
            wire = list(buf.chunk(len(finals)))
            n = self.micro + 1 if self.scaled else 1
            for dst, v in zip(wire, finals):
                if n > 1:   # in the wide dtype, before the cast (the accumulator is overwritten after the reduce)
                    v.div_(n)
                dst.copy_(v)
        pending = reduce_bucket(self.dist.comm, wire, b, self.layouts[b.group].shard, self.reduce_scatter,
                                what=f"{self.what} of bucket {i}")
        self.work.append((b, pending, buf, n))

    def finish(self) -> list[torch.Tensor]:
        """Complete the step's reduction; per group, this rank's range of the summed gradients (``owned``)."""
        owned = self.owned()
        if self.dist.world > 1:
            self.launcher.flush()  # buckets whose parameters got no gradient, or no overlap
            for b, pending, buf, n in self.work:
                self.dist.comm.wait(pending, self.what)
                if buf is not None:  # reduced in the wire dtype: this rank's sums back into its partition
                    base = self.bounds[b.group][0]
                    for lo, hi, off in own_parts(b, *self.bounds[b.group]):
                        own = owned[b.group][lo - base:hi - base].copy_(buf[off:off + hi - lo])
                        if n > 1:   # in the wide dtype: exact (an fp16 value times a small integer)
                            own.mul_(n)
            self.work = []
        else:   # every range is final at once: there is nothing to reduce
            for g, grad in enumerate(self.grads):
                self._final(g, 0, grad.numel())
        return owned

    def owned(self) -> list[torch.Tensor]:
        """Per group, this rank's range of the step's sums: where ``_final`` ranges live, or (``widen``, no
        accumulator) a buffer of the accumulator's dtype, made at the first step (zeros: the ranges between
        parameters, in no bucket, stay zero)."""
        if self.micro or not self.widen:
            return [s[lo:hi] for s, (lo, hi) in zip(self.acc if self.micro else self.grads, self.bounds)]
        if self.landing is None:
            self.landing = [torch.zeros(hi - lo, dtype=self.accum_dtype, device=g.device)
                            for g, (lo, hi) in zip(self.grads, self.bounds)]
        return self.landing

    def zero(self) -> None:
        for g in self.grads + (self.acc if self.micro else []):
            g.zero_()
        self.micro = 0
        if self.work:   # a step cut short in finish: its reductions must not be read into the next one's sums
            self.abort_backward(wait=False)

    def memory(self, fp: Footprint) -> None:
        fp.add("grads", device=tensor_bytes(self.grads))
        fp.add("grad_accumulator", device=tensor_bytes((self.acc or []) + (self.landing or [])))


class Arrivals:
    """Calls ``launch(bucket index)`` once per armed backward, strictly in bucket order (every rank issues the
    same collectives), once all the bucket's parameters arrived (only where armed with ``launch``). Arrival is
    a per-parameter flag: under reentrant checkpointing a weight can arrive twice, which raises."""

    def __init__(self, buckets: list[Bucket], launch: Callable[[int], None], names: list[str], stage: str):
        self.buckets, self.run, self.names, self.stage = buckets, launch, names, stage
        self.owners: dict[int, list[int]] = {}  # param id -> buckets holding a piece of it
        for i, b in enumerate(buckets):
            for pid in b.params:
                self.owners.setdefault(pid, []).append(i)
        self.armed = self.launching = False
        self.seen: list[bool] = []     # per parameter, whether it arrived in the armed pass
        self.pending: list[int] = []   # per bucket, its parameters yet to arrive
        self.next = len(buckets)  # the next bucket to launch (buckets before it went out); none armed

    def attach(self, params: list[nn.Parameter], acc: Accelerator) -> list:
        return [p.register_post_accumulate_grad_hook(acc.hook(lambda _p, i=i: self.ready(i),
                                                              f"the {self.stage} gradient hook"))
                for i, p in enumerate(params)]

    def arm(self, launch: bool = True) -> None:
        """Arrivals are checked until disarm(); with ``launch`` buckets launch as their gradients arrive, without
        it all of them at the next flush()."""
        self.armed, self.launching = True, launch
        self.seen = [False] * len(self.names)
        self.pending = [len(b.params) for b in self.buckets]
        self.next = 0

    def disarm(self) -> None:
        self.armed = False

    def reset(self) -> None:
        """After a pass cut short: nothing armed and no bucket left to launch."""
        self.armed, self.next = False, len(self.buckets)

    def ready(self, pid: int) -> None:
        if not self.armed:
            return
        if self.seen[pid]:
            raise late_gradient(f"{self.stage}: {self.names[pid]!r}")
        self.seen[pid] = True
        if not self.launching:
            return
        for i in self.owners.get(pid, ()):   # none for a parameter of 0 elements: no bucket holds it
            self.pending[i] -= 1
        self.flush(arrived=True)

    def flush(self, arrived: bool = False) -> None:
        """Launch the buckets not yet launched; ``arrived``: only up to the first one still waiting."""
        while self.next < len(self.buckets) and not (arrived and self.pending[self.next]):
            self.next += 1
            self.run(self.next - 1)
