"""offload=nvme's placements and what they share: the swap folder, the pre-flight agreed by every
rank, opening swap files, agreeing on swap IO errors across ranks, and removing the files.

``NVMePlacement`` alone is ``optimizer: cpu`` (host pieces); ``DiskPlacement`` keeps optimizer
tiles in a swap file and ``_diskshards.DiskShards`` zero3's parameter shards, each made resident in
a pool of pinned host buffers by a ``DiskStore``. The pipeline acquires a tile (read into a slot), steps it
and releases it (written back); zero3's shards are spilled as construction fills them and swapped
out at the end of setup.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import torch

from framework.comm.accelerator import Accelerator, Event
from framework.core.errors import ConfigError, FrameworkError, SwapIOError
from framework.core.footprint import Footprint
from framework.core.room import Claim, nearest_existing, shortfalls
from framework.core.units import GiB, MiB
from framework.offload._diskstore import DiskStore
from framework.offload._gradswap import GradSwap
from framework.offload._store import Tier
from framework.offload._swapfile import reserved_bytes, swap_path
from framework.offload.base import Piece, PieceInfo, Shards
from framework.offload.cpu import HostPlacement

if TYPE_CHECKING:   # the component module builds the placements: no import back at run time
    from framework.offload.nvme import NVMeOffloadConfig


def agree_swap_room(dist, folder: str, stores: Mapping[str, object], check: Callable[[], None]) -> None:
    """``check()`` on this rank, then with every rank of ``dist`` the room the swap files of ``stores``
    (kind -> ``DiskStore`` or None) still need, summed per file system: every rank raises the same
    one-line ConfigError, so none dies alone while the others wait for it."""
    rank = dist.rank if dist is not None else 0
    error, claim = None, None
    try:
        need = sum(max(0, reserved_bytes(store.extents()) - _allocated(swap_path(folder, rank, kind)))
                   for kind, store in stores.items() if store is not None)
        claim = Claim.of(folder, need, rank)
        check()
    except (FrameworkError, OSError) as e:
        error = f"rank {rank}: {e}"
        mine = e
    if dist is not None and dist.world > 1:
        everyone = dist.all_gather_object((claim, error), what="nvme pre-flight")
    else:
        everyone = [(claim, error)]
    shorts = shortfalls([c for c, _ in everyone if c is not None])
    if shorts:
        raise ConfigError(f"offload.nvme_path={shorts[0].describe('the swap files')}; free space or point "
                          "offload.nvme_path at a larger disk (each rank of a host needs its own files there)")
    if error is not None:
        raise mine
    errors = [e for _, e in everyone if e]
    if errors:
        raise ConfigError(f"nvme pre-flight failed on another rank ({errors[0]}); this rank stops too")


def _allocated(path) -> int:
    """Bytes already reserved by an existing swap file (taken over: its space is not needed again)."""
    try:
        return os.lstat(path).st_blocks * 512
    except FileNotFoundError:
        return 0


class NVMePlacement(HostPlacement):
    """offload=nvme: host pieces (``optimizer: cpu``), and the swap files' machinery (module docstring)."""

    def __init__(self, spec: NVMeOffloadConfig, host_fraction: float, pin: bool, shards: Shards | None = None,
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
        if self._cleaned or self.spec.nvme_path is None:
            return
        from framework.offload._swapfile import remove_stale

        self._cleaned = True
        count, freed = remove_stale(self.spec.nvme_path)
        if count:
            print(f"nvme: removed {count} stale swap file(s) of dead processes from {self.spec.nvme_path}, "
                  f"freeing {freed / GiB:.2f} GiB ({freed} bytes)", flush=True)

    def expect(self, numel: int, param_dtype: torch.dtype) -> None:
        """One line if the disk cannot hold even the least every optimizer needs, or host memory the
        pools; the exact checks follow at ``init_opt_state``."""
        if not numel:
            return
        self.clean_stale()
        spec, size = self.spec, param_dtype.itemsize
        params = spec.params == "nvme"
        need = numel * ((4 if spec.optimizer == "nvme" else 0) + (4 if self.grad_swap else 0)
                        + (2 * size if params else 0))
        folder = spec.nvme_path
        free = shutil.disk_usage(nearest_existing(Path(folder or tempfile.gettempdir()))).free
        if need > free:
            raise ConfigError(f"offload.nvme_path={folder}: this rank's {numel} parameters need at least "
                              f"{need / GiB:.2f} GiB ({need} bytes) of swap but its file system has "
                              f"{free / GiB:.2f} GiB free; free space, point offload.nvme_path at a larger disk "
                              f"or use more ranks")
        tile = min(spec.sub_group_size, numel)
        pools = spec.buffer_count * tile * (4 + (4 if self.grad_swap else 0))
        if params:
            pools += min(spec.param_buffer_count * spec.param_buffer_size, spec.max_in_cpu, numel) * size
        self.check_ram(pools, "at least")

    def check_ram(self, pools: int, bound: str) -> None:
        available = _available_ram()
        if available is not None and pools > available:
            raise ConfigError(f"offload: the swap buffer pools need {bound} {pools / GiB:.2f} GiB ({pools} bytes) of "
                              f"host memory but {available / GiB:.2f} GiB is available; lower offload.buffer_count, "
                              f"offload.sub_group_size, offload.param_buffer_count or offload.max_in_cpu")

    def folder(self) -> str:
        if self.spec.nvme_path is not None:
            if self._made is None and not Path(self.spec.nvme_path).exists():
                self._made = self.spec.nvme_path   # made by pre-flight (the run directory's nvme/): removed at close
            return self.spec.nvme_path
        if self._tmpdir is None:   # library use without a run directory: a private folder
            self._tmpdir = tempfile.mkdtemp(prefix="framework-nvme-")
        return self._tmpdir

    def open_swap(self, store: DiskStore, kind: str) -> None:
        """After the pre-flight: ``store``'s swap file, IO engine and pool."""
        from framework.offload._aio import AsyncIO

        rank = self.dist.rank if self.dist is not None else 0
        path = swap_path(self.folder(), rank, kind)
        aio = self.spec.aio
        store.open(path, AsyncIO(aio.block_size, aio.queue_depth, aio.intra_op_parallelism), rank,
                   self.dist.world if self.dist is not None else 1)
        slot, _, total, _ = store.layout()
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


class DiskPlacement(NVMePlacement):
    """offload=nvme, ``optimizer: nvme``: the first ``host_fraction`` of each partition in tiles of at
    most ``sub_group_size`` elements in the optimizer's swap file (tier DISK)."""

    def __init__(self, *args, **kwargs):
        self.gradswap: GradSwap | None = None   # (``swap_grads``) owned gradients in the swap file
        super().__init__(*args, **kwargs)

    def bind(self, acc: Accelerator) -> None:
        super().bind(acc)
        spec = self.spec
        self.stores[Tier.DISK] = DiskStore(acc, pin=self.pin, buffer_count=spec.buffer_count,
                                           read_ahead=spec.pipeline_read, write_behind=spec.pipeline_write,
                                           name="optimizer")

    def _off_device(self, own: torch.Tensor, master_dtype: torch.dtype, k: int,
                    chunk: int | None) -> list[tuple[Tier, Piece]]:
        """Placeholders until ``init_opt_state`` registers them with the disk store (which points them
        at a pool slot only while resident) and fills them from ``own``."""
        step, host, pieces = min(chunk or max(k, 1), self.spec.sub_group_size), self.stores[Tier.HOST], []
        if self.gradswap is None:   # gradients in host memory: one pinned arena for the partition
            host.reserve([(min(a + step, k) - a, master_dtype) for a in range(0, k, step)])
        for a in range(0, k, step):
            b = min(a + step, k)
            if self.gradswap is not None:   # in the swap file beside the tile (``_gradswap``)
                grad = parked(b - a, self.gradswap.dtype)
            else:
                grad = host.allocate(b - a, master_dtype)
                grad.zero_()
            staging = None if own.dtype == master_dtype else parked(b - a, own.dtype)
            pieces.append((Tier.DISK, Piece(a, b, parked(b - a, master_dtype), grad, staging)))
        return pieces

    @property
    def grad_swap(self) -> bool:
        return self.gradswap is not None

    def swap_grads(self, accum_dtype: torch.dtype) -> bool:
        """With every piece stepped by the host the owned gradients live beside their tiles."""
        if self.host_fraction == 1.0:
            self.gradswap = GradSwap(accum_dtype)
        return self.grad_swap

    def load_grad(self, group: int, numel: int, device: torch.device) -> torch.Tensor:
        return self.gradswap.load(group, numel, device)

    def save_grad(self, group: int, buf: torch.Tensor, final: bool) -> None:
        self.gradswap.save(group, buf, final, self.acc.device)

    def finish_grads(self, sizes: Sequence[int]) -> None:
        self.gradswap.finish(sizes, self.acc.device)

    def grad_sq_norm_local(self, sizes: Sequence[int]) -> torch.Tensor:
        return self.gradswap.sq_norm(sizes, self.acc.device)

    def clear_grads(self) -> None:
        if self.gradswap is not None:
            self.gradswap.clear()

    def readable_grads(self, grads: Sequence[torch.Tensor]):
        return grads if self.gradswap is None else self.gradswap.piece_grads(self.infos)

    def _init_state(self, tx, params: Sequence[torch.Tensor]) -> Any:
        """``tx.init(params)``, each disk piece's state made and swapped out one at a time (host memory
        holds at most a slot's worth); zero3's shards go to their swap file first."""
        from framework.optimizers import group_state, init_groups, merge_groups

        self.clean_stale()
        self.shards.swap_out()
        store: DiskStore = self.stores[Tier.DISK]
        disk, n = [i for i in self.infos if i.tier is Tier.DISK], len(params)
        rest = {i.index for i in self.infos if i.tier is not Tier.DISK}
        states, owner = [init_groups(tx, params, rest)], [0] * n
        for info in disk:
            # The piece's master is parked (zero strides): its new state tensors are contiguous,
            # and ``add`` parks them at once, so only one piece's state exists at a time.
            state = init_groups(tx, params, {info.index})
            owner[info.index] = len(states)
            states.append(state)
            grad = [info.piece.grad] if self.grad_swap else []
            store.add(info.index, [info.piece.master, *group_state(state, n, info.index), *grad],
                      [info.piece.staging] if info.piece.staging is not None else [], readonly=len(grad))
        full = merge_groups(states, owner)
        agree_swap_room(self.dist, self.folder(), self.swap_stores(), lambda: self._preflight(store))
        failed = None
        try:   # a rank that cannot open its swap file stops every rank below, none left in a collective
            self.open_swap(store, "optim")
            if self.gradswap is not None:
                self.gradswap.bind(store, disk, self.acc)
            for info in disk:   # initial values: the working values and a fresh state, written out
                def fill(info=info):
                    values = self.shards.initial_values(info.partition, info.start, info.end)
                    self.acc.copy(info.piece.master, values)   # blocking: setup
                    fresh = group_state(init_groups(tx, params, {info.index}), n, info.index)
                    for dst, src in zip(group_state(full, n, info.index), fresh):
                        dst.copy_(src)
                    if self.grad_swap:
                        info.piece.grad.zero_()
                store.create(info.index, fill)
            store.flush()
        except Exception as e:   # noqa: BLE001 - agreed on below, re-raised on every rank
            failed = e
        self.agree(failed, "writing the initial state to the swap files")
        return full

    def _preflight(self, store: DiskStore) -> None:
        """Room on the disk, a writable folder and host memory for the pool: one line otherwise."""
        from framework.offload._swapfile import preflight

        # never more slots than tiles (with the default sub_group_size a partition is one tile)
        slot, slots, total, bounce = store.layout(self.spec.buffer_count)
        store.buffer_count = slots
        preflight(self.folder(), total, create=True)   # (no buffer check: a slot holds any tile)
        self.check_ram(store.buffer_count * slot + bounce, "")

    def memory(self, fp: Footprint, opt_state: Any) -> None:
        super().memory(fp, opt_state)
        self.stores[Tier.DISK].memory(fp, "nvme_optimizer_pool", "optimizer")

    def step_errors(self, failed: BaseException | None) -> None:
        # Swap IO may fail on one rank only: all ranks agree before the gather (a collective).
        self.agree(failed, "stepping the optimizer tiles")

    def _publish(self, info: PieceInfo, after: Event) -> Event | None:
        if info.tier is not Tier.DISK:
            return super()._publish(info, after)
        store = self.stores[Tier.DISK]
        handle = store.acquire(info.index)   # resident while its values are copied back
        store.wait(handle)
        if info.piece.staging is not None:   # (not swapped: made from the master, as copy_16bit would)
            info.piece.staging.copy_(info.piece.master)
        ev = self.copy_back(info, after)
        store.release(handle, ev)
        return ev

    def reset_master(self, pieces: Sequence[Piece], shard: torch.Tensor, values: torch.Tensor) -> None:
        store = self.stores[Tier.DISK]
        for p in pieces:
            info = next((i for i in self.infos if i.piece is p and i.tier is Tier.DISK), None)
            if info is None:
                super().reset_master([p], shard, values)
                continue
            handle = store.acquire(info.index)
            store.wait(handle)
            self.acc.copy(p.master, values[p.start:p.end])
            store.release(handle, None)

    def mapped_state(self, params: Sequence[torch.Tensor], opt_state: Any, *, write: bool
                     ) -> tuple[list[torch.Tensor], Any, Any]:
        """Every disk piece's master and state as views of the mapped swap file (no host copy)."""
        from framework.optimizers import replace_groups

        fmap, views = self.stores[Tier.DISK].mapped(write)
        out, groups = list(params), {}
        for info in self.infos:
            if info.tier is Tier.DISK:   # (a swapped gradient, last, is not part of the state)
                out[info.index], *groups[info.index] = views[info.index][:len(views[info.index]) - self.grad_swap]
        return out, replace_groups(opt_state, len(params), groups), fmap

    def unmapped(self, fmap: Any) -> None:
        self.stores[Tier.DISK].unmapped(fmap)

    def close(self) -> None:
        if self.gradswap is not None:
            self.gradswap.close()
        super().close()
