"""zero3's owned gradients in the optimizer's swap file (offload=nvme, every piece on the host).

Each tile's swap entry ends with its range of the owned gradient partition (``DiskStore``'s read-only
tail, read with the tile). A unit group's reduction is added into a transient partition (zeros, or
read back: the same additions in the same dtype as in memory), written on a thread of its own (at
most two queued) and dropped; on the last micro batch its squared norm is kept, so clipping and the
step are bitwise those of in-memory partitions. Host memory: up to three partitions and a bounce buffer.
"""
from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Iterator, Sequence

import torch

from framework.core.utils import sq_norm_part
from framework.offload._store import Tier


class GradSwap:
    """``_disk.DiskPlacement``'s side of the stage calls for owned gradients in its swap file (module
    docstring); on once ``swap_grads`` said so."""

    grad_dtype: torch.dtype | None = None    # the accumulation dtype, while on
    writer: ThreadPoolExecutor | None = None

    @property
    def grad_swap(self) -> bool:
        return self.grad_dtype is not None

    def swap_grads(self, accum_dtype: torch.dtype) -> bool:
        """With every piece stepped by the host the owned gradients live beside their tiles."""
        if self.host_fraction == 1.0:
            self.grad_dtype = accum_dtype
            self.written: set[int] = set()            # groups whose extents hold this step's sums
            self.norms: dict[int, torch.Tensor] = {}  # group -> squared norm of its final partition
            self.grad_pieces: dict[int, list] = {}    # group -> its disk Pieces, in order
            self.pending: deque[Future] = deque()     # queued partition writes, oldest first
        return self.grad_swap

    def start_grad_writer(self, infos: Sequence) -> None:
        """Once the disk pieces are known: the thread that writes the partitions."""
        self.writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grad-swap",
                                         initializer=self.acc.bind_thread)
        for info in infos:
            self.grad_pieces.setdefault(info.group, []).append(info)

    def load_grad(self, group: int) -> torch.Tensor:
        """Group ``group``'s partition so far this step: zeros, or its extents read back."""
        numel = self.partitions[group].numel()
        buf = torch.zeros(numel, dtype=self.grad_dtype, device=self.acc.device)
        if group in self.written:
            self._wait_writes()
            host = buf if buf.device.type == "cpu" else torch.empty(numel, dtype=self.grad_dtype, device="cpu")
            for info in self.grad_pieces.get(group, ()):
                self.stores[Tier.DISK].read_extent(info.index, host[info.start:info.end])
            if host is not buf:
                buf.copy_(host)
        return buf

    def save_grad(self, group: int, buf: torch.Tensor, final: bool) -> None:
        """Group ``group``'s partition ``buf`` -> its tiles' gradient extents; on the last micro
        batch (``final``) its squared norm is kept for the step's global norm."""
        if final:
            self.norms[group] = sq_norm_part(buf, self.acc.device)   # on the device, no host sync
        produced = self.acc.event()
        produced.record()
        while len(self.pending) >= 2:   # back-pressure: the oldest write finishes first
            self.pending.popleft().result()
        self.pending.append(self.writer.submit(self._write_grads, group, buf, produced))
        self.written.add(group)

    def _write_grads(self, group: int, buf: torch.Tensor, produced) -> None:
        """(the writer thread) ``buf`` -> the group's extents, once the stream that added it is done."""
        produced.synchronize()   # sync point: this reduction only, off the backward thread
        host = buf if buf.device.type == "cpu" else buf.to("cpu")   # host sync: writer thread, after the event
        for info in self.grad_pieces.get(group, ()):
            self.stores[Tier.DISK].write_extent(info.index, host[info.start:info.end])

    def _wait_writes(self) -> None:
        """Every queued write has landed (raises the first failure)."""
        while self.pending:
            self.pending.popleft().result()

    def finish_grads(self) -> None:
        """After backward: every partition's extents hold this step's gradient and its norm is known."""
        self._wait_writes()
        for group, part in enumerate(self.partitions):
            if group in self.norms or not part.numel():
                continue
            buf = self.load_grad(group)   # reduced on an earlier micro batch only, or never
            self.save_grad(group, buf, final=True)
        self._wait_writes()

    def grad_sq_norm_local(self) -> torch.Tensor:
        """This rank's squared norm over its partitions, summed as ``utils.sq_norm`` sums them."""
        parts = [self.norms[g] for g, part in enumerate(self.partitions) if part.numel()]
        if not parts:
            return torch.zeros((), dtype=torch.float64, device=self.acc.device)
        return torch.stack(parts).sum()

    def readable_grads(self, grads: Sequence[torch.Tensor]):
        return self._read_grads() if self.grad_swap else grads

    def _read_grads(self) -> Iterator[torch.Tensor]:
        """Each piece's gradient read from disk, one at a time (the overflow report)."""
        self._wait_writes()
        for info in self.infos:
            out = torch.empty(info.end - info.start, dtype=self.grad_dtype, device="cpu")   # a host read buffer
            self.stores[Tier.DISK].read_extent(info.index, out)
            yield out

    def clear_grads(self) -> None:
        """A new step: the extents' contents are stale."""
        for f in self.pending:   # (after a failed step: a write still queued must not land later)
            f.exception()
        self.pending.clear()
        self.written.clear()
        self.norms.clear()

    def close(self) -> None:
        if self.writer is not None:
            self.clear_grads()
            self.writer.shutdown(wait=True)
            self.writer = None
        super().close()
