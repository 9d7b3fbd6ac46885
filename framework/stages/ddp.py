"""ddp: replicated data parallelism. Every rank holds everything; gradients are all-reduced.

Gradients live in one flat buffer per group, so the all-reduce works on contiguous buckets launched
from the gradient hooks during backward, in the same order on every rank (see _grads.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from framework.comm.distributed import Dist
from framework.core.errors import ConfigError
from framework.precision import Policy
from framework.core.registry import Component
from framework.engine.materialize import initializer
from framework.stages._flat import Layout, bind_group, param_groups, views
from framework.stages._grads import Arrivals, FlatGrads
from framework.stages._reduce import expected_order, plan_buckets
from framework.stages._spec import PieceSpec, piece_spec
from framework.core.footprint import Footprint
from framework.core.utils import sq_norm, tensor_bytes, tensors_in
from framework.stages.base import Setup, WholeParameters


@dataclass(kw_only=True)
class DDPConfig:
    bucket_size: int = 6_553_600   # elements per all-reduce bucket (25 MiB of fp32, torch DDP's default)
    overlap_comm: bool = True      # launch buckets during backward instead of after it


class DDPStage(WholeParameters):
    def __init__(self, cfg: DDPConfig, dist: Dist, offload=None):
        # (replicated training has no partition to offload: the compatibility table allows only none)
        if cfg.bucket_size < 1:
            raise ConfigError("stage.bucket_size must be >= 1 element")
        self.cfg, self.dist = cfg, dist
        self.layouts: list[Layout] = []
        self.flats: list[torch.Tensor] = []
        self.grads: list[torch.Tensor] = []
        self.master: list[torch.Tensor] = []
        self.launcher: Arrivals | None = None
        self.flat_grads: FlatGrads | None = None
        self.reduce_dtype = torch.float32
        self.work: list = []   # (handles, wire tensor, grad view) of launched buckets
        self.reduced: list[torch.Tensor] = []   # what reduce_grads returned, until zero_grads
        self.hook_handles: list = []   # removed by close()

    def setup(self, module: nn.Module, policy: Policy) -> Setup:
        self.module = module
        groups = param_groups(module)
        init = initializer(module)   # materialises meta parameters, one at a time
        entries = []  # (param, group index, slot) in registration order
        grad_views = []
        for g, (_, named) in enumerate(groups):
            layout, flat, params = bind_group(module, named, 1, policy.param_dtype, self.dist, init)
            grad = torch.zeros_like(flat)
            grad_views += views(grad, layout)  # bound as .grad during backward (in-place accumulation)
            self.layouts.append(layout)
            self.flats.append(flat)
            self.grads.append(grad)
            self.master.append(flat if policy.master_dtype == flat.dtype else flat.to(policy.master_dtype))
            entries += [(p, (g, s)) for p, s in zip(params, layout.slots)]
        self.reduce_dtype = policy.reduce_dtype
        named = [(p, s.name) for p, (_, s) in entries]
        self.flat_grads = FlatGrads(named, grad_views, self.grads, policy.grad_accum_dtype, "ddp")
        buckets = plan_buckets(expected_order([e[1] for e in entries]), self.cfg.bucket_size)
        self.launcher = Arrivals(buckets, self._launch, [n for _, n in named], "ddp")
        if self.dist.world > 1 and self.cfg.overlap_comm:
            self.hook_handles += self.launcher.attach([p for p, _ in entries], self.dist.acc)
        return Setup(self.master, [kind for kind, _ in groups])

    def _launch(self, i: int) -> None:
        b = self.launcher.buckets[i]
        view = self.flat_grads.final(b.group, b.start, b.end)
        wire = view if view.dtype == self.reduce_dtype else view.to(self.reduce_dtype)
        self.work.append(([self.dist.all_reduce(wire, what=f"gradient all-reduce of bucket {i}", async_op=True)],
                          wire, view))

    def backward(self, loss: torch.Tensor, *, sync: bool) -> None:
        # Buckets go out during the last micro batch's backward only. Gradients are summed across
        # ranks, so each rank contributes 1/world of the mean.
        with self.launcher.backward_pass(arm=sync and self.dist.world > 1):
            self.flat_grads.backward(lambda: (loss / self.dist.world).backward(), sync=sync)

    def reduce_grads(self) -> list[torch.Tensor]:
        if self.dist.world > 1:
            self.launcher.flush()  # buckets whose parameters got no gradient, or no overlap
            for works, wire, view in self.work:
                self.dist.wait(works, "gradient all-reduce")
                if wire is not view:
                    view.copy_(wire)
            self.work = []
        else:
            self.flat_grads.final_all()
        summed = self.flat_grads.summed()
        self.reduced = [g if g.dtype == m.dtype else g.to(m.dtype) for g, m in zip(summed, self.master)]
        return self.reduced

    def grad_sq_norm(self) -> torch.Tensor:
        """Over the master-dtype gradients (rounded as the update reads them); replicated, so local = global."""
        return sq_norm(self.reduced, self.dist.device)

    def nonfinite_names(self, grads: list[torch.Tensor]) -> list[str]:
        return [s.name for g, lay in zip(grads, self.layouts) for s in lay.slots
                if not torch.isfinite(g[s.offset:s.offset + s.numel]).all()]

    def publish(self, master: list[torch.Tensor]) -> None:
        for flat, m in zip(self.flats, master):
            if flat is not m:
                flat.copy_(m)

    def zero_grads(self) -> None:
        self.flat_grads.zero()
        self.reduced = []   # master-dtype copies, when there are any, are the step's only

    def piece_specs(self) -> list[PieceSpec]:   # one piece per group: the whole flat buffer
        return [piece_spec(layout, 0, layout.padded) for layout in self.layouts]

    def memory(self, opt_state) -> Footprint:
        fp = Footprint()
        fp.add("params", device=tensor_bytes(self.flats))
        self.flat_grads.memory(fp)
        fp.add("master_params", device=tensor_bytes(m for m, f in zip(self.master, self.flats) if m is not f))
        fp.add("optimizer_state", device=tensor_bytes(tensors_in(opt_state)))
        return fp


COMPONENT = Component(config=DDPConfig, build=DDPStage)
