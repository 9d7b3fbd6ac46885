"""Tiered stores: where a master piece's buffers live, and when the host step may use them.

A *piece* (``base.Piece``) is a range of an owned partition whose optimizer step runs in one go:
its master values, its gradient buffer, its 16-bit staging buffer and (created by the optimizer
from the master) its optimizer state. Its tier says where they live:

    DEVICE  on the compute device (or wherever the working values are): stepped there, in place
    HOST    in host memory, pinned when the device is CUDA: stepped by the host
    DISK    (next: NVMe) in files, read into a pool of pinned buffers before the step, written
            back after it; a ``DiskStore`` implements the same four calls, the pipeline and the
            stages stay as they are

The piece pipeline (``_pipeline.py``) asks the store of a piece's tier for it around each host
step, so a store can make the piece resident asynchronously:

    handle = store.acquire(k)       start making piece k usable by the host (may queue a read)
    store.wait(handle)              block until it is: no stream still reads its buffers (the
                                    last copy back), and for a disk store the read has landed
    store.release(handle, readers)  the host step is done; ``readers`` is the event after which
                                    the streams that copy from its buffers are done with them
    store.flush()                   settle every released piece (before closing, checkpointing)
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from framework.accelerator import Accelerator, Event


class Tier(enum.Enum):
    DEVICE = "device"
    HOST = "host"


@dataclass(frozen=True)
class Handle:
    key: int                   # the piece's position in master order
    readers: Event | None      # when the streams stop reading its buffers (None: nobody reads them)


class HostStore:
    """Host memory: pieces are always resident; the host waits only for the copies that read them."""

    tier = Tier.HOST

    def __init__(self, acc: Accelerator, pin: bool):
        self.acc, self.pin = acc, pin
        self.readers: dict[int, Event] = {}

    def allocate(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return self.acc.empty_host(numel, dtype, pinned=self.pin)

    def acquire(self, key: int) -> Handle:
        return Handle(key, self.readers.pop(key, None))

    def wait(self, handle: Handle) -> None:
        if handle.readers is not None:
            handle.readers.synchronize()   # sync point: this piece's copy back only, never the device

    def release(self, handle: Handle, readers: Event | None) -> None:
        if readers is not None:
            self.readers[handle.key] = readers

    def flush(self) -> None:
        for ev in self.readers.values():
            ev.synchronize()
        self.readers.clear()


class DeviceStore:
    """The compute device: pieces are stepped in place on the compute stream, in queue order."""

    tier = Tier.DEVICE

    def acquire(self, key: int) -> Handle:
        return Handle(key, None)

    def wait(self, handle: Handle) -> None:
        pass

    def release(self, handle: Handle, readers: Event | None) -> None:
        pass   # later work on the compute stream is ordered after the readers anyway

    def flush(self) -> None:
        pass
