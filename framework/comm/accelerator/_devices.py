"""The unchecked accelerators: CUDA and the plain CPU."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import Tensor

from framework.comm.accelerator._base import Accelerator, DeviceMismatch, Event, all_cpu


class _CudaEvent:
    def __init__(self, device: torch.device):
        self.device = device
        # Blocking: the host threads that wait for copies (the host step, the stores) sleep in
        # synchronize instead of spinning a core each; stream waits are the same either way.
        self.ev = torch.cuda.Event(blocking=True)

    def record(self, stream=None) -> None:
        self.ev.record(stream or torch.cuda.current_stream(self.device))

    def wait(self, stream=None) -> None:
        self.ev.wait(stream or torch.cuda.current_stream(self.device))

    def synchronize(self) -> None:
        self.ev.synchronize()

    def query(self) -> bool:
        return self.ev.query()


class CudaAccelerator(Accelerator):
    host = torch.device("cpu")

    def __init__(self, device: torch.device):
        self.device = device if device.index is not None else torch.device("cuda", torch.cuda.current_device())

    def current_stream(self):
        return torch.cuda.current_stream(self.device)

    def new_stream(self, name: str):
        return torch.cuda.Stream(self.device)

    def stream(self, stream):
        return torch.cuda.stream(stream)

    def event(self) -> Event:
        return _CudaEvent(self.device)

    def bind_thread(self) -> None:
        torch.cuda.set_device(self.device)

    def record_stream(self, t: Tensor, stream) -> None:
        t.record_stream(stream)

    def empty_host(self, shape, dtype: torch.dtype, pinned: bool = True) -> Tensor:
        return torch.empty(shape, dtype=dtype, device=self.host, pin_memory=pinned)

    def copy(self, dst: Tensor, src: Tensor, non_blocking: bool = False) -> None:
        dst.copy_(src, non_blocking=non_blocking)

    def on_device(self, *tensors: Tensor, what: str) -> None:
        for t in tensors:
            if t.device != self.device:
                raise DeviceMismatch(f"{what}: expected a tensor on {self.device}, got one on {t.device}")

    def on_host(self, *tensors: Tensor, what: str) -> None:
        all_cpu(tensors, what)

    def pinned_stats(self) -> dict[str, int]:
        """As torch's caching host allocator reports them: blocks handed out and blocks held (both
        at their power-of-two size; zeros where this torch reports nothing)."""
        stats = getattr(torch.cuda, "host_memory_stats", lambda: {})()
        return {"requested": int(stats.get("active_bytes.current", 0)),
                "reserved": int(stats.get("allocated_bytes.current", 0))}


class _NoStream:
    def __init__(self, name: str):
        self.name = name


class _NoEvent(Event):
    """Work ran when it was issued: nothing to record, wait for or synchronize."""

    def query(self) -> bool:
        return True


class CpuAccelerator(Accelerator):
    """Work runs when it is issued, so streams and events have nothing to order."""

    device = torch.device("cpu")
    host = torch.device("cpu")

    def __init__(self):
        self._stream = _NoStream("compute")

    def current_stream(self):
        return self._stream

    def new_stream(self, name: str):
        return _NoStream(name)

    @contextmanager
    def stream(self, stream) -> Iterator[None]:
        yield

    def event(self) -> Event:
        return _NoEvent()

    def empty_host(self, shape, dtype: torch.dtype, pinned: bool = True) -> Tensor:
        return torch.empty(shape, dtype=dtype, device="cpu")  # nothing to pin for without CUDA

    def copy(self, dst: Tensor, src: Tensor, non_blocking: bool = False) -> None:
        dst.copy_(src)

    def on_device(self, *tensors: Tensor, what: str) -> None:
        all_cpu(tensors, what)

    on_host = on_device   # the device is the host
