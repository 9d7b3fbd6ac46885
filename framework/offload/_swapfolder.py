"""The NVMe offload's config (``offload=nvme``: read by ``nvme.py`` and the tiers it builds, below it) and its
swap folder: its default, whether it keeps files in host memory, the pre-flight every rank agrees on before
any file is made, and what a placement made there."""
from __future__ import annotations

import ctypes
import fcntl
import os
import shutil
import sys
import tempfile
import weakref
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping

from framework.core.errors import ConfigError, FrameworkError
from framework.core.files import make_dirs, probe_writable, remove_made
from framework.core.room import Claim, free_bytes, shortfalls
from framework.core.units import size as _size
from framework.offload._swapfile import remove_stale, reserved_bytes, swap_path


@dataclass(frozen=True, kw_only=True)
class AIOConfig:
    """DeepSpeed's ``aio`` section: how the IO engine (``offload._aio``) splits and queues requests."""
    block_size: int = 1048576          # bytes per request (a multiple of 4096: O_DIRECT)
    # Their product is the number of IO threads, each taking the next block of any request from one queue
    # (DeepSpeed's two knobs kept for its configs: only the product matters here).
    queue_depth: int = 8
    intra_op_parallelism: int = 1
    # DeepSpeed's libaio knobs: the engine always batches and overlaps completion with submission,
    # which is what these defaults mean; another value is refused (it would do nothing).
    single_submit: bool = False
    overlap_events: bool = True


@dataclass(frozen=True, kw_only=True)
class NVMeOffloadConfig:
    optimizer: str = "nvme"            # fp32 master + optimizer state: cpu | nvme
    params: str = "auto"               # zero3 parameter shards: none | cpu | nvme | auto
    nvme_path: str | None = None       # None: <run dir>/nvme (printed at start-up with its size)
    pin_memory: bool = True
    ratio: float = 1.0                 # fraction of each partition whose optimizer step runs off the device
    overlap_step: bool = False         # speculative host step during backward (optimizer=cpu only)
    # Elements per optimizer tile. DeepSpeed's 10^9 makes a smaller partition one tile, resident for
    # its whole step (as much host memory as offload=cpu); 10^7 bounds the pool (about 4 x 140 MB)
    # and keeps requests large enough for disk speed. A DeepSpeed config's value still overrides it.
    sub_group_size: int = 10_000_000
    buffer_count: int = 4              # host tiles in the optimizer pool
    pipeline_read: bool = False        # read tile i+1 while tile i steps
    pipeline_write: bool = False       # write tile i-1 back while tile i steps
    # host buffers for zero3 parameter shards on NVMe; with at least the units prefetched + 1 the host
    # never waits in a hook for a shard's copy to the device before reusing its buffer
    param_buffer_count: int = 5
    param_buffer_size: int = 100_000_000  # a floor: refused below the largest parameter shard (_diskshards.slots)
    max_in_cpu: int = 1_000_000_000    # cap on host-resident parameter elements (params=nvme)
    aio: AIOConfig = field(default_factory=AIOConfig)


PRIVATE = "framework-nvme-"   # the prefix of the private folders made without offload.nvme_path

# statfs(2) f_type of the file systems that keep their files in host memory (<linux/magic.h>)
MEMORY_FS = {0x01021994: "tmpfs", 0x858458F6: "ramfs"}


def memory_fs(path: str | os.PathLike) -> str | None:
    """The type of the file system holding ``path`` (or its nearest existing parent) when it keeps its
    files in host memory (tmpfs, ramfs); None otherwise or where unknown (``os.statvfs`` does not say)."""
    if not sys.platform.startswith("linux"):
        return None
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    buf = ctypes.create_string_buffer(512)   # struct statfs (120 bytes on 64-bit Linux); f_type comes first
    try:
        if ctypes.CDLL(None, use_errno=True).statfs(os.fsencode(p), buf) != 0:
            return None
    except (OSError, AttributeError):
        return None
    return MEMORY_FS.get(ctypes.c_ulong.from_buffer(buf).value & 0xFFFF_FFFF)


def temp_root() -> str:
    """Without ``nvme_path``: the temporary folder, or /var/tmp (on disk by convention) if only the former is in RAM."""
    tmp = tempfile.gettempdir()
    if memory_fs(tmp) and os.access("/var/tmp", os.W_OK | os.X_OK) and not memory_fs("/var/tmp"):
        return "/var/tmp"
    return tmp


def make_private(root: str) -> tuple[str, int]:
    """A new private swap folder in ``root`` and a descriptor holding its ``flock`` until this process
    closes it or dies: ``sweep_private`` in another run leaves it alone."""
    while True:
        path = tempfile.mkdtemp(prefix=PRIVATE, dir=root)   # 0700
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            continue   # another run's sweep removed it before it was opened (still unlocked): make another
        fcntl.flock(fd, fcntl.LOCK_EX)   # (waits for a sweep that found it unlocked and is removing it)
        with suppress(OSError):
            named, held = os.lstat(path), os.fstat(fd)
            if (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino):
                return path, fd
        os.close(fd)   # swept in the moment between making and locking it: make another


def sweep_private(root: str) -> tuple[int, int, int]:
    """Remove the private swap folders in ``root`` that no live process holds (``make_private``'s lock)
    with the swap files in them no live process holds (``remove_stale``); (folders, files, bytes) removed.
    A folder still holding anything else stays, and so does everything of a live run."""
    folders = files = freed = 0
    try:
        names = sorted(n for n in os.listdir(root) if n.startswith(PRIVATE))
    except OSError:
        return 0, 0, 0
    for name in names:
        path = os.path.join(root, name)
        try:   # (not ours: another user's 0700 folder; a link is never followed)
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue   # held: its run is alive (in this process or another)
            count, nbytes = remove_stale(path)   # (a file a live process holds stays, and so the folder)
            files, freed = files + count, freed + nbytes
            with suppress(OSError):
                os.rmdir(path)   # only if empty
                folders += 1
        finally:
            os.close(fd)
    return folders, files, freed


def preflight(path: str | os.PathLike, total_bytes: int, *, create: bool = False) -> None:
    """One-line ConfigErrors unless ``path`` exists (``create``: made) and is writable with room for
    ``total_bytes``."""
    path = Path(path)
    where = f"offload.nvme_path={path}"
    if not path.exists():
        if not create:
            raise ConfigError(f"{where} does not exist; create it or set offload.nvme_path to a folder on a fast disk")
        try:   # exist_ok: the ranks of one host share the folder and may make it at the same moment
            make_dirs(path)   # 0700, parents too
        except OSError as e:
            at = f"{e.filename}: " if e.filename and Path(e.filename) != path else ""   # (a parent in the way)
            raise ConfigError(f"{where}: cannot create it ({at}{e.strerror}); set offload.nvme_path to a "
                              "writable folder") from None
    if not path.is_dir():
        raise ConfigError(f"{where} is not a folder; set offload.nvme_path to a folder")
    try:
        probe_writable(path)
    except OSError as e:
        raise ConfigError(f"{where} is not writable ({e.strerror}); fix its permissions or set "
                          "offload.nvme_path to a writable folder") from None
    free = free_bytes(path)
    if free < total_bytes:
        raise ConfigError(f"{where}: the swap files need {_size(total_bytes)} but its file system has "
                          f"{_size(free)} free; free space or point offload.nvme_path at a larger disk")


def agree_swap_room(dist, folder: str, stores: Mapping[str, object], check: Callable[[], None],
                    made: MadeOnDisk | None = None) -> None:
    """``agree_room`` on the room the swap files of ``stores`` (kind -> ``DiskStore`` or None) still need."""
    rank = dist.rank if dist is not None else 0
    agree_room(dist, folder, lambda: sum(
        max(0, reserved_bytes(s.extents()) - _allocated(swap_path(folder, rank, k)))
        for k, s in stores.items() if s is not None), check, made=made)


def agree_room(dist, folder: str, need: Callable[[], int], check: Callable[[], None], verb: str = "need",
               made: MadeOnDisk | None = None) -> None:
    """``check()`` on this rank, and the bytes ``need()`` in ``folder`` summed over the ranks sharing its file
    system: every rank raises the same one-line ConfigError (none dies alone). Before any raises, ``made``
    notes ``folder`` and its parents where a rank sharing the file system found them missing (``check()`` may
    make them; a sibling another rank made is not this rank's): removed at close once empty, also after a
    refusal."""
    rank = dist.rank if dist is not None else 0
    claim = mine = None
    try:
        claim = Claim.of(folder, need(), rank)
        check()
    except (FrameworkError, OSError) as e:
        mine = e
    error = None if mine is None else f"rank {rank}: {mine}"
    everyone = [(claim, error)] if dist is None or dist.world == 1 else \
        dist.all_gather_object((claim, error), what="nvme pre-flight")
    here = Path(folder).absolute()   # (a top another rank found missing, this folder or a parent: made by the run)
    tops = [c.missing for c, _ in everyone if c is not None and c.missing and claim is not None
            and (c.host, c.device) == (claim.host, claim.device) and Path(c.missing) in (here, *here.parents)]
    if made is not None and tops:
        made.made(folder, min(tops, key=len))   # (a rank may look after another made some)
    shorts = shortfalls([c for c, _ in everyone if c is not None])
    if shorts:
        raise ConfigError(f"offload.nvme_path={shorts[0].describe('the swap files', verb)}; free space or point "
                          "offload.nvme_path at a larger disk (each rank of a host needs its own files there)")
    if mine is not None:
        raise mine
    errors = [e for _, e in everyone if e]
    if errors:
        raise ConfigError(f"the nvme pre-flight failed on another rank: {errors[0]}")


def _allocated(path) -> int:
    """Bytes an existing swap file reserved (taken over: not needed again)."""
    try:
        return os.lstat(path).st_blocks * 512
    except (FileNotFoundError, NotADirectoryError):   # none yet, or a folder that is not one: check() says so
        return 0


class MadeOnDisk:
    """What a placement made on disk (temporary or swap folder, swap files): apart, for the placement's finalizer."""

    def __init__(self):
        self.tmpdir: str | None = None
        self.lock: int | None = None   # the descriptor holding ``tmpdir``'s lock (``make_private``)
        self.folders: list[Path] = []   # the swap folder and its parents a rank of this run made, deepest first
        self.files: list[weakref.finalize] = []

    def made(self, folder: str | os.PathLike, top: str) -> None:
        """``folder`` and its parents up to ``top`` did not exist before this run."""
        path, top = Path(folder).absolute(), Path(top)
        self.folders = [path]
        if top in path.parents:
            self.folders += path.parents[:path.parents.index(top) + 1]

    def remove(self) -> None:
        for removal in self.files:   # (each runs once: one already run does nothing)
            removal()
        if self.tmpdir is not None:
            shutil.rmtree(self.tmpdir, ignore_errors=True)
        if self.lock is not None:   # (after the removal: no sweep races it)
            os.close(self.lock)
        remove_made(self.folders)   # only while empty: never what another run keeps there
        self.tmpdir = self.lock = None
        self.folders = []
        self.files.clear()
