"""The checking CPU accelerator: the CPU as the plain one runs it, raising where CUDA would go wrong
and a CPU run would not notice (a mutation in ``tests/_mutations.py`` proves each check):

- placement: host buffers are those ``empty_host`` made, those ``register_host`` names (what the caller made of
  host buffers: pageable), in hot regions what torch calls make of host buffers alone (``_hostsync``), and in
  hot regions and ``building`` (setup) what framework code makes on the host by name (``device="cpu"``,
  ``acc.host``); all else is device memory (torch's calls elsewhere are not watched: a mode costs every call). One where the other
  is expected (``on_device``/``on_host``, compute in ``use``, a collective), or a ``non_blocking`` copy with a
  pageable host side: ``DeviceMismatch``;
- stream order (vector clocks, ``Clocked``): each access through the interface (``copy``, ``use``,
  ``host_use``, a collective) is logged per byte range of its storage; one conflicting with an
  earlier access by another stream (or the host: all its threads count as one, ordering between them
  is their own business) that no event orders: ``OrderError`` naming both places. Work the host
  queues is ordered after what the host knew;
- NCCL's own stream: a collective runs after the stream current at its issue, and the stream
  current at ``collective_done`` after it;
- the caching allocator: device memory freed while a stream other than compute may still use it
  (no event, no ``record_stream``) is reported at the next checked call; device memory first seen (or refilled
  by ``resize_`` at a new address) comes from compute's pool, so another stream using it first must have waited
  for compute (unless torch made it while that stream was current: its own pool);
- per-thread devices: a thread other than the creator must ``bind_thread`` before device work;
- host syncs: in ``hot(...)`` and hooks wrapped by ``hook(...)``, framework code (not model code)
  reading device memory on the host (``item``, a boolean-mask index, ``bincount``, formatting it...),
  copying it into a host buffer blocking (``copy_``, ``host[...] = t``, ``out=host``, ``.to(host)``), or a host
  buffer into it blocking (``copy(dev, host)``, ``t[...] = host``, ``host.to(t)``), or synchronizing an event
  that orders the host after work it has not waited for yet (``query`` does not wait), raises ``HostSync``;
- pinned memory as CUDA's caching host allocator holds it (``pinned_stats``).
"""
from __future__ import annotations

import contextlib
import threading
import weakref
from contextlib import contextmanager
from typing import Callable, Iterator, Sequence

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

from framework.comm.accelerator._base import CpuAccelerator, DeviceMismatch, Event, HostSync, OrderError, all_cpu
from framework.comm.accelerator._hostsync import (HostMade, NoHostSync, _host_key, framework_caller, new_outputs,
                                                  tensors_of)
from framework.comm.accelerator._hostsync import place as _place


class Clocked:
    """An emulated stream (or the host): its position in its queue and what it is ordered after."""

    def __init__(self, name: str):
        self.name = name
        self.pos = 0
        self.known: dict[Clocked, int] = {}   # other stream -> position this one is ordered after
        self.last_copy: str | None = None      # h2d | d2h | d2d: the latest copy queued here

    def clock(self) -> dict:
        return {**self.known, self: self.pos}

    def merge(self, clock: dict) -> None:
        for s, p in clock.items():
            if s is not self and self.known.get(s, -1) < p:
                self.known[s] = p

    def sees(self, other: "Clocked", pos: int) -> bool:
        return other is self or self.known.get(other, -1) >= pos

    def __repr__(self) -> str:
        return f"stream {self.name!r}" if self.name != "host" else "the host"


class CheckingEvent:
    def __init__(self, acc: "CheckingCpuAccelerator"):
        self.acc = acc
        self.clock: dict | None = None   # None: never recorded (waiting on it orders nothing, as on CUDA)
        self.after_copy: str | None = None   # the kind of copy its stream queued last when recorded

    def record(self, stream=None) -> None:
        with self.acc._lock:
            self.acc._entry("record an event")
            s = self.acc._queue(stream)
            self.clock, self.after_copy = s.clock(), s.last_copy

    def wait(self, stream=None) -> None:
        with self.acc._lock:
            self.acc._entry("make a stream wait for an event")
            self.acc._queue(stream).merge(self.clock or {})

    def synchronize(self) -> None:
        with self.acc._lock:
            self.acc._pending()
            hot = getattr(self.acc._local, "hot", ())
            if hot and any(not self.acc._host.sees(s, p) for s, p in (self.clock or {}).items()) \
                    and framework_caller(skip=self):   # (one that teaches the host nothing new does not wait)
                raise HostSync(f"host sync (synchronize of an event waiting for {self._unseen()}) inside {hot[-1]}, "
                               f"at {_place()}: on CUDA the host stalls until the device catches up; move the wait "
                               f"out of the hook, poll it with query(), or make a stream wait on the event instead")
            self._reached()

    def query(self) -> bool:
        with self.acc._lock:   # (no wait: allowed in hooks)
            self.acc._pending()
            self._reached()   # on the CPU the work ran when it was queued: reached, and the host knows it
        return True

    def _reached(self) -> None:
        """The host learns that the recorded point was reached."""
        self.acc._host.merge(self.clock or {})

    def _unseen(self) -> str:
        return " and ".join(repr(s) for s, p in self.clock.items() if not self.acc._host.sees(s, p))


class CheckingCpuAccelerator(CpuAccelerator):
    """The CPU, checked as if it were CUDA (see the module docstring)."""

    checks = True

    def __init__(self):
        self._lock = threading.RLock()
        self._compute = Clocked("compute")
        self._host = Clocked("host")
        self._collectives = Clocked("collectives")   # NCCL's own stream
        self._local = threading.local()   # per thread, like CUDA's current stream
        self._bound = {threading.get_ident()}   # threads that set their device (the creator has)
        # storage address -> (a tensor keeping it alive, pinned) for host buffers
        self._host_buffers: dict[int, tuple[weakref.ref, bool]] = {}
        # storage address -> (keeper, [(lo, hi, stream, pos, is_write, place)]) byte ranges accessed
        self._accesses: dict[int, tuple[weakref.ref, list]] = {}
        self._recorded: dict[int, set] = {}   # device storage address -> streams it was record_stream'ed to
        self._allocated_on: dict[int, tuple[weakref.ref, Clocked]] = {}   # address -> side stream it was made on
        self._violations: list[str] = []      # found outside a call (a free), raised at the next one
        self._pinned = {"requested": 0, "reserved": 0}
        self._pinned_free: dict[int, int] = {}   # rounded size -> cached free blocks

    # streams and events

    def current_stream(self):
        return getattr(self._local, "stream", self._compute)

    def new_stream(self, name: str):
        return Clocked(name)

    @contextmanager
    def stream(self, stream) -> Iterator[None]:
        before = self.current_stream()
        self._local.stream = stream
        try:
            if stream is self._compute or before is not self._compute:   # (inside a side stream: its mode is on)
                yield
            else:   # (what torch allocates here comes from that stream's pool, not compute's)
                with AllocatedOn(self):
                    yield
        finally:
            self._local.stream = before

    def event(self) -> Event:
        return CheckingEvent(self)

    def bind_thread(self) -> None:
        with self._lock:
            self._bound.add(threading.get_ident())

    def record_stream(self, t: Tensor, stream) -> None:
        if t.numel():
            with self._lock:
                self._recorded.setdefault(_storage(t), set()).add(stream)

    def _queue(self, stream) -> Clocked:
        """The host queues work on ``stream``: it runs after what the host did and knew so far."""
        s = stream or self.current_stream()
        s.merge(self._host.clock())
        return s

    def _pending(self) -> None:
        if self._violations:
            found, self._violations = self._violations, []
            raise OrderError(found[0] + (f" (and {len(found) - 1} more)" if len(found) > 1 else ""))

    def _entry(self, what: str) -> None:
        """Every checked call that queues device work: earlier findings, then the thread's device."""
        self._pending()
        if threading.get_ident() not in self._bound:
            raise DeviceMismatch(
                f"thread {threading.current_thread().name!r} tries to {what} without having set its device, "
                f"at {_place()}: on CUDA its work and pinned memory would create a context on GPU 0 (hundreds "
                f"of MB per rank); call acc.bind_thread() first (e.g. as the thread pool's initializer)")

    def verify(self) -> None:
        with self._lock:
            self._pending()

    # memory

    def empty_host(self, shape, dtype: torch.dtype, pinned: bool = True) -> Tensor:
        t = torch.empty(shape, dtype=dtype, device="cpu")
        if t.numel():
            with self._lock:
                if pinned:
                    self._entry("pin host memory")
                    self._pin(t)
                self._add_host(t, pinned)
        return t

    def register_host(self, *tensors: Tensor, what: str) -> None:
        with self._lock:
            all_cpu(tensors, what)
            for t in tensors:
                if t.numel() and not self._is_host(t):
                    self._add_host(t, pinned=False)

    def _add_host(self, t: Tensor, pinned: bool) -> None:
        key = _storage(t)
        self._host_buffers[key] = (self._keeper(t, self._host_buffers, key), pinned)
        self._accesses.pop(key, None)   # a new buffer at a reused address

    def _derived(self, name: str, args, kwargs, out) -> None:
        """In a hot region: ``out`` of a torch call whose first operand is a host buffer is host memory too (pageable,
        as a CUDA op makes it beside its operands) where every tensor operand is and the call names no device."""
        if kwargs.get("out") is not None or "device" in kwargs \
                or name == "to" and any(isinstance(a, (str, torch.device)) for a in args[1:]):
            return
        if all(self._is_host(t) for t in tensors_of(args, kwargs)):
            self.register_host(*(t for t in ((out,) if isinstance(out, Tensor) else out) if isinstance(t, Tensor)),
                               what=name)

    def _pin(self, t: Tensor) -> None:
        """Account a pinned buffer as CUDA's caching host allocator does: a power-of-two block, reused when freed."""
        nbytes = t.untyped_storage().nbytes()
        size = 1 << max(0, nbytes - 1).bit_length()
        self._pinned["requested"] += nbytes
        if self._pinned_free.get(size):
            self._pinned_free[size] -= 1
        else:
            self._pinned["reserved"] += size

        def freed(stats=self._pinned, cache=self._pinned_free, nbytes=nbytes, size=size):
            stats["requested"] -= nbytes
            cache[size] = cache.get(size, 0) + 1
        weakref.finalize(t.untyped_storage(), freed).atexit = False

    def pinned_stats(self) -> dict[str, int]:
        with self._lock:
            return dict(self._pinned)

    def _host_entry(self, t: Tensor) -> tuple[weakref.ref, bool] | None:
        key = _storage(t) if t.numel() and t.layout is torch.strided else None   # (a sparse one has none)
        entry = self._host_buffers.get(key)
        if entry is not None and not _owns(entry[0], key):   # freed; the address may be reused
            del self._host_buffers[key]
            return None
        return entry

    def _is_host(self, t: Tensor) -> bool:
        return self._host_entry(t) is not None

    def on_device(self, *tensors: Tensor, what: str) -> None:
        with self._lock:
            for t in tensors:   # (per tensor: the first misplaced one is named)
                all_cpu([t], what)
                self._placed([t], what, host=False)

    def on_host(self, *tensors: Tensor, what: str) -> None:
        with self._lock:
            self._placed(tensors, what, host=True)

    def _placed(self, tensors: Sequence[Tensor], what: str, host: bool) -> None:
        for t in tensors:
            if t.numel() and self._is_host(t) != host:
                want, got = ("a host buffer", "device memory") if host else ("device memory", "a host buffer")
                hint = ("; if torch made it of host buffers alone (host.clone(), zeros_like(host)), it is host "
                        "memory: acc.register_host it where it is made") if host else ""
                raise DeviceMismatch(f"{what}: expected {want}, got {got} ({tuple(t.shape)}, {t.dtype}), at "
                                     f"{_place()}{hint}")

    # accesses

    def copy(self, dst: Tensor, src: Tensor, non_blocking: bool = False) -> None:
        with self._lock:
            dst_host, src_host = self._is_host(dst), self._is_host(src)
            if dst_host and src_host:   # host memory to host memory: the host does it
                self._pending()
                self._access(self._host, [src], [dst], "host copy")
            else:
                self._entry("queue a copy")
                if non_blocking:
                    for t, on_host in ((dst, dst_host), (src, src_host)):
                        if on_host and not self._host_entry(t)[1]:
                            raise DeviceMismatch("a non_blocking copy between host and device needs a pinned "
                                                 f"host buffer (got a pageable one, {tuple(t.shape)}, {t.dtype}), "
                                                 f"at {_place()}")
                s = self._queue(None)
                self._access(s, [src], [dst], "copy")
                s.last_copy = "h2d" if src_host else "d2h" if dst_host else "d2d"
                if (dst_host or src_host) and not non_blocking:
                    self._host.merge(s.clock())   # a blocking copy returns when it is done
        dst.copy_(src, non_blocking=non_blocking)   # (inside ``hot``, a blocking device-to-host copy is a sync)

    def use(self, reads: Sequence[Tensor] = (), writes: Sequence[Tensor] = ()) -> None:
        with self._lock:
            self._entry("queue compute")
            self._placed([*reads, *writes], "compute on the device", host=False)
            self._access(self._queue(None), reads, writes, "compute")

    def host_use(self, reads: Sequence[Tensor] = (), writes: Sequence[Tensor] = ()) -> None:
        with self._lock:
            self._pending()
            self._access(self._host, reads, writes, "host code")

    def _issuing_stream(self) -> Clocked:   # (a mutation issues from another)
        return self._queue(None)

    def collective(self, tensors: Sequence[Tensor], what: str):
        with self._lock:
            self._entry("issue a collective")
            self._placed(tensors, f"collective {what!r} (NCCL takes device memory only)", host=False)
            self._collectives.merge(self._issuing_stream().clock())   # NCCL waits for the current stream
            self._access(self._collectives, tensors, tensors, f"collective {what!r}")
            return self._collectives.clock()

    def collective_done(self, token) -> None:
        with self._lock:
            self._entry("wait for a collective")
            self._queue(None).merge(token)

    def hot(self, where: str) -> contextlib.AbstractContextManager:
        return NoHostSync(self, where)

    def building(self, where: str) -> contextlib.AbstractContextManager:
        return HostMade(self)

    def hook(self, fn: Callable, where: str) -> Callable:
        def checked(*args, **kwargs):
            with self.hot(where):
                return fn(*args, **kwargs)
        return checked

    @staticmethod
    def _keeper(t: Tensor, table: dict, key: int) -> weakref.ref:
        """A weak reference to ``t``'s storage (alive while any tensor views it, ``view(dtype)`` of a byte arena
        too); its entry in ``table`` goes when it does."""
        def forget(ref, table=table, key=key):
            if table.get(key, (None,))[0] is ref:
                table.pop(key, None)
        return weakref.ref(t.untyped_storage(), forget)

    def _access(self, s: Clocked, reads: Sequence[Tensor], writes: Sequence[Tensor], what: str) -> None:
        s.pos += 1
        place = None
        for t, write in [(r, False) for r in reads] + [(w, True) for w in writes]:
            if t.numel() == 0:
                continue
            place = place or _place()
            key = _storage(t)
            lo, hi = _span(t)
            keeper, log = self._accesses.get(key, (None, None))
            if keeper is None or not _owns(keeper, key):
                log = []
                self._accesses[key] = (self._keeper(t, self._accesses, key), log)
                if not self._is_host(t):
                    self._watch_free(t, key, log)
                    self._fresh(s, t, what)
            for a_lo, a_hi, other, pos, other_write, other_place in log:
                if a_lo < hi and lo < a_hi and (write or other_write) and not s.sees(other, pos):
                    raise OrderError(
                        f"{what} on {s!r} {'writes' if write else 'reads'} bytes [{lo}, {hi}) of a "
                        f"{tuple(t.shape)} {t.dtype} buffer at {place}, which {other!r} "
                        f"{'wrote' if other_write else 'read'} at {other_place} without an event ordering them "
                        f"(record an event after that use and wait on it / synchronize it first)")
            if write:  # what this write is ordered after no longer matters for later accesses
                log[:] = [a for a in log if not (lo <= a[0] and a[1] <= hi and s.sees(a[2], a[3]))]
            else:      # nor does an earlier read of the same bytes on the same stream
                log[:] = [a for a in log if not (a[0] == lo and a[1] == hi and a[2] is s and not a[4])]
            log.append((lo, hi, s, s.pos, write, place))

    def _fresh(self, s: Clocked, t: Tensor, what: str) -> None:
        """Device memory first seen (or refilled at a new address) came from the caching allocator on the compute
        stream, which may hand out bytes compute's queued work still reads: another stream may use it only after
        waiting for compute (as far as compute has got by now: when it was allocated is not seen), unless torch
        made it while that stream was current (``AllocatedOn``: from that stream's own pool). (Host code reading
        device memory waits for the device: a sync, not a stream.)"""
        made = self._allocated_on.pop(_storage(t), None)
        if made is not None and made[0]() is t.untyped_storage() and made[1] is s:
            return
        if s is not self._compute and s is not self._host and self._compute.pos \
                and not s.sees(self._compute, self._compute.pos):   # (position 0: compute queued nothing yet)
            raise OrderError(
                f"{what} on {s!r} uses a {tuple(t.shape)} {t.dtype} device buffer that the compute stream's "
                f"allocator handed out, at {_place()}, before {s!r} waited for compute: the bytes may still be "
                f"read by compute's queued work; record an event on compute after the allocation and wait on it "
                f"first")

    def _watch_free(self, t: Tensor, key: int, log: list) -> None:
        """When ``t``'s device storage is freed, check that no stream may still use it (the caching allocator
        hands its bytes to the next compute allocation)."""
        def freed(acc=weakref.ref(self), key=key, log=log):
            me = acc()
            if me is None:
                return
            with me._lock:
                recorded = me._recorded.pop(key, set())
                if me._accesses.get(key, (None, None))[1] is log:
                    me._accesses.pop(key, None)
                for _lo, _hi, s, pos, _w, place in log:
                    if s in (me._compute, me._host, me._collectives) or s in recorded:
                        continue   # ordered by the allocator's own stream, done, or kept by the collective
                    if not me._compute.sees(s, pos) and not me._host.sees(s, pos):
                        me._violations.append(
                            f"device memory used by {s!r} at {place} was freed at {_place()} while that use may "
                            f"still run: the caching allocator hands freed bytes to the next compute allocation; "
                            f"keep the tensor until an event after the use, or acc.record_stream(t, stream)")
                        return
        weakref.finalize(t.untyped_storage(), freed).atexit = False   # not at interpreter exit


class AllocatedOn(TorchFunctionMode):
    """Inside a side stream's context: the storages torch calls make are from the pool of the stream current at
    each call (``acc._fresh``): compute's inside a nested compute context (the mode stays on torch's stack)."""

    def __init__(self, acc: CheckingCpuAccelerator):
        super().__init__()
        self.acc = acc

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        stream = self.acc.current_stream()
        if "out" not in kwargs and stream is not self.acc._compute:
            for t in new_outputs(args, kwargs, out):
                key = _host_key(t)
                with self.acc._lock:
                    self.acc._allocated_on[key] = (self.acc._keeper(t, self.acc._allocated_on, key), stream)
        return out


def _owns(ref: weakref.ref, address: int) -> bool:
    """Whether the storage behind ``ref`` is alive and still at ``address`` (one resized to zero and refilled,
    as zero3's gather buffers are, may move)."""
    s = ref()
    return s is not None and s.nbytes() > 0 and s.data_ptr() == address


def _storage(t: Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _span(t: Tensor) -> tuple[int, int]:
    """Byte range of the storage that ``t`` covers (its extent, for strided views)."""
    size = t.element_size()
    lo = t.storage_offset() * size
    extent = 1 + sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride()))
    return lo, lo + extent * size
