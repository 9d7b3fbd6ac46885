"""zero1: optimizer state (and fp32 master) partitioned; gradients reduced at the boundary.

Gradients accumulate over micro batches in one full flat buffer per group (parameters' .grad
are views into it), as in ddp. On the last micro batch each bucket is reduced to the ranks
that own its elements as soon as backward has produced it (``overlap_comm``) or after
backward; a rank then reads only its own partition. Only the owned partition of the master
weights and optimizer state exists on each rank. The .grad views are bound only during
backward, and micro batches are summed in ``precision.grad_accum_dtype`` (see _grads.py).
"""
from __future__ import annotations

import torch

from framework.registry import Component
from framework.stages._flat import views
from framework.stages._grads import Arrivals, FlatGrads
from framework.stages._reduce import expected_order, own_overlap, plan_buckets, reduce_to_owners
from framework.stages._sharded import ShardedStage, ZeroConfig
from framework.utils import tensor_bytes


class Zero1Stage(ShardedStage):
    def _setup_grads(self, entries: list) -> None:
        # contiguous_gradients is inherent here: autograd accumulates straight into the flat buffer.
        self.grads = [torch.zeros_like(f) for f in self.flats]
        grad_views = [v for grad, layout in zip(self.grads, self.layouts) for v in views(grad, layout)]
        named = [(p, s.name) for p, (_, s) in entries]   # entries are in group order, as the views
        self.flat_grads = FlatGrads(named, grad_views, self.grads, self.policy.grad_accum_dtype, "zero1")
        buckets = plan_buckets(expected_order([e[1] for e in entries]), self.cfg.reduce_bucket_size)
        self.launcher = Arrivals(buckets, self._launch, [n for _, n in named], "zero1")
        self.work: list = []
        if self.dist.world > 1 and self.cfg.overlap_comm:
            for i, (p, _) in enumerate(entries):
                p.register_post_accumulate_grad_hook(lambda _p, i=i: self.launcher.ready(i))

    def _launch(self, i: int) -> None:
        b = self.launcher.buckets[i]
        view = self.flat_grads.final(b.group, b.start, b.end)
        wire = view if view.dtype == self.policy.reduce_dtype else view.to(self.policy.reduce_dtype)
        works = reduce_to_owners(self.dist, wire, b.start, self.layouts[b.group].shard, self.cfg.reduce_scatter,
                                 what=f"gradient reduction of bucket {i}")
        self.work.append((b, works, wire, view))

    def backward(self, loss: torch.Tensor, *, sync: bool) -> None:
        if sync and self.dist.world > 1:
            self.launcher.arm()
        try:
            self.flat_grads.backward(lambda: (loss / self.dist.world).backward(), sync=sync)
        finally:
            self.launcher.disarm()

    def _partition_grads(self) -> list[torch.Tensor]:
        if self.dist.world > 1:
            self.launcher.flush()
            for b, works, wire, view in self.work:
                self.dist.wait(works, "gradient reduction")
                lo, hi = self.bounds[b.group]
                own = own_overlap(b.start, b.end, lo, hi)
                if wire is not view and own is not None:
                    view[own[0] - b.start:own[1] - b.start].copy_(wire[own[0] - b.start:own[1] - b.start])
            self.work = []
        else:
            for g, grad in enumerate(self.grads):
                self.flat_grads.final(g, 0, grad.numel())
        return [g[lo:hi] for g, (lo, hi) in zip(self.flat_grads.summed(), self.bounds)]

    def zero_grads(self) -> None:
        self.flat_grads.zero()

    def _grad_memory(self) -> dict[str, int]:
        return {"grads": tensor_bytes(self.flat_grads.tensors()), "comm_buffers": 0}


def build(cfg: ZeroConfig, *, dist, offload) -> Zero1Stage:
    return Zero1Stage(cfg, dist, offload)


COMPONENT = Component(config=ZeroConfig, build=build)
