"""Gradient bookkeeping that ddp, zero1 and zero2 share: ``FlatGrads`` (ddp, zero1) holds the
gradients in flat buffers and reduces them; ``Arrivals`` (all three) launches the buckets.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from framework.comm.accelerator import Accelerator
from framework.core.errors import TrainingError
from framework.core.footprint import Footprint
from framework.core.utils import few, tensor_bytes
from framework.stages._reduce import Bucket, own_parts, reduce_bucket

Entry = tuple[nn.Parameter, str]   # a parameter and its name


def check_no_grads(entries: list[Entry], stage: str) -> None:
    """Raise if a parameter has a gradient before train_step's backward (and clear them all)."""
    stray = [name for p, name in entries if p.grad is not None]
    if not stray:
        return
    for p, _ in entries:
        p.grad = None
    shown = few(stray, 4)
    raise TrainingError(
        f"{stage}: {shown} already had a gradient when train_step started its backward pass: loss_fn ran a "
        f"backward pass itself (loss.backward() or torch.autograd.backward, e.g. with create_graph=True). "
        f"loss_fn must only return the loss; train_step runs the backward pass")


class FlatGrads:
    """ddp's and zero1's gradients and their reduction: buckets go out from the hooks during the
    step's last backward (``overlap``) or after it, each to its owners (``bounds``: this rank's
    [lo, hi) per group; ddp: the whole buffer, all-reduced).

    .grad are views into one flat buffer per group, bound only while train_step's backward runs, so
    ``module.zero_grad()`` in ``loss_fn`` touches nothing of ours and a backward that ran inside
    ``loss_fn`` (or replaced a .grad) is an error, not a silent zero. With a wider
    ``precision.grad_accum_dtype`` every micro batch but the last is added into an accumulator; the
    last one range by range as it is reduced (``_final``)."""

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
        self.acc: list[torch.Tensor] | None = None   # the wider sums, once a step has accumulated
        self.used = False   # acc holds earlier micro batches of this step
        self.work: list = []   # (bucket, pending, wire buffer or None) of launched buckets
        self.launcher = Arrivals(buckets, self._launch, [n for _, n in self.entries], stage)
        self.hook_handles = (self.launcher.attach([p for p, _ in self.entries], dist.acc)
                             if dist.world > 1 and overlap else [])

    def backward(self, loss: torch.Tensor, *, sync: bool) -> None:
        """One micro batch's backward into the bound views; ``sync``: the step's last one. Gradients
        are summed across ranks, so each rank contributes 1/world of the mean."""
        check_no_grads(self.entries, self.stage)
        for (p, _), v in zip(self.entries, self.views):
            p.grad = v
        if sync and self.dist.world > 1:
            self.launcher.arm()
        try:
            (loss / self.dist.world).backward()
        finally:
            self.launcher.disarm()   # arrivals after this backward are ignored
            replaced = []
            for (p, name), v in zip(self.entries, self.views):
                if p.grad is not v and p.grad is not None:
                    replaced.append(name)
                p.grad = None
        if replaced:
            raise TrainingError(
                f"{self.stage}: the gradient of {replaced[0]!r} was replaced during backward instead of being "
                f"accumulated in place (a backward with create_graph=True, or a hook assigning .grad): "
                f"{len(replaced)} parameter(s) affected; gradients must accumulate into the stage's buffers")
        if not sync and self.accum_dtype != self.grads[0].dtype:
            if self.acc is None:
                self.acc = [torch.zeros_like(g, dtype=self.accum_dtype) for g in self.grads]
            for a, g in zip(self.acc, self.grads):
                a.add_(g)
                g.zero_()
            self.used = True

    def _final(self, g: int, start: int, end: int) -> torch.Tensor:
        """Range [start, end) of group ``g`` summed over the step's micro batches; call once per range
        after the last backward produced it (it adds that micro batch)."""
        if not self.used:
            return self.grads[g][start:end]
        out = self.acc[g][start:end]
        out.add_(self.grads[g][start:end])
        return out

    def _launch(self, i: int) -> None:
        b = self.launcher.buckets[i]
        ranges = [(b.start, b.start + b.numel)] if b.contiguous else b.ranges
        finals = [self._final(b.group, lo, hi) for lo, hi in ranges]
        if finals[0].dtype == self.reduce_dtype:
            wire, buf = finals, None   # reduced in place in the gradient buffer
        else:
            buf = torch.empty(b.numel, dtype=self.reduce_dtype, device=finals[0].device)
            wire = list(buf.chunk(len(finals)))
            for dst, v in zip(wire, finals):
                dst.copy_(v)
        pending = reduce_bucket(self.dist.comm, wire, b, self.layouts[b.group].shard, self.reduce_scatter,
                                what=f"{self.what} of bucket {i}")
        self.work.append((b, pending, buf))

    def finish(self) -> list[torch.Tensor]:
        """Complete the step's reduction; per group, the buffer the summed gradients live in."""
        if self.dist.world > 1:
            self.launcher.flush()  # buckets whose parameters got no gradient, or no overlap
            summed = self.summed()
            for b, pending, buf in self.work:
                self.dist.comm.wait(pending, self.what)
                if buf is not None:  # reduced in the wire dtype: this rank's sums back into its partition
                    for lo, hi, off in own_parts(b, *self.bounds[b.group]):
                        summed[b.group][lo:hi].copy_(buf[off:off + hi - lo])
            self.work = []
        else:   # every range is final at once: there is nothing to reduce
            for g, grad in enumerate(self.grads):
                self._final(g, 0, grad.numel())
        return self.summed()

    def summed(self) -> list[torch.Tensor]:
        """Per group, the buffer ``_final`` ranges live in."""
        return self.acc if self.used else self.grads

    def zero(self) -> None:
        for g in self.grads:
            g.zero_()
        if self.used:
            for a in self.acc:
                a.zero_()
        self.used = False

    def memory(self, fp: Footprint) -> None:
        fp.add("grads", device=tensor_bytes(self.grads))
        fp.add("grad_accumulator", device=tensor_bytes(self.acc or []))


class Arrivals:
    """Calls ``launch(bucket index)`` once per armed backward, strictly in bucket order (so every rank
    issues the same collectives in the same order), once every parameter of the bucket arrived.
    A per-parameter arrival flag, not a count of hook calls: under reentrant checkpointing a weight
    can arrive twice, and a second arrival after its bucket was reduced would be lost, so it raises."""

    def __init__(self, buckets: list[Bucket], launch: Callable[[int], None], names: list[str], stage: str):
        self.buckets, self.run, self.names, self.stage = buckets, launch, names, stage
        self.owners: dict[int, list[int]] = {}  # param id -> buckets holding a piece of it
        for i, b in enumerate(buckets):
            for pid in b.params:
                self.owners.setdefault(pid, []).append(i)
        self.armed = False
        self.seen = [False] * len(names)
        self.pending: list[int] = []   # per bucket, its parameters yet to arrive
        self.next = len(buckets)  # the next bucket to launch (buckets before it went out); none armed

    def _launch(self) -> None:
        self.next += 1
        self.run(self.next - 1)

    def attach(self, params: list[nn.Parameter], acc: Accelerator) -> list:
        """Hooks reporting parameter ``i`` of ``params`` to ``ready``; returns their handles."""
        return [p.register_post_accumulate_grad_hook(acc.hook(lambda _p, i=i: self.ready(i),
                                                              f"the {self.stage} gradient hook"))
                for i, p in enumerate(params)]

    def arm(self) -> None:
        """Buckets launch as their gradients arrive until ``disarm``."""
        self.armed = True
        self.seen = [False] * len(self.names)
        self.pending = [len(b.params) for b in self.buckets]
        self.next = 0

    def disarm(self) -> None:
        self.armed = False

    def ready(self, pid: int) -> None:
        if not self.armed:
            return
        if self.seen[pid]:
            if any(b < self.next for b in self.owners.get(pid, ())):
                raise TrainingError(
                    f"{self.stage}: {self.names[pid]!r} received a second gradient in one backward pass after its "
                    f"bucket was reduced (a weight used in two segments of reentrant activation checkpointing?); "
                    f"use torch.utils.checkpoint with use_reentrant=False")
            return  # accumulated again before its bucket went out: nothing is lost
        self.seen[pid] = True
        for i in self.owners[pid]:
            self.pending[i] -= 1
        while self.next < len(self.buckets) and self.pending[self.next] == 0:
            self._launch()

    def flush(self) -> None:
        """Launch every bucket not yet launched (their parameters got no gradient, or nothing was armed)."""
        while self.next < len(self.buckets):
            self._launch()
