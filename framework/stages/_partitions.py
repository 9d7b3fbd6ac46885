"""The owned partitions of a ZeRO stage and the Stage methods built on them.

zero1/zero2 (``sharded``) and zero3 own, per group, this rank's partition [lo, hi) of a padded
flat layout and the master pieces the offload target (the stage's listener: ``offload.grads_final``,
see ``offload.base``) cut it into.
"""
from __future__ import annotations

import torch

from framework.comm.distributed import Dist
from framework.core.utils import sq_norm
from framework.engine.update import PlainUpdate, Update
from framework.offload.base import Piece, Placement
from framework.optimizers import GradientTransformation
from framework.stages._flat import Layout, PieceSpec, piece_spec


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
