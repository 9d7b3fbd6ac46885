"""zero2: optimizer state and gradients partitioned; buckets reduced during backward.

Once a bucket's gradients arrived they are copied into a reusable bucket buffer
(``contiguous_gradients``), their .grad freed, and the buffer reduced to its owners, who add their
share into their partition. Every micro batch is reduced, as in DeepSpeed's stage 2.
"""
from __future__ import annotations

from collections import deque

import torch

from framework.comm.collectives import Pending
from framework.core.registry import Component
from framework.stages._grads import Arrivals, check_no_grads
from framework.stages._reduce import (expected_order, own_overlap, plan_buckets, plan_round_robin, reduce_bucket,
                                      reduce_to_owners)
from framework.stages._partitions import ShardedStage, ZeroConfig
from framework.core.utils import tensor_bytes

IN_FLIGHT = 2   # bucket buffers in flight: launching a third first completes the oldest


class Zero2Stage(ShardedStage):
    @property
    def round_robin(self) -> bool:
        return self.cfg.round_robin_gradients

    def _setup_grads(self, entries: list) -> None:
        self.params = [p for p, _ in entries]
        self.slots = [gs for _, gs in entries]
        dtype = self.policy.reduce_dtype
        self.part = [torch.zeros(hi - lo, dtype=self.policy.grad_accum_dtype, device=self.dist.device)
                     for lo, hi in self.bounds]
        self.named = [(p, s.name) for p, (_, s) in entries]
        # On partition boundaries: each bucket has one owner, or is a whole aligned group buffer.
        plan = plan_round_robin if self.round_robin else plan_buckets
        buckets = plan(expected_order(self.slots), self.cfg.reduce_bucket_size,
                       {g: layout.shard for g, layout in enumerate(self.layouts)}, self.dist.world)
        self.launcher = Arrivals(buckets, self._launch, [n for _, n in self.named], "zero2")
        # Without overlap_comm each bucket completes before the next is filled: one buffer does.
        n = min(IN_FLIGHT if self.cfg.overlap_comm else 1, len(buckets)) if self.cfg.contiguous_gradients else 0
        size = max(b.numel for b in buckets)
        self.free = [torch.empty(size, dtype=dtype, device=self.dist.device) for _ in range(n)]
        self.buffer_elems = n * size
        self.in_flight: deque = deque()
        self.sync = True   # set by each backward: its pass is the step's last, so the ranges it completes are final
        self.hook_handles += self.launcher.attach(self.params, self.dist.acc)

    def _launch(self, i: int) -> None:
        b = self.launcher.buckets[i]
        shard, numel = self.layouts[b.group].shard, self.layouts[b.group].numel
        what = f"gradient reduction of bucket {i}"
        comm, rs = self.dist.comm, self.cfg.reduce_scatter
        if self.cfg.contiguous_gradients:
            while not self.free:  # bound the buffers in flight
                self._complete(self.in_flight.popleft())
            buf = self.free.pop()[:b.numel]
            for lo, hi, part, off in self._pieces(b):
                dst = buf[off:off + hi - lo]
                dst.copy_(part) if part is not None else dst.zero_()
            base = 0
            for start, end in b.ranges:  # the padding at a group's end (in a whole-buffer bucket)
                if end > numel:
                    buf[base + max(start, numel) - start:base + end - start].zero_()
                base += end - start
            chunks = buf.chunk(b.count)
            wire = [buf] if b.contiguous else list(chunks)
            pieces = [(start, t) for (start, _), t in zip(b.ranges, chunks)]
            pending = reduce_bucket(comm, wire, b, shard, rs, what)
        else:  # reduce each gradient piece where it lies (no bucket buffer)
            buf = None
            pieces = [(lo, part.to(self.policy.reduce_dtype) if part is not None
                       else torch.zeros(hi - lo, dtype=self.policy.reduce_dtype, device=self.dist.device))
                      for lo, hi, part, _ in self._pieces(b)]
            pending = Pending.of(reduce_to_owners(comm, t, lo, shard, rs, what) for lo, t in pieces)
        for pid in b.params:  # a parameter's .grad goes with the last bucket that reads it
            if self.launcher.owners[pid][-1] == i:
                self.params[pid].grad = None
        self.in_flight.append((b, pending, pieces, buf))
        if not self.cfg.overlap_comm:
            self._complete(self.in_flight.popleft())

    def _pieces(self, b):
        """(flat lo, flat hi, gradient values or None, offset in the buffer) of each piece in ``b``."""
        base = 0
        for start, end in b.ranges:
            for pid in b.params:
                slot = self.slots[pid][1]
                lo, hi = max(start, slot.offset), min(end, slot.offset + slot.numel)
                if lo < hi:
                    g = self.params[pid].grad
                    yield lo, hi, None if g is None else g.reshape(-1)[lo - slot.offset:hi - slot.offset], \
                        base + lo - start
            base += end - start

    def _complete(self, item) -> None:
        b, pending, pieces, buf = item
        self.dist.comm.wait(pending, "gradient reduction")
        lo, hi = self.bounds[b.group]
        real = min(hi, self.layouts[b.group].numel)   # a whole-buffer bucket's padding: zeros, never reported
        for start, t in pieces:   # (flat start, values) of each reduced range
            own = own_overlap(start, start + t.numel(), lo, real)   # this rank's sums
            if own is None:
                continue
            a, z = own
            self.part[b.group][a - lo:z - lo] += t[a - start:z - start]
            if self.sync:  # tell the listener (the offload target)
                self.offload.grads_final(b.group, a - lo, z - lo, self.part[b.group])
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

    def _finish_grads(self) -> None:
        pass   # each backward pass completed its own reductions

    def _partition_grads(self) -> list[torch.Tensor]:
        return self.part

    def zero_grads(self) -> None:
        for g in self.part:
            g.zero_()

    def _grad_memory(self, fp) -> None:
        fp.add("grads", device=tensor_bytes(self.part))
        fp.add("bucket_buffers", device=self.buffer_elems * self.policy.reduce_dtype.itemsize)


COMPONENT = Component(config=ZeroConfig, build=Zero2Stage)
