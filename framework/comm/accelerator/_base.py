"""What every accelerator offers (``Accelerator``, ``Event``; a method an implementation leaves
out does nothing: no pinned bytes for ``pinned_stats``) and the errors the checks raise."""
from __future__ import annotations

import contextlib
from contextlib import contextmanager
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

    def current_stream(self): ...
    def new_stream(self, name: str): ...
    def stream(self, stream) -> contextmanager: ...
    def event(self) -> Event: ...

    def bind_thread(self) -> None:
        """Make the calling thread work on this device (a worker thread's initializer)."""

    def record_stream(self, t: Tensor, stream) -> None:
        """``t``'s memory is not reused before ``stream``'s work queued so far is done."""

    def empty_host(self, shape, dtype: torch.dtype, pinned: bool = True) -> Tensor:
        """A host buffer (pinned: page-locked, the only kind a ``non_blocking`` copy may use)."""

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

    def hook(self, fn: Callable, where: str) -> Callable:
        """``fn`` for registration as a module, tensor or autograd hook (checked: no host syncs in it;
        autograd runs hooks outside the caller's ``hot`` region)."""
        return fn

    def pinned_stats(self) -> dict[str, int]:
        """Pinned host bytes: ``requested`` (live buffers) and ``reserved`` (what the allocator holds)."""
        return {"requested": 0, "reserved": 0}

    def verify(self) -> None:
        """Raise what the checks found outside a call (a freed buffer still in use); else nothing."""


def all_cpu(tensors, what: str) -> None:
    """Raise unless every tensor is on the CPU (both sides of a CPU accelerator)."""
    for t in tensors:
        if t.device.type != "cpu":
            raise DeviceMismatch(f"{what}: expected a CPU tensor, got one on {t.device}")
