"""Swap files of the NVMe offload: one preallocated file per rank and kind (``swap_path``), with a
manifest beside it, deleted at ``remove`` (or leaving ``with SwapFile.create(...)``), else by a
finalizer when collected or at exit.

Extents (name -> bytes) lie one after another, each padded to 4 KiB (O_DIRECT moves whole blocks);
``posix_fallocate`` reserves the size, so a full disk fails at creation, not mid-run. The file is
owner-only and ``flock``-ed while open (a second run on the same folder is refused). A file of
another layout (the manifest says) is refused, one of the same layout taken over (its contents
untrusted: the IO engine's checksums, kept in memory, start empty).
"""
from __future__ import annotations

import errno
import fcntl
import json
import math
import mmap
import os
import threading
import warnings
import weakref
from contextlib import suppress
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Mapping

import torch

from framework.core.errors import ConfigError, SwapIOError
from framework.core.files import DIRECT_ALIGN, refuse_links, temp_name, write_atomic
from framework.core.room import DISK_FULL
from framework.core.utils import dtype_name

ALIGN = DIRECT_ALIGN
FORMAT = 2            # of the manifest: a file of another format is refused (``_check_same_layout``)


def padded(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def os_reason(e: OSError) -> str:
    """An OS error's reason for a one-line message: the errno's text, else what it says."""
    return os.strerror(e.errno) if e.errno else str(e)


_NOT_WRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS)   # a folder this process may not write


def nvme_fix(e: OSError) -> str:
    """The fix for an OS error writing under offload.nvme_path, by its reason, for a one-line message."""
    if e.errno == errno.EFBIG:   # a per-file limit: more room would not help
        return ("a file size limit stops it: raise it (ulimit -f) or point offload.nvme_path at a file system that "
                "takes larger files")
    if e.errno in DISK_FULL:
        return "free space or point offload.nvme_path at a larger disk"
    if e.errno in _NOT_WRITABLE:
        return "fix its permissions or set offload.nvme_path to a writable folder"
    return "check the disk, or set offload.nvme_path to a folder on another one"


def reserved_bytes(extents: Mapping[str, int]) -> int:
    return sum(padded(int(n)) for n in extents.values())


def swap_path(folder: str | os.PathLike, rank: int, kind: str) -> Path:
    return Path(folder) / f"rank{rank:05d}.{kind}.swap"


class DirectIOFallback(RuntimeWarning):
    """O_DIRECT was refused by the file system; buffered IO is used instead."""


class Syscalls:
    """The engine's system calls on swap files: a seam where tests inject faults (EIO, ENOSPC, short counts, EINVAL)."""

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


class _Held:
    """A swap file's descriptors and what its paths named: apart, so that its finalizer may let them go."""

    def __init__(self, path: Path, fd: int):
        self.path = path
        self.fd: int | None = fd           # buffered descriptor (creation, fallback IO)
        self.direct: int | None = None     # O_DIRECT descriptor, opened on first use
        self.file = os.fstat(fd)           # the swap file this run made or took over
        self.manifest: os.stat_result | None = None   # of the manifest this run wrote
        # Held open while this run lives, as the file's are: an inode stays allocated while open, so another file
        # at the path (the manifest deleted under this run, another run's written there) never has its number.
        self.manifest_fd: int | None = None

    def hold_manifest(self, manifest: Path) -> None:
        fd = os.open(manifest, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        old, self.manifest_fd, self.manifest = self.manifest_fd, fd, os.fstat(fd)
        if old is not None:
            os.close(old)

    def release(self) -> None:
        """Delete the file and its manifest if their paths still name this run's (deleted under a live run, a
        path may name another run's file by now), then close the descriptors (first: a file of this run's
        that is still open keeps its inode number from any other file)."""
        _unlink_if(self.path, self.file)
        _unlink_if(_manifest_path(self.path), self.manifest)
        fds, self.fd, self.direct, self.manifest_fd = (self.direct, self.fd, self.manifest_fd), None, None, None
        for fd in fds:
            if fd is not None:
                with suppress(OSError):
                    os.close(fd)


class SwapFile:
    """One preallocated swap file (module docstring); made by ``SwapFile.create``."""

    def __init__(self, path: Path, extents: dict[str, Extent], size: int, meta: dict, fd: int,
                 syscalls: Syscalls):
        self.path, self.size, self.meta, self.syscalls, self.extents = path, size, meta, syscalls, extents
        self._held = _Held(path, fd)
        # Runs once: at ``remove``, when collected unremoved or at interpreter exit.
        self.removal = weakref.finalize(self, self._held.release)
        self._direct_refused: OSError | None = None
        self._lock = threading.Lock()
        # (block size, checksum name) -> block -> [(offset, nbytes, checksum)] of the pieces written
        self._sums: dict[tuple[int, str], dict[int, list[tuple[int, int, int]]]] = {}

    @classmethod
    def create(cls, path: str | os.PathLike, extents: Mapping[str, int], *, layout_hash: str,
               world_size: int, rank: int, dtype: torch.dtype,
               syscalls: Syscalls | None = None) -> "SwapFile":
        """Create (or take over, if its manifest matches) the swap file at ``path`` holding ``extents``
        (name -> bytes, in order). ConfigError: another layout, or in use; SwapIOError: no room."""
        syscalls = syscalls or Syscalls()
        path = Path(path)
        table, size = {}, 0
        for name, nbytes in extents.items():
            if nbytes < 0 or nbytes % dtype.itemsize:
                raise ValueError(f"extent {name!r}: {nbytes} bytes is not a whole number of {dtype} elements")
            table[name] = Extent(size, int(nbytes), int(nbytes) // dtype.itemsize)
            size += padded(int(nbytes))
        meta = {"format": FORMAT, "layout_hash": str(layout_hash), "world_size": int(world_size),
                "rank": int(rank), "dtype": dtype_name(dtype), "size": size,
                "extents": {n: asdict(e) for n, e in table.items()}}
        manifest = _manifest_path(path)
        refuse_links(path, manifest, manifest.with_name(temp_name(manifest.name)))   # planted links: one line each
        # Until this run holds the lock, another run's ``remove_stale`` may take the file for a dead
        # run's and unlink it: once locked, the path must still name the file, else it starts again.
        for _ in range(3):
            made = not os.path.lexists(path)
            if not made:   # a live run's file is in use, whatever its layout: never advise deleting it
                _refuse_if_held(path)
                _check_same_layout(path, manifest, meta)
            fd = syscalls.open(str(path), os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | (os.O_CREAT | os.O_EXCL if made else 0))
            try:
                os.fchmod(fd, 0o600)
                locked = _flock(fd)
                if _names(path, os.fstat(fd)):
                    if not locked:
                        raise _in_use(path)
                    try:
                        if size:
                            syscalls.fallocate(fd, 0, size)
                    except OSError as e:
                        raise SwapIOError(f"cannot reserve {size} bytes for swap file {path} (offset 0, all extents): "
                                          f"{os_reason(e)}; {nvme_fix(e)}",
                                          path=str(path), offset=0, what="all extents", errno=e.errno) from e
                    f = cls(path, table, size, meta, fd, syscalls)
                    break
            except BaseException:
                if made:   # never delete what another run (or a crashed one) left
                    _unlink_if(path, os.fstat(fd))
                os.close(fd)
                raise
            os.close(fd)   # removed meanwhile: what the path names now is looked at again
        else:
            raise ConfigError(f"swap file {path} keeps being removed by another process while it is created; "
                              "give each run its own offload.nvme_path")
        try:
            f.write_manifest()
        except BaseException:
            f.remove()
            raise
        return f

    def extent(self, name: str) -> tuple[int, int]:
        e = self.extents[name]
        return e.offset, e.nbytes

    def name_at(self, offset: int) -> str | None:
        """The extent holding byte ``offset`` (None: padding or past the end)."""
        return next((name for name, e in self.extents.items() if e.offset <= offset < e.offset + e.nbytes), None)

    def descriptor(self, direct: bool) -> tuple[int, OSError | None]:
        """(fd, refusal): O_DIRECT's when asked for and accepted, else the buffered one and why O_DIRECT was not."""
        with self._lock:
            self._open()
            if direct and self._held.direct is None and self._direct_refused is None:
                try:
                    self._held.direct = self.syscalls.open(str(self.path),
                                                         os.O_RDWR | os.O_CLOEXEC | os.O_DIRECT | os.O_NOFOLLOW)
                except OSError as e:
                    if e.errno != errno.EINVAL:
                        raise
                    self._refuse(e)
            if direct and self._held.direct is not None:
                return self._held.direct, None
            return self._held.fd, self._direct_refused if direct else None

    def refuse_direct(self, error: OSError) -> int:
        """O_DIRECT IO failed with EINVAL (overlay file systems accept the open, not the IO): buffered from now on."""
        with self._lock:
            if self._held.direct is not None:
                os.close(self._held.direct)
                self._held.direct = None
            fd = self._open()
            self._refuse(error)
            return fd

    def _open(self) -> int:
        if self._held.fd is None:
            raise ValueError(f"swap file {self.path} was removed")
        return self._held.fd

    def _refuse(self, error: OSError) -> None:
        first, self._direct_refused = self._direct_refused is None, error
        if first:   # said once per file; recorded first, so a warning raised as an error still sticks
            warnings.warn(f"{self.path.parent}: the file system refuses O_DIRECT ({os.strerror(error.errno)}); "
                          "swapping through the page cache (buffered IO) instead", DirectIOFallback, stacklevel=3)

    def record(self, kind: tuple[int, str] | None, offset: int, nbytes: int, value: int | None) -> None:
        """[offset, offset + nbytes) now holds bytes with checksum ``value`` (None: none), written by an
        engine of ``kind`` (block size, checksum name) as one piece within one of its blocks."""
        with self._lock:
            for (grid, _), table in self._sums.items():   # what overlaps is stale, whoever wrote it
                for block in range(offset // grid, (offset + max(nbytes, 1) - 1) // grid + 1):
                    if block in table:
                        table[block] = [p for p in table[block] if p[0] + p[1] <= offset or offset + nbytes <= p[0]]
            if value is not None:
                self._sums.setdefault(kind, {}).setdefault(offset // kind[0], []).append((offset, nbytes, value))

    def expected(self, kind: tuple[int, str], offset: int, nbytes: int) -> int | None:
        """The checksum of ``kind`` recorded for exactly this piece (None: not written as one piece)."""
        with self._lock:
            pieces = self._sums.get(kind, {}).get(offset // kind[0], ())
            return next((value for o, n, value in pieces if (o, n) == (offset, nbytes)), None)

    def checksums(self, name: str) -> list[tuple[int, int, int, str]]:
        """(offset, bytes, checksum, checksum name) recorded inside extent ``name``, in file order."""
        e = self.extents[name]
        with self._lock:
            found = [(*p, kind[1]) for kind, table in self._sums.items() for pieces in table.values()
                     for p in pieces if e.offset <= p[0] < e.offset + max(e.nbytes, 1)]
        return sorted(found)

    def map(self, write: bool) -> "FileMap":
        with self._lock:
            return FileMap(self, self._open(), write)

    def write_manifest(self) -> None:
        manifest = _manifest_path(self.path)
        write_atomic(manifest, json.dumps(self.meta, indent=1).encode())
        self._held.hold_manifest(manifest)

    def remove(self) -> None:
        """Close the file and delete it and its manifest (idempotent)."""
        with self._lock:
            self.removal()   # (once: later calls, and the finalizer, do nothing)

    def __enter__(self) -> "SwapFile":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


class FileMap:
    """A swap file mapped into this process: its extents as host tensors over the page cache, so a
    checkpoint reads (or a load writes) the swapped state where it lies. O_DIRECT bypasses the cached
    pages: map only once the engine's writes landed, and ``sync()`` before the engine reads again."""

    def __init__(self, file: SwapFile, fd: int, write: bool):
        self.file, self.write = file, write
        # A file shortened behind the engine's back (mmap refuses a length past the end, a page past it
        # would be SIGBUS on touch): the swapped state is lost.
        found = os.fstat(fd).st_size
        if found < file.size:
            raise SwapIOError(f"swap file {file.path}: short file: {found} of {file.size} bytes (truncated outside "
                              "this run?); its swapped state is lost: resume from the last checkpoint",
                              path=str(file.path), offset=found, what="the whole file")
        # ACCESS_COPY (MAP_PRIVATE): writable tensors that never write the file; only read here.
        try:
            self._mm = mmap.mmap(fd, file.size, access=mmap.ACCESS_WRITE if write else mmap.ACCESS_COPY)
        except ValueError as e:   # shortened between the check and the map
            raise SwapIOError(f"swap file {file.path}: cannot map {file.size} bytes ({e}; truncated outside this "
                              "run?); its swapped state is lost: resume from the last checkpoint",
                              path=str(file.path), offset=0, what="the whole file") from None
        except OSError as e:   # a file system without mmap support, or no address space left
            raise SwapIOError(f"swap file {file.path}: cannot map it into memory to save or load a checkpoint "
                              f"({os_reason(e)}); put offload.nvme_path on a local file system (ext4, xfs)",
                              path=str(file.path), offset=0, what="the whole file", errno=e.errno) from e
        self._mm.madvise(mmap.MADV_SEQUENTIAL)   # read in order: aggressive read-ahead, pages dropped behind
        self._bytes = torch.frombuffer(self._mm, dtype=torch.uint8)
        self._start = self._bytes.data_ptr()

    def extent(self, name: str, dtype: torch.dtype, shape) -> torch.Tensor:
        offset = self.file.extents[name].offset
        return self._bytes[offset:offset + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)

    def prefetch(self, name: str) -> None:
        """Start reading extent ``name`` into the page cache (touching it then does not fault page by page)."""
        e = self.file.extents[name]
        if e.nbytes:
            self._mm.madvise(mmap.MADV_WILLNEED, e.offset, padded(e.nbytes))

    def padded(self, name: str) -> torch.Tensor:
        """Extent ``name`` with its padding, as bytes: what the engine writes and checksums."""
        e = self.file.extents[name]
        return self._bytes[e.offset:e.offset + padded(e.nbytes)]

    def own(self, t: torch.Tensor) -> torch.Tensor | None:
        """A tensor over ``t``'s bytes whose storage is exactly those bytes (a writer that clones views of
        larger storages writes it as it is); None unless ``t`` is a contiguous view of this map."""
        offset = t.data_ptr() - self._start
        nbytes = t.numel() * t.element_size()
        if not t.is_contiguous() or t.device.type != "cpu" or offset < 0 or offset + nbytes > self.file.size:
            return None
        if not nbytes:
            return t.new_empty(t.shape)
        return torch.frombuffer(self._mm, dtype=t.dtype, count=t.numel(), offset=offset).view(t.shape)

    def release(self, t: torch.Tensor) -> None:
        """Drop this process's mapping of the pages under ``t`` (a pass keeps a bounded resident set)."""
        lo = t.data_ptr() - self._start
        if t.device.type != "cpu" or not t.numel() or not 0 <= lo < self.file.size:
            return   # not a view of this map
        page = mmap.PAGESIZE
        hi = min(-(-(lo + t.numel() * t.element_size()) // page) * page, self.file.size)
        lo = lo // page * page
        self._mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)

    def sync(self) -> None:
        """msync: the engine's O_DIRECT IO sees what was written through the map."""
        if self.write:
            self._mm.flush()


def remove_stale(folder: str | os.PathLike) -> tuple[int, int]:
    """Remove ``folder``'s swap files (and manifests) no live process ``flock``s, links unfollowed; (files, bytes)."""
    count = freed = 0
    try:
        names = sorted(n for n in os.listdir(folder) if n.startswith("rank") and n.endswith(".swap"))
    except (FileNotFoundError, NotADirectoryError):
        return 0, 0
    for name in names:
        path = Path(folder) / name
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:   # a link, gone meanwhile, not ours to open
            continue
        try:
            if not _flock(fd):
                continue   # held: its process is alive
            st = os.fstat(fd)
            path.unlink(missing_ok=True)
            manifest = _manifest_path(path)
            if manifest.exists() and not manifest.is_symlink():
                freed += manifest.stat().st_blocks * 512
            manifest.unlink(missing_ok=True)
            count += 1
            freed += st.st_blocks * 512
        finally:
            os.close(fd)
    return count, freed


def _manifest_path(path: Path) -> Path:
    return path.with_name(path.name + ".manifest.json")


def _unlink_if(path: Path, mine: os.stat_result | None) -> None:
    if _names(path, mine):
        path.unlink(missing_ok=True)


def _names(path: Path, mine: os.stat_result | None) -> bool:
    """Whether ``path`` (not followed) names the file ``mine`` describes (same device and inode)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    return mine is not None and (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def _flock(fd: int) -> bool:
    """Take ``fd``'s exclusive ``flock``; False: a live process holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _in_use(path: Path) -> ConfigError:
    return ConfigError(f"swap file {path} is in use by another run or engine (in this process or another); "
                       "give each run its own offload.nvme_path")


def _refuse_if_held(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:   # a link, gone meanwhile, unreadable: the checks that follow say so
        return
    try:
        if not _flock(fd):
            raise _in_use(path)
    finally:
        os.close(fd)


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
    if old.get("extents") != meta["extents"]:
        raise ConfigError(f"swap file {path} belongs to another layout (its extents differ); "
                          f"refusing to reuse it: {fix}")
