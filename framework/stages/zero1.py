"""zero1: optimizer state (and fp32 master) partitioned; gradients reduced at the boundary.

Gradients accumulate in one full flat buffer per group, as in ddp; on the last micro batch each
bucket is reduced to its owners during backward (``overlap_comm``) or after it, in stripes.
"""
from __future__ import annotations

import torch

from framework.core.registry import Component
from framework.stages._flat import views
from framework.stages._grads import Arrivals, FlatGrads
from framework.stages._reduce import expected_order, own_parts, plan_buckets, plan_stripes, reduce_bucket
from framework.stages._sharded import ShardedStage, ZeroConfig


class Zero1Stage(ShardedStage):
    def _setup_grads(self, entries: list) -> None:
        # contiguous_gradients is inherent here: autograd accumulates straight into the flat buffer.
        self.grads = [torch.zeros_like(f) for f in self.flats]
        grad_views = [v for grad, layout in zip(self.grads, self.layouts) for v in views(grad, layout)]
        named = [(p, s.name) for p, (_, s) in entries]   # entries are in group order, as the views
        self.flat_grads = FlatGrads(named, grad_views, self.grads, self.policy.grad_accum_dtype, "zero1")
        order = expected_order([e[1] for e in entries])
        shards = {g: layout.shard for g, layout in enumerate(self.layouts)}
        size, world = self.cfg.reduce_bucket_size, self.dist.world
        # Reduced during backward: buckets in gradient order on partition boundaries. Reduced after
        # it: every gradient is present, so stripes (one reduce-scatter per bucket on NCCL).
        buckets = (plan_buckets(order, size, shards, world) if self.cfg.overlap_comm
                   else plan_stripes(order, size, shards, world))
        self.launcher = Arrivals(buckets, self._launch, [n for _, n in named], "zero1")
        self.work: list = []
        if self.dist.world > 1 and self.cfg.overlap_comm:
            self.hook_handles += self.launcher.attach([p for p, _ in entries], self.dist.acc)

    def _launch(self, i: int) -> None:
        b = self.launcher.buckets[i]
        ranges = [(b.start, b.start + b.numel)] if b.contiguous else b.ranges
        views = [self.flat_grads.final(b.group, lo, hi) for lo, hi in ranges]
        dtype = self.policy.reduce_dtype
        if views[0].dtype == dtype:
            wire, buf = views, None   # reduced in place in the gradient buffer
        else:
            buf = torch.empty(b.numel, dtype=dtype, device=views[0].device)
            wire = list(buf.chunk(len(views)))
            for dst, v in zip(wire, views):
                dst.copy_(v)
        pending = reduce_bucket(self.dist.comm, wire, b, self.layouts[b.group].shard, self.cfg.reduce_scatter,
                                what=f"gradient reduction of bucket {i}")
        self.work.append((b, pending, buf))

    def backward(self, loss: torch.Tensor, *, sync: bool) -> None:
        with self.launcher.backward_pass(arm=sync and self.dist.world > 1):
            self.flat_grads.backward(lambda: (loss / self.dist.world).backward(), sync=sync)

    def _finish_grads(self) -> None:
        if self.dist.world > 1:
            self.launcher.flush()
            for b, pending, buf in self.work:
                self.dist.comm.wait(pending, "gradient reduction")
                if buf is not None:  # reduced in the wire dtype: this rank's sums back into its partition
                    summed = self.flat_grads.summed()[b.group]
                    for lo, hi, off in own_parts(b, *self.bounds[b.group]):
                        summed[lo:hi].copy_(buf[off:off + hi - lo])
            self.work = []
        else:
            self.flat_grads.final_all()

    def _partition_grads(self) -> list[torch.Tensor]:
        return [g[lo:hi] for g, (lo, hi) in zip(self.flat_grads.summed(), self.bounds)]

    def zero_grads(self) -> None:
        self.flat_grads.zero()

    def _grad_memory(self, fp) -> None:
        self.flat_grads.memory(fp)


COMPONENT = Component(config=ZeroConfig, build=Zero1Stage)
