"""The offload target: where a rank's master partition and optimizer state live, and how they move.

A sharded stage is built with its offload target and talks to it only through these calls (no
attribute of either is read or set by the other):

* setup: ``place(own, master_dtype, chunk, real=...)`` once per owned partition, in master order.
  It cuts the partition into pieces (host tier: the first ``host_fraction``, in ``chunk``-element
  pieces; device tier: the rest) and returns them; their masters are what the optimizer updates.
  zero3 also allocates its parameter shards here (``shard_buffer``: pinned host memory with
  ``offload.params``) and loads them for a gather through ``load_shard``.
* backward: the target is the stage's listener. ``grads_final(g, lo, hi, grad)`` says that range
  [lo, hi) of partition g's reduced gradient ``grad`` is final for this step. It is emitted on the
  thread and stream that produced the range, right after queueing the producer; each element is
  reported at most once a step (zero2 reports per bucket, zero3 per unit group after its
  reduction, on the last micro batch; a stage that reports nothing is served after backward by
  ``grads``).
* ``grads(parts)``: the gradient of every piece, in master order (host pieces: their host buffer,
  filled by a copy that the update orders before the host reads it).
* update: ``make_update(tx, gather)`` returns the piece pipeline (``_pipeline.py``) when there are
  host pieces; ``gather()`` is the stage's part (make the working parameters whole after every
  piece was published). Without host pieces the stage steps itself and calls ``publish()``.

* offload=nvme (``disk``): host pieces become DISK pieces whose master and optimizer state live in a
  swap file (``_store.DiskStore``) and zero3's shards may too (``param_store``); ``init_opt_state``
  makes the optimizer state piece by piece and swaps everything out before the first step.

What the pipeline needs about pieces it gets from ``pieces()`` (``PieceInfo``), not from the stage.
Stores (``_store.py``) hold the pieces of each tier; every copy and every stream or event decision
goes through the accelerator (``framework.comm.accelerator``).
"""
from __future__ import annotations

import hashlib
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

import torch

from framework.comm.accelerator import Accelerator, Event, for_device
from framework.core.errors import SwapIOError
from framework.core.units import GiB, MiB
from framework.offload._gradswap import GradSwap, Spill
from framework.offload._room import agree_swap_room
from framework.offload._store import DeviceStore, DiskStore, HostStore, Tier


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


@dataclass(frozen=True)
class Piece:
    start: int               # range within the partition
    end: int
    master: torch.Tensor     # fp32 (master dtype) values of that range, on host or device
    grad: torch.Tensor | None  # host buffer the gradients are copied into (None: use a view)
    # Host pieces of 16-bit training: the optimizer writes the updated values here in the
    # working dtype (the C++ kernels in the same pass), so half the bytes travel back.
    staging: torch.Tensor | None = None


@dataclass(frozen=True)
class PieceInfo:
    """One master piece as the pipeline sees it."""

    index: int               # position in master order (the optimizer's group index)
    group: int               # the partition it belongs to (order of ``place`` calls)
    start: int               # range within the partition
    end: int
    real: int                # elements of the range that hold parameters (padding is never reported final)
    tier: Tier
    piece: Piece
    partition: torch.Tensor  # the working partition (the tensor object: its storage may move to a pool slot)

    @property
    def working(self) -> torch.Tensor:
        """Where its updated values go: its range of the working partition. A view made on use: a
        view kept here would keep a zero3 shard's memory alive after it moved to the swap file."""
        return self.partition[self.start:self.end]


class GradListener(Protocol):
    """What a piece pipeline implements to hear from the stage through its offload target."""

    def ready(self, group: int, lo: int, hi: int, grad: torch.Tensor) -> None: ...
    def grads(self, parts: Sequence[torch.Tensor]) -> list[torch.Tensor]: ...


class Placement:
    """Splits partitions between the host tier (the first ``host_fraction``) and the device tier."""

    def __init__(self, host_fraction: float, pin: bool, params_on_host: bool, overlap_step: bool = False,
                 accelerator: Accelerator | None = None, disk: DiskSpec | None = None):
        self.host_fraction, self.pin, self.params_on_host = host_fraction, pin, params_on_host
        self.disk = disk      # the optimizer's host part lives on disk (tier DISK) instead of in host memory
        self.param_store: DiskStore | None = None   # (``bind``) zero3 shards on disk
        self._read_error: BaseException | None = None   # a failed shard read, until ranks agree on it
        self._shard_keys: dict[int, int] = {}
        self.dist = None      # (``connect``) ranks agree on swap IO errors
        self._initial: dict[int, tuple] = {}   # disk piece -> (partition, lo, hi) of its working values (setup)
        self.gradswap: GradSwap | None = None   # (``swap_grads``) owned gradients in the swap file
        self.spill: Spill | None = None         # zero3 shards spilled during construction
        self._cleaned = False                   # stale swap files looked for (``clean_stale``)
        self._tmpdir: str | None = None
        self._made: str | None = None   # the swap folder, when this run made it
        self.overlap_step = overlap_step  # see framework/offload/_pipeline.py
        self._acc = None
        self.infos: list[PieceInfo] = []
        self.partitions: list[torch.Tensor] = []   # the working partition of each group
        self.listener: GradListener | None = None
        self._shard_reads: dict[int, Event] = {}   # host shard storage address -> its last load's copy
        self._held: tuple[int, object] | None = None   # (group, handle): a zero3 shard on disk kept resident
        if accelerator is not None:
            self.bind(accelerator)

    # --- accelerator and stores ------------------------------------------------------------

    def bind(self, acc: Accelerator) -> None:
        self._acc = acc
        if self.disk is not None:
            _return_freed_memory()
        self.stores = {Tier.HOST: HostStore(acc, self.pin), Tier.DEVICE: DeviceStore()}
        self.param_store: DiskStore | None = None   # zero3 shards on disk (``offload.params=nvme``)
        self._shard_keys: dict[int, int] = {}        # id(shard) -> its key in the param store
        if self.disk is not None and self.disk.optimizer:
            self.stores[Tier.DISK] = DiskStore(acc, pin=self.pin, buffer_count=self.disk.buffer_count,
                                               read_ahead=self.disk.read_ahead, write_behind=self.disk.write_behind,
                                               name="optimizer")
        if self.disk is not None and self.disk.params:
            # Read ahead in the order the shards were loaded last time (zero3's gather order); the
            # slot count is settled at pre-flight (``max_in_cpu``).
            self.param_store = DiskStore(acc, pin=self.pin, buffer_count=self.disk.param_buffer_count,
                                         read_ahead=True, write_behind=True, name="parameter", learn_order=True)
        # Copies between host and device, ordered by events: one stream per direction, so gradient
        # copies to the host never queue behind shard loads or copies back (nor the reverse).
        self.d2h_stream = acc.new_stream("offload d2h")   # gradient copies to the host
        self.h2d_stream = acc.new_stream("offload h2d")   # zero3 shard loads, copies back

    def _bind_device(self, device: torch.device) -> Accelerator:
        if self._acc is None:  # built without initialize (tests): the device the stage works on
            self.bind(for_device(device))
        return self._acc

    @property
    def acc(self) -> Accelerator:
        return self._acc

    def connect(self, dist) -> None:
        """The process group whose ranks agree on swap IO errors (``initialize`` calls it)."""
        self.dist = dist

    # --- setup -------------------------------------------------------------------------------

    def place(self, own: torch.Tensor, master_dtype: torch.dtype, chunk: int | None = None,
              real: int | None = None) -> list[Piece]:
        """Master pieces of one owned partition ``own`` (the working values), of which the first
        ``real`` elements hold parameters (default: all).

        The host part is cut into pieces of ``chunk`` elements: the unit in which the pipeline
        copies gradients, steps and copies back."""
        acc = self._bind_device(own.device)
        group, n = len(self.partitions), own.numel()
        real = n if real is None else real
        k = round(self.host_fraction * n)
        step = chunk or max(k, 1)
        on_disk = self.disk is not None and self.disk.optimizer
        if on_disk:
            step = min(step, self.disk.sub_group_size)
        pieces = []
        host = self.stores[Tier.HOST]
        sizes = []   # the host buffers allocated below, in order: one pinned arena for the partition
        for a in range(0, k, step):
            m = min(a + step, k) - a
            sizes += [] if on_disk and self.grad_swap else [(m, master_dtype)]
            sizes += [] if on_disk else [(m, master_dtype)] + ([] if own.dtype == master_dtype else [(m, own.dtype)])
        host.reserve(sizes)
        for a in range(0, k, step):
            b = min(a + step, k)
            if on_disk and self.grad_swap:   # in the swap file beside the tile (``_gradswap``)
                grad = _parked(b - a, self.grad_dtype)
            else:
                grad = host.allocate(b - a, master_dtype)   # in host memory
                grad.zero_()
            if on_disk:
                # Placeholders until ``init_opt_state`` registers them with the disk store (which
                # points them at a pool slot only while the piece is resident). The initial values
                # are read from ``own`` then (or from the construction spill, ``_gradswap``).
                self._initial[len(self.infos) + len(pieces)] = (own, a, b)
                staging = None if own.dtype == master_dtype else _parked(b - a, own.dtype)
                pieces.append((Tier.DISK, Piece(a, b, _parked(b - a, master_dtype), grad, staging)))
                continue
            master = host.allocate(b - a, master_dtype)
            acc.copy(master, own[a:b])   # blocking: setup
            staging = None if own.dtype == master_dtype else host.allocate(b - a, own.dtype)
            pieces.append((Tier.HOST, Piece(a, b, master, grad, staging)))
        if k < n:  # kept with the working values; fp32 training updates them in place
            rest = own[k:]
            pieces.append((Tier.DEVICE, Piece(k, n, rest if rest.dtype == master_dtype else rest.to(master_dtype),
                                              None)))
        for tier, p in pieces:
            self.infos.append(PieceInfo(len(self.infos), group, p.start, p.end, max(0, min(p.end, real) - p.start),
                                        tier, p, own))
        self.partitions.append(own)
        return [p for _, p in pieces]

    def pieces(self) -> list[PieceInfo]:
        """Every piece, in master order."""
        return list(self.infos)

    def has_host_pieces(self) -> bool:
        """Whether some piece is stepped by the host (in host memory or swapped from disk)."""
        return any(i.tier is not Tier.DEVICE for i in self.infos)

    # --- the disk tier -------------------------------------------------------------------------

    @property
    def grad_swap(self) -> bool:
        return self.gradswap is not None

    @property
    def grad_dtype(self) -> torch.dtype:
        return self.gradswap.dtype

    def swap_grads(self, accum_dtype: torch.dtype) -> bool:
        """zero3, before placing its partitions: whether the owned gradient partitions live in the
        optimizer's swap file (``_gradswap``): with the optimizer on disk and every piece stepped by
        the host. Then the stage calls ``load_grad`` / ``save_grad`` around each reduction."""
        if self.disk is not None and self.disk.optimizer and self.host_fraction == 1.0:
            self.gradswap = GradSwap(accum_dtype)
        return self.grad_swap

    def load_grad(self, group: int, numel: int, device: torch.device) -> torch.Tensor:
        return self.gradswap.load(group, numel, device)

    def save_grad(self, group: int, buf: torch.Tensor, final: bool) -> None:
        self.gradswap.save(group, buf, final, self._acc.device)

    def finish_grads(self, sizes: Sequence[int]) -> None:
        self.gradswap.finish(sizes, self._acc.device)

    def grad_sq_norm_local(self, sizes: Sequence[int]) -> torch.Tensor:
        return self.gradswap.sq_norm(sizes, self._acc.device)

    def clear_grads(self) -> None:
        if self.gradswap is not None:
            self.gradswap.clear()

    def readable_grads(self, grads: Sequence[torch.Tensor]):
        """``grads`` (aligned with ``pieces()``) with swapped gradients read from disk, one at a time."""
        if self.gradswap is None:
            return grads
        return self.gradswap.piece_grads(self.infos)

    def clean_stale(self) -> None:
        """At start-up, before the pre-flight counts free space: swap files that dead processes left
        in ``nvme_path`` are removed, with one line saying what was freed (``remove_stale``)."""
        if self.disk is None or self._cleaned or self.disk.path is None:
            return
        from framework.offload._swapfile import remove_stale

        self._cleaned = True
        count, freed = remove_stale(self.disk.path)
        if count:
            print(f"nvme: removed {count} stale swap file(s) of dead processes from {self.disk.path}, "
                  f"freeing {freed / GiB:.2f} GiB ({freed} bytes)", flush=True)

    def expect(self, numel: int, param_dtype: torch.dtype) -> None:
        """zero3, before construction writes anything (``numel``: about this rank's share of the
        parameters): stop with one line if the disk cannot hold even the states every optimizer
        needs (16-bit shards and their spill, fp32 master, swapped gradients) or the pools
        configured cannot be backed by host memory. The exact checks follow at ``init_opt_state``."""
        if self.disk is None or not numel:
            return
        from framework.core.errors import ConfigError

        self.clean_stale()
        size = torch.empty((), dtype=param_dtype).element_size()
        need = numel * ((4 if self.disk.optimizer else 0) + (4 if self.grad_swap else 0)
                        + (2 * size if self.disk.params else 0))
        folder = self.disk.path
        probe = Path(folder) if folder is not None else Path(tempfile.gettempdir())
        while not probe.exists():
            probe = probe.parent
        free = _free_bytes(probe)
        if need > free:
            raise ConfigError(f"offload.nvme_path={folder}: this rank's {numel} parameters need at least "
                              f"{need / GiB:.2f} GiB ({need} bytes) of swap but its file system has "
                              f"{free / GiB:.2f} GiB free; free space, point offload.nvme_path at a larger disk "
                              f"or use more ranks")
        tile = min(self.disk.sub_group_size, numel)
        pools = self.disk.buffer_count * tile * (4 + (4 if self.grad_swap else 0))
        if self.disk.params:
            pools += min(self.disk.param_buffer_count * self.disk.param_buffer_size, self.disk.max_in_cpu,
                         numel) * size
        self._check_ram(pools, "at least")

    def _check_ram(self, pools: int, bound: str) -> None:
        """One line if host buffers of ``pools`` bytes cannot fit in the memory available now."""
        from framework.core.errors import ConfigError

        available = _available_ram()
        if available is not None and pools > available:
            raise ConfigError(f"offload: the swap buffer pools need {bound} {pools / GiB:.2f} GiB ({pools} bytes) of "
                              f"host memory but {available / GiB:.2f} GiB is available; lower offload.buffer_count, "
                              f"offload.sub_group_size, offload.param_buffer_count or offload.max_in_cpu")

    def shard_filled(self, shard: torch.Tensor) -> None:
        """zero3, construction: ``shard`` holds its initial values. With shards on disk they are
        spilled (``_gradswap.Spill``) and the shard's memory released, so construction streams."""
        if self.param_store is None or self._shard_keys.get(id(shard)) is None:
            return
        if self.spill is None:
            from framework.core.files import make_dirs

            folder = self._folder()
            make_dirs(folder)   # (0700; removed at close when this run made it)
            self.spill = Spill(folder)
        self.spill.put(shard)
        shard.set_(_parked(shard.numel(), shard.dtype).untyped_storage(), 0, shard.shape, (0,))

    def initial_values(self, own: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """Elements [lo, hi) of partition ``own``'s initial working values (setup): from the parameter
        swap file once the shard is there, else from the spill, else ``own`` itself."""
        key = self._shard_keys.get(id(own))
        if key is not None and self._params_swapped():
            import os

            file = self.param_store.file
            size = own.element_size()
            out = torch.empty(hi - lo, dtype=own.dtype)
            view = memoryview(out.view(torch.uint8).numpy())   # host sync: no (a host tensor, setup)
            fd, _ = file.descriptor(direct=False)
            base, done = file.extent(f"{key}.0")[0] + lo * size, 0
            while done < len(view):   # setup: the bytes were just written through this file
                n = os.preadv(fd, [view[done:]], base + done)
                if n <= 0:
                    raise SwapIOError(f"swap file {file.path}: short read at {base + done}", path=str(file.path),
                                      offset=base + done, what="initial master values", errno=None)
                done += n
            return out
        if self.spill is not None and self.spill.has(own):
            return self.spill.read(own, lo, hi)
        return own[lo:hi]

    def spill_filler(self, shard: torch.Tensor):
        """``DiskStore.create``'s fill for a shard: from its spill (None: its own values)."""
        if self.spill is None or not self.spill.has(shard):
            return None
        return lambda: self.spill.read(shard, 0, shard.numel(), out=shard)

    def close_spill(self) -> None:
        if self.spill is not None:
            self.spill.close()
            self.spill = None

    def mapped_state(self, params: Sequence[torch.Tensor], opt_state: Any, *, write: bool
                     ) -> tuple[list[torch.Tensor], Any, Any]:
        """(params, opt_state, map): ``params`` and ``opt_state`` with every disk piece's master and
        optimizer state replaced by views of the swap file mapped into memory (``DiskStore.mapped``),
        so a checkpoint reads (``write``: writes) the swapped state where it lies, with no host copy
        of it. ``map`` is None without a swap file; after writing, pass it to ``unmapped``."""
        from framework.optimizers import replace_groups

        store = self.stores.get(Tier.DISK)
        if store is None:
            return list(params), opt_state, None
        fmap, views = store.mapped(write)
        out, groups = list(params), {}
        for info in self.infos:
            if info.tier is Tier.DISK:   # (a swapped gradient, last, is not part of the state)
                out[info.index], *groups[info.index] = views[info.index][:len(views[info.index]) - self.grad_swap]
        return out, replace_groups(opt_state, len(params), groups), fmap

    def unmapped(self, fmap: Any) -> None:
        """After writing through ``mapped_state(write=True)``: the swap file has the written values
        (synced, checksums refreshed) and the next step reads them."""
        store = self.stores.get(Tier.DISK)
        if store is not None:
            store.unmapped(fmap)

    def swapped_indices(self) -> set[int]:
        """Positions (master order) of the pieces in the swap file."""
        return {i.index for i in self.infos if i.tier is Tier.DISK}

    def swapped(self, piece: Piece) -> bool:
        """Whether ``piece`` lives in the swap file (tier DISK)."""
        return any(i.piece is piece and i.tier is Tier.DISK for i in self.infos)

    def swaps(self) -> bool:
        """Whether some state lives in swap files (offload=nvme)."""
        return Tier.DISK in getattr(self, "stores", {}) or self.param_store is not None

    def init_opt_state(self, tx, params: Sequence[torch.Tensor]) -> Any:
        """``tx.init(params)``, except that each disk piece's state is made one piece at a time and
        swapped out at once, with its master, so host memory never holds more than a slot's worth.
        Then zero3's parameter shards on disk are written out and leave host memory."""
        try:
            return self._init_disk(tx, params)
        except BaseException:
            self.close()   # no swap file outlives a failed start
            raise

    def _init_disk(self, tx, params: Sequence[torch.Tensor]) -> Any:
        from framework.optimizers import group_state, init_groups, merge_groups

        disk = [i for i in self.infos if i.tier is Tier.DISK]
        full = tx.init(list(params)) if not disk else None
        if disk or self.param_store is not None:
            self.clean_stale()
        if self.param_store is not None:   # before any swap file is made: a too-small pool or disk fails now
            agree_swap_room(self.dist, self._folder(), self._swap_stores(),
                            lambda: self._preflight(self.param_store, "params"))
        failed = None
        if self.param_store is not None:
            # The parameter file first: construction's spill is consumed and closed before the
            # optimizer's file is reserved (disk: never both at once), and the masters' initial
            # values are read back from it.
            try:
                self._open_disk(self.param_store, "params")
                for key in list(self.param_store.order):
                    # the shard's values (or their spill) -> its extent; its memory goes
                    self.param_store.create(key, self.spill_filler(self.param_store.entries[key].swapped[0]))
                self.param_store.flush()
                self.close_spill()
            except Exception as e:   # noqa: BLE001
                failed = e
            self.agree(failed, "writing the parameter shards to their swap file")
        if disk:
            store: DiskStore = self.stores[Tier.DISK]
            n = len(params)
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
            self._open_disk(store, "optim")
            if self.gradswap is not None:
                self.gradswap.bind(store, disk, self._acc)
            try:
                for info in disk:   # initial values: the working values and a fresh state, written out
                    def fill(info=info):
                        m = info.piece.master
                        self._acc.copy(m, self.initial_values(*self._initial[info.index]))   # blocking: setup
                        fresh = group_state(init_groups(tx, params, {info.index}), n, info.index)
                        for dst, src in zip(group_state(full, n, info.index), fresh):
                            dst.copy_(src)
                        if self.grad_swap:
                            info.piece.grad.zero_()
                    store.create(info.index, fill)
                store.flush()
            except Exception as e:   # noqa: BLE001 - agreed on below, re-raised on every rank
                failed = e
            self._initial.clear()
        self.agree(failed, "writing the initial state to the swap files")
        return full

    def _folder(self) -> str:
        if self.disk.path is not None:
            if self._made is None and not Path(self.disk.path).exists():
                self._made = self.disk.path   # made by pre-flight (the run directory's nvme/): removed at close
            return self.disk.path
        if self._tmpdir is None:   # library use without a run directory: a private folder
            self._tmpdir = tempfile.mkdtemp(prefix="framework-nvme-")
        return self._tmpdir

    def _preflight(self, store: DiskStore, kind: str) -> None:
        """Room on the disk, a writable folder, buffers that hold the largest tile: one line otherwise."""
        from framework.core.errors import ConfigError
        from framework.offload._aio import preflight

        total, slot = sum(store.extents().values()), store.slot_bytes()
        if kind == "optim":
            preflight(self._folder(), total, slot, slot, self.disk.buffer_count,
                      min_buffer_count=self.disk.buffer_count, create=True)
            # never more slots than tiles (with the default sub_group_size a partition is one tile)
            store.buffer_count = min(self.disk.buffer_count, len(store.entries))
            pools = store.buffer_count * slot + store.bounce_bytes()
            if self.param_store is not None and self.param_store.file is None:
                pools += self.param_store.buffer_count * self.param_store.slot_bytes()
            self._check_ram(pools, "")
            return
        shard = next(iter(store.entries.values())).swapped[0]
        size = shard.element_size()
        largest = max(e.swapped[0].numel() for e in store.entries.values())
        preflight(self._folder(), total, largest * size, self.disk.param_buffer_size * size,
                  self.disk.param_buffer_count, itemsize=size, size_key="offload.param_buffer_size",
                  count_key="offload.param_buffer_count", create=True)
        # Slots are as large as the largest shard (not param_buffer_size: no pinned memory idles);
        # max_in_cpu caps how many shards are resident at once.
        store.buffer_count = min(self.disk.param_buffer_count, self.disk.max_in_cpu // largest, len(store.entries))
        if store.buffer_count == 1 < len(store.entries):
            # A slot is reused only once its last copy to the device has finished (polled, see
            # ``DiskStore._free_slot``): with one slot every shard load waits for the previous one.
            print(f"nvme: the zero3 parameter pool has 1 slot, so each shard load waits (in a hook) for the "
                  f"previous shard's copy to the device; allow at least the units prefetched + 1 slots "
                  f"(offload.param_buffer_count, offload.max_in_cpu >= that many x {largest} elements)", flush=True)
        if store.buffer_count < 1:
            raise ConfigError(f"offload buffers too small: offload.max_in_cpu={self.disk.max_in_cpu} is smaller "
                              f"than the largest parameter shard ({largest} elements): set "
                              f"offload.max_in_cpu >= {largest}")

    def _swap_stores(self) -> dict:
        return {"optim": self.stores.get(Tier.DISK), "params": self.param_store}

    def _open_disk(self, store: DiskStore, kind: str) -> None:
        """Pre-flight, then the swap file, the IO engine and the pool (before the first step)."""
        from framework.offload._aio import AsyncIO, aligned_empty, swap_path
        from framework.offload._swapfile import SwapFile

        rank = self.dist.rank if self.dist is not None else 0
        world = self.dist.world if self.dist is not None else 1
        # every rank at once (the first swap file made: all ranks come here together)
        agree_swap_room(self.dist, self._folder(), self._swap_stores(), lambda: self._preflight(store, kind),
                        collective=kind == "optim" or Tier.DISK not in self.stores)
        extents = store.extents()
        total, slot = sum(extents.values()), store.slot_bytes()
        dtype = next(iter(store.entries.values())).swapped[0].dtype   # the extents' element type
        layout = hashlib.sha256(repr((world, rank, sorted(extents.items()))).encode()).hexdigest()[:16]
        path = swap_path(self._folder(), rank, kind)
        file = SwapFile.create(path, extents, layout_hash=layout, world_size=world, rank=rank, dtype=dtype)
        try:
            io = AsyncIO(self.disk.block_size, self.disk.queue_depth, self.disk.intra_op_parallelism)
            pool = aligned_empty(store.buffer_count * slot, torch.uint8, pin=self.pin, acc=self._acc)
        except BaseException:
            file.remove()
            raise
        store.open(file, io, pool)
        what = "fp32 master + optimizer state" if kind == "optim" else "zero3 parameter shards"
        print(f"nvme: rank {rank} swaps {total} bytes ({total / GiB:.2f} GiB) of {what} to {path}; "
              f"host pool {store.buffer_count} x {slot} bytes", flush=True)

    def agree(self, error: BaseException | None, what: str) -> None:
        """Every rank learns whether some rank's swap IO failed, and raises (no rank is left waiting
        in a collective). Sync point: a one-element all-reduce, once a step with a disk tier."""
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
        """Settle the stores; remove the swap files (also after an error)."""
        self.close_spill()
        if self._held is not None:   # (a step that failed between a copy back and working_ready)
            self.param_store.release(self._held[1], None, dirty=False)
            self._held = None
        if self.gradswap is not None:
            self.gradswap.close()
        try:
            for store in [*self.stores.values(), *([self.param_store] if self.param_store else [])]:
                (store.close if hasattr(store, "close") else store.flush)()
        finally:
            if self._tmpdir is not None:
                import shutil
                shutil.rmtree(self._tmpdir, ignore_errors=True)
                self._tmpdir = None
            if self._made is not None:
                try:
                    Path(self._made).rmdir()   # only if empty: never what another run keeps there
                except OSError:
                    pass
                self._made = None

    def shard_buffer(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A zeroed zero3 parameter shard: on the device, or pinned on the host (``offload.params``)."""
        self._bind_device(device)
        if not self.params_on_host:
            return torch.zeros(numel, dtype=dtype, device=device)
        shard = self.stores[Tier.HOST].allocate(numel, dtype)
        shard.zero_()
        if self.param_store is not None:   # filled by the stage, swapped out in ``init_opt_state``
            self._shard_keys[id(shard)] = len(self._shard_keys)
            self.param_store.add(self._shard_keys[id(shard)], [shard], park=False)
        return shard

    # --- the stage's listener and gradients --------------------------------------------------

    def grads_final(self, group: int, lo: int, hi: int, grad: torch.Tensor) -> None:
        if self.listener is not None:
            self.listener.ready(group, lo, hi, grad)

    def grads(self, parts: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Gradient pieces aligned with ``pieces()`` (master dtype)."""
        if self.listener is not None:
            return self.listener.grads(parts)
        out = []
        for info in self.infos:
            g = parts[info.group][info.start:info.end]
            if info.tier is not Tier.DEVICE:  # no pipeline (a stage driven by hand): copy and wait
                self.copy_grad(info, g).synchronize()
                g = info.piece.grad
            out.append(g if g.dtype == info.piece.master.dtype else g.to(info.piece.master.dtype))
        return out

    def copy_grad(self, info: PieceInfo, src: torch.Tensor, produced: Event | None = None) -> Event:
        """Queue ``src`` (device) -> the piece's host gradient buffer on the D2H stream, after
        ``produced`` (default: an event recorded now on the current stream, where ``src`` is final);
        the returned event says when the host may read the buffer."""
        acc = self._acc
        acc.on_device(src, what="gradient copy source")
        acc.on_host(info.piece.grad, what="gradient copy destination")
        if produced is None:
            produced = acc.event()
            produced.record()
        with acc.stream(self.d2h_stream):
            produced.wait()
            acc.copy(info.piece.grad, src, non_blocking=self.pin)
            done = acc.event()
            done.record()
        return done

    # --- publishing ----------------------------------------------------------------------------

    def working_used(self) -> Event:
        """An event after the compute stream's last use of the working partitions (forward,
        backward and the previous gather): copies back into them wait on it."""
        self._acc.use(writes=self._device_partitions())  # the stage's gather wrote them, forward/backward read them
        mark = self._acc.event()
        mark.record()
        return mark

    def copy_back(self, info: PieceInfo, after: Event | None) -> Event | None:
        """The piece's updated values (staging, else master) -> its working range. Host -> device
        copies run on the H2D stream after ``after``; returns their event (None: nothing queued
        off the current stream)."""
        p = info.piece
        # (sliced now: a shard on disk is re-pointed at a pool slot while resident)
        dst = self.partitions[info.group][info.start:info.end]
        src = p.staging if p.staging is not None else p.master
        if src.data_ptr() == dst.data_ptr():
            return None   # fp32 device piece: the optimizer updated the working values in place
        acc = self._acc
        if info.tier is Tier.DEVICE:
            acc.copy(dst, src)   # on the compute stream, in order
            return None
        acc.on_host(src, what="copy back source")
        if self._params_swapped():   # zero3 shard on disk: resident for host copies, written once
            acc.copy(self._hold_shard(info.group)[info.start:info.end], src)
            return None
        if self.params_on_host:  # zero3 shard on the host: a host copy, once its loads are done
            self._settle_shard(dst)
            acc.copy(dst, src)
            return None
        acc.on_device(dst, what="copy back destination")
        with acc.stream(self.h2d_stream):
            if after is not None:
                after.wait()
            acc.copy(dst, src, non_blocking=self.pin)
            done = acc.event()
            done.record()
        return done

    def _hold_shard(self, group: int) -> torch.Tensor:
        """Group ``group``'s zero3 shard on disk, resident in the pool and kept so across the copies
        back of the group's pieces (one after another in the step), then written back once: when
        another group's turn comes, or at ``working_ready``. (A write per piece would write the
        whole shard once per piece of the group: at sub_group_size 10 M and 113 M-element layers,
        22 bytes per parameter per step instead of 2, measured.)"""
        if self._held is not None and self._held[0] == group:
            return self.partitions[group]
        self._write_held()
        store, shard = self.param_store, self.partitions[group]
        handle = store.acquire(self._shard_keys[id(shard)])
        self._held = (group, handle)
        store.wait(handle)
        return shard

    def _write_held(self) -> None:
        """The shard ``_hold_shard`` keeps resident (if any) -> written back, released."""
        held, self._held = self._held, None
        if held is not None:
            self.param_store.release(held[1], None, dirty=True)

    def working_ready(self, copies: Sequence[Event]) -> None:
        """The compute stream waits for the copies back before the stage's gather reads the working values."""
        self._write_held()
        for ev in copies:
            ev.wait()
        self._acc.use(reads=self._device_partitions())

    def _device_partitions(self) -> list[torch.Tensor]:
        # zero3 shards on the host are read by the compute stream only through ``load_shard``.
        return [] if self.params_on_host else self.partitions

    def publish(self) -> None:
        """Every piece's updated values -> the working partitions (outside the pipeline: the plain
        update, or values loaded into the master pieces)."""
        after, copies = self.working_used(), []
        for info in self.infos:
            store, handle = self.stores[info.tier], None
            if info.tier is Tier.DISK:   # resident while its values are copied back
                handle = store.acquire(info.index)
                store.wait(handle)
                if info.piece.staging is not None:   # (not swapped: made from the master, as copy_16bit would)
                    info.piece.staging.copy_(info.piece.master)
            ev = self.copy_back(info, after)
            if ev is not None:
                copies.append(ev)
            if handle is not None or ev is not None:
                # the host waits for this copy before writing the piece (a later event of the same stream)
                store.release(handle or store.acquire(info.index), ev)
        self.working_ready(copies)

    def out16(self) -> list[torch.Tensor] | None:
        """Where the optimizer also writes the updated values in the working dtype, one per master
        piece: a host piece's staging buffer (what travels back), else the working slice itself.
        None unless some host piece stages (16-bit training with offload). The caller's host code
        may write the staging buffers at once: copies still reading them are waited for."""
        if all(i.piece.staging is None for i in self.infos):
            return None
        self.stores[Tier.HOST].flush()
        if Tier.DISK in self.stores:
            self.stores[Tier.DISK].flush()
        return [i.piece.staging if i.piece.staging is not None else i.working for i in self.infos]

    # --- zero3 parameter shards ----------------------------------------------------------------

    @contextmanager
    def loading(self):
        """Around ``load_shard`` and issuing the gather that reads the loaded slice. Host shards: both
        are queued on the H2D stream, behind the current stream's work so far (the gather buffer is
        fresh memory whose last users ran there), so a prefetch hides the copy and the gather; the
        current stream waits only where it consumes the unit: the gather's wait, and the waits
        yielded here (filled on leaving; at world size 1 on CUDA there is no collective to wait for).
        Device shards: the current stream, nothing to wait for."""
        waits: list[Callable[[], None]] = []
        if not self.params_on_host:
            yield waits
            return
        acc = self._acc
        fresh = acc.event()
        fresh.record()
        with acc.stream(self.h2d_stream):
            fresh.wait()
            yield waits
            issued = acc.event()
            issued.record()
        waits.append(issued.wait)

    def load_shard(self, dst: torch.Tensor, shard: torch.Tensor) -> None:
        """``shard`` -> ``dst`` (this rank's slice of a gather buffer, on the device), queued on the
        current stream: inside ``loading``, which issues host shards' copies (and their gather) on
        the H2D stream."""
        acc = self._acc
        acc.on_device(dst, what="zero3 gather buffer")
        if not self.params_on_host:
            acc.copy(dst, shard)
            return
        handle = None
        if self._params_swapped():   # on the host before the gather (read ahead in gather order)
            handle = self.param_store.acquire(self._shard_keys[id(shard)])
            try:
                self.param_store.wait(handle, host_writes=False)   # (only copied from: no wait for earlier copies)
            except SwapIOError as e:
                # Raised on every rank at the next agreement (``read_errors``): this rank still takes
                # part in the gather, with zeros, so no peer waits in it forever.
                self._read_error = self._read_error or e
                self.param_store.release(handle, None, dirty=False)
                dst.zero_()
                return
        acc.on_host(shard, what="zero3 host shard")
        acc.copy(dst, shard, non_blocking=self.pin)   # the gather reads it on this stream next
        done = acc.event()
        done.record()
        if handle is not None:
            self.param_store.release(handle, done, dirty=False)   # its slot is reused after the copy
            return
        self._shard_reads[shard.untyped_storage().data_ptr()] = done

    def store_shard(self, shard: torch.Tensor, values: torch.Tensor) -> None:
        """``values`` (device) -> ``shard`` (framework.gathered's modifications; blocking)."""
        if self._params_swapped():
            with self._shard_resident(shard, dirty=True) as resident:
                self._acc.copy(resident, values)
            return
        if self.params_on_host:
            self._settle_shard(shard)
        self._acc.copy(shard, values)

    def reset_master(self, pieces: Sequence[Piece], shard: torch.Tensor, values: torch.Tensor) -> None:
        """``values`` (the partition, device) -> the master of every piece that is not ``shard`` itself."""
        disk = self.stores.get(Tier.DISK)
        for p in pieces:
            info = next((i for i in self.infos if i.piece is p), None)
            if disk is not None and info is not None and info.tier is Tier.DISK:
                handle = disk.acquire(info.index)
                disk.wait(handle)
                self._acc.copy(p.master, values[p.start:p.end])
                disk.release(handle, None)
            elif p.master.data_ptr() != shard[p.start:].data_ptr():
                self._acc.copy(p.master, values[p.start:p.end])

    def read_errors(self) -> None:
        """Every rank raises if some rank's zero3 shard read failed since the last call (the pipeline
        calls it after backward, a point every rank reaches each step)."""
        if self._params_swapped():
            error, self._read_error = self._read_error, None
            self.agree(error, "reading zero3 parameter shards")

    def _params_swapped(self) -> bool:
        """zero3 shards live on disk (from the end of setup on; until then in host memory)."""
        return self.param_store is not None and self.param_store.file is not None

    @contextmanager
    def _shard_resident(self, shard: torch.Tensor, dirty: bool):
        """A zero3 shard on disk, resident in the pool inside the block (written back if ``dirty``)."""
        store = self.param_store
        handle = store.acquire(self._shard_keys[id(shard)])
        store.wait(handle)
        try:
            yield shard
        finally:
            store.release(handle, None, dirty=dirty)

    def _settle_shard(self, shard: torch.Tensor) -> None:
        """The host is about to write a host shard: wait for the copy that last read it (if any)."""
        done = self._shard_reads.pop(shard.untyped_storage().data_ptr(), None)
        if done is not None:
            done.synchronize()

    # --- the update ------------------------------------------------------------------------------

    def make_update(self, tx, gather: Callable[[], None]):
        """The piece pipeline over the host pieces; it listens to the stage from now on."""
        from framework.offload._pipeline import PiecePipeline  # it builds on this module
        self.listener = PiecePipeline(tx, self, gather, speculative=self.overlap_step)
        return self.listener


def _return_freed_memory() -> None:
    """glibc: blocks of 1 MiB or more are mmapped, so freeing one returns it to the kernel at once.
    By default the threshold rises to 32 MiB after the first such free, and a freed buffer below
    it (a unit group's gradient partition, a parameter being initialised) stays in the heap: with
    the model on disk, resident memory would then creep with the model's size. A process-wide
    allocator setting (not module state); without glibc nothing changes."""
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


def _free_bytes(path: Path) -> int:
    import os
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _available_ram() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024   # host sync: no (text of /proc/meminfo)
    except OSError:
        return None
    return None


def _parked(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A placeholder of ``numel`` elements that holds no memory (zero strides over one element)."""
    return torch.empty(0, dtype=dtype, device="cpu").set_(
        torch.zeros(1, dtype=dtype, device="cpu").untyped_storage(), 0, (numel,), (0,))
