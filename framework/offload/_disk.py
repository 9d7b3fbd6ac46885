"""offload=nvme's placements: ``NVMePlacement`` (``optimizer: cpu``: host pieces) opens, agrees on and
removes the swap files; ``DiskPlacement`` keeps the optimizer tiles (and zero3's owned gradients) in
one, resident in a ``DiskStore``'s pinned pool while stepped."""
from __future__ import annotations

import ctypes
import sys
import weakref
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import suppress
from functools import partial
from typing import Any, Callable, Iterable, Sequence

import torch

from framework.comm.accelerator import Accelerator
from framework.core.errors import ConfigError, FrameworkError, SwapIOError, say
from framework.core.footprint import Footprint
from framework.core.room import available_ram
from framework.core.units import GiB, MiB
from framework.core.utils import counted, sq_norm_part
from framework.offload._aio import AsyncIO, aligned_empty
from framework.offload._diskstore import DiskStore, parked, pool_layout
from framework.offload._store import Tier, copy_on
from framework.offload._swapfile import remove_stale, swap_path
from framework.offload._swapfolder import (PRIVATE, MadeOnDisk, NVMeOffloadConfig, agree_room, agree_swap_room,
                                           make_private, memory_fs, preflight, sweep_private, temp_root)
from framework.offload.base import Piece, Shards
from framework.offload.cpu import HostPlacement
from framework.optimizers import group_state, init_groups, merge_groups, replace_groups


class NVMePlacement(HostPlacement):
    """offload=nvme: host pieces (``optimizer: cpu``), and the swap files' machinery."""

    swaps = True

    def __init__(self, spec: NVMeOffloadConfig, shards: Shards, accelerator: Accelerator | None = None):
        self.spec = spec
        self._cleaned = self._fs_checked = False   # (stale files removed, swap folder looked at: once)
        self._made = MadeOnDisk()
        # Runs once: at ``close``, when collected unclosed or at interpreter exit: nothing is left behind.
        self._remove_made = weakref.finalize(self, self._made.remove)
        super().__init__(spec.ratio, spec.pin_memory, shards, spec.overlap_step, accelerator)

    def bind(self, acc: Accelerator) -> None:
        # glibc: mmap blocks of 1 MiB or more, so freeing one returns it to the kernel at once (the default
        # threshold rises to 32 MiB, and resident memory would creep with the model's size)
        with suppress(OSError, AttributeError):   # (no C library that has it)
            ctypes.CDLL(None).mallopt(-3, MiB)   # M_MMAP_THRESHOLD (<malloc.h>)
        super().bind(acc)

    def init_opt_state(self, tx, params: Sequence[torch.Tensor]) -> Any:
        """With every swap file made and written (before the first step); zero3's shards go first."""
        try:
            self.clean_stale()
            self.shards.swap_out()
            return self._init_state(tx, params)
        except BaseException:
            self.close()   # no swap file outlives a failed start
            raise

    _init_state = HostPlacement.init_opt_state   # (``DiskPlacement`` swaps its tiles' state out)

    def clean_stale(self) -> None:
        """Before the pre-flight counts free space: remove swap files that dead processes left (without
        ``nvme_path``: in the private folders of the temporary folder, and those folders)."""
        if self._cleaned:
            return
        self._cleaned = True
        if self.spec.nvme_path is not None:
            folders, (count, freed), where = 0, remove_stale(self.spec.nvme_path), self.spec.nvme_path
        else:   # a library run killed (SIGTERM, SIGKILL) left its private folder: no later run has its name
            root = temp_root()
            (folders, count, freed), where = sweep_private(root), f"{root}/{PRIVATE}*"
        if count or folders:
            also = f" and {counted(folders, 'folder')}" if folders else ""
            say(f"nvme: removed {counted(count, 'stale swap file')}{also} of dead processes from {where}, "
                f"freeing {freed / GiB:.2f} GiB ({freed} bytes)", sys.stdout)

    def expect(self, sizes: Sequence[int], working: torch.dtype, master: torch.dtype) -> None:
        """zero3, before construction (``sizes``: each unit group's partition): one line on every rank if a
        swap folder is no writable folder, a disk (its ranks summed) cannot hold the least any optimizer needs,
        or a host the pools (exact at init). A refusal removes the folders it made."""
        numel = sum(sizes)
        if not numel:
            return
        spec = self.spec
        size = working.itemsize if spec.params == "nvme" else 0   # a swapped parameter's bytes
        fp32 = (4 if spec.optimizer == "nvme" else 0) + (4 if self.grad_swap else 0)   # swapped bytes per element

        def need() -> int:   # once dead runs' files are gone: their room is free
            self.clean_stale()
            return numel * (fp32 + 2 * size)

        def check() -> None:   # (construction spills the shards there: a folder it can write first)
            if spec.nvme_path is not None:
                preflight(spec.nvme_path, 0, create=True)
            # the pools as the estimator predicts them, without optimizer state (none is known yet)
            fp = Footprint(items={"params": (0, 0)})   # (the shards' prediction moves or drops it)
            self.shards.predict(fp, sizes, working.itemsize)
            self.predict_pool(fp, sizes, None, working, master, ())   # (optimizer=cpu: no tile pool)
            self.check_ram(sum(host for _, host in fp.items.values()), "at least ")
        try:
            agree_room(self.dist, spec.nvme_path or temp_root(), need, check,
                       verb="need at least", made=self._made if spec.nvme_path else None)
        except BaseException:
            self.close()
            raise

    def check_ram(self, pools: int, bound: str) -> None:
        available = available_ram()
        if available is not None and pools > available:
            raise ConfigError(f"offload: the swap buffer pools need {bound}{pools / GiB:.2f} GiB ({pools} bytes) of "
                              f"host memory but {available / GiB:.2f} GiB is available; lower offload.buffer_count, "
                              f"offload.sub_group_size, offload.param_buffer_count or offload.max_in_cpu")

    def folder(self) -> str:
        if self.spec.nvme_path is not None:
            return self.spec.nvme_path
        if self._made.tmpdir is None:   # library use without a run directory: a private folder
            self._made.tmpdir, self._made.lock = make_private(temp_root())
            say(f"nvme: offload.nvme_path is not set: the swap files go to {self._made.tmpdir} (removed at "
                "close or exit; if this process is killed, by the next run without offload.nvme_path)", sys.stdout)
        return self._made.tmpdir

    def write_swap(self, store: DiskStore, kind: str, check: Callable[[], None], fills: Iterable, what: str) -> None:
        """Room agreed, ``check()`` passed: open ``store``'s file, ``create`` each (key, fill); a failure stops all."""
        stores = {"optim": self.stores.get(Tier.DISK), "params": self.shards.store}
        if not self._fs_checked and (fs := memory_fs(self.folder())) is not None:
            # the swap files would take RAM (shared memory, not in the process's resident set), not disk
            say(f"warning: offload.nvme_path={self.folder()} is on {fs}, which keeps files in host memory: the "
                "swap files will take RAM, not disk; set offload.nvme_path to a folder on a disk")
        self._fs_checked = True
        # what pre-flight makes (the run directory's nvme/, or offload.nvme_path's missing folders): removed at close
        agree_swap_room(self.dist, self.folder(), stores, check,
                        made=self._made if self.spec.nvme_path is not None else None)
        failed, aio = None, self.spec.aio
        try:
            rank, world = (self.dist.rank, self.dist.world) if self.dist is not None else (0, 1)
            path = swap_path(self.folder(), rank, kind)
            store.open(path, AsyncIO(aio.block_size, aio.queue_depth, aio.intra_op_parallelism), rank, world)
            self._made.files.append(store.file.removal)   # removed before the folder it is in
            slot, _, total, _ = store.layout()
            held = "fp32 master + optimizer state" if kind == "optim" else "zero3 parameter shards"
            # the full path: a relative offload.nvme_path is relative to the launch directory, not the run's
            say(f"nvme: rank {rank} swaps {total} bytes ({total / GiB:.2f} GiB) of {held} to {path.absolute()}; "
                f"host pool {store.buffer_count} x {slot} bytes", sys.stdout)
            for key, fill in fills:
                store.create(key, fill)
            store.flush()
        except Exception as e:   # noqa: BLE001 - agreed on below, re-raised on every rank
            failed = e
        self.agree_io_error(failed, what)

    def agree_io_error(self, error: BaseException | None, what: str) -> None:
        """Every rank raises if some rank's swap IO failed: none is left waiting in a collective. The flag:
        1 setting a swap file up failed (a ConfigError: in use, another layout), 2 its IO."""
        failed = 0 if error is None else 1 if isinstance(error, ConfigError) else 2
        if self.dist is not None and self.dist.world > 1:
            flag = torch.full((1,), failed, dtype=torch.float32, device=self.dist.device)   # no pageable copy
            self.dist.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, what=f"swap IO error flag ({what})")
            failed = int(flag.item())   # host sync: once a step with swap files, every rank must agree
        if error is not None:
            raise error
        if failed == 1:
            raise ConfigError("another rank failed to set up its swap file (its error says why); this rank stops too")
        if failed:
            raise SwapIOError(f"another rank failed while {what} (its error names the file, offset and tensor); "
                              f"this rank stops too")

    def close(self) -> None:
        try:
            super().close()
        finally:
            self._remove_made()


class DiskPlacement(NVMePlacement):
    """offload=nvme, ``optimizer: nvme``: the first ``host_fraction`` of each partition in tiles of at
    most ``sub_group_size`` elements in the optimizer's swap file (tier DISK).

    zero3's owned gradients (``swap_grads``) end each tile's entry (the store's read-only tail). A
    reduction is added into a transient partition (zeros, or read back), copied on the D2H stream into
    one of two pinned staging buffers, written from there on a thread of its own and dropped; its squared
    norm is kept on the last micro batch, so clipping and the step are bitwise those of in-memory
    partitions. With several micro batches a second thread reads the partition reduced next (last step's
    order) into one of two pinned landings ahead of its hook; a read takes the landing freed longest ago,
    so it waits for the copy to the device queued a hook earlier, not the one just queued."""

    tier = Tier.DISK
    grad_dtype: torch.dtype | None = None    # the gradients' accumulation dtype, while swapped
    read_back = False                        # swapped and more than one micro batch a step: partitions read back
    writer: ThreadPoolExecutor | None = None
    reader: ThreadPoolExecutor | None = None

    @property
    def tile(self) -> int:
        return self.spec.sub_group_size

    def bind(self, acc: Accelerator) -> None:
        super().bind(acc)
        self.stores[Tier.DISK] = DiskStore(acc, pin=self.pin, buffer_count=self.spec.buffer_count, name="optimizer",
                                           read_ahead=self.spec.pipeline_read, write_behind=self.spec.pipeline_write)

    def predict_pool(self, fp: Footprint, sizes: Sequence[int], chunk: int | None, working: torch.dtype,
                     master: torch.dtype, state: Sequence[int]) -> None:
        """Each tile's master, state and swapped gradient in the file; in a slot its 16-bit staging too."""
        grad = [self.grad_dtype.itemsize] if self.grad_swap else []
        tiles = [([w * (b - a) for w in (master.itemsize, *state, *grad)],
                  [working.itemsize * (b - a)] if working != master else [], len(grad))
                 for n in sizes for a, b, tier in self.ranges(n, chunk) if tier is Tier.DISK]
        if tiles:
            slot, slots, nbytes, bounce = pool_layout(tiles, self.spec.buffer_count)
            fp.add("nvme_optimizer_pool", host=slots * slot + bounce)
            fp.add_disk("optimizer", nbytes)
            if self.grad_swap:
                fp.add("nvme_grad_staging", host=self.staging_bytes(sizes))
            if self.read_back:
                fp.add("nvme_grad_read_back", host=self.staging_bytes(sizes) + bounce)   # landings, bounce buffer

    def _largest(self, sizes: Iterable[int] | None = None) -> int:
        """Elements of the largest partition (of ``sizes``, else of those placed): a read-back landing's."""
        return max(sizes if sizes is not None else (p.numel() for p in self.partitions), default=0)

    def staging_bytes(self, sizes: Iterable[int] | None = None) -> int:   # the staging buffers, or the landings
        return 2 * self._largest(sizes) * self.grad_dtype.itemsize

    def _partition_buffers(self) -> list[torch.Tensor]:
        """Two pinned host buffers of the largest partition in arenas, as the pools. Pinned whatever
        ``pin_memory`` says: the hooks copy to and from them, and a pageable copy would wait for the device."""
        return [aligned_empty(self._largest(), self.grad_dtype, pin=True, acc=self.acc) for _ in range(2)]

    def memory(self, fp: Footprint, opt_state: Any) -> None:
        super().memory(fp, opt_state)
        if self.grad_swap:
            fp.add("nvme_grad_staging", host=sum(t.nbytes for t in self.staging))
        if self.read_back:
            bounce = self.read_bounce.nbytes if self.read_bounce is not None else 0
            fp.add("nvme_grad_read_back", host=sum(t.nbytes for t, _ in self.landings) + bounce)

    def _off_device(self, own: torch.Tensor, master_dtype: torch.dtype, cut: list[tuple[int, int]]) -> list[Piece]:
        """Placeholders until ``init_opt_state`` registers them with the disk store and fills them."""
        host, pieces = self.stores[Tier.HOST], []
        if not self.grad_swap:   # gradients in host memory: one pinned arena for the partition
            host.reserve([(b - a, master_dtype) for a, b in cut])
        for a, b in cut:   # (a swapped gradient: in the swap file beside the tile, ``swap_grads``)
            grad = parked(b - a, self.grad_dtype) if self.grad_swap else host.allocate(b - a, master_dtype).zero_()
            staging = None if own.dtype == master_dtype else parked(b - a, own.dtype)
            pieces.append(Piece(a, b, parked(b - a, master_dtype), grad, staging, Tier.DISK))
        return pieces

    def _init_state(self, tx, params: Sequence[torch.Tensor]) -> Any:
        """``tx.init(params)``, each disk piece's state made and swapped out one at a time."""
        store: DiskStore = self.stores[Tier.DISK]
        disk, n = [i for i in self.infos if i.tier is Tier.DISK], len(params)
        rest = {i.index for i in self.infos if i.tier is not Tier.DISK}
        states, owner = [init_groups(tx, params, rest)], [0] * n
        for info in disk:
            # The piece's master is parked (zero strides): its new state tensors are contiguous,
            # and ``add`` parks them at once, so only one piece's state exists at a time.
            owner[info.index] = len(states)
            states.append(init_groups(tx, params, {info.index}))
            grad = [info.grad] if self.grad_swap else []
            store.add(info.index, [info.master, *group_state(states[-1], n, info.index), *grad],
                      [info.staging] if info.staging is not None else [], readonly=len(grad))
        full = merge_groups(states, owner)
        if self.grad_swap:   # the threads that write the partitions and (``read_back``) read them back
            thread = partial(ThreadPoolExecutor, max_workers=1, initializer=self.acc.bind_thread)
            self.writer = thread(thread_name_prefix="grad-swap")
            self.reader = thread(thread_name_prefix="grad-read") if self.read_back else None
            for info in disk:
                self.grad_pieces.setdefault(info.group, []).append(info)

        def fill(info):   # initial values: the working values and a fresh state, written out
            values = self.shards.initial_values(info.partition, info.start, info.end)
            self.acc.copy(info.master, values)   # blocking: setup
            fresh = group_state(init_groups(tx, params, {info.index}), n, info.index)
            for dst, src in zip(group_state(full, n, info.index), fresh):
                dst.copy_(src)
            if self.grad_swap:
                info.grad.zero_()
        self.write_swap(store, "optim", lambda: self._preflight(store),
                        ((info.index, partial(fill, info)) for info in disk),
                        "writing the initial state to the swap files")
        # Made at setup (a page-locked allocation in a backward hook would wait for the device), after the
        # pre-flight, which counts them: memory pinned before it would be counted twice.
        if self.grad_swap:
            self.staging = deque(self._partition_buffers())
        if self.read_back:
            self.landings = [(t, None) for t in self._partition_buffers()]
            self.free = deque([0, 1])
            self.read_bounce = store.new_bounce()
        return full

    def _preflight(self, store: DiskStore) -> None:
        """Room on the disk, a writable folder and host memory for the pool: one line otherwise."""
        slot, slots, total, bounce = store.layout(self.spec.buffer_count)   # (never more slots than tiles)
        store.buffer_count = slots
        preflight(self.folder(), total, create=True)
        grads = self.staging_bytes() if self.grad_swap else 0
        if self.read_back:   # as many landings and a bounce buffer
            grads += self.staging_bytes() + bounce
        self.check_ram(store.buffer_count * slot + bounce + grads, "")

    def mapped_state(self, params: Sequence[torch.Tensor], opt_state: Any, *, write: bool
                     ) -> tuple[list[torch.Tensor], Any, Any]:
        """Every disk piece's master and state as views of the mapped swap file (no host copy)."""
        if write:   # (a load also repairs what a step cut short left, if its abort could not)
            self.recover()
        fmap, views = self.stores[Tier.DISK].mapped(write)
        out, groups = list(params), {}
        for info in self.infos:
            if info.tier is Tier.DISK:   # (a swapped gradient, last, is not part of the state)
                out[info.index], *groups[info.index] = views[info.index][:len(views[info.index]) - self.grad_swap]
        return out, replace_groups(opt_state, len(params), groups), fmap

    def unmapped(self, fmap: Any) -> None:
        self.stores[Tier.DISK].unmapped(fmap)

    def recover(self) -> None:
        """As ``Placement.recover``; the swapped gradients' threads done with what was queued (a future Ctrl-C
        lost too), their stale bookkeeping dropped and every landing free again."""
        if self.grad_swap and self.writer is not None:
            self.stores[Tier.DISK].interrupt()   # (this thread holds none of its locks now: the threads need them)
            for pool in (self.writer, self.reader):   # (one thread each: the jobs before this one have run)
                if pool is not None:
                    pool.submit(int).exception()
            self.grad_error = None   # (only this failed step's gradients, never applied, were lost: no state)
            for stale in (self.pending, self.reads, self.writes, self.norms):
                stale.clear()
            if self.read_back:
                self.free = deque(range(len(self.landings)))
        super().recover()

    # zero3's owned gradients in the swap file (class docstring)
    def swap_grads(self, accum_dtype: torch.dtype, grad_accum: int) -> bool:
        """With every piece stepped by the host; a partition is read back only with ``grad_accum`` > 1."""
        if self.host_fraction == 1.0:
            self.grad_swap, self.grad_dtype, self.read_back = True, accum_dtype, grad_accum > 1
            self.norms: dict[int, torch.Tensor] = {}  # group -> squared norm of its final partition
            self.grad_pieces: dict[int, list] = {}    # group -> its disk Pieces, in order
            self.pending: deque[Future] = deque()     # queued partition writes, oldest first
            self.writes: dict[int, Future] = {}       # group -> its latest write (its extents hold this step's sums)
            self.grad_error: BaseException | None = None   # failed in a backward hook: agreed on after it
            self.reads: dict[int, tuple[Future, int]] = {}   # group -> its read back (future, landing index)
            self.follow: dict[int, int] = {}          # group -> the group reduced after it last time
            self.last: int | None = None              # the group saved last
            self.staging: deque[torch.Tensor] = deque()   # two pinned buffers the partitions are copied into
            self.landings: list[tuple[torch.Tensor, Any]] = []   # two pinned buffers and their last copy's event
            self.free: deque[int] = deque()           # landings no read holds, freed longest ago first
            self.read_bounce: torch.Tensor | None = None   # the reader thread's ``read_extent`` buffer
        return self.grad_swap

    def load_grad(self, group: int) -> torch.Tensor:
        """Group ``group``'s partition so far this step, on the device: zeros, or its extents read back (the
        hook waits for the reader thread only; the copy goes on the H2D stream)."""
        acc, numel = self.acc, self.partitions[group].numel()
        if group not in self.writes:
            return torch.zeros(numel, dtype=self.grad_dtype, device=acc.device)
        if not self.read_back:   # (one micro batch a step: each group is reduced once, as its final sum)
            raise FrameworkError(f"internal error: zero3's swapped gradient partition {group} was reduced twice "
                                 f"in a step set up for one micro batch (no read-back buffers were made)")
        future, k = self.reads.pop(group, None) or self._read_back(group)
        try:
            host = future.result()   # IO wait (the write it reads waited for the previous micro batch only)
        except BaseException as e:
            self.free.append(k)      # (the read wrote nothing the device reads)
            if not isinstance(e, Exception):
                raise
            self.grad_error = self.grad_error or e   # (zeros: backward goes on on every rank)
            return torch.zeros(numel, dtype=self.grad_dtype, device=acc.device)
        buf = torch.empty(numel, dtype=self.grad_dtype, device=acc.device)
        copied = copy_on(acc, self.h2d_stream, buf, host)   # (after the current stream's uses of buf's memory)
        copied.wait()
        self.landings[k] = (self.landings[k][0], copied)   # reused once this copy is done
        self.free.append(k)
        return buf

    def _read_back(self, group: int) -> tuple[Future, int]:
        """Queue group ``group``'s extents -> a free pinned buffer (reader thread), after its latest write."""
        k = self.free.popleft()   # (two: one read ahead, one read in the hook; not the one just copied from)
        landing, copied = self.landings[k]
        return self.reader.submit(self._read_grads, group, self.writes.get(group), landing, copied), k

    def _read_grads(self, group: int, write: Future | None, landing: torch.Tensor, copied) -> torch.Tensor:
        """(the reader thread) The group's extents, once written, -> ``landing``, once no copy reads it."""
        if write is not None:
            write.result()       # its extents hold the previous micro batch's sums (raises its failure)
        if copied is not None:
            copied.synchronize()   # sync point: the last copy from this buffer, off the backward thread
        host = landing[:self.partitions[group].numel()]
        self.acc.host_use(writes=[host])
        pieces = self.grad_pieces.get(group, ())
        if sum(i.end - i.start for i in pieces) != host.numel():
            host.zero_()
        store = self.stores[Tier.DISK]
        for info in pieces:   # (its own bounce buffer: the writer thread uses the store's meanwhile)
            store.read_extent(info.index, host[info.start:info.end], self.read_bounce)
        return host

    def _drop_reads(self) -> None:
        """(outside the hooks) Reads ahead no reduction took, waited for: their buffers are free again."""
        for future, k in self.reads.values():
            future.exception()
            self.free.append(k)
        self.reads.clear()

    def save_grad(self, group: int, buf: torch.Tensor, final: bool) -> None:
        """``buf`` -> the group's gradient extents; on the last micro batch (``final``) its squared norm is kept."""
        if final:
            self.norms[group] = sq_norm_part(buf, self.acc.device)   # on the device, no host sync
        self.acc.use(writes=[buf])   # the reduction added into it on this stream (after its copy from the host)
        try:
            self._wait_writes(keep=1)   # back-pressure: the oldest write finishes first
        except Exception as e:   # noqa: BLE001 - raised on every rank once backward ends (``finish_grads``)
            self.grad_error = self.grad_error or e
        # At most the previous write is pending now: the other staging buffer is free
        host = self.staging[0][:buf.numel()]
        self.staging.rotate(-1)
        copied = copy_on(self.acc, self.d2h_stream, host, buf)   # after the reduction
        self.acc.record_stream(buf, self.d2h_stream)   # (the caller drops it: the copy may still read it)
        self.pending.append(self.writer.submit(self._write_grads, group, host, copied))
        self.writes[group] = self.pending[-1]
        if self.last is not None:
            self.follow[self.last] = group
        self.last = group
        # read back the group reduced next last time, unless a read ahead is still unused (a hook must not
        # wait for it) or there is nothing to read
        nxt = self.follow.get(group)
        if self.read_back and not self.reads and nxt in self.writes and nxt not in self.norms:
            self.reads[nxt] = self._read_back(nxt)

    def _write_grads(self, group: int, host: torch.Tensor, copied) -> None:
        """(the writer thread) ``host`` -> the group's extents, once its copy from the device is done."""
        copied.synchronize()   # sync point: this partition's copy only, off the backward thread
        for info in self.grad_pieces.get(group, ()):
            self.stores[Tier.DISK].write_extent(info.index, host[info.start:info.end])

    def _wait_writes(self, keep: int = 0) -> None:   # (raises the first failure)
        while len(self.pending) > keep:
            self.pending.popleft().result()

    def finish_grads(self) -> None:
        """After backward: each partition's extents hold this step's gradient, its norm known; a failure stops all."""
        try:
            self._wait_writes()
            for group, part in enumerate(self.partitions):
                if group not in self.norms and part.numel():   # reduced on an earlier micro batch only, or never
                    self.save_grad(group, self.load_grad(group), final=True)
            self._drop_reads()   # (one read ahead for a reduction that did not come)
            self._wait_writes()
        except Exception as e:   # noqa: BLE001 - agreed on below, re-raised on every rank
            self.grad_error = self.grad_error or e
        error, self.grad_error = self.grad_error, None
        self.agree_io_error(error, "writing or reading back zero3's gradients in the swap file")

    def grad_sq_norm_local(self) -> torch.Tensor:
        """This rank's squared norm over its partitions, summed as ``utils.sq_norm`` sums them."""
        parts = [self.norms[g] for g, part in enumerate(self.partitions) if part.numel()]
        return torch.stack(parts).sum() if parts else torch.zeros((), dtype=torch.float64, device=self.acc.device)

    def readable_grads(self, grads: Sequence[torch.Tensor]) -> Iterable[torch.Tensor]:
        """Swapped: each piece's gradient read into a host buffer, one at a time (the overflow report)."""
        if not self.grad_swap:
            return grads
        self._wait_writes()
        store = self.stores[Tier.DISK]
        return (store.read_extent(i.index, self.acc.empty_host(i.end - i.start, self.grad_dtype, pinned=False))
                for i in self.infos)

    def clear_grads(self) -> None:
        """A new step: the extents' contents are stale."""
        for f in self.pending:   # (after a failed step: a queued write must not land later)
            f.exception()
        self._drop_reads()
        self.grad_error = None
        for done in (self.pending, self.writes, self.norms):
            done.clear()

    def close(self) -> None:
        if self.writer is not None:
            self.clear_grads()
            self.writer.shutdown(wait=True)
            if self.reader is not None:
                self.reader.shutdown(wait=True)
            self.writer = self.reader = None
        super().close()
