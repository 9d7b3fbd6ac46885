"""ddp: replicated data parallelism. Every rank holds everything; gradients are all-reduced in
contiguous buckets of one flat buffer per group, launched from the gradient hooks (see _grads.py)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from framework.comm.distributed import Dist
from framework.precision import Policy
from framework.core.registry import Component
from framework.stages._flat import PieceSpec, bind_groups, initializer, piece_spec
from framework.stages._grads import FlatGrads, check_buckets, expected_order, plan_buckets
from framework.core.footprint import Footprint
from framework.core.utils import sq_norm, tensor_bytes, tensors_in
from framework.stages.base import BaseStage, Setup


@dataclass(frozen=True, kw_only=True)
class DDPConfig:
    reduce_bucket_size: int = 6_553_600   # elements per all-reduce bucket (25 MiB of fp32, torch DDP's default)
    overlap_comm: bool = True      # launch buckets during backward instead of after it


class DDPStage(BaseStage):
    def __init__(self, cfg: DDPConfig, dist: Dist, offload=None):
        # (replicated training has no partition to offload: the compatibility table allows only none)
        self.cfg, self.dist = cfg, dist
        self.reduced: list[torch.Tensor] = []   # what reduce_grads returned, until zero_grads
        self.hook_handles: list = []

    def setup(self, module: nn.Module, policy: Policy, *, grad_accum: int = 1) -> Setup:
        self.module, self.policy = module, policy
        kinds, self.layouts, self.flats, entries = bind_groups(module, 1, policy.param_dtype, self.dist,
                                                               initializer(module))
        self.master = [f.to(policy.master_dtype) for f in self.flats]   # the flat buffer itself when fp32
        buckets = plan_buckets(expected_order([e[1] for e in entries]), self.cfg.reduce_bucket_size)
        self.flat_grads = FlatGrads(entries, self.flats, self.layouts, [(0, f.numel()) for f in self.flats], buckets,
                                    self.dist, policy, reduce_scatter=False, overlap=self.cfg.overlap_comm,
                                    stage="ddp", what="gradient all-reduce")
        self.hook_handles = self.flat_grads.hook_handles
        return Setup(self.master, kinds)

    def backward(self, loss: torch.Tensor, *, sync: bool) -> None:
        self.flat_grads.backward(loss, sync=sync)

    def reduce_grads(self) -> list[torch.Tensor]:
        summed = self.flat_grads.finish()
        self.reduced = [g.to(m.dtype) for g, m in zip(summed, self.master)]
        return self.reduced

    def grad_sq_norm(self) -> torch.Tensor:   # of the master-dtype gradients the update reads; local = global
        return sq_norm(self.reduced, self.dist.device)

    def nonfinite_names(self, grads: list[torch.Tensor]) -> list[str]:
        # host sync: on the slow path after an overflow
        return [n for g, lay in zip(grads, self.layouts) for n in lay.nonfinite_names(g)]

    def publish(self, master: list[torch.Tensor]) -> None:
        for flat, m in zip(self.flats, master):
            if flat is not m:
                flat.copy_(m)

    def zero_grads(self) -> None:
        self.flat_grads.zero()
        self.reduced = []   # master-dtype copies, when there are any, are the step's only

    def piece_specs(self) -> list[PieceSpec]:   # one piece per group: the whole flat buffer
        return [piece_spec(layout, 0, layout.padded) for layout in self.layouts]

    def _memory(self, fp: Footprint, opt_state) -> None:
        fp.add("params", device=tensor_bytes(self.flats))
        self.flat_grads.memory(fp)
        fp.add("master_params", device=tensor_bytes(m for m, f in zip(self.master, self.flats) if m is not f))
        fp.add("optimizer_state", device=tensor_bytes(tensors_in(opt_state)))


COMPONENT = Component(config=DDPConfig, build=DDPStage, check=check_buckets)
