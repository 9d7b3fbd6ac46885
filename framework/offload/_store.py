"""Tiered stores: where a master piece's buffers live, and when the host step may use them.

A piece (``base.Piece``) lives on the DEVICE (stepped in place: no store), the HOST (pinned when the
device is CUDA) or the DISK (a swap file read into a pool of pinned slots: ``_diskstore.DiskStore``).
The piece pipeline asks the store of its tier for it around each host step:

    store.acquire(k)                start making piece k usable by the host (may queue a read)
    store.wait(k)                   block until it is (the last copy back is done, the read landed)
    store.release(k, readers)       the host step is done; ``readers``: the event after which the
                                    streams copying from its buffers are done with them
    store.flush()                   settle every released piece (before closing, checkpointing)
    store.close()                   settle them and give back what the store holds (its swap file)
"""
from __future__ import annotations

import enum
import weakref
from collections import Counter, deque
from itertools import accumulate
from typing import Sequence

import torch

from framework.comm.accelerator import Accelerator, Event
from framework.offload._aio import host_arena


def recorded(acc: Accelerator) -> Event:
    """An event recorded now, on the current stream."""
    ev = acc.event()
    ev.record()
    return ev


def copy_on(acc: Accelerator, stream, dst: torch.Tensor, src: torch.Tensor, after: Event | None = None,
            non_blocking: bool = True) -> Event:
    """``src`` -> ``dst`` on ``stream`` behind ``after`` (default: the current stream's work); the copy's event."""
    after = recorded(acc) if after is None else after
    with acc.stream(stream):
        after.wait()
        acc.copy(dst, src, non_blocking=non_blocking)
        return recorded(acc)


class Tier(enum.Enum):
    DEVICE = "device"
    HOST = "host"
    DISK = "disk"


class HostStore:
    """Host memory: pieces are always resident; the host waits only for the copies that read them.
    Pinned buffers are slices of arenas (``_aio.host_arena``), one per ``reserve`` or lone
    ``allocate``, not torch's caching pinned allocator (it rounds every block up to a power of two
    and never returns it)."""

    def __init__(self, acc: Accelerator, pin: bool):
        self.acc, self.pin = acc, pin
        self.readers: dict[int, Event] = {}
        self._reserved: deque = deque()   # (buffer, numel, dtype) sliced by ``reserve``, not yet handed out
        self._pinned = Counter()          # bytes of the live arenas (their finalizers subtract)

    def reserve(self, sizes: Sequence[tuple[int, torch.dtype]]) -> None:
        """One arena for the pinned buffers ``allocate`` will ask for next, (numel, dtype) in order."""
        if not self.pin or not sizes:
            return
        nbytes = [numel * dtype.itemsize for numel, dtype in sizes]
        offsets = list(accumulate((-(-n // 64) * 64 for n in nbytes[:-1]), initial=0))   # 64-byte aligned
        arena = self._arena(offsets[-1] + nbytes[-1])
        self._reserved = deque((arena[o:o + n * dt.itemsize].view(dt), n, dt) for o, (n, dt) in zip(offsets, sizes))

    def allocate(self, numel: int, dtype: torch.dtype, pin: bool | None = None) -> torch.Tensor:
        """A host buffer: pinned (``pin``; None: as the store pins) from the reserved arena, else its own arena."""
        if not (self.pin if pin is None else pin):
            return self.acc.empty_host(numel, dtype, pinned=False)
        if self._reserved and self._reserved[0][1:] == (numel, dtype):
            return self._reserved.popleft()[0]
        return self._arena(numel * dtype.itemsize).view(dtype)

    def _arena(self, nbytes: int) -> torch.Tensor:
        arena = host_arena(nbytes, pin=True, acc=self.acc)
        size = arena.untyped_storage().nbytes()   # what is really allocated (CUDA: whole pages)
        self._pinned["bytes"] += size
        weakref.finalize(arena.untyped_storage(), self._pinned.subtract, {"bytes": size}).atexit = False
        return arena[:nbytes]

    def pinned_bytes(self) -> int:
        """Bytes of pinned host memory this store holds now, as allocated (not as requested)."""
        return self._pinned["bytes"]

    def acquire(self, key: int) -> int:
        return key

    def wait(self, key: int) -> None:
        if (readers := self.readers.pop(key, None)) is not None:
            readers.synchronize()   # sync point: this piece's copy back only, never the device

    def release(self, key: int, readers: Event | None) -> None:
        if readers is not None:
            self.readers[key] = readers

    def flush(self) -> None:
        for ev in self.readers.values():
            ev.synchronize()
        self.readers.clear()

    def recover(self) -> None:   # (``DiskStore.recover``: a host piece is always resident, nothing to redo)
        pass

    def interrupt(self) -> None:   # (``DiskStore.interrupt``: no worker ever waits for a host slot)
        pass

    resume = interrupt   # (``DiskStore.resume``: nothing was interrupted)

    close = flush   # (the same call as DiskStore.close: nothing else to settle, the arenas go with the store)

