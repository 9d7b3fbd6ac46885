"""zero2: optimizer state and gradients partitioned; buckets reduced during backward.

Autograd writes each parameter's gradient into its own .grad. When every gradient of a
bucket has arrived (post-accumulate-grad hooks, in bucket order) the bucket is copied into
a reusable bucket buffer (``contiguous_gradients``), the .grad tensors are freed, and the
buffer is reduced to the ranks that own its elements. Each rank adds its share into its
gradient partition; nothing else of the gradients survives backward. At most two bucket
buffers are in flight: launching a third first completes the oldest. Every micro batch is
reduced (gradients are never kept whole), as in DeepSpeed's stage 2, and summed into the
partition in ``precision.grad_accum_dtype``.
"""
from __future__ import annotations

from collections import deque

import torch

from framework.registry import Component
from framework.stages._grads import Arrivals, check_no_grads
from framework.stages._reduce import expected_order, own_overlap, plan_buckets, reduce_to_owners
from framework.stages._sharded import ShardedStage, ZeroConfig
from framework.utils import tensor_bytes

IN_FLIGHT = 2


class Zero2Stage(ShardedStage):
    def _setup_grads(self, entries: list) -> None:
        self.params = [p for p, _ in entries]
        self.slots = [gs for _, gs in entries]
        dtype = self.policy.reduce_dtype
        # The owned gradient partition, summed over micro batches in the accumulation dtype.
        self.part = [torch.zeros(hi - lo, dtype=self.policy.grad_accum_dtype, device=self.dist.device)
                     for lo, hi in self.bounds]
        self.named = [(p, s.name) for p, (_, s) in entries]
        buckets = plan_buckets(expected_order(self.slots), self.cfg.reduce_bucket_size)
        self.launcher = Arrivals(buckets, self._launch, [n for _, n in self.named], "zero2")
        # Without overlap_comm each bucket completes before the next is filled: one buffer does.
        n = min(IN_FLIGHT if self.cfg.overlap_comm else 1, len(buckets)) if self.cfg.contiguous_gradients else 0
        size = max(b.numel for b in buckets)
        self.free = [torch.empty(size, dtype=dtype, device=self.dist.device) for _ in range(n)]
        self.buffer_elems = n * size
        self.in_flight: deque = deque()
        for i, p in enumerate(self.params):
            p.register_post_accumulate_grad_hook(lambda _p, i=i: self.launcher.ready(i))

    def _launch(self, i: int) -> None:
        b = self.launcher.buckets[i]
        shard = self.layouts[b.group].shard
        what = f"gradient reduction of bucket {i}"
        if self.cfg.contiguous_gradients:
            while not self.free:  # bound the buffers in flight
                self._complete(self.in_flight.popleft())
            buf = self.free.pop()[:b.numel]
            pieces = [(b.start, buf)]
            for pid, (lo, hi, part) in self._pieces(b):
                dst = buf[lo - b.start:hi - b.start]
                dst.copy_(part) if part is not None else dst.zero_()
        else:  # reduce each gradient piece where it lies (no bucket buffer)
            buf = None
            pieces = [(lo, part.to(self.policy.reduce_dtype) if part is not None
                       else torch.zeros(hi - lo, dtype=self.policy.reduce_dtype, device=self.dist.device))
                      for _, (lo, hi, part) in self._pieces(b)]
        for pid in b.params:  # the bucket holding a parameter's first element is its last
            if b.start <= self.slots[pid][1].offset:
                self.params[pid].grad = None
        works = [w for start, t in pieces
                 for w in reduce_to_owners(self.dist, t, start, shard, self.cfg.reduce_scatter, what)]
        self.in_flight.append((b, works, pieces, buf))
        if not self.cfg.overlap_comm:
            self._complete(self.in_flight.popleft())

    def _pieces(self, b):
        """(param id, (flat lo, flat hi, gradient values or None)) for each piece in bucket ``b``."""
        for pid in b.params:
            slot = self.slots[pid][1]
            lo, hi = max(b.start, slot.offset), min(b.end, slot.offset + slot.numel)
            g = self.params[pid].grad
            yield pid, (lo, hi, None if g is None else g.reshape(-1)[lo - slot.offset:hi - slot.offset])

    def _complete(self, item) -> None:
        b, works, pieces, buf = item
        self.dist.wait(works, "gradient reduction")
        lo, hi = self.bounds[b.group]
        for start, t in pieces:
            own = own_overlap(start, start + t.numel(), lo, hi)
            if own is not None:
                self.part[b.group][own[0] - lo:own[1] - lo] += t[own[0] - start:own[1] - start]
                if self.sync and self.on_grads_final is not None:
                    self.on_grads_final(b.group, own[0] - lo, own[1] - lo, self.part[b.group])
        if buf is not None:
            self.free.append(buf._base if buf._base is not None else buf)

    def backward(self, loss: torch.Tensor, *, sync: bool) -> None:
        self.sync = sync
        check_no_grads(self.named, "zero2")  # .grad are freed per bucket: any here came from loss_fn
        self.launcher.arm()
        try:
            (loss / self.dist.world).backward()
        finally:
            self.launcher.disarm()
        self.launcher.flush()  # buckets of parameters that got no gradient
        while self.in_flight:
            self._complete(self.in_flight.popleft())

    def _partition_grads(self) -> list[torch.Tensor]:
        return self.part

    def zero_grads(self) -> None:
        for g in self.part:
            g.zero_()

    def _grad_memory(self) -> dict[str, int]:
        return {"grads": tensor_bytes(self.part),
                "comm_buffers": self.buffer_elems * self.policy.reduce_dtype.itemsize}


def build(cfg: ZeroConfig, *, dist, offload) -> Zero2Stage:
    return Zero2Stage(cfg, dist, offload)


COMPONENT = Component(config=ZeroConfig, build=build)
