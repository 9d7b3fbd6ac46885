"""The compute device, its streams and events, behind one small interface.

    acc = accelerator.for_device(dist.device)        # CUDA, or CPU (plain, or checking under tests)
    copy = acc.new_stream("copy")
    produced = acc.event(); produced.record()        # after the producer, on the current stream
    with acc.stream(copy):
        produced.wait()                              # the copy stream waits for the producer
        acc.copy(host_buf, dev_values, non_blocking=True)   # into a pinned host buffer
        done = acc.event(); done.record()
    done.synchronize()                               # now the host may read host_buf

Every device, stream and event decision of the offload path goes through this interface, so the
same code runs on three implementations:

* ``CudaAccelerator``: torch.cuda streams and events, pinned host memory.
* ``CpuAccelerator``: one process, no streams; copies are plain ``copy_``, events do nothing.
* ``CheckingCpuAccelerator``: runs on the CPU like the plain one but *checks* what CUDA needs and a
  CPU run would not notice. Host buffers are the ones allocated with ``empty_host``; everything
  else counts as device memory, so a host buffer handed where device memory is expected (or the
  reverse) raises ``DeviceMismatch``, and so does a ``non_blocking`` copy with a host side that
  is not pinned. Streams are emulated with vector clocks: each access made through the interface
  (``copy``, ``use`` on a stream, ``host_use`` by host code) is recorded per byte range of its
  storage, and an access that conflicts with an earlier one made on another stream (or by the
  host) that it is not ordered after, through an event recorded after it and waited on (or
  synchronized by the host), raises ``OrderError``. Work queued on a stream by the host is
  ordered after what the host did and knew before queueing it, as on CUDA. All host threads
  count as one host: ordering between them (futures, locks) is their own business. Compute that
  runs outside ``copy`` (a stage's reduction, the gather) is declared with ``use`` by the code
  that hands its result across streams, and host code with ``host_use``.

``FRAMEWORK_ACCELERATOR`` picks the CPU implementation: ``check`` (the test suite sets it) or
``plain`` (the default). It has no effect on CUDA devices.
"""
from __future__ import annotations

import os
import threading
import weakref
from contextlib import contextmanager
from typing import Iterator, Protocol, Sequence

import torch
from torch import Tensor

from framework.errors import ConfigError

ENV = "FRAMEWORK_ACCELERATOR"


class AcceleratorError(RuntimeError):
    """A tensor on the wrong device or used out of stream order: a bug in the calling code."""


class DeviceMismatch(AcceleratorError):
    pass


class OrderError(AcceleratorError):
    pass


class Event(Protocol):
    def record(self, stream=None) -> None:
        """Mark the point the stream (default: current) has reached in its queue."""

    def wait(self, stream=None) -> None:
        """Make the stream (default: current) wait for the recorded point; the host does not wait."""

    def synchronize(self) -> None:
        """Block the host until the recorded point is reached."""


class Accelerator(Protocol):
    device: torch.device   # where compute runs
    host: torch.device     # where host buffers live

    def current_stream(self): ...
    def new_stream(self, name: str): ...
    def stream(self, stream) -> contextmanager: ...
    def event(self) -> Event: ...

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


def for_device(device: torch.device, mode: str | None = None) -> Accelerator:
    """The accelerator of ``device``; ``mode`` (default: $FRAMEWORK_ACCELERATOR) picks the CPU one."""
    mode = mode or os.environ.get(ENV) or "plain"
    if mode not in ("plain", "check"):
        raise ConfigError(f"{ENV}={mode!r} is not one of plain, check")
    if device.type == "cuda":
        return CudaAccelerator(device)
    if device.type != "cpu":
        raise ConfigError(f"no accelerator for device {device}; use cuda or cpu")
    return CheckingCpuAccelerator() if mode == "check" else CpuAccelerator()


# --- CUDA -------------------------------------------------------------------------------------

class _CudaEvent:
    def __init__(self, device: torch.device):
        self.device = device
        self.ev = torch.cuda.Event()

    def record(self, stream=None) -> None:
        self.ev.record(stream or torch.cuda.current_stream(self.device))

    def wait(self, stream=None) -> None:
        self.ev.wait(stream or torch.cuda.current_stream(self.device))

    def synchronize(self) -> None:
        self.ev.synchronize()


class CudaAccelerator:
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

    def empty_host(self, shape, dtype: torch.dtype, pinned: bool = True) -> Tensor:
        return torch.empty(shape, dtype=dtype, device=self.host, pin_memory=pinned)

    def copy(self, dst: Tensor, src: Tensor, non_blocking: bool = False) -> None:
        dst.copy_(src, non_blocking=non_blocking)

    def on_device(self, *tensors: Tensor, what: str) -> None:
        for t in tensors:
            if t.device != self.device:
                raise DeviceMismatch(f"{what}: expected a tensor on {self.device}, got one on {t.device}")

    def on_host(self, *tensors: Tensor, what: str) -> None:
        for t in tensors:
            if t.device.type != "cpu":
                raise DeviceMismatch(f"{what}: expected a host tensor, got one on {t.device}")

    def use(self, reads: Sequence[Tensor] = (), writes: Sequence[Tensor] = ()) -> None:
        pass

    def host_use(self, reads: Sequence[Tensor] = (), writes: Sequence[Tensor] = ()) -> None:
        pass


# --- CPU, plain ---------------------------------------------------------------------------------

class _NoStream:
    def __init__(self, name: str):
        self.name = name


class _NoEvent:
    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass


class CpuAccelerator:
    """One CPU process: work runs when it is issued, so streams and events have nothing to order."""

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
        _all_cpu(tensors, what)

    def on_host(self, *tensors: Tensor, what: str) -> None:
        _all_cpu(tensors, what)

    def use(self, reads: Sequence[Tensor] = (), writes: Sequence[Tensor] = ()) -> None:
        pass

    def host_use(self, reads: Sequence[Tensor] = (), writes: Sequence[Tensor] = ()) -> None:
        pass


def _all_cpu(tensors, what: str) -> None:
    for t in tensors:
        if t.device.type != "cpu":
            raise DeviceMismatch(f"{what}: expected a CPU tensor, got one on {t.device}")


# --- CPU, checking ------------------------------------------------------------------------------

class _Clocked:
    """An emulated stream (or the host): its position in its queue and what it is ordered after."""

    def __init__(self, name: str):
        self.name = name
        self.pos = 0
        self.known: dict[_Clocked, int] = {}   # other stream -> position this one is ordered after

    def clock(self) -> dict:
        return {**self.known, self: self.pos}

    def merge(self, clock: dict) -> None:
        for s, p in clock.items():
            if s is not self and self.known.get(s, -1) < p:
                self.known[s] = p

    def sees(self, other: "_Clocked", pos: int) -> bool:
        return other is self or self.known.get(other, -1) >= pos

    def __repr__(self) -> str:
        return f"stream {self.name!r}" if self.name != "host" else "the host"


class _CheckingEvent:
    def __init__(self, acc: "CheckingCpuAccelerator"):
        self.acc = acc
        self.clock: dict | None = None   # None: never recorded (waiting on it orders nothing, as on CUDA)

    def record(self, stream=None) -> None:
        with self.acc._lock:
            s = self.acc._queue(stream)
            self.clock = s.clock()

    def wait(self, stream=None) -> None:
        with self.acc._lock:
            s = self.acc._queue(stream)
            if self.clock is not None:
                s.merge(self.clock)

    def synchronize(self) -> None:
        with self.acc._lock:
            if self.clock is not None:
                self.acc._host.merge(self.clock)


class CheckingCpuAccelerator:
    """The CPU, checked as if it were CUDA (see the module docstring)."""

    device = torch.device("cpu")
    host = torch.device("cpu")

    def __init__(self):
        self._lock = threading.RLock()
        self._compute = _Clocked("compute")
        self._host = _Clocked("host")
        self._local = threading.local()   # per thread, like CUDA's current stream
        # storage address -> (a tensor keeping it alive, pinned) for host buffers
        self._host_buffers: dict[int, tuple[weakref.ref, bool]] = {}
        # storage address -> (keeper, [(lo, hi, stream, pos, is_write)]) byte ranges accessed
        self._accesses: dict[int, tuple[weakref.ref, list]] = {}

    # streams and events

    def current_stream(self):
        return getattr(self._local, "stream", self._compute)

    def new_stream(self, name: str):
        return _Clocked(name)

    @contextmanager
    def stream(self, stream) -> Iterator[None]:
        before = self.current_stream()
        self._local.stream = stream
        try:
            yield
        finally:
            self._local.stream = before

    def event(self) -> Event:
        return _CheckingEvent(self)

    def _queue(self, stream) -> _Clocked:
        """The host queues work on ``stream``: it runs after what the host did and knew so far."""
        s = stream or self.current_stream()
        s.merge(self._host.clock())
        return s

    # memory

    def empty_host(self, shape, dtype: torch.dtype, pinned: bool = True) -> Tensor:
        t = torch.empty(shape, dtype=dtype, device="cpu")
        if t.numel():
            with self._lock:
                key = _storage(t)
                self._host_buffers[key] = (self._keeper(t, self._host_buffers, key), pinned)
                self._accesses.pop(key, None)   # a new buffer at a reused address
        return t

    def _host_entry(self, t: Tensor) -> tuple[weakref.ref, bool] | None:
        if t.numel() == 0:
            return None
        entry = self._host_buffers.get(_storage(t))
        if entry is not None and not _owns(entry[0], _storage(t)):   # freed; the address may be reused
            del self._host_buffers[_storage(t)]
            return None
        return entry

    def _is_host(self, t: Tensor) -> bool:
        return self._host_entry(t) is not None

    def on_device(self, *tensors: Tensor, what: str) -> None:
        with self._lock:
            for t in tensors:
                _all_cpu([t], what)
                if self._is_host(t):
                    raise DeviceMismatch(f"{what}: expected device memory, got a host buffer "
                                         f"({tuple(t.shape)}, {t.dtype})")

    def on_host(self, *tensors: Tensor, what: str) -> None:
        with self._lock:
            for t in tensors:
                if t.numel() and not self._is_host(t):
                    raise DeviceMismatch(f"{what}: expected a host buffer, got device memory "
                                         f"({tuple(t.shape)}, {t.dtype})")

    # accesses

    def copy(self, dst: Tensor, src: Tensor, non_blocking: bool = False) -> None:
        with self._lock:
            dst_host, src_host = self._is_host(dst), self._is_host(src)
            if dst_host and src_host:   # host memory to host memory: the host does it
                self._access(self._host, [src], [dst], "host copy")
            else:
                if non_blocking:
                    for t, on_host in ((dst, dst_host), (src, src_host)):
                        if on_host and not self._host_entry(t)[1]:
                            raise DeviceMismatch("a non_blocking copy between host and device needs a pinned "
                                                 f"host buffer (got a pageable one, {tuple(t.shape)}, {t.dtype})")
                s = self._queue(None)
                self._access(s, [src], [dst], "copy")
                if (dst_host or src_host) and not non_blocking:
                    self._host.merge(s.clock())   # a blocking copy returns when it is done
        dst.copy_(src)

    def use(self, reads: Sequence[Tensor] = (), writes: Sequence[Tensor] = ()) -> None:
        with self._lock:
            self._access(self._queue(None), reads, writes, "compute")

    def host_use(self, reads: Sequence[Tensor] = (), writes: Sequence[Tensor] = ()) -> None:
        with self._lock:
            self._access(self._host, reads, writes, "host code")

    @staticmethod
    def _keeper(t: Tensor, table: dict, key: int) -> weakref.ref:
        """A weak reference to the tensor that owns ``t``'s storage; its entry in ``table`` goes when it does."""
        def forget(ref, table=table, key=key):
            if table.get(key, (None,))[0] is ref:
                table.pop(key, None)
        return weakref.ref(t._base if t._base is not None else t, forget)

    def _access(self, s: _Clocked, reads: Sequence[Tensor], writes: Sequence[Tensor], what: str) -> None:
        s.pos += 1
        for ts, write in ((reads, False), (writes, True)):
            for t in ts:
                if t.numel() == 0:
                    continue
                key = _storage(t)
                lo, hi = _span(t)
                keeper, log = self._accesses.get(key, (None, None))
                if keeper is None or not _owns(keeper, key):
                    log = []
                    self._accesses[key] = (self._keeper(t, self._accesses, key), log)
                for a_lo, a_hi, other, pos, other_write in log:
                    if a_lo < hi and lo < a_hi and (write or other_write) and not s.sees(other, pos):
                        raise OrderError(
                            f"{what} on {s!r} {'writes' if write else 'reads'} bytes [{lo}, {hi}) of a "
                            f"{tuple(t.shape)} {t.dtype} buffer that {other!r} "
                            f"{'wrote' if other_write else 'read'} without an event ordering them "
                            f"(record an event after that use and wait on it / synchronize it first)")
                if write:  # what this write is ordered after no longer matters for later accesses
                    log[:] = [a for a in log if not (lo <= a[0] and a[1] <= hi and s.sees(a[2], a[3]))]
                else:      # nor does an earlier read of the same bytes on the same stream
                    log[:] = [a for a in log if not (a[0] == lo and a[1] == hi and a[2] is s and not a[4])]
                log.append((lo, hi, s, s.pos, write))


def _owns(ref: weakref.ref, address: int) -> bool:
    """Whether the tensor behind ``ref`` is alive and still has its storage at ``address`` (a
    storage resized to zero and refilled, as zero3's gather buffers are, may move)."""
    t = ref()
    return t is not None and t.untyped_storage().nbytes() > 0 and _storage(t) == address


def _storage(t: Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _span(t: Tensor) -> tuple[int, int]:
    """Byte range of the storage that ``t`` covers (its extent, for strided views)."""
    size = t.element_size()
    lo = t.storage_offset() * size
    extent = 1 + sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride()))
    return lo, lo + extent * size
