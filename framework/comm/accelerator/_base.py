"""What every accelerator offers (``Accelerator``, ``Event``: a method an implementation leaves out does
nothing), the errors the checks raise, and the unchecked accelerators: CUDA and the plain CPU."""
from __future__ import annotations

import contextlib
from typing import Callable, Protocol, Sequence

import torch
from torch import Tensor


class AcceleratorError(RuntimeError):
    """A tensor on the wrong device or used out of stream order: a bug in the calling code."""


class DeviceMismatch(AcceleratorError):
    pass


class OrderError(AcceleratorError):
    pass


class HostSync(AcceleratorError):
    """The host waited for the device where it must not (inside a hook)."""


class Event(Protocol):
    def record(self, stream=None) -> None:
        """Mark the point the stream (default: current) has reached in its queue."""

    def wait(self, stream=None) -> None:
        """Make the stream (default: current) wait for the recorded point; the host does not wait."""

    def synchronize(self) -> None:
        """Block the host until the recorded point is reached."""

    def query(self) -> bool:
        """Whether the recorded point was reached, without waiting (True: as after ``synchronize``)."""


class Accelerator(Protocol):
    device: torch.device   # where compute runs
    host: torch.device     # where host buffers live
    # The checking CPU one: framework checks with a per-operation cost run on every pass, not the first only.
    checks: bool = False

    def current_stream(self): ...
    def new_stream(self, name: str): ...
    def stream(self, stream) -> contextlib.AbstractContextManager: ...
    def event(self) -> Event: ...

    def bind_thread(self) -> None:
        """Make the calling thread work on this device (a worker thread's initializer)."""

    def record_stream(self, t: Tensor, stream) -> None:
        """``t``'s memory is not reused before ``stream``'s work queued so far is done."""

    def empty_host(self, shape, dtype: torch.dtype, pinned: bool = True) -> Tensor:
        """A host buffer (pinned: page-locked, the only kind a ``non_blocking`` copy may use)."""

    def register_host(self, *tensors: Tensor, what: str) -> None:
        """Count ``tensors`` as (pageable) host buffers: what torch made of host buffers (``torch.zeros_like(host)``,
        as an optimizer's state of host masters) is host memory on CUDA too; raise unless they are on the host."""

    def copy(self, dst: Tensor, src: Tensor, non_blocking: bool = False) -> None:
        """``dst.copy_(src)`` queued on the current stream (host to host copies run on the host)."""

    def on_device(self, *tensors: Tensor, what: str) -> None:
        """Raise unless every tensor is in device memory."""

    def on_host(self, *tensors: Tensor, what: str) -> None:
        """Raise unless every tensor is in host memory."""

    def use(self, reads: Sequence[Tensor] = (), writes: Sequence[Tensor] = ()) -> None:
        """Declare compute queued on the current stream outside ``copy`` (checked, else nothing)."""

    def host_use(self, reads: Sequence[Tensor] = (), writes: Sequence[Tensor] = ()) -> None:
        """Declare host code reading or writing buffers that streams also use (checked, else nothing)."""

    def collective(self, tensors: Sequence[Tensor], what: str):
        """A collective on ``tensors`` is being issued (checked: a token for ``collective_done``; else None)."""

    def collective_done(self, token) -> None:
        """The collective of ``token`` was waited for: the current stream is ordered after it."""

    def hot(self, where: str) -> contextlib.AbstractContextManager:
        """A region where framework code must not make the host wait for the device (checked)."""
        return contextlib.nullcontext()

    def building(self, where: str) -> contextlib.AbstractContextManager:
        """A setup region (not the step): checked, what framework code makes there on the host by name is host
        memory."""
        return contextlib.nullcontext()

    def hook(self, fn: Callable, where: str) -> Callable:
        """``fn`` to register as a hook, checked as ``hot`` (autograd runs hooks outside the caller's region)."""
        return fn

    def pinned_stats(self) -> dict[str, int]:
        """Pinned host bytes: ``requested`` (live buffers) and ``reserved`` (what the allocator holds)."""
        return {"requested": 0, "reserved": 0}

    def free_memory(self) -> int | None:
        """Bytes free in device memory now; None where the device is the host (its room: ``available_ram``)."""
        return None

    def verify(self) -> None:
        """Raise what the checks found outside a call (a freed buffer still in use); else nothing."""


def all_cpu(tensors, what: str) -> None:
    """Raise unless every tensor is on the CPU (both sides of a CPU accelerator)."""
    for t in tensors:
        if t.device.type != "cpu":
            raise DeviceMismatch(f"{what}: expected a CPU tensor, got one on {t.device}")


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

    def register_host(self, *tensors: Tensor, what: str) -> None:
        all_cpu(tensors, what)

    def copy(self, dst: Tensor, src: Tensor, non_blocking: bool = False) -> None:
        dst.copy_(src, non_blocking=non_blocking)

    def on_device(self, *tensors: Tensor, what: str) -> None:
        for t in tensors:
            if t.device != self.device:
                raise DeviceMismatch(f"{what}: expected a tensor on {self.device}, got one on {t.device}")

    def on_host(self, *tensors: Tensor, what: str) -> None:
        all_cpu(tensors, what)

    def pinned_stats(self) -> dict[str, int]:
        """Torch's caching host allocator's blocks handed out and held (zeros where this torch reports none)."""
        stats = getattr(torch.cuda, "host_memory_stats", lambda: {})()
        return {"requested": int(stats.get("active_bytes.current", 0)),
                "reserved": int(stats.get("allocated_bytes.current", 0))}

    def free_memory(self) -> int | None:
        """The driver's count of free bytes on the device (a host-side query: no stream is waited for), plus what
        torch's caching allocator holds and can hand out again."""
        held = torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
        return int(torch.cuda.mem_get_info(self.device)[0]) + held


class _NoStream:
    def __init__(self, name: str):
        self.name = name


class _NoEvent(Event):   # (the protocol's methods do nothing)
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

    def stream(self, stream) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def event(self) -> Event:
        return _NoEvent()

    def empty_host(self, shape, dtype: torch.dtype, pinned: bool = True) -> Tensor:
        return torch.empty(shape, dtype=dtype, device="cpu")  # nothing to pin for without CUDA

    def copy(self, dst: Tensor, src: Tensor, non_blocking: bool = False) -> None:
        dst.copy_(src)

    def on_device(self, *tensors: Tensor, what: str) -> None:
        all_cpu(tensors, what)

    on_host = on_device   # the device is the host
