"""Owned gradients in the swap file, and construction that streams into it (zero3 + offload=nvme).

* ``GradSwap``: each optimizer tile's swap entry ends with its range of the owned gradient partition
  (accumulation dtype; ``DiskStore``'s read-only tail, read with the tile). A unit group's reduction
  is added into a transient partition (zeros, or read back from the extents: the same additions in
  the same dtype as in memory), written on a thread of its own (at most two queued) and dropped; on
  the last micro batch its squared norm is kept, so clipping and the step are bitwise those of
  in-memory partitions. Host memory: up to three partitions and one tile's gradient bounce buffer.
* ``Spill``: a zero3 shard on disk is spilled once filled to an unlinked temporary file (it never
  outlives its process) and its memory released; nothing model-sized is resident during construction.
"""
from __future__ import annotations

import os
import tempfile
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Iterator, Sequence

import torch

from framework.core.utils import sq_norm_part


class Spill:
    """An unlinked temporary file that construction appends shard values to and reads back once."""

    def __init__(self, folder: str):
        fd, path = tempfile.mkstemp(prefix=".construction-", suffix=".spill", dir=folder)
        os.unlink(path)   # its space is freed when the descriptor closes, whatever ends the process
        self.fd, self.size = fd, 0
        self.where: dict[int, tuple[int, int, torch.dtype]] = {}   # id(shard) -> (offset, numel, dtype)

    def put(self, t: torch.Tensor) -> None:
        """Append ``t``'s values (contiguous, host) under ``id(t)``."""
        data = memoryview(t.detach().reshape(-1).view(torch.uint8).numpy())
        off, done = self.size, 0
        while done < len(data):
            done += os.pwrite(self.fd, data[done:], off + done)
        self.where[id(t)] = (off, t.numel(), t.dtype)
        self.size += len(data)

    def has(self, t: torch.Tensor) -> bool:
        return id(t) in self.where

    def read(self, t: torch.Tensor, lo: int, hi: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Elements [lo, hi) of the values put under ``t`` (into ``out`` if given)."""
        off, _, dtype = self.where[id(t)]
        out = torch.empty(hi - lo, dtype=dtype) if out is None else out
        short = read_into(self.fd, out, off + lo * out.element_size())
        if short is not None:
            raise OSError(f"construction spill: short read at {short}")
        return out

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        self.where.clear()


def read_into(fd: int, out: torch.Tensor, offset: int) -> int | None:
    """``out``'s bytes (host, contiguous) read from ``fd`` at ``offset``; where the file ended
    first (None: read whole)."""
    view, done = memoryview(out.reshape(-1).view(torch.uint8).numpy()), 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            return offset + done
        done += n
    return None


class GradSwap:
    """The owned gradient partitions of zero3 in the optimizer's swap file (module docstring)."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype                        # the accumulation dtype
        self.written: set[int] = set()            # groups whose extents hold this step's sums
        self.norms: dict[int, torch.Tensor] = {}  # group -> squared norm of its final partition
        self.store = None                         # the optimizer's DiskStore (``bind``)
        self.pieces: dict[int, list] = {}         # group -> its disk PieceInfos, in order
        self.acc = None
        self.writer: ThreadPoolExecutor | None = None
        self.pending: deque[Future] = deque()     # queued partition writes, oldest first

    def bind(self, store, infos: Sequence, acc) -> None:
        self.store, self.acc = store, acc
        self.writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grad-swap", initializer=acc.bind_thread)
        for info in infos:
            self.pieces.setdefault(info.group, []).append(info)

    def _slot(self, info) -> int:
        """The gradient's position among the piece's swapped tensors (the last)."""
        return len(self.store.entries[info.index].swapped) - 1

    def load(self, group: int, numel: int, device: torch.device) -> torch.Tensor:
        """Group ``group``'s partition so far this step: zeros, or its extents read back."""
        buf = torch.zeros(numel, dtype=self.dtype, device=device)
        if group in self.written:
            self.wait()
            host = buf if buf.device.type == "cpu" else torch.empty(numel, dtype=self.dtype)
            for info in self.pieces.get(group, ()):
                self.store.read_extent(info.index, self._slot(info), host[info.start:info.end])
            if host is not buf:
                buf.copy_(host)
        return buf

    def save(self, group: int, buf: torch.Tensor, final: bool, device: torch.device) -> None:
        """Group ``group``'s partition ``buf`` -> its tiles' gradient extents; on the last micro
        batch (``final``) its squared norm is kept for the step's global norm."""
        if final:
            self.norms[group] = sq_norm_part(buf, device)   # on the device, no host sync
        produced = self.acc.event()
        produced.record()
        while len(self.pending) >= 2:   # back-pressure: the oldest write finishes first
            self.pending.popleft().result()
        self.pending.append(self.writer.submit(self._write, group, buf, produced))
        self.written.add(group)

    def _write(self, group: int, buf: torch.Tensor, produced) -> None:
        """(the writer thread) ``buf`` -> the group's extents, once the stream that added it is done."""
        produced.synchronize()   # sync point: this reduction only, off the backward thread
        host = buf if buf.device.type == "cpu" else buf.to("cpu")   # host sync: writer thread, after the event
        for info in self.pieces.get(group, ()):
            self.store.write_extent(info.index, self._slot(info), host[info.start:info.end])

    def wait(self) -> None:
        """Every queued write has landed (raises the first failure)."""
        while self.pending:
            self.pending.popleft().result()

    def finish(self, sizes: Sequence[int], device: torch.device) -> None:
        """After backward: every partition's extents hold this step's gradient and its norm is known."""
        self.wait()
        for group, numel in enumerate(sizes):
            if group in self.norms or not numel:
                continue
            buf = self.load(group, numel, device)   # reduced on an earlier micro batch only, or never
            self.save(group, buf, final=True, device=device)
        self.wait()

    def sq_norm(self, sizes: Sequence[int], device: torch.device) -> torch.Tensor:
        """This rank's squared norm over its partitions, summed as ``utils.sq_norm`` sums them."""
        parts = [self.norms[g] for g, numel in enumerate(sizes) if numel]
        if not parts:
            return torch.zeros((), dtype=torch.float64, device=device)
        return torch.stack(parts).sum()

    def piece_grads(self, infos: Sequence) -> Iterator[torch.Tensor]:
        """Each piece's gradient read from disk, one at a time (the overflow report)."""
        self.wait()
        for info in infos:
            out = torch.empty(info.end - info.start, dtype=self.dtype)
            self.store.read_extent(info.index, self._slot(info), out)
            yield out

    def clear(self) -> None:
        """A new step: the extents' contents are stale."""
        for f in self.pending:   # (after a failed step: a write still queued must not land later)
            f.exception()
        self.pending.clear()
        self.written.clear()
        self.norms.clear()

    def close(self) -> None:
        if self.writer is not None:
            self.clear()
            self.writer.shutdown(wait=True)
            self.writer = None
