"""Swap files of the NVMe offload: one preallocated file per rank and kind, with a manifest beside it.

    extents = {"master.0": 4 * n0, "exp_avg.0": 4 * n0, ...}          # name -> bytes
    with SwapFile.create(swap_path(folder, rank, "optim"), extents, layout_hash=h,
                         world_size=w, rank=rank, dtype=torch.float32) as f:
        offset, nbytes = f.extent("master.0")                           # 4 KiB aligned offset
        ...                                                             # AsyncIO reads / writes
    # leaving the block (or f.remove()) deletes the file and its manifest, also on error

Layout on disk: the extents one after another in the given order, each starting on a 4 KiB
boundary (so O_DIRECT can move whole blocks; the tail of an extent is padding), the whole size
reserved up front with ``posix_fallocate`` so a full disk fails at creation, not mid-run. The file
is owner-only (0600) and locked (``flock``) while open, so a second run on the same folder is
refused instead of corrupting it.

The manifest (``<file>.manifest.json``) records what the bytes mean: layout hash, world size,
rank, dtype and per extent its offset, bytes and element count (``write_manifest`` adds the
checksums recorded so far). An existing file whose manifest describes another layout (or that has
none) is refused with one line naming it; one with the same layout is taken over (its contents are
not trusted: checksums start empty).

Checksums: the IO engine records a checksum for every piece it writes (pieces never straddle a
``block_size`` boundary of the file) and verifies the same pieces when they are read back; the
table lives here, with the file it describes, per engine kind (block size, checksum name): a
piece is verified when it is read back by an engine of the kind that wrote it.
"""
from __future__ import annotations

import errno
import fcntl
import json
import math
import mmap
import os
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import torch

from framework.core.errors import ConfigError, SwapIOError
from framework.core.files import make_dirs, refuse_links, write_atomic
from framework.core.units import GiB, MiB

ALIGN = 4096          # O_DIRECT unit: file offsets, lengths and buffer addresses are multiples of it
FORMAT = 1


def padded(nbytes: int) -> int:
    """``nbytes`` rounded up to a whole number of 4 KiB blocks."""
    return -(-nbytes // ALIGN) * ALIGN


def reserved_bytes(extents: Mapping[str, int]) -> int:
    """Bytes a swap file of ``extents`` (name -> bytes) reserves on disk: each padded to 4 KiB
    (what ``preflight`` should be given as ``total_bytes``)."""
    return sum(padded(int(n)) for n in extents.values())


def swap_path(folder: str | os.PathLike, rank: int, kind: str) -> Path:
    """Where rank ``rank`` keeps its swap file of ``kind`` (e.g. "optim", "params")."""
    return Path(folder) / f"rank{rank:05d}.{kind}.swap"


class Syscalls:
    """The system calls the engine makes on swap files.

    A seam for tests: a subclass that fails on purpose (EIO, ENOSPC, short counts, EINVAL for
    O_DIRECT) exercises every error path without a broken disk and without patching anything."""

    def open(self, path: str, flags: int, mode: int = 0o600) -> int:
        return os.open(path, flags, mode)

    def preadv(self, fd: int, buffers: list, offset: int) -> int:
        return os.preadv(fd, buffers, offset)

    def pwritev(self, fd: int, buffers: list, offset: int) -> int:
        return os.pwritev(fd, buffers, offset)

    def fallocate(self, fd: int, offset: int, length: int) -> None:
        os.posix_fallocate(fd, offset, length)


@dataclass(frozen=True)
class Extent:
    offset: int    # 4 KiB aligned
    nbytes: int    # bytes of the tensor (the padding up to the next 4 KiB is not part of it)
    numel: int


class SwapFile:
    """One preallocated swap file (see the module docstring). Build it with ``SwapFile.create``."""

    def __init__(self, path: Path, extents: dict[str, Extent], size: int, meta: dict, fd: int,
                 syscalls: Syscalls):
        self.path, self.size, self.meta, self.syscalls = path, size, meta, syscalls
        self._extents = extents
        self._fd: int | None = fd           # buffered descriptor (creation, fallback IO)
        self._direct_fd: int | None = None  # O_DIRECT descriptor, opened on first use
        self._direct_refused: OSError | None = None
        self._lock = threading.Lock()
        # (block size, checksum name) -> block -> [(offset, nbytes, checksum)] of the pieces written
        self._sums: dict[tuple[int, str], dict[int, list[tuple[int, int, int]]]] = {}

    # --- creation --------------------------------------------------------------------------------

    @classmethod
    def create(cls, path: str | os.PathLike, extents: Mapping[str, int], *, layout_hash: str,
               world_size: int, rank: int, dtype: torch.dtype,
               syscalls: Syscalls | None = None) -> "SwapFile":
        """Create (or take over, if its manifest matches) the swap file at ``path`` holding ``extents``
        (name -> bytes, in order), preallocated. Raises ConfigError for a file of another layout or
        in use, SwapIOError when the space cannot be reserved."""
        syscalls = syscalls or Syscalls()
        path = Path(path)
        itemsize = torch.empty((), dtype=dtype).element_size()
        table, offset = {}, 0
        for name, nbytes in extents.items():
            if nbytes < 0 or nbytes % itemsize:
                raise ValueError(f"extent {name!r}: {nbytes} bytes is not a whole number of {dtype} elements")
            table[name] = Extent(offset, int(nbytes), int(nbytes) // itemsize)
            offset += padded(int(nbytes))
        size = offset   # == reserved_bytes(extents)
        meta = {"format": FORMAT, "layout_hash": str(layout_hash), "world_size": int(world_size),
                "rank": int(rank), "dtype": str(dtype).removeprefix("torch."), "size": size,
                "extents": {n: {"offset": e.offset, "nbytes": e.nbytes, "numel": e.numel}
                            for n, e in table.items()}}
        manifest = _manifest_path(path)
        refuse_links(path, manifest, manifest.with_name(manifest.name + ".tmp"))   # planted links: one line each
        flags = os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW
        made = not os.path.lexists(path)
        if made:
            fd = syscalls.open(str(path), flags | os.O_CREAT | os.O_EXCL, 0o600)
        else:
            _check_same_layout(path, manifest, meta)
            fd = syscalls.open(str(path), flags)
        try:
            os.fchmod(fd, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise ConfigError(f"swap file {path} is in use by another process; give each run its "
                                  "own offload.nvme_path") from None
            try:
                if size:
                    syscalls.fallocate(fd, 0, size)
            except OSError as e:
                raise SwapIOError(f"cannot reserve {size} bytes for swap file {path} (offset 0, "
                                  f"all extents): {os.strerror(e.errno) if e.errno else e}; free space "
                                  "or point offload.nvme_path at a larger disk",
                                  path=str(path), offset=0, what="all extents", errno=e.errno) from e
            f = cls(path, table, size, meta, fd, syscalls)
        except BaseException:
            os.close(fd)
            if made:   # never delete what another run (or a crashed one) left
                _unlink(path)
            raise
        try:
            f.write_manifest()
        except BaseException:
            f.remove()
            raise
        return f

    # --- layout ------------------------------------------------------------------------------------

    @property
    def extents(self) -> Mapping[str, Extent]:
        return dict(self._extents)

    def extent(self, name: str) -> tuple[int, int]:
        """(offset, bytes) of extent ``name``."""
        e = self._extents[name]
        return e.offset, e.nbytes

    def name_at(self, offset: int) -> str | None:
        """The extent holding byte ``offset`` (None: padding or past the end)."""
        for name, e in self._extents.items():
            if e.offset <= offset < e.offset + e.nbytes:
                return name
        return None

    # --- descriptors (the IO engine's) --------------------------------------------------------------

    def descriptor(self, direct: bool) -> tuple[int, OSError | None]:
        """(fd, refusal): the O_DIRECT descriptor when ``direct`` and the file system accepts it;
        otherwise the buffered one, with the error that refused O_DIRECT (None if not asked for)."""
        with self._lock:
            if self._fd is None:
                raise ValueError(f"swap file {self.path} was removed")
            if not direct:
                return self._fd, None
            if self._direct_fd is None and self._direct_refused is None:
                try:
                    self._direct_fd = self.syscalls.open(str(self.path),
                                                         os.O_RDWR | os.O_CLOEXEC | os.O_DIRECT | os.O_NOFOLLOW)
                except OSError as e:
                    if e.errno != errno.EINVAL:
                        raise
                    self._direct_refused = e
            if self._direct_fd is not None:
                return self._direct_fd, None
            return self._fd, self._direct_refused

    def refuse_direct(self, error: OSError) -> None:
        """O_DIRECT IO failed with EINVAL (overlay file systems accept the open, not the IO)."""
        with self._lock:
            if self._direct_fd is not None:
                os.close(self._direct_fd)
                self._direct_fd = None
            self._direct_refused = error

    # --- checksums ---------------------------------------------------------------------------------

    def record(self, kind: tuple[int, str], offset: int, nbytes: int, value: int) -> None:
        """The piece [offset, offset + nbytes) now holds bytes with checksum ``value``; ``kind`` is the
        writing engine's (block size, checksum name); its pieces never straddle one of its blocks."""
        with self._lock:
            self._forget(offset, nbytes)
            self._sums.setdefault(kind, {}).setdefault(offset // kind[0], []).append((offset, nbytes, value))

    def forget(self, offset: int, nbytes: int) -> None:
        """Bytes [offset, offset + nbytes) were written without a checksum: drop the stale ones."""
        with self._lock:
            self._forget(offset, nbytes)

    def _forget(self, offset: int, nbytes: int) -> None:
        for (grid, _), table in self._sums.items():   # what overlaps is stale, whoever wrote it
            for block in range(offset // grid, (offset + max(nbytes, 1) - 1) // grid + 1):
                if block in table:
                    table[block] = [p for p in table[block] if p[0] + p[1] <= offset or offset + nbytes <= p[0]]

    def expected(self, kind: tuple[int, str], offset: int, nbytes: int) -> int | None:
        """The checksum of ``kind`` recorded for exactly this piece (None: not written as one piece)."""
        with self._lock:
            for o, n, value in self._sums.get(kind, {}).get(offset // kind[0], ()):
                if o == offset and n == nbytes:
                    return value
            return None

    def checksums(self, name: str) -> list[tuple[int, int, int, str]]:
        """The (offset, bytes, checksum, checksum name) pieces recorded inside extent ``name``, in file order."""
        e = self._extents[name]
        with self._lock:
            found = [(*p, kind[1]) for kind, table in self._sums.items() for pieces in table.values()
                     for p in pieces if e.offset <= p[0] < e.offset + max(e.nbytes, 1)]
        return sorted(found)

    # --- mapping ---------------------------------------------------------------------------------

    def map(self, write: bool) -> "FileMap":
        """The whole file mapped into memory (see ``FileMap``): ``write`` maps it shared, so stores into
        its tensors change the file; otherwise privately (reads only: nothing reaches the file)."""
        with self._lock:
            if self._fd is None:
                raise ValueError(f"swap file {self.path} was removed")
            return FileMap(self, self._fd, write)

    # --- manifest and removal ------------------------------------------------------------------------

    def write_manifest(self) -> None:
        """Write the manifest (layout, and the checksums recorded so far) atomically, owner-only."""
        meta = json.loads(json.dumps(self.meta))
        for name in self._extents:
            meta["extents"][name]["checksums"] = [list(p) for p in self.checksums(name)]
        write_atomic(_manifest_path(self.path), json.dumps(meta, indent=1).encode())   # no-follow, O_EXCL

    def remove(self) -> None:
        """Close the file and delete it and its manifest (idempotent)."""
        with self._lock:
            for fd in (self._direct_fd, self._fd):
                if fd is not None:
                    os.close(fd)
            self._fd = self._direct_fd = None
        _unlink(self.path)
        _unlink(_manifest_path(self.path))

    def __enter__(self) -> "SwapFile":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def __repr__(self) -> str:
        return f"SwapFile({str(self.path)!r}, {len(self._extents)} extents, {self.size} bytes)"


class FileMap:
    """A swap file mapped into this process (``SwapFile.map``): its extents as host tensors that view
    the file's pages, so a checkpoint reads (or a load writes) the swapped state where it lies, with
    no host copy of it. The pages are the kernel's page cache (file-backed, reclaimable), not
    anonymous memory. Tensors made here keep the mapping alive; it is unmapped when the last goes.

    Coherence with the IO engine: O_DIRECT writes invalidate the cached pages they cover and
    O_DIRECT reads first write back dirty cached pages of their range, so map only after the
    engine's writes to the file have landed (``DiskStore.flush``) and, after writing through the
    map, ``sync()`` before the engine reads again."""

    def __init__(self, file: SwapFile, fd: int, write: bool):
        self.file, self.write = file, write
        # ACCESS_COPY (MAP_PRIVATE): writable tensors that never write the file; only read here.
        try:
            self._mm = mmap.mmap(fd, file.size, access=mmap.ACCESS_WRITE if write else mmap.ACCESS_COPY)
        except OSError as e:   # a file system without mmap support, or no address space left
            raise SwapIOError(f"swap file {file.path}: cannot map it into memory to save or load a checkpoint "
                              f"({os.strerror(e.errno) if e.errno else e}); put offload.nvme_path on a local "
                              "file system (ext4, xfs)", path=str(file.path), offset=0, what="the whole file",
                              errno=e.errno) from e
        self._mm.madvise(mmap.MADV_SEQUENTIAL)   # read in order: aggressive read-ahead, pages dropped behind
        self._bytes = torch.frombuffer(self._mm, dtype=torch.uint8)
        self._start = self._bytes.data_ptr()

    def extent(self, name: str, dtype: torch.dtype, shape) -> torch.Tensor:
        """The first bytes of extent ``name`` as a tensor of ``dtype`` and ``shape`` (a view of the
        mapping)."""
        e = self.file._extents[name]
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if nbytes > e.nbytes:
            raise ValueError(f"extent {name!r} of {self.file.path} holds {e.nbytes} bytes, not {nbytes}")
        return self._bytes[e.offset:e.offset + nbytes].view(dtype).view(shape)

    def prefetch(self, name: str) -> None:
        """Start reading extent ``name`` into the page cache (asynchronously), so that touching it
        later does not fault page by page."""
        e = self.file._extents[name]
        if e.nbytes:
            self._mm.madvise(mmap.MADV_WILLNEED, e.offset, padded(e.nbytes))

    def padded(self, name: str) -> torch.Tensor:
        """Extent ``name`` with its padding up to the next 4 KiB, as bytes: what the engine writes
        and checksums."""
        e = self.file._extents[name]
        return self._bytes[e.offset:e.offset + padded(e.nbytes)]

    def contains(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s first element lies in this mapping."""
        offset = t.data_ptr() - self._start
        return t.device.type == "cpu" and 0 <= offset < self.file.size

    def own(self, t: torch.Tensor) -> torch.Tensor | None:
        """A tensor over the same bytes as ``t`` whose storage is exactly those bytes (a writer that
        clones views of larger storages then writes it as it is), or None when ``t`` is not a
        contiguous view of this mapping."""
        offset = t.data_ptr() - self._start
        nbytes = t.numel() * t.element_size()
        if not t.is_contiguous() or t.device.type != "cpu" or offset < 0 or offset + nbytes > self.file.size:
            return None
        if not nbytes:
            return t.new_empty(t.shape)
        return torch.frombuffer(self._mm, dtype=t.dtype, count=t.numel(), offset=offset).view(t.shape)

    def release(self, t: torch.Tensor | None = None, *, name: str | None = None) -> None:
        """Drop this process's mapping of the pages under ``t`` (a tensor of this map), of extent
        ``name``, or of the whole file when neither is given, so that a pass over the swapped state
        keeps a bounded resident set: the pages stay in the file (a shared map's written pages in
        the page cache, still to be synced) and the next touch maps them again. Safe on any range:
        a read-only map never writes its pages (no private copies to lose)."""
        if name is not None:
            e = self.file._extents[name]
            lo, hi = e.offset, e.offset + padded(e.nbytes)
        elif t is not None:
            if not self.contains(t) or not t.numel():
                return
            lo = t.data_ptr() - self._start
            hi = min(lo + t.numel() * t.element_size(), self.file.size)
        else:
            lo, hi = 0, self.file.size
        page = mmap.PAGESIZE
        lo, hi = lo // page * page, min(-(-hi // page) * page, self.file.size)
        if hi > lo:
            self._mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)

    def sync(self) -> None:
        """Write the changed pages to the file (msync): the engine's O_DIRECT IO sees them."""
        if self.write:
            self._mm.flush()


def remove_stale(folder: str | os.PathLike) -> tuple[int, int]:
    """Remove the swap files (and manifests) in ``folder`` that no live process holds: each is
    ``flock``-ed by its owner for as long as it is open, so a lock granted here means its process
    is gone (kill -9, OOM). Returns (files removed, bytes freed on disk). A live process's file is
    never touched; links are never followed."""
    count = freed = 0
    try:
        names = sorted(os.listdir(folder))
    except (FileNotFoundError, NotADirectoryError):
        return 0, 0
    for name in names:
        if not (name.startswith("rank") and name.endswith(".swap")):
            continue
        path = Path(folder) / name
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:   # a link, gone meanwhile, not ours to open
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue   # held: its process is alive
            st = os.fstat(fd)
            _unlink(path)
            manifest = _manifest_path(path)
            if manifest.exists() and not manifest.is_symlink():
                freed += manifest.stat().st_blocks * 512
            _unlink(manifest)
            count += 1
            freed += st.st_blocks * 512
        finally:
            os.close(fd)
    return count, freed


def _manifest_path(path: Path) -> Path:
    return path.with_name(path.name + ".manifest.json")


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _check_same_layout(path: Path, manifest: Path, meta: dict) -> None:
    fix = f"delete {path} (and its manifest) or point offload.nvme_path elsewhere"
    try:
        old = json.loads(manifest.read_text())
    except FileNotFoundError:
        raise ConfigError(f"swap file {path} exists without a manifest; refusing to reuse it: {fix}") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"swap file {path}: unreadable manifest ({e}); refusing to reuse it: {fix}") from None
    for key in ("format", "layout_hash", "world_size", "rank", "dtype", "size"):
        if old.get(key) != meta[key]:
            raise ConfigError(f"swap file {path} belongs to another layout ({key} {old.get(key)!r}, "
                              f"this run {meta[key]!r}); refusing to reuse it: {fix}")
    strip = {n: {k: v for k, v in e.items() if k != "checksums"} for n, e in old.get("extents", {}).items()}
    if strip != meta["extents"]:
        raise ConfigError(f"swap file {path} belongs to another layout (its extents differ); "
                          f"refusing to reuse it: {fix}")


# --- pre-flight ---------------------------------------------------------------------------------

def preflight(path: str | os.PathLike, total_bytes: int, largest_tile_bytes: int, buffer_bytes: int,
              buffer_count: int, *, min_buffer_count: int = 1, itemsize: int = 1,
              size_key: str = "offload.buffer_size", count_key: str = "offload.buffer_count",
              create: bool = False) -> None:
    """Check before the first step that swapping can work; raise one-line ConfigErrors otherwise.

    ``path`` must exist (``create``: make it, for a default folder in the run directory) and be
    writable; its file system must have room for ``total_bytes`` (``reserved_bytes(extents)``
    summed over the swap files: what fallocate will reserve); buffers of ``buffer_bytes`` must hold
    the largest tile and there must be ``min_buffer_count`` of them. ``itemsize`` converts bytes
    to the elements the config keys ``size_key`` / ``count_key`` count, for the message."""
    path = Path(path)
    where = f"offload.nvme_path={path}"
    if not path.exists():
        if not create:
            raise ConfigError(f"{where} does not exist; create it or set offload.nvme_path to a folder on a fast disk")
        try:   # exist_ok: the ranks of one host share the folder and may make it at the same moment
            make_dirs(path)   # 0700, parents too
        except OSError as e:
            raise ConfigError(f"{where}: cannot create it ({e.strerror}); set offload.nvme_path to a "
                              "writable folder") from None
    if not path.is_dir():
        raise ConfigError(f"{where} is not a folder; set offload.nvme_path to a folder")
    try:
        fd, probe = tempfile.mkstemp(prefix=".preflight-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ConfigError(f"{where} is not writable ({e.strerror}); fix its permissions or set "
                          "offload.nvme_path to a writable folder") from None
    st = os.statvfs(path)
    free = st.f_bavail * st.f_frsize
    if free < total_bytes:
        raise ConfigError(f"{where}: the swap files need {_size(total_bytes)} but its file system has "
                          f"{_size(free)} free; free space or point offload.nvme_path at a larger disk")
    problems = []
    if buffer_bytes < largest_tile_bytes:
        need = -(-largest_tile_bytes // itemsize)
        problems.append(f"{size_key}={buffer_bytes // itemsize} is smaller than the largest tile "
                        f"({need} elements): set {size_key} >= {need}")
    if buffer_count < min_buffer_count:
        problems.append(f"{count_key}={buffer_count} is too few: set {count_key} >= {min_buffer_count}")
    if problems:
        raise ConfigError("offload buffers too small: " + "; ".join(problems))


def _size(nbytes: int) -> str:
    unit, scale = ("GiB", GiB) if nbytes >= GiB else ("MiB", MiB)
    return f"{nbytes / scale:.2f} {unit} ({nbytes} bytes)"
