"""The NVMe offload's IO engine: ``AsyncIO.pread`` / ``pwrite`` of a host tensor at a swap-file offset
return a handle at once; its ``wait()`` raises a ``SwapIOError`` naming the file, offset and tensor
(a short count, an OS error or a checksum mismatch).

Requests are cut at the file's ``block_size`` boundaries; ``queue_depth * intra_op_parallelism``
threads move the pieces with ``os.preadv`` / ``os.pwritev`` (they release the GIL). Measured within a
few percent of fio with O_DIRECT and libaio (``python -m bench.nvme_io``).

Checksums are taken per piece by the thread that writes it and compared by the one that reads it.
``sum64`` (default): the 64-bit word sum, about 3x cheaper than CRC-32 here; it catches any change
confined to a word and zeroed, stale or misplaced blocks, not words swapped among themselves (not
how disks fail). ``crc32``: stronger, slower; ``none``: off.
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import mmap
import queue
import threading
import weakref
import zlib

import numpy as np
import torch

from framework.core.errors import ConfigError, SwapIOError
from framework.core.units import MiB, size as _size
from framework.offload._swapfile import ALIGN, SwapFile, os_reason, padded

HUGE = 2 << 20   # transparent huge page size on x86-64 and most arm64 kernels
# Bounds for the ``aio`` keys (DeepSpeed's sweeps go up to 1 MiB blocks and 128 x 8 requests in flight):
# each thread keeps a bounce buffer of ``block_size``.
MAX_BLOCK_SIZE = 64 * MiB
MAX_THREADS = 1024
POLL_S = 1.0     # how often a wait checks that the engine still has a thread to finish it


def aligned_empty(numel: int, dtype: torch.dtype, *, pin: bool, acc) -> torch.Tensor:
    """An uninitialised host tensor of ``numel`` elements in a ``host_arena``, starting on a 4 KiB
    boundary (2 MiB from 2 MiB on, advised onto transparent huge pages: O_DIRECT reads 1.3 -> 2.1 GB/s)."""
    nbytes = int(numel) * dtype.itemsize
    align = HUGE if nbytes >= HUGE else ALIGN
    raw = host_arena(nbytes, pin=pin, acc=acc, align=align)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)   # advisory: ignored where THP is off or unsupported
    if align == HUGE and advice is not None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.madvise(raw.data_ptr(), nbytes // HUGE * HUGE, advice)
    return raw[:nbytes].view(dtype)


def host_arena(nbytes: int, *, pin: bool, acc, align: int = 0) -> torch.Tensor:
    """``nbytes`` of host memory (uint8) in one allocation, ``align``-ed if given. CUDA: an anonymous mmap (torch's
    pinned allocator would round it up to a power of two and keep it); else ``acc.empty_host`` (checked)."""
    if acc.device.type == "cuda":   # the mapping aligns it: no bytes beyond the tensor's are pinned or held
        return _mapped(max(int(nbytes), 1), pin, align=align or mmap.PAGESIZE)
    # (what the extra ``align`` bytes span is never touched, so never committed)
    raw = acc.empty_host(max(int(nbytes) + align, 1), torch.uint8, pinned=pin)
    return raw[(-raw.data_ptr()) % align:] if align else raw   # (host allocations are 64-byte aligned: whole elements)


def _mapped(nbytes: int, pin: bool, cudart=None, align: int = mmap.PAGESIZE) -> torch.Tensor:
    """Anonymous mmap memory: a uint8 tensor of ``nbytes`` in whole pages from an ``align`` boundary,
    ``cudaHostRegister``-ed when ``pin``. The finalizer of the ctypes view the storage holds keeps the mmap,
    so the memory is unregistered before it is unmapped (the mmap's own finalizers run after munmap)."""
    size = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
    extra = max(align - mmap.PAGESIZE, 0)   # (the mapping starts on a page)
    mm = mmap.mmap(-1, size + extra, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # (a temporary view of the mapping, dropped at once: the one below is the only one kept)
    shift = -ctypes.addressof(ctypes.c_char.from_buffer(mm)) % align
    pages = type("_Pages", (ctypes.c_char * size,), {}).from_buffer(mm, shift)   # a subclass: weak-referenceable
    t = torch.frombuffer(pages, dtype=torch.uint8)
    if pin:
        cudart = cudart or torch.cuda.cudart()
        ptr = t.data_ptr()
        err = cudart.cudaHostRegister(ptr, size, 0)
        if err != cudart.cudaError.success:
            raise RuntimeError(f"cudaHostRegister of {size} bytes failed: {err}")
        # ``mm`` (an argument, so still mapped) goes after the unregister
        weakref.finalize(pages, lambda mm: cudart.cudaHostUnregister(ptr), mm)
    return t


def _memory(address: int, nbytes: int):   # (memory the caller keeps alive)
    return (ctypes.c_char * nbytes).from_address(address)


def _sum64(memory, nbytes: int) -> int:
    """Sum of the little-endian 64-bit words (the last one zero-padded) modulo 2**64."""
    words = nbytes // 8
    total = int(np.frombuffer(memory, dtype="<u8", count=words).sum()) if words else 0
    return (total + int.from_bytes(memory[words * 8:nbytes], "little")) & 0xFFFF_FFFF_FFFF_FFFF


CHECKSUMS = {"sum64": _sum64, "crc32": lambda memory, nbytes: zlib.crc32(memory), "none": None}


class IOHandle:
    """One read or write in flight, done when all its pieces are."""

    def __init__(self, op: str, file: SwapFile, what: str, tensor: torch.Tensor, pieces: int, engine: "AsyncIO"):
        self.op, self.file, self.what = op, file, what
        self._tensor = tensor       # its memory must outlive the IO
        self._left = pieces
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._error: SwapIOError | None = None
        self._engine = engine       # whose threads finish it (a wait gives up once none is alive)
        if pieces == 0:
            self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def exception(self) -> SwapIOError | None:
        """Wait, then return the request's error (None if it succeeded) instead of raising it."""
        while not self._done.wait(POLL_S):
            if not self._engine._alive():   # nobody left to finish it: never wait forever
                self._piece_done(self._engine._broken or SwapIOError(
                    f"swap {self.op} of {self.what!r} on {self.file.path}: the IO engine's threads have "
                    "stopped", path=str(self.file.path), offset=-1, what=self.what), abandon=True)
        return self._error

    def wait(self) -> None:
        if self.exception() is not None:
            raise self._error

    def _piece_done(self, error: SwapIOError | None, abandon: bool = False) -> None:
        """A piece finished; ``abandon``: fail the request now (no thread is left to do its remaining pieces)."""
        with self._lock:
            if self._error is None:   # the first failure is the request's
                self._error = error
            self._left = 0 if abandon else self._left - 1
            last = self._left == 0
        if last:
            self._tensor = None
            self._done.set()


class AsyncIO:
    """Worker threads moving ``block_size`` pieces between host tensors and swap files."""

    def __init__(self, block_size: int = MiB, queue_depth: int = 8, intra_op_parallelism: int = 1,
                 direct: bool = True, *, checksum: str = "sum64", bounce=None):
        """``bounce(nbytes)``: a page-aligned buffer for a thread's unaligned O_DIRECT IO (a test seam)."""
        if block_size < ALIGN or block_size % ALIGN:
            raise ValueError(f"aio.block_size={block_size} must be a positive multiple of {ALIGN}")
        if queue_depth < 1 or intra_op_parallelism < 1:
            raise ValueError(f"aio.queue_depth={queue_depth} and aio.intra_op_parallelism="
                             f"{intra_op_parallelism} must be at least 1")
        if checksum not in CHECKSUMS:
            raise ValueError(f"checksum={checksum!r} is not one of {', '.join(CHECKSUMS)}")
        self.block_size, self.direct, self._hash = block_size, direct, CHECKSUMS[checksum]
        self._kind = (block_size, checksum)   # whose checksums a piece is verified against
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        self._broken: SwapIOError | None = None   # set when a thread died: every request fails from then on
        count, nbytes = queue_depth * intra_op_parallelism, block_size + 2 * ALIGN
        # on the caller's thread: a buffer that cannot be had is one error here, never a dead thread
        bounces: list[mmap.mmap] = []
        try:
            for _ in range(count):
                # (default: page-aligned (O_DIRECT), anonymous: committed when touched)
                bounces.append(bounce(nbytes) if bounce else mmap.mmap(-1, nbytes))
        except OSError as e:
            for b in bounces:
                b.close()
            raise ConfigError(f"offload.aio.block_size={block_size}: cannot allocate the IO threads' bounce "
                              f"buffers ({count} x {_size(nbytes)}: {os_reason(e)}); "
                              f"lower offload.aio.block_size (DeepSpeed's default is {MiB})") from None
        self._threads: list[threading.Thread] | None = []   # (None: closed)
        # the threads hold the engine weakly: one collected unclosed stops them (not at exit: daemon threads)
        self._stop = weakref.finalize(self, _stop, self._work, self._threads)
        self._stop.atexit = False
        try:
            for i, b in enumerate(bounces):
                t = threading.Thread(target=_worker, args=(weakref.ref(self), self._work, b),
                                     name=f"framework-aio-{i}", daemon=True)
                t.start()
                self._threads.append(t)
        except RuntimeError as e:   # "can't start new thread": a thread or memory limit
            for b in bounces[len(self._threads):]:
                b.close()
            self.close()
            raise ConfigError(f"offload.aio.queue_depth={queue_depth} x offload.aio.intra_op_parallelism="
                              f"{intra_op_parallelism}: cannot start {count} IO threads ({e}); lower them "
                              "(DeepSpeed's defaults are 8 x 1)") from None

    def _submit(self, op: str, file: SwapFile, offset: int, t: torch.Tensor, what: str) -> IOHandle:
        """Start reading into ``t`` or writing it (unchanged until done) at ``offset`` of ``file``."""
        if self._threads is None:
            raise ValueError("AsyncIO is closed")
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"{op} of {what!r}: needs a contiguous host tensor, got {t.device} "
                             f"{'contiguous' if t.is_contiguous() else 'strided'}")
        nbytes = t.numel() * t.element_size()
        if offset < 0 or offset + nbytes > file.size:
            raise ValueError(f"{op} of {what!r}: bytes [{offset}, {offset + nbytes}) are outside "
                             f"{file.path} ({file.size} bytes)")
        address = t.data_ptr()
        bounds = self._bounds(offset, nbytes)
        handle = IOHandle(op, file, what, t, len(bounds), self)
        if self._broken is not None:
            handle._piece_done(self._broken, abandon=True)
            return handle
        for lo, hi in bounds:
            self._work.put((handle, lo, address + (lo - offset), hi - lo))
        return handle

    def fence(self) -> None:
        """Every piece queued before now is done, a request's whose handle nobody holds too (its submit or its
        owner's bookkeeping cut by Ctrl-C): each thread takes one ``_Fence`` once done with what it took before."""
        threads = self._threads
        if not threads or self._broken is not None:
            return
        fence = _Fence(len(threads))
        try:
            for _ in threads:
                self._work.put(fence)
            while not fence.arrived.wait(POLL_S):
                if not self._alive() or self._broken is not None:   # (a dead thread failed what was queued)
                    return
        finally:
            fence.go.set()

    pread = functools.partialmethod(_submit, "read")     # (file, offset, dst, what)
    pwrite = functools.partialmethod(_submit, "write")   # (file, offset, src, what)

    def _bounds(self, offset: int, nbytes: int) -> list[tuple[int, int]]:
        """[offset, offset + nbytes) cut at the file's block boundaries (always alike: checksums are per piece)."""
        edges = [offset, *range((offset // self.block_size + 1) * self.block_size, offset + nbytes, self.block_size)]
        return list(zip(edges, [*edges[1:], offset + nbytes])) if nbytes else []

    def rehash(self, file: SwapFile, offset: int, data: torch.Tensor) -> None:
        """``data`` (uint8) was written at ``offset`` through a memory map: its checksums recorded."""
        base = data.data_ptr()
        for lo, hi in self._bounds(offset, data.numel()):
            value = None if self._hash is None else self._hash(_memory(base + lo - offset, hi - lo), hi - lo)
            file.record(self._kind, lo, hi - lo, value)

    def close(self) -> None:
        """Finish the queued requests, then stop the threads."""
        if self._threads is None:
            return
        self._stop()   # (once)
        for t in self._threads:
            t.join()
        self._threads = None

    def __enter__(self) -> "AsyncIO":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _alive(self) -> bool:   # a thread is left to finish the queued requests
        threads = self._threads
        return threads is not None and any(t.is_alive() for t in threads)

    def _run(self, job: tuple, bounce_addr: int) -> None:
        """One piece of a request (its locals go with this frame: a thread waiting for work holds no request)."""
        handle, offset, address, nbytes = job
        error = self._broken
        if error is None and handle._error is None:   # a failed request skips its remaining pieces
            try:
                self._piece(handle, offset, address, nbytes, bounce_addr)
            except SwapIOError as e:
                error = e
            except OSError as e:
                error = self._error(handle, offset, nbytes, os_reason(e), e.errno)
            except Exception as e:  # noqa: BLE001 - reported through the handle, never lost in a thread
                error = self._error(handle, offset, nbytes, f"{type(e).__name__}: {e}", None)
        handle._piece_done(error)

    def _die(self, cause: BaseException, job) -> None:
        """A thread stopped on ``cause``: its request and every queued and later one fail with one error."""
        if self._broken is None:
            self._broken = SwapIOError(f"the swap IO thread {threading.current_thread().name} stopped "
                                       f"({type(cause).__name__}: {cause}); the swap IO in flight failed",
                                       path="", offset=-1, what="")
        queued = []
        with contextlib.suppress(queue.Empty):
            while True:
                queued.append(self._work.get_nowait())
        for failed in (job, *queued):
            if isinstance(failed, _Fence):
                failed.go.set()
            elif failed is not None:
                failed[0]._piece_done(self._broken)
        for _ in range(queued.count(None)):   # the other threads' stop signals stay queued for them
            self._work.put(None)

    def _piece(self, handle: IOHandle, offset: int, address: int, nbytes: int, bounce_addr: int) -> None:
        file, write = handle.file, handle.op == "write"
        memory = _memory(address, nbytes)
        # before the write: ``memory`` must not change meanwhile
        value = self._hash(memory, nbytes) if write and self._hash is not None else None
        fd, refused = file.descriptor(self.direct)
        direct = self.direct and refused is None
        try:
            self._move(handle, fd, direct, offset, address, nbytes, bounce_addr)
        except OSError as e:
            if not (direct and e.errno == errno.EINVAL):
                raise
            self._move(handle, file.refuse_direct(e), False, offset, address, nbytes, bounce_addr)
        if write:
            file.record(self._kind, offset, nbytes, value)
        elif self._hash is not None:
            want = file.expected(self._kind, offset, nbytes)
            if want is not None and self._hash(memory, nbytes) != want:
                raise self._error(handle, offset, nbytes, "checksum mismatch (the swap file was changed "
                                  "or the disk returned bad data)", None)

    def _move(self, handle: IOHandle, fd: int, direct: bool, offset: int, address: int, nbytes: int,
              bounce_addr: int) -> None:
        """One piece's IO: O_DIRECT IO of an unaligned range goes through the aligned bounce buffer."""
        if not (direct and (offset % ALIGN or nbytes % ALIGN or address % ALIGN)):
            # buffered IO takes any offset, length and address
            return self._io(handle, fd, offset, address, nbytes)
        lo = offset // ALIGN * ALIGN
        hi = -(-(offset + nbytes) // ALIGN) * ALIGN
        if handle.op == "read":
            self._io(handle, fd, lo, bounce_addr, hi - lo, report=(offset, nbytes))
            ctypes.memmove(address, bounce_addr + offset - lo, nbytes)
            return
        # write: keep the bytes of the first and last 4 KiB blocks that are not ours (extents are padded
        # to 4 KiB: only writes inside one extent could race here, and the store never issues them)
        if offset > lo:
            self._io(handle, fd, lo, bounce_addr, ALIGN, report=(offset, nbytes), op="read")
        if offset + nbytes < hi and (hi - ALIGN > lo or offset == lo):
            self._io(handle, fd, hi - ALIGN, bounce_addr + hi - ALIGN - lo, ALIGN, report=(offset, nbytes), op="read")
        ctypes.memmove(bounce_addr + offset - lo, address, nbytes)
        self._io(handle, fd, lo, bounce_addr, hi - lo, report=(offset, nbytes))

    def _io(self, handle: IOHandle, fd: int, offset: int, address: int, nbytes: int, *, report=None,
            op: str | None = None) -> None:
        """One system call; anything but the full byte count fails the request."""
        sys, memory = handle.file.syscalls, _memory(address, nbytes)
        read = (op or handle.op) == "read"
        got = sys.preadv(fd, [memory], offset) if read else sys.pwritev(fd, [memory], offset)
        if got != nbytes:
            at, n = report or (offset, nbytes)
            raise self._error(handle, at, n, f"short {'read' if read else 'write'}: {got} of {nbytes} bytes "
                              f"at file offset {offset}", None)

    @staticmethod
    def _error(handle: IOHandle, offset: int, nbytes: int, reason: str, code: int | None) -> SwapIOError:
        name = handle.file.name_at(offset)
        inside = f" (extent {name!r})" if name and name != handle.what else ""
        return SwapIOError(f"swap {handle.op} of {handle.what!r} failed at offset {offset} "
                           f"({nbytes} bytes) of {handle.file.path}{inside}: {reason}",
                           path=str(handle.file.path), offset=offset, what=handle.what, errno=code)


def _worker(engine: weakref.ref, work: queue.SimpleQueue, bounce: mmap.mmap) -> None:
    """An IO thread: holds its engine only while doing a piece (a queued piece's handle keeps it alive)."""
    view = (ctypes.c_char * len(bounce)).from_buffer(bounce)
    bounce_addr = ctypes.addressof(view)
    job = None
    try:
        while (job := work.get()) is not None:
            if isinstance(job, _Fence):
                job.reach()
            else:
                engine()._run(job, bounce_addr)
            job = None
    except BaseException as e:  # noqa: BLE001 - this thread is lost: fail what is queued, never hang a wait
        if (alive := engine()) is not None:
            alive._die(e, job)
    finally:
        del view
        bounce.close()


class _Fence:
    """``AsyncIO.fence``'s marker: each of ``n`` threads reaches it after its earlier pieces, then waits for ``go``."""

    def __init__(self, n: int):
        self.left, self.lock, self.arrived, self.go = n, threading.Lock(), threading.Event(), threading.Event()

    def reach(self) -> None:
        with self.lock:
            self.left -= 1
            if not self.left:
                self.arrived.set()
        self.go.wait()


def _stop(work: queue.SimpleQueue, threads: list) -> None:
    for _ in threads:
        work.put(None)


def verify_extent(fmap, name: str, what: str = "") -> None:
    """Extent ``name`` of ``fmap`` against the engine's checksums before a checkpoint takes it: a mismatch,
    or a byte without one, is a SwapIOError naming the file, offset and tensor."""
    file = fmap.file
    extent = file.extents[name]
    lo, hi = extent.offset, extent.offset + padded(extent.nbytes)
    if hi == lo:
        return
    pieces = file.checksums(name)
    if not pieces and not any(file.checksums(n) for n in file.extents):
        return   # an engine built with checksum="none" records none anywhere: nothing to verify against
    data = fmap.padded(name)
    memory = memoryview(data.numpy())
    label = what or f"extent {name!r}"
    pos = lo
    for offset, nbytes, value, kind in pieces:
        if offset != pos:
            break
        if CHECKSUMS[kind](memory[offset - lo:offset - lo + nbytes], nbytes) != value:   # (recorded by an engine: a known kind)
            raise _mismatch(file, offset, nbytes, label, "checksum mismatch",
                            "the swap file was changed or the disk returned bad data")
        pos = offset + nbytes
    if pos != hi:
        raise _mismatch(file, pos, hi - pos, label, "no checksum recorded",
                        "these bytes were not written by the IO engine and cannot be verified")
    fmap.release(data)   # checked: its pages leave this process (the pass stays bounded)


def verify_map(fmap, what: str = "") -> None:
    for name in fmap.file.extents if fmap is not None else ():
        verify_extent(fmap, name, f"extent {name!r}{f' ({what})' if what else ''}")


def _mismatch(file, offset: int, nbytes: int, what: str, reason: str, why: str) -> SwapIOError:
    return SwapIOError(f"swap file {file.path}: {reason} at offset {offset} ({nbytes} bytes, {what}): {why}",
                       path=str(file.path), offset=offset, what=what, errno=None)
