"""The owned partitions of a ZeRO stage and the Stage methods built on them.

zero1, zero2 (``ShardedStage``: replicated working parameters) and zero3 own, per group, this rank's
partition [lo, hi) of a padded flat layout and the master pieces the offload target (the stage's
listener: ``offload.grads_final``, see ``offload.base``) cut it into. After the optimizer step
zero1/zero2 gather every rank's updated partition back into the working buffers.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from framework.comm.distributed import Dist
from framework.core.errors import ConfigError
from framework.core.footprint import Footprint
from framework.core.utils import sq_norm, tensor_bytes
from framework.engine.materialize import initializer
from framework.engine.update import PlainUpdate, Update
from framework.offload.base import Piece, Placement
from framework.optimizers import GradientTransformation
from framework.precision import Policy
from framework.stages._flat import Layout, PieceSpec, bind_group, param_groups, piece_spec
from framework.stages.base import Setup, WholeParameters


class PartitionedStage:
    """Subclasses supply ``_finish_grads()`` (complete the step's reduction after its last backward),
    ``_partition_grads()`` (each group's reduced gradient partition on the device, once finished; read
    only) and ``publish_finish()`` (after every piece is published, make the working parameters current)."""

    def __init__(self, cfg, dist: Dist, offload: Placement, chunk: int | None):
        """``chunk``: the longest master piece the offload target may cut (None: one per partition)."""
        self.cfg, self.dist, self.offload, self.chunk = cfg, dist, offload, chunk
        self.layouts: list[Layout] = []
        self.bounds: list[tuple[int, int]] = []     # owned [lo, hi) per group
        self.pieces: list[list[Piece]] = []         # from the offload target, in the optimizer's order
        self.hook_handles: list = []                # removed by close()

    def _own(self, layout: Layout, owned: torch.Tensor, master_dtype: torch.dtype) -> list[Piece]:
        """Own ``owned`` (this rank's partition of ``layout``, working values) and place its master."""
        lo, hi = layout.partition(self.dist.rank)
        pieces = self.offload.place(owned, master_dtype, self.chunk, real=max(0, min(hi, layout.numel) - lo))
        self.layouts.append(layout)
        self.bounds.append((lo, hi))
        self.pieces.append(pieces)
        return pieces

    @property
    def master(self) -> list[torch.Tensor]:
        return [p.master for pieces in self.pieces for p in pieces]

    @property
    def piece_index(self) -> list[tuple[int, int]]:
        """(group, start within the partition) of each master piece."""
        return [(g, p.start) for g, pieces in enumerate(self.pieces) for p in pieces]

    def piece_specs(self) -> list[PieceSpec]:
        return [piece_spec(self.layouts[g], self.bounds[g][0] + p.start, self.bounds[g][0] + p.end)
                for g, pieces in enumerate(self.pieces) for p in pieces]

    def reduce_grads(self) -> list[torch.Tensor]:
        self._finish_grads()
        return self.offload.grads(self._partition_grads())

    def grad_sq_norm(self) -> torch.Tensor:
        # Over the reduced partitions, not the pieces: how a partition is cut must not change the
        # rounding of the norm, so offload and overlap settings give identical steps.
        local = sq_norm(self._partition_grads(), self.dist.device)
        # Partitions are disjoint: the global squared norm is the sum over ranks.
        self.dist.all_reduce(local, what="gradient norm all-reduce")
        return local

    def nonfinite_names(self, grads: list[torch.Tensor]) -> list[str]:
        mine = set()   # (zero3's gradients in the swap file are read one piece at a time)
        for g, (group, start) in zip(self.offload.readable_grads(grads), self.piece_index):
            bad = (~torch.isfinite(g)).nonzero().flatten()   # host sync: slow path, after an overflow
            if bad.numel():
                base = self.bounds[group][0] + start
                lo, hi = int(bad.min()), int(bad.max())   # host sync: slow path, after an overflow
                mine.update(self.layouts[group].names_in(base + lo, base + hi + 1))
        return sorted(set().union(*self.dist.all_gather_object(sorted(mine), what="overflow names gather")))

    def publish(self, master: list[torch.Tensor]) -> None:
        # ``master`` is the state's list: the same tensors as the pieces, updated in place.
        self.offload.publish()
        self.publish_finish()

    def out16(self) -> list[torch.Tensor] | None:
        return self.offload.out16()

    def make_update(self, tx: GradientTransformation) -> Update:
        if self.offload.has_host_pieces():  # CPU offload: the piece pipeline steps and publishes
            return self.offload.make_update(tx, gather=self.publish_finish)
        return PlainUpdate(tx, self)


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
