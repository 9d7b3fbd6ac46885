"""What zero1 and zero2 share: replicated working parameters, partitioned master and optimizer.

Each parameter group is one flat buffer padded to a multiple of world * ALIGN; rank r owns
elements [r * shard, (r + 1) * shard). The fp32 master copy (when the working dtype is not
fp32) and the optimizer state exist only for the owned partition. After the optimizer step
every rank's updated partition is gathered back into the working buffers.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from framework.distributed import Dist
from framework.errors import ConfigError
from framework.offload.base import Piece, Placement
from framework.optimizers import GradientTransformation
from framework.precision import Policy
from framework.stages._flat import Layout, bind, make_layout, param_groups
from framework.stages._spec import PieceSpec, piece_spec
from framework.stages.base import Setup, WholeParameters
from framework.update import PlainUpdate, Update
from framework.utils import sq_norm, tensor_bytes


@dataclass(kw_only=True)
class ZeroConfig:
    """DeepSpeed's zero_optimization keys (same names and defaults, so configs port over)."""

    reduce_bucket_size: int = 500_000_000      # elements per gradient reduction bucket
    allgather_bucket_size: int = 500_000_000   # elements per parameter all-gather chunk
    overlap_comm: bool = False                 # reduce buckets while backward still runs
    contiguous_gradients: bool = True          # zero2: copy gradients into a bucket buffer (zero1: always)
    reduce_scatter: bool = True                # False: all-reduce fallback (every rank gets all)
    round_robin_gradients: bool = False        # only false: not implemented (config.py refuses true)


def check(cfg: ZeroConfig) -> None:
    if cfg.reduce_bucket_size < 1 or cfg.allgather_bucket_size < 1:
        raise ConfigError("stage.reduce_bucket_size and stage.allgather_bucket_size must be >= 1 element")


class ShardedStage(WholeParameters):
    """Base of zero1/zero2/zero3; subclasses own the gradient path (``_setup_grads`` and friends).

    The offload target given at construction is this stage's listener: a subclass that knows a
    partition range's reduced gradient is final calls ``self.offload.grads_final`` (see
    ``offload.base`` for the whole contract)."""

    def __init__(self, cfg: ZeroConfig, dist: Dist, offload: Placement):
        check(cfg)
        self.cfg, self.dist, self.offload = cfg, dist, offload
        self.layouts: list[Layout] = []
        self.flats: list[torch.Tensor] = []     # working parameters, replicated
        self.pieces: list[list[Piece]] = []     # per group: master pieces of the owned partition
        self.bounds: list[tuple[int, int]] = []  # owned [lo, hi) per group
        self.policy: Policy | None = None
        self.hook_handles: list = []            # removed by close()

    def setup(self, module: nn.Module, policy: Policy) -> Setup:
        self.module = module
        self.policy = policy
        groups = param_groups(module)
        entries = []  # (param, (group, slot)) in registration order
        for g, (_, named) in enumerate(groups):
            layout = make_layout(named, world=self.dist.world)
            flat = torch.zeros(layout.padded, dtype=policy.param_dtype, device=self.dist.device)
            params = bind(module, named, flat, layout)
            self.dist.broadcast(flat, what="initial parameter broadcast")
            lo, hi = layout.partition(self.dist.rank)
            # fp32 without offload: the owned slice of the working buffer is the master (no copy).
            self.pieces.append(self.offload.place(flat[lo:hi], policy.master_dtype, self._host_chunk(),
                                                  real=max(0, min(hi, layout.numel) - lo)))
            self.layouts.append(layout)
            self.flats.append(flat)
            self.bounds.append((lo, hi))
            entries += [(p, (g, s)) for p, s in zip(params, layout.slots)]
        self._setup_grads(entries)
        return Setup(self.master, [groups[g][0] for g, _ in self.piece_index])

    def _host_chunk(self) -> int:
        """Host pieces as large as one rank's share of a bucket: the unit of the overlapped host step."""
        return -(-self.cfg.reduce_bucket_size // self.dist.world)

    @property
    def master(self) -> list[torch.Tensor]:
        """What the optimizer updates: every group's master pieces, in order."""
        return [p.master for pieces in self.pieces for p in pieces]

    @property
    def piece_index(self) -> list[tuple[int, int]]:
        """(group, start within the partition) of each master piece."""
        return [(g, p.start) for g, pieces in enumerate(self.pieces) for p in pieces]

    def piece_specs(self) -> list[PieceSpec]:
        """What each master piece holds by parameter name, in ``master`` order."""
        return [piece_spec(self.layouts[g], self.bounds[g][0] + p.start, self.bounds[g][0] + p.end)
                for g, pieces in enumerate(self.pieces) for p in pieces]

    def _setup_grads(self, entries: list) -> None:
        raise NotImplementedError

    def _partition_grads(self) -> list[torch.Tensor]:
        """Each group's reduced gradient partition (on the device)."""
        raise NotImplementedError

    def reduce_grads(self) -> list[torch.Tensor]:
        self._reduced = self._partition_grads()
        return self.offload.grads(self._reduced)

    def grad_sq_norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        # Over the reduced partitions (the values of ``grads``, on the device) rather than over
        # the pieces the offload target cut them into: how a partition is cut must not change
        # the rounding of the norm, so offload and overlap settings give identical steps.
        local = sq_norm(self._reduced, self.dist.device)
        # Partitions are disjoint: the global squared norm is the sum over ranks.
        self.dist.all_reduce(local, what="gradient norm all-reduce")
        return local

    def nonfinite_names(self, grads: list[torch.Tensor]) -> list[str]:
        mine = set()
        for g, (group, start) in zip(grads, self.piece_index):
            bad = (~torch.isfinite(g)).nonzero().flatten()
            if bad.numel():
                base = self.bounds[group][0] + start
                mine.update(self.layouts[group].names_in(base + int(bad.min()), base + int(bad.max()) + 1))
        return sorted(set().union(*self.dist.all_gather_object(sorted(mine), what="overflow names gather")))

    def publish(self, master: list[torch.Tensor]) -> None:
        # ``master`` is the state's list: the same tensors as the pieces, updated in place.
        self.offload.publish()
        self.publish_finish()

    def publish_finish(self) -> None:
        """After every piece is published: make the working parameters whole again."""
        for flat, layout in zip(self.flats, self.layouts):
            gather_partitions(self.dist, flat, layout.shard, self.cfg.allgather_bucket_size)

    def out16(self) -> list[torch.Tensor] | None:
        return self.offload.out16()

    def make_update(self, tx: GradientTransformation) -> Update:
        if self.offload.has_host_pieces():  # CPU offload: the piece pipeline steps and publishes
            return self.offload.make_update(tx, gather=self.publish_finish)
        return PlainUpdate(tx, self)

    def memory(self) -> dict[str, int]:
        return {"params": tensor_bytes(self.flats), **master_memory(self.pieces, self.flats, self.bounds),
                **self._grad_memory()}

    def _grad_memory(self) -> dict[str, int]:
        raise NotImplementedError


def master_memory(pieces: list[list[Piece]], working: list[torch.Tensor], bounds) -> dict[str, int]:
    """Bytes of master copies that are not the working values themselves, and of those on the host."""
    separate = [p.master for ps, w, (lo, _) in zip(pieces, working, bounds) for p in ps
                if p.master.data_ptr() != w[lo + p.start:].data_ptr()]
    host = [p.master for ps in pieces for p in ps if p.master.device.type == "cpu" and p.grad is not None]
    return {"master_params": tensor_bytes(separate), "host_master_params": tensor_bytes(host)}


def gather_partitions(dist: Dist, flat: torch.Tensor, shard: int, chunk: int) -> None:
    """Every rank's owned partition of ``flat`` -> everywhere (gloo: in calls of ``chunk`` elements)."""
    dist.comm.wait(dist.comm.all_gather_into(flat, shard, "parameter all-gather", chunk), "parameter all-gather")
