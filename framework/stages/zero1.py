"""zero1: optimizer state (and fp32 master) partitioned; gradients reduced at the boundary.

Gradients accumulate in one full flat buffer per group, as in ddp; on the last micro batch each
bucket is reduced to its owners during backward (``overlap_comm``) or after it, in stripes.
"""
from __future__ import annotations

import torch

from framework.core.registry import Component
from framework.stages._grads import FlatGrads
from framework.stages._reduce import expected_order, plan_buckets, plan_stripes
from framework.stages._partitions import ShardedStage, ZeroConfig


class Zero1Stage(ShardedStage):
    def _setup_grads(self, entries: list) -> None:
        # contiguous_gradients is inherent here: autograd accumulates straight into the flat buffer.
        order = expected_order([e[1] for e in entries])
        shards = {g: layout.shard for g, layout in enumerate(self.layouts)}
        size, world = self.cfg.reduce_bucket_size, self.dist.world
        # Reduced during backward: buckets in gradient order on partition boundaries. Reduced after
        # it: every gradient is present, so stripes (one reduce-scatter per bucket on NCCL).
        buckets = (plan_buckets(order, size, shards, world) if self.cfg.overlap_comm
                   else plan_stripes(order, size, shards, world))
        self.flat_grads = FlatGrads(entries, self.flats, self.layouts, self.bounds, buckets, self.dist, self.policy,
                                    reduce_scatter=self.cfg.reduce_scatter, overlap=self.cfg.overlap_comm,
                                    stage="zero1", what="gradient reduction")
        self.hook_handles = self.flat_grads.hook_handles

    def backward(self, loss: torch.Tensor, *, sync: bool) -> None:
        self.flat_grads.backward(loss, sync=sync)

    def _finish_grads(self) -> None:
        self.flat_grads.finish()

    def _partition_grads(self) -> list[torch.Tensor]:
        return [g[lo:hi] for g, (lo, hi) in zip(self.flat_grads.summed(), self.bounds)]

    def zero_grads(self) -> None:
        self.flat_grads.zero()

    def _grad_memory(self, fp) -> None:
        self.flat_grads.memory(fp)


COMPONENT = Component(config=ZeroConfig, build=Zero1Stage)
