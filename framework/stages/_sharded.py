"""What zero1 and zero2 share: replicated working parameters, partitioned master and optimizer.

Rank r owns elements [r * shard, (r + 1) * shard) of each group's flat buffer; after the optimizer
step every rank's updated partition is gathered back into the working buffers.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from framework.comm.distributed import Dist
from framework.core.errors import ConfigError
from framework.offload.base import Placement
from framework.precision import Policy
from framework.engine.materialize import initializer
from framework.stages._flat import bind_group, param_groups
from framework.stages._partitions import PartitionedStage
from framework.stages.base import Setup, WholeParameters
from framework.core.footprint import Footprint
from framework.core.utils import tensor_bytes


@dataclass(kw_only=True)
class ZeroConfig:
    """DeepSpeed's zero_optimization keys (same names and defaults, so configs port over)."""

    reduce_bucket_size: int = 500_000_000      # elements per gradient reduction bucket
    allgather_bucket_size: int = 500_000_000   # elements per parameter all-gather chunk
    overlap_comm: bool = False                 # reduce buckets while backward still runs
    contiguous_gradients: bool = True          # zero2: copy gradients into a bucket buffer (zero1: always)
    reduce_scatter: bool = True                # False: all-reduce fallback (every rank gets all)
    # zero2: parameters laid out round-robin over the partitions (DeepSpeed's order), so every rank
    # copies its reduced buckets to the host while backward runs (zero1: no effect, a note)
    round_robin_gradients: bool = False


class ShardedStage(PartitionedStage, WholeParameters):
    """Base of zero1/zero2; subclasses own the gradient path: ``_setup_grads(entries)`` ((param, (group,
    slot)) in registration order), ``_grad_memory(fp)`` and ``PartitionedStage``'s."""

    round_robin = False   # lay parameters out round-robin over the partitions (zero2's round_robin_gradients)

    def __init__(self, cfg: ZeroConfig, dist: Dist, offload: Placement):
        if cfg.reduce_bucket_size < 1 or cfg.allgather_bucket_size < 1:
            raise ConfigError("stage.reduce_bucket_size and stage.allgather_bucket_size must be >= 1 element")
        # Host pieces as large as one rank's share of a bucket: the unit of the overlapped host step.
        super().__init__(cfg, dist, offload, chunk=-(-cfg.reduce_bucket_size // dist.world))
        self.flats: list[torch.Tensor] = []     # working parameters, replicated
        self.policy: Policy | None = None

    def setup(self, module: nn.Module, policy: Policy) -> Setup:
        self.module = module
        self.policy = policy
        groups = param_groups(module)
        init = initializer(module)   # materialises meta parameters, one at a time
        entries = []  # (param, (group, slot)) in registration order
        for g, (_, named) in enumerate(groups):
            # Layout order (round-robin, or registration order); entries stay in registration order,
            # the order backward runs in reverse, from which buckets are planned.
            placed = round_robin(named, self.dist.world) if self.round_robin else named
            layout, flat, bound = bind_group(module, placed, self.dist.world, policy.param_dtype, self.dist, init)
            params = dict(zip((n for n, _ in placed), bound))
            slots = {s.name: s for s in layout.slots}
            lo, hi = layout.partition(self.dist.rank)
            # fp32 without offload: the owned slice of the working buffer is the master (no copy).
            self._own(layout, flat[lo:hi], policy.master_dtype)
            self.flats.append(flat)
            entries += [(params[n], (g, slots[n])) for n, _ in named]
        self._setup_grads(entries)
        return Setup(self.master, [groups[g][0] for g, _ in self.piece_index])

    def publish_finish(self) -> None:
        comm = self.dist.comm   # every rank's owned partition -> everywhere (gloo: in allgather_bucket_size calls)
        for flat, layout in zip(self.flats, self.layouts):
            comm.wait(comm.all_gather_into(flat, layout.shard, "parameter all-gather", self.cfg.allgather_bucket_size),
                      "parameter all-gather")

    def memory(self, opt_state) -> Footprint:
        fp = Footprint()
        fp.add("params", device=tensor_bytes(self.flats))
        self.offload.memory(fp, opt_state)
        self._grad_memory(fp)
        return fp


def round_robin(named: list, world: int) -> list:
    """DeepSpeed's round-robin order: parameters adjacent in registration (and backward) order lie
    in different ranks' partitions of the flat buffer."""
    return [x for r in range(world) for x in named[r::world]]
