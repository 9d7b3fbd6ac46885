"""The OffloadTarget protocol: where a rank's master partition and optimizer state live.

A stage asks its target to place each owned partition: ``place`` splits it into pieces
(start, end, master tensor) kept on the host or on the training device; the optimizer runs
over the pieces (so its state lives where they live). ``grads`` hands the optimizer the
gradient pieces (copied to the host for host pieces) and ``publish`` writes updated master
values back into the working partition on the device.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Piece:
    start: int               # range within the partition
    end: int
    master: torch.Tensor     # fp32 (master dtype) values of that range, on host or device
    grad: torch.Tensor | None  # host buffer the gradients are copied into (None: use a view)
    # Host pieces of 16-bit training: the optimizer writes the updated values here in the
    # working dtype (the C++ kernels in the same pass), so half the bytes travel back.
    staging: torch.Tensor | None = None


class Placement:
    """Splits partitions between host (the first ``host_fraction``) and device."""

    def __init__(self, host_fraction: float, pin: bool, params_on_host: bool, overlap_step: bool = False):
        self.host_fraction, self.pin, self.params_on_host = host_fraction, pin, params_on_host
        self.overlap_step = overlap_step  # see framework/offload/_overlap.py

    @property
    def host(self) -> torch.device:
        return torch.device("cpu")

    def _host_copy(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        out = torch.empty(t.shape, dtype=dtype, device=self.host, pin_memory=self.pin)
        out.copy_(t)
        return out

    def place(self, own: torch.Tensor, master_dtype: torch.dtype, chunk: int | None = None) -> list[Piece]:
        """Master pieces of one owned partition ``own`` (the working values on the device).

        The host part is cut into pieces of ``chunk`` elements: the unit in which the
        overlapped update copies gradients, steps and copies back (``_overlap``)."""
        n = own.numel()
        k = round(self.host_fraction * n)
        step = chunk or max(k, 1)
        pieces = []
        for a in range(0, k, step):
            b = min(a + step, k)
            staging = None if own.dtype == master_dtype else \
                torch.empty(b - a, dtype=own.dtype, device=self.host, pin_memory=self.pin)
            pieces.append(Piece(a, b, self._host_copy(own[a:b], master_dtype),
                                torch.zeros(b - a, dtype=master_dtype, device=self.host, pin_memory=self.pin),
                                staging))
        if k < n:  # kept on the device; fp32 training updates the working values in place
            rest = own[k:]
            pieces.append(Piece(k, n, rest if rest.dtype == master_dtype else rest.to(master_dtype), None))
        return pieces

    def grads(self, part_grad: torch.Tensor, pieces: list[Piece],
              fresh: set[int] = frozenset()) -> list[torch.Tensor]:
        """Gradient pieces aligned with ``pieces`` (host pieces: copied into their host buffer,
        except the positions in ``fresh``, whose buffer already holds this step's gradient)."""
        out = []
        for j, p in enumerate(pieces):
            g = part_grad[p.start:p.end]
            if p.grad is not None:
                if j not in fresh:
                    p.grad.copy_(g, non_blocking=True)
                g = p.grad
            out.append(g if g.dtype == p.master.dtype else g.to(p.master.dtype))
        if self.pin and any(p.grad is not None for p in pieces):
            torch.cuda.synchronize()  # the host step reads them next
        return out

    def publish(self, own: torch.Tensor, pieces: list[Piece]) -> None:
        """Updated master values -> the working partition (cast to the working dtype)."""
        for p in pieces:
            dst = own[p.start:p.end]
            if p.master.data_ptr() != dst.data_ptr():
                dst.copy_(p.staging if p.staging is not None else p.master, non_blocking=True)

    def shard_device(self, device: torch.device) -> torch.device:
        """Where zero3 keeps working parameter shards between gathers."""
        return self.host if self.params_on_host else device
