"""Gradient bookkeeping that ddp, zero1 and zero2 share.

* ``FlatGrads`` (ddp, zero1): .grad are views into one flat buffer per group, bound only while
  train_step's backward runs, so ``module.zero_grad()`` in ``loss_fn`` touches nothing of ours and
  a backward that ran inside ``loss_fn`` (or replaced a .grad) is an error, not a silent zero.
  With a wider ``precision.grad_accum_dtype`` every micro batch but the last is added into an
  accumulator; the last one range by range as it is reduced (``final``).
* ``Arrivals`` (ddp, zero1, zero2): a per-parameter arrival flag, not a count of hook calls: under
  reentrant checkpointing a weight can arrive twice, and a second arrival after its bucket was
  reduced would be lost, so it raises.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

import torch
from torch import nn

from framework.comm.accelerator import Accelerator
from framework.core.errors import TrainingError
from framework.core.footprint import Footprint
from framework.core.utils import few, tensor_bytes
from framework.stages._reduce import Bucket, OrderedLauncher

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
    def __init__(self, entries: list[Entry], views: list[torch.Tensor], grads: list[torch.Tensor],
                 accum_dtype: torch.dtype, stage: str):
        self.entries, self.views, self.grads, self.stage = entries, views, grads, stage
        self.accum_dtype = accum_dtype
        self.acc: list[torch.Tensor] | None = None   # the wider sums, once a step has accumulated
        self.used = False   # acc holds earlier micro batches of this step

    def backward(self, run: Callable[[], None], *, sync: bool) -> None:
        """Run one micro batch's backward into the bound views; ``sync``: the step's last one."""
        check_no_grads(self.entries, self.stage)
        for (p, _), v in zip(self.entries, self.views):
            p.grad = v
        try:
            run()
        finally:
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

    def final(self, g: int, start: int, end: int) -> torch.Tensor:
        """Range [start, end) of group ``g`` summed over the step's micro batches; call once per range
        after the last backward produced it (it adds that micro batch)."""
        if not self.used:
            return self.grads[g][start:end]
        out = self.acc[g][start:end]
        out.add_(self.grads[g][start:end])
        return out

    def summed(self) -> list[torch.Tensor]:
        """Per group, the buffer ``final`` ranges live in."""
        return self.acc if self.used else self.grads

    def zero(self) -> None:
        for g in self.grads:
            g.zero_()
        if self.used:
            for a in self.acc:
                a.zero_()
        self.used = False

    def final_all(self) -> None:
        """Every range is final at once (world size 1: there is nothing to reduce)."""
        for g, grad in enumerate(self.grads):
            self.final(g, 0, grad.numel())

    def memory(self, fp: Footprint) -> None:
        fp.add("grads", device=tensor_bytes(self.grads))
        fp.add("grad_accumulator", device=tensor_bytes(self.acc or []))


class Arrivals:
    """An ``OrderedLauncher`` fed once per parameter and armed backward (see the module doc)."""

    def __init__(self, buckets: list[Bucket], launch: Callable[[int], None], names: list[str], stage: str):
        self.launcher = OrderedLauncher(buckets, self._launch)
        self.buckets, self._run, self.names, self.stage = buckets, launch, names, stage
        self.owners = self.launcher.owners   # param id -> buckets holding a piece of it
        self.armed = False
        self.seen = [False] * len(names)
        self.launched = [False] * len(buckets)

    def _launch(self, i: int) -> None:
        self.launched[i] = True
        self._run(i)

    def attach(self, params: list[nn.Parameter], acc: Accelerator) -> list:
        """Hooks reporting parameter ``i`` of ``params`` to ``ready``; returns their handles."""
        return [p.register_post_accumulate_grad_hook(acc.hook(lambda _p, i=i: self.ready(i),
                                                              f"the {self.stage} gradient hook"))
                for i, p in enumerate(params)]

    @contextmanager
    def backward_pass(self, arm: bool = True) -> Iterator[None]:
        """With ``arm``, buckets launch as their gradients arrive; arrivals after the block are ignored."""
        if arm:
            self.arm()
        try:
            yield
        finally:
            self.disarm()

    def arm(self) -> None:
        self.armed = True
        self.seen = [False] * len(self.names)
        self.launched = [False] * len(self.buckets)
        self.launcher.arm()

    def disarm(self) -> None:
        self.armed = False

    def ready(self, pid: int) -> None:
        if not self.armed:
            return
        if self.seen[pid]:
            if any(self.launched[b] for b in self.owners.get(pid, ())):
                raise TrainingError(
                    f"{self.stage}: {self.names[pid]!r} received a second gradient in one backward pass after its "
                    f"bucket was reduced (a weight used in two segments of reentrant activation checkpointing?); "
                    f"use torch.utils.checkpoint with use_reentrant=False")
            return  # accumulated again before its bucket went out: nothing is lost
        self.seen[pid] = True
        self.launcher.ready(pid)

    def flush(self) -> None:
        self.launcher.flush()
