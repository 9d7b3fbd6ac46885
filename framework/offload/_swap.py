"""What every offload=nvme placement shares: the swap folder, pre-flight checks, opening swap files,
agreeing on swap IO errors across ranks, and removing the files.

``NVMePlacement`` alone is ``optimizer: cpu`` (host pieces, zero3 shards in ``_disk.DiskShards``).
"""
from __future__ import annotations

import hashlib
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from framework.comm.accelerator import Accelerator
from framework.core.errors import ConfigError, SwapIOError
from framework.core.room import nearest_existing
from framework.core.units import GiB, MiB
from framework.offload._room import agree_swap_room
from framework.offload._store import Tier
from framework.offload.base import Shards
from framework.offload.cpu import HostPlacement


@dataclass(frozen=True)
class DiskSpec:
    """Where and how the disk tier swaps (``offload=nvme``; see ``offload.nvme``)."""

    path: str | None            # folder of the swap files (None: a private temporary folder)
    sub_group_size: int         # elements per optimizer tile
    buffer_count: int           # slots in the optimizer pool
    read_ahead: bool            # pipeline_read
    write_behind: bool          # pipeline_write
    block_size: int
    queue_depth: int
    intra_op_parallelism: int
    optimizer: bool = True      # fp32 master + optimizer state on disk
    params: bool = False        # zero3 parameter shards on disk
    param_buffer_count: int = 5
    param_buffer_size: int = 100_000_000   # elements
    max_in_cpu: int = 1_000_000_000        # elements of parameter shards resident at once


class NVMePlacement(HostPlacement):
    """offload=nvme: host pieces (``optimizer: cpu``), and the swap files' machinery (module docstring)."""

    def __init__(self, spec: DiskSpec, host_fraction: float, pin: bool, shards: Shards | None = None,
                 overlap_step: bool = False, accelerator: Accelerator | None = None):
        self.spec = spec
        self._cleaned = False             # stale swap files looked for (``clean_stale``)
        self._tmpdir: str | None = None
        self._made: str | None = None     # the swap folder, when this run made it
        super().__init__(host_fraction, pin, shards, overlap_step, accelerator)

    def bind(self, acc: Accelerator) -> None:
        _return_freed_memory()
        super().bind(acc)

    def swaps(self) -> bool:
        return True

    def swap_stores(self) -> dict:
        return {"optim": self.stores.get(Tier.DISK), "params": self.shards.store}

    def init_opt_state(self, tx, params: Sequence[torch.Tensor]) -> Any:
        """With every swap file made and written (before the first step)."""
        try:
            return self._init_state(tx, params)
        except BaseException:
            self.close()   # no swap file outlives a failed start
            raise

    def _init_state(self, tx, params: Sequence[torch.Tensor]) -> Any:
        full = tx.init(list(params))
        self.clean_stale()
        self.shards.swap_out()
        return full

    def clean_stale(self) -> None:
        """Before the pre-flight counts free space: remove swap files that dead processes left."""
        if self._cleaned or self.spec.path is None:
            return
        from framework.offload._swapfile import remove_stale

        self._cleaned = True
        count, freed = remove_stale(self.spec.path)
        if count:
            print(f"nvme: removed {count} stale swap file(s) of dead processes from {self.spec.path}, "
                  f"freeing {freed / GiB:.2f} GiB ({freed} bytes)", flush=True)

    def expect(self, numel: int, param_dtype: torch.dtype) -> None:
        """One line if the disk cannot hold even the least every optimizer needs, or host memory the
        pools; the exact checks follow at ``init_opt_state``."""
        if not numel:
            return
        self.clean_stale()
        spec, size = self.spec, torch.empty((), dtype=param_dtype).element_size()
        need = numel * ((4 if spec.optimizer else 0) + (4 if self.grad_swap else 0) + (2 * size if spec.params else 0))
        folder = spec.path
        free = shutil.disk_usage(nearest_existing(Path(folder or tempfile.gettempdir()))).free
        if need > free:
            raise ConfigError(f"offload.nvme_path={folder}: this rank's {numel} parameters need at least "
                              f"{need / GiB:.2f} GiB ({need} bytes) of swap but its file system has "
                              f"{free / GiB:.2f} GiB free; free space, point offload.nvme_path at a larger disk "
                              f"or use more ranks")
        tile = min(spec.sub_group_size, numel)
        pools = spec.buffer_count * tile * (4 + (4 if self.grad_swap else 0))
        if spec.params:
            pools += min(spec.param_buffer_count * spec.param_buffer_size, spec.max_in_cpu, numel) * size
        self.check_ram(pools, "at least")

    def check_ram(self, pools: int, bound: str) -> None:
        available = _available_ram()
        if available is not None and pools > available:
            raise ConfigError(f"offload: the swap buffer pools need {bound} {pools / GiB:.2f} GiB ({pools} bytes) of "
                              f"host memory but {available / GiB:.2f} GiB is available; lower offload.buffer_count, "
                              f"offload.sub_group_size, offload.param_buffer_count or offload.max_in_cpu")

    def folder(self) -> str:
        if self.spec.path is not None:
            if self._made is None and not Path(self.spec.path).exists():
                self._made = self.spec.path   # made by pre-flight (the run directory's nvme/): removed at close
            return self.spec.path
        if self._tmpdir is None:   # library use without a run directory: a private folder
            self._tmpdir = tempfile.mkdtemp(prefix="framework-nvme-")
        return self._tmpdir

    def open_swap(self, store, kind: str, preflight: Callable[[], None], collective: bool = True) -> None:
        """``preflight()`` agreed by the ranks, then ``store``'s swap file, IO engine and pool."""
        from framework.offload._aio import AsyncIO, aligned_empty
        from framework.offload._swapfile import SwapFile, swap_path

        rank = self.dist.rank if self.dist is not None else 0
        world = self.dist.world if self.dist is not None else 1
        agree_swap_room(self.dist, self.folder(), self.swap_stores(), preflight, collective=collective)
        extents = store.extents()
        total, slot = sum(extents.values()), store.slot_bytes()
        dtype = next(iter(store.entries.values())).swapped[0].dtype   # the extents' element type
        layout = hashlib.sha256(repr((world, rank, sorted(extents.items()))).encode()).hexdigest()[:16]
        path = swap_path(self.folder(), rank, kind)
        file = SwapFile.create(path, extents, layout_hash=layout, world_size=world, rank=rank, dtype=dtype)
        try:
            io = AsyncIO(self.spec.block_size, self.spec.queue_depth, self.spec.intra_op_parallelism)
            pool = aligned_empty(store.buffer_count * slot, torch.uint8, pin=self.pin, acc=self.acc)
        except BaseException:
            file.remove()
            raise
        store.open(file, io, pool)
        what = "fp32 master + optimizer state" if kind == "optim" else "zero3 parameter shards"
        print(f"nvme: rank {rank} swaps {total} bytes ({total / GiB:.2f} GiB) of {what} to {path}; "
              f"host pool {store.buffer_count} x {slot} bytes", flush=True)

    def agree(self, error: BaseException | None, what: str) -> None:
        """Every rank raises if some rank's swap IO failed (none is left waiting in a collective)."""
        if self.dist is None or self.dist.world == 1:
            if error is not None:
                raise error
            return
        flag = torch.full((1,), 0.0 if error is None else 1.0, device=self.dist.device)   # no pageable copy
        self.dist.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, what=f"swap IO error flag ({what})")
        if flag.item() == 0.0:   # host sync: once a step with swap files, every rank must agree
            return
        if error is not None:
            raise error
        raise SwapIOError(f"another rank failed while {what} (its error names the file, offset and tensor); "
                          f"this rank stops too")

    def close(self) -> None:
        try:
            super().close()
        finally:
            if self._tmpdir is not None:
                shutil.rmtree(self._tmpdir, ignore_errors=True)
                self._tmpdir = None
            if self._made is not None:
                try:
                    Path(self._made).rmdir()   # only if empty: never what another run keeps there
                except OSError:
                    pass
                self._made = None


def _return_freed_memory() -> None:
    """glibc: mmap blocks of 1 MiB or more, so freeing one returns it to the kernel at once (the
    default threshold rises to 32 MiB, and resident memory would creep with the model's size)."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if name is None:
        return
    try:
        libc = ctypes.CDLL(name)
        libc.mallopt(-3, MiB)   # M_MMAP_THRESHOLD (<malloc.h>)
    except (OSError, AttributeError):
        pass


def _available_ram() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024   # host sync: no (text of /proc/meminfo)
    except OSError:
        return None
    return None


def parked(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A placeholder of ``numel`` elements that holds no memory (zero strides over one element)."""
    return torch.empty(0, dtype=dtype, device="cpu").set_(
        torch.zeros(1, dtype=dtype, device="cpu").untyped_storage(), 0, (numel,), (0,))
