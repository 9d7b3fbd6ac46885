"""The owned partitions of a ZeRO stage and their master pieces, and the Stage methods built on them.

zero1/zero2 (``_sharded``) and zero3 each hold one ``Partitions``: per group, this rank's partition
[lo, hi) of a padded flat layout and the master pieces the offload target cut it into.
"""
from __future__ import annotations

import torch

from framework.comm.distributed import Dist
from framework.offload.base import Piece, Placement
from framework.optimizers import GradientTransformation
from framework.stages._flat import Layout
from framework.stages._spec import PieceSpec, piece_spec
from framework.engine.update import PlainUpdate, Update
from framework.core.utils import sq_norm


class Partitions:
    def __init__(self, dist: Dist, offload: Placement, chunk: int | None):
        self.dist, self.offload, self.chunk = dist, offload, chunk
        self.layouts: list[Layout] = []
        self.bounds: list[tuple[int, int]] = []     # owned [lo, hi) per group
        self.pieces: list[list[Piece]] = []         # from the offload target, in the optimizer's order

    def add(self, layout: Layout, owned: torch.Tensor, master_dtype: torch.dtype) -> list[Piece]:
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

    def grad_sq_norm(self, reduced: list[torch.Tensor]) -> torch.Tensor:
        # Over the reduced partitions, not the pieces: how a partition is cut must not change the
        # rounding of the norm, so offload and overlap settings give identical steps.
        local = sq_norm(reduced, self.dist.device)
        # Partitions are disjoint: the global squared norm is the sum over ranks.
        self.dist.all_reduce(local, what="gradient norm all-reduce")
        return local

    def nonfinite_names(self, grads: list[torch.Tensor]) -> list[str]:
        mine = set()
        for g, (group, start) in zip(grads, self.piece_index):
            bad = (~torch.isfinite(g)).nonzero().flatten()   # host sync: slow path, after an overflow
            if bad.numel():
                base = self.bounds[group][0] + start
                lo, hi = int(bad.min()), int(bad.max())   # host sync: slow path, after an overflow
                mine.update(self.layouts[group].names_in(base + lo, base + hi + 1))
        return sorted(set().union(*self.dist.all_gather_object(sorted(mine), what="overflow names gather")))


class PartitionedStage:
    """Stage methods common to the ZeRO stages, over ``parts`` and the offload target (the stage's
    listener: ``self.offload.grads_final``, see ``offload.base``)."""

    parts: Partitions
    offload: Placement

    def _finish_grads(self) -> None:
        """Complete the step's gradient reduction (after its last backward pass)."""
        raise NotImplementedError

    def _partition_grads(self) -> list[torch.Tensor]:
        """Each group's reduced gradient partition (device) once ``_finish_grads`` ran; read only."""
        raise NotImplementedError

    def publish_finish(self) -> None:
        """After every piece is published: make the working parameters current again."""
        raise NotImplementedError

    @property
    def layouts(self) -> list[Layout]:
        return self.parts.layouts

    @property
    def bounds(self) -> list[tuple[int, int]]:
        return self.parts.bounds

    @property
    def master(self) -> list[torch.Tensor]:
        return self.parts.master

    def piece_specs(self) -> list[PieceSpec]:
        return self.parts.piece_specs()

    def reduce_grads(self) -> list[torch.Tensor]:
        self._finish_grads()
        return self.offload.grads(self._partition_grads())

    def grad_sq_norm(self) -> torch.Tensor:
        return self.parts.grad_sq_norm(self._partition_grads())

    def nonfinite_names(self, grads: list[torch.Tensor]) -> list[str]:
        return self.parts.nonfinite_names(grads)

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
