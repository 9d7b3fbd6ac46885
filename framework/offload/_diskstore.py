"""The disk tier's store (offload=nvme): a swap file plus a pool of pinned, page-aligned slots that
pieces are read into before the host uses them and written back from after (``_store.py``'s calls)."""
from __future__ import annotations

import hashlib
import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from functools import partial
from typing import Sequence

import torch

from framework.comm.accelerator import Accelerator, Event
from framework.offload._aio import aligned_empty, verify_extent
from framework.offload._swapfile import SwapFile, padded


def pool_layout(entries: Sequence[tuple[Sequence[int], Sequence[int], int]], buffer_count: int
                ) -> tuple[int, int, int, int]:
    """(slot bytes, slots, file bytes, bounce bytes) of a store holding ``entries``: (swapped bytes,
    scratch bytes, how many swapped ones, last, are read-only); the store and the predictions use it."""
    slot = max((sum(padded(n) for n in (*swapped, *scratch)) for swapped, scratch, _ in entries), default=0)
    bounce = max((padded(n) for swapped, _, ro in entries for n in swapped[len(swapped) - ro:]), default=0)
    return slot, min(buffer_count, len(entries)), sum(padded(n) for sw, _, _ in entries for n in sw), bounce


def parked(numel: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """A placeholder of ``numel`` elements that holds no memory (zero strides over one element)."""
    one = torch.zeros(1, dtype=dtype, device=device)
    return torch.empty(0, dtype=dtype, device=device).set_(one.untyped_storage(), 0, (numel,), (0,))


def park_tensor(t: torch.Tensor) -> None:
    """``t`` (the tensor object others hold; its shape kept) re-pointed at such a placeholder."""
    t.set_(parked(1, t.dtype, t.device).untyped_storage(), 0, t.shape, (0,) * t.dim())


@dataclass
class _Entry:
    """A disk piece: tensors whose bytes live in the swap file (``swapped``) and tensors that only need
    room while it is resident (``scratch``: the 16-bit staging). The tensor objects are stable (the
    state holds them): they view its slot while it is resident, else are parked."""

    swapped: list[torch.Tensor]
    scratch: list[torch.Tensor]
    # the last ``readonly`` swapped tensors are never written back by a release (the owned gradient:
    # written by ``write_extent`` during backward, read with the piece by the step)
    readonly: int = 0
    offsets: list[int] = field(default_factory=list)   # byte offset of each tensor within a slot


@dataclass(eq=False)   # slots are compared by identity (``writing.remove``)
class _Slot:
    buffer: torch.Tensor        # uint8 view of the pool, page-aligned
    key: int | None = None      # the piece it holds
    # free | reading (reads in flight, or taken back with its writes) | resident (in use) | clean
    # (resident, unchanged: evicted without a write) | writing | draining (a thread waits for its
    # writes) | failed (a read failed: freed on release, never written)
    state: str = "free"
    io: list = field(default_factory=list)     # IO handles in flight (reads or writes)
    stamp: int = 0                             # when it was last made resident (eviction order)
    readers: Event | None = None               # streams still copying from it

    def synced(self) -> None:
        """Wait for the streams' last copy that read this slot, only (a sync point)."""
        if self.readers is not None:
            self.readers.synchronize()
            self.readers = None


class DiskStore:
    """A swap file plus a pool of ``buffer_count`` slots, each as large as the largest piece.
    ``acquire(k)`` queues piece k's reads (with ``read_ahead`` also the next piece's); ``wait`` points
    k's tensors at the slot once they landed; ``release`` queues the writes (with ``write_behind`` they
    drain while the next piece steps). A slot is reused only once its writes finished and no stream
    reads it. Several threads call in: a condition variable guards the slot table."""

    def __init__(self, acc: Accelerator, *, pin: bool, buffer_count: int, read_ahead: bool, write_behind: bool,
                 name: str, learn_order: bool = False):
        self.acc, self.pin, self.buffer_count = acc, pin, buffer_count
        self.read_ahead, self.write_behind, self.name = read_ahead, write_behind, name
        # The read-ahead reads ``follow[k]`` after k: the order pieces were added (the optimizer's tiles),
        # or with ``learn_order`` that of the previous acquires (zero3's gather order).
        self.learn_order, self.follow, self.last = learn_order, {}, None
        self.entries: dict[int, _Entry] = {}
        self.slots: list[_Slot] = []
        self.where: dict[int, _Slot] = {}   # key -> the slot holding (or reading, or writing) it
        self.writing: deque[_Slot] = deque()
        # An explicit RLock: ``_drop_held`` releases while ``_is_owned()``, which tells the calling thread's
        # ownership only for an RLock (with a plain Lock it is True whenever any thread holds it).
        self.cond = threading.Condition(threading.RLock())
        self.file = self.io = None
        self.bytes_read = self.bytes_written = 0
        self.interrupted = False   # the step failed: a worker waiting for a slot gives up
        self.bounce: torch.Tensor | None = None   # ``write_extent`` / ``read_extent``'s aligned buffer
        self.clock = itertools.count(1)   # ``_Slot.stamp``s
        self.wait_s = 0.0   # seconds callers spent blocked on this store's IO (benchmarks)

    def add(self, key: int, swapped: Sequence[torch.Tensor], scratch: Sequence[torch.Tensor] = (),
            park: bool = True, readonly: int = 0) -> None:
        """Register piece ``key``'s tensors and park them (``park=False``: ``create`` does)."""
        tensors = (*swapped, *scratch)
        offsets = list(itertools.accumulate((padded(t.nbytes) for t in tensors), initial=0))[:-1]
        if self.entries and not self.learn_order:
            self.follow[next(reversed(self.entries))] = key
        self.entries[key] = _Entry(list(swapped), list(scratch), readonly, offsets)
        if park:
            for t in tensors:
                park_tensor(t)

    def extents(self) -> dict[str, int]:   # padded bytes, one per swapped tensor
        return {f"{k}.{j}": padded(t.nbytes) for k, e in self.entries.items() for j, t in enumerate(e.swapped)}

    def layout(self, buffer_count: int | None = None) -> tuple[int, int, int, int]:
        """``pool_layout`` of the entries (default ``buffer_count``: this store's)."""
        sizes = [([t.nbytes for t in e.swapped], [t.nbytes for t in e.scratch], e.readonly)
                 for e in self.entries.values()]
        return pool_layout(sizes, self.buffer_count if buffer_count is None else buffer_count)

    def open(self, path, io, rank: int = 0, world: int = 1) -> None:
        """Create the swap file at ``path`` and the pool; ``io`` (an ``AsyncIO``) moves pieces between them."""
        self.io, extents = io, self.extents()
        dtype = next(iter(self.entries.values())).swapped[0].dtype   # the extents' element type
        layout = hashlib.sha256(repr((world, rank, sorted(extents.items()))).encode()).hexdigest()[:16]
        self.file = SwapFile.create(path, extents, layout_hash=layout, world_size=world, rank=rank, dtype=dtype)
        size = self.layout()[0]
        try:
            pool = aligned_empty(self.buffer_count * size, torch.uint8, pin=self.pin, acc=self.acc)
        except BaseException:   # no pool (host memory, pinning): the new swap file goes with it
            self.file.remove()
            self.file = None
            raise
        self.slots = [_Slot(pool[i * size:(i + 1) * size]) for i in range(self.buffer_count)]

    def acquire(self, key: int) -> int:
        with self.cond:
            while (slot := self.where.get(key)) is not None and slot.state == "draining":
                self._give_up()
                self.cond.wait()   # its writes are being waited for by another thread; then it is free
            if slot is None:
                self._read(key, self._free_slot(block=True))
            elif slot.state == "writing":   # taken back before its writes drained: wait for them in ``wait``
                self.writing.remove(slot)
                slot.state = "reading"
            elif slot.state == "clean":     # still resident from an earlier use, unchanged since
                slot.state = "reading"
            if self.learn_order and self.last not in (None, key):
                self.follow[self.last] = key
            self.last = key
            nxt = self.follow.get(key) if self.read_ahead else None
            if nxt is not None and nxt not in self.where and (free := self._free_slot(block=False)) is not None:
                self._read(nxt, free)
        return key

    def wait(self, key: int, host_writes: bool = True) -> None:
        """``host_writes=False``: the host only reads the piece, so copies still reading it need not end."""
        with self.cond:
            slot = self.where[key]
            pending, slot.io = slot.io, []
        try:
            self._wait_io(pending)   # its reads (or, taken back, its writes)
        except BaseException:
            with self.cond:     # nothing valid in the slot: free it, never write it back
                slot.state = "failed"
            raise
        if host_writes:
            slot.synced()
        with self.cond:
            slot.state, slot.stamp = "resident", next(self.clock)
            self._point(key, slot)

    def release(self, key: int, readers: Event | None, dirty: bool = True, readonly_too: bool = False) -> None:
        """``dirty=False``: the host only read the piece; it stays resident (clean) until its slot is
        needed, and is never written back. ``readonly_too``: the read-only tail is written too."""
        with self.cond:
            slot = self.where.get(key)
            # not resident: acquired but never stepped (an aborted step), unchanged
            if slot is None or slot.state not in ("resident", "failed"):
                return
            if slot.state == "failed":
                self._free(slot)
                return
            if readers is not None:   # (else an earlier reader of the same piece still counts)
                slot.readers = readers
            if not dirty:
                slot.state = "clean"
                self.cond.notify_all()
                return
            e = self.entries[key]
            slot.state = "writing"
            self.bytes_written += self._start_io(slot, len(e.swapped) - (0 if readonly_too else e.readonly), read=False)
            self.writing.append(slot)
            self.cond.notify_all()
        if not self.write_behind:
            self._finish_writes(slot)

    def flush(self) -> None:
        """Every write landed and no stream reads a slot any more."""
        while True:
            with self.cond:
                if not self.writing:
                    break
                slot = self.writing[0]
            self._finish_writes(slot)
        for slot in self.slots:
            slot.synced()

    def close(self) -> None:
        try:
            self.flush()
            for slot in self.slots:
                for h in slot.io:
                    h.wait()
                slot.io = []
        finally:
            if self.io is not None:
                self.io.close()
            if self.file is not None:
                self.file.remove()
            self.io = self.file = self.bounce = None

    def interrupt(self) -> None:
        """The step failed: a thread waiting for a slot gives up (also what follows: ``resume``)."""
        self._drop_held()
        with self.cond:
            self.interrupted = True
            self.cond.notify_all()

    def resume(self) -> None:
        with self.cond:
            self.interrupted = False

    def recover(self) -> None:
        """After a step cut short at any line of the calls above (an exception, Ctrl-C), once no other thread
        calls in: every IO queued so far finished (one whose handle was lost too), every slot free, every piece
        parked. The swap file holds what was released and written; a slot never released held nothing changed
        but by a half-applied update (which the engine then refuses to step on until a load). A write that failed
        is raised once all that is done: the file lacks the piece it freed, which must never be read as current."""
        self._drop_held()
        if self.io is not None:
            self.io.fence()
        for slot in self.slots:
            slot.synced()   # (a sync point: after a failed step or a load only, never a healthy step)
        failed = next((e for slot in self.slots for h in slot.io   # (fenced: done, no wait)
                       if h.op == "write" and (e := h.exception()) is not None), None)
        with self.cond:
            for key in {*self.where, *(slot.key for slot in self.slots)} - {None}:   # (a piece pointed at has both)
                for t in (*self.entries[key].swapped, *self.entries[key].scratch):
                    park_tensor(t)
            for slot in self.slots:
                slot.key, slot.state, slot.io = None, "free", []
            self.where.clear()
            self.writing.clear()
            self.interrupted = False
            self.cond.notify_all()
        if failed is not None:
            raise failed

    def create(self, key: int, fill=None) -> None:
        """Setup: piece ``key`` made resident unread, ``fill()``-ed (default: its unparked values), written."""
        if fill is None:
            swapped = self.entries[key].swapped
            old = [t.detach() for t in swapped]   # aliases keeping the original memory until copied
            # (torch._foreach_copy_: no public multi-tensor copy; torch.optim's own steps use the foreach ops)
            fill = partial(torch._foreach_copy_, swapped, old)   # (once the slot is pointed at)
        with self.cond:
            slot = self._free_slot(block=True)
            slot.key, slot.state = key, "resident"
            self.where[key] = slot
            self._point(key, slot)
        fill()
        self.release(key, None, readonly_too=True)

    # --- one tensor of a piece, around the slots (owned gradients during backward) ---------------

    def write_extent(self, key: int, src: torch.Tensor) -> None:
        """``src`` (host) -> piece ``key``'s read-only tail, waited for, through the bounce buffer
        (padded as the slot reads it, so the checksums cover the same pieces)."""
        self.acc.on_host(src, what="a swapped extent's source")   # (device memory: a copy outside the streams)
        self.acc.host_use(reads=[src])
        j, n, buf = self._bounce(key)
        buf[:n].copy_(src.reshape(-1).view(torch.uint8))
        buf[n:].zero_()
        self._wait_io([self._extent_io(self.io.pwrite, key, j, buf)])
        self.bytes_written += buf.numel()

    def read_extent(self, key: int, dst: torch.Tensor, bounce: torch.Tensor | None = None) -> torch.Tensor:
        """Piece ``key``'s last swapped tensor from the swap file -> ``dst`` (host, contiguous), waited for.
        ``bounce``: the caller's own (``new_bounce``), for a thread reading while another writes."""
        self.acc.on_host(dst, what="a swapped extent's destination")
        j, n, buf = self._bounce(key, bounce)
        self._wait_io([self._extent_io(self.io.pread, key, j, buf)])
        self.bytes_read += buf.numel()
        self.acc.host_use(writes=[dst])
        dst.reshape(-1).view(torch.uint8).copy_(buf[:n])
        return dst

    def new_bounce(self, least: int = 0) -> torch.Tensor:
        """An aligned buffer as large as any piece's last swapped tensor (``read_extent``'s ``bounce``)."""
        return aligned_empty(max(self.layout()[3], least), torch.uint8, pin=False, acc=self.acc)

    def _bounce(self, key: int, own: torch.Tensor | None = None) -> tuple[int, int, torch.Tensor]:
        """(index, bytes, padded bounce buffer: ``own`` or the store's) of piece ``key``'s last tensor,
        once no slot holds it (written behind, read ahead: every slot is settled)."""
        if key in self.where:
            self.settle()
        swapped = self.entries[key].swapped
        n = swapped[-1].nbytes
        if own is None:
            if self.bounce is None or self.bounce.numel() < padded(n):
                self.bounce = self.new_bounce(padded(n))
            own = self.bounce
        return len(swapped) - 1, n, own[:padded(n)]

    def settle(self) -> None:
        """Between steps: every IO landed and no slot holds a piece (the swap file is the only copy)."""
        self.flush()
        with self.cond:
            busy = [s.key for s in self.slots if s.state in ("resident", "writing", "draining")]
            if busy:
                raise RuntimeError(f"{self.name} swap: pieces {busy} are in use; the swap file can be mapped "
                                   "only between steps")
            pending = [h for s in self.slots for h in s.io]
            for s in self.slots:
                s.io = []
        for h in pending:   # reads ahead into slots dropped below: their data (or error) is not used
            h.exception()
        with self.cond:
            for s in self.slots:
                if s.key is not None:
                    self._free(s)

    def mapped(self, write: bool) -> tuple[object | None, dict[int, list[torch.Tensor]]]:
        """(map, views): the settled swap file mapped and, per piece, its swapped tensors as views of it
        ((None, {}) without one). Read-only: every extent is checked against the engine's checksums, so
        a damaged file never reaches a checkpoint. Writable: ``unmapped`` it when done."""
        if self.file is None or not self.entries or not self.file.size:
            return None, {}
        self.settle()
        fmap = self.file.map(write)
        views: dict[int, list[torch.Tensor]] = {}
        extents = [(f"{key}.{j}", key, j, t) for key, e in self.entries.items() for j, t in enumerate(e.swapped)]
        for i, (name, key, j, t) in enumerate(extents):
            if not write:
                for ahead in extents[i + (i > 0):i + 2]:   # (the first, and) the next, read while this one is checked
                    fmap.prefetch(ahead[0])
                verify_extent(fmap, name, what=f"{self.name} piece {key} tensor {j}")   # strict: every byte
            views.setdefault(key, []).append(fmap.extent(name, t.dtype, t.shape))
        return fmap, views

    def unmapped(self, fmap) -> None:
        """After writing through ``mapped(write=True)``'s views: synced, the checksums recomputed."""
        if fmap is None:
            return
        fmap.sync()
        for name, extent in self.file.extents.items():
            data = fmap.padded(name)
            self.io.rehash(self.file, extent.offset, data)
            fmap.release(data)

    def memory(self, fp, pool: str, file: str) -> None:
        """The pool (slots and bounce buffer) and the swap file, into footprint ``fp``."""
        fp.add(pool, host=self.buffer_count * self.layout()[0] + (0 if self.bounce is None else self.bounce.numel()))
        fp.add_disk(file, sum(self.extents().values()))

    # --- internals (called with the condition held unless said otherwise) --------------------

    def _free_slot(self, block: bool) -> _Slot | None:
        """A slot to read into. One whose last copy to the device still runs is taken only when nothing
        else is (polled: in zero3's hooks a wait would stall the host), and without ``block`` never."""
        while True:
            free = [slot for slot in self.slots if slot.state == "free"]
            clean = sorted((slot for slot in self.slots if slot.state == "clean"), key=lambda sl: sl.stamp)
            for slot in [*free, *clean]:   # free first, then the least recently released clean piece
                if slot.readers is None or slot.readers.query():
                    return self._evict(slot)
            if block and (free or clean):   # every candidate is still being copied from: wait for the oldest
                return self._evict((free or clean)[0])
            if self.writing and (block or all(h.done() for h in self.writing[0].io)):
                slot = self.writing[0]
                self.cond.release()
                try:
                    self._finish_writes(slot)
                finally:
                    self.cond.acquire()
                continue
            if not block:
                return None
            self._give_up()
            # Every slot holds a piece being read, stepped or copied back: wait for a release.
            t = time.perf_counter()
            self.cond.wait()
            self.wait_s += time.perf_counter() - t

    def _drop_held(self) -> None:
        """(the failing thread) A Ctrl-C landing on a ``with self.cond`` block's exit skips it: the lock stays
        held by this thread, and another one needing it would wait forever. (``_is_owned``: the threading
        module's own test of the caller's ownership.)"""
        while self.cond._is_owned():
            self.cond.release()

    def _give_up(self) -> None:   # (before a wait for another thread)
        if self.interrupted:
            raise RuntimeError(f"{self.name} swap: the step failed while this piece waited for a buffer")

    def _evict(self, slot: _Slot) -> _Slot:
        if slot.state == "clean":   # its piece needs no write
            self._free(slot)
        slot.synced()   # the copy back of the piece it held
        return slot

    def _read(self, key: int, slot: _Slot) -> None:
        slot.key, slot.state = key, "reading"
        self.where[key] = slot
        self.bytes_read += self._start_io(slot, len(self.entries[key].swapped), read=True)

    def _start_io(self, slot: _Slot, count: int, read: bool) -> int:
        """Reads or writes of ``slot``'s first ``count`` swapped tensors queued; their bytes."""
        e = self.entries[slot.key]
        bufs = [slot.buffer[e.offsets[j]:e.offsets[j] + padded(e.swapped[j].nbytes)] for j in range(count)]
        if read:
            self.acc.host_use(writes=bufs)   # the reads land there
        start = self.io.pread if read else self.io.pwrite
        slot.io = [self._extent_io(start, slot.key, j, b) for j, b in enumerate(bufs)]
        return sum(b.numel() for b in bufs)

    def _extent_io(self, start, key: int, j: int, buf: torch.Tensor):   # start: io.pread or io.pwrite
        return start(self.file, self.file.extent(f"{key}.{j}")[0], buf, what=f"{self.name} piece {key} tensor {j}")

    def _wait_io(self, handles) -> None:
        """(without the condition held) Counted in ``wait_s``."""
        t = time.perf_counter()
        try:
            for h in handles:
                h.wait()
        finally:
            self.wait_s += time.perf_counter() - t

    def _finish_writes(self, slot: _Slot) -> None:
        """(without the condition held) Wait for ``slot``'s writes and free it."""
        with self.cond:
            if slot.state != "writing":
                while slot.state == "draining":   # another thread waits for them
                    self._give_up()
                    self.cond.wait()
                return
            slot.state = "draining"
            pending, slot.io = slot.io, []
        try:
            self._wait_io(pending)
        finally:
            with self.cond:
                self.writing.remove(slot)
                self._free(slot)

    def _free(self, slot: _Slot) -> None:
        e = self.entries[slot.key]
        for t in (*e.swapped, *e.scratch):
            park_tensor(t)
        self.where.pop(slot.key, None)
        slot.key, slot.state, slot.io = None, "free", []
        self.cond.notify_all()

    def _point(self, key: int, slot: _Slot) -> None:
        e = self.entries[key]
        for j, t in enumerate((*e.swapped, *e.scratch)):
            t.set_(slot.buffer[e.offsets[j]:e.offsets[j] + t.nbytes].view(t.dtype).view(t.shape))

