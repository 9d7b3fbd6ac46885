"""The offload target: where a rank's master partition, optimizer state and zero3 parameter shards
live, and how they move. A stage talks to it only through these calls:

* setup: ``place`` cuts each owned partition into master pieces (``ranges``); zero3 gets its shards
  from ``shard_buffer``. ``predict`` says from sizes alone what ``memory`` will measure.
* backward: ``grads_final(g, lo, hi, grad)``: range [lo, hi) of partition g's reduced gradient is
  final (each element at most once a step); ``grads(parts)`` then returns every piece's gradient.
* update: ``make_update`` returns the piece pipeline (``_pipeline.py``) when there are host pieces;
  otherwise None: the stage steps itself and calls ``publish()``.

Tiers override only what differs: ``Placement`` (offload=none), ``cpu.HostPlacement`` (HOST),
``_disk.NVMePlacement`` and ``_disk.DiskPlacement`` (DISK). zero3's shards live in ``Shards``,
``cpu.HostShards`` or ``_diskshards.DiskShards``, which zero3 calls directly (``placement.shards``).
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import torch

from framework.comm.accelerator import Accelerator, Event, for_device
from framework.core.errors import SwapIOError
from framework.core.footprint import Footprint
from framework.core.utils import tensor_bytes
from framework.offload._store import HostStore, Tier, copy_on, recorded
from framework.optimizers import group_state


PIECE_ALIGN = 128   # elements: pieces of a (so aligned) partition start 256-byte aligned for 16-bit dtypes


@dataclass(frozen=True, eq=False)
class Piece:
    """One master piece: a range of an owned partition, its buffers and where it is stepped."""

    start: int               # range within the partition
    end: int
    master: torch.Tensor     # fp32 (master dtype) values of that range, on host or device
    grad: torch.Tensor | None  # host buffer the gradients are copied into (None: use a view)
    # Host pieces of 16-bit training: the optimizer writes the updated values here in the
    # working dtype (the C++ kernels in the same pass), so half the bytes travel back.
    staging: torch.Tensor | None = None
    tier: Tier = Tier.DEVICE
    # set by ``place``:
    index: int = 0           # position in master order (the optimizer's group index)
    group: int = 0           # the partition it belongs to (order of ``place`` calls)
    real: int = 0            # elements of the range that hold parameters (padding is never reported final)
    partition: torch.Tensor | None = None  # the working partition (the tensor object: its storage may move to a pool slot)

    @property
    def working(self) -> torch.Tensor:
        """Its range of the working partition; made on use: a kept view would pin a swapped shard's memory."""
        return self.partition[self.start:self.end]


class Shards:
    """Where zero3's parameter shards live between gathers: here, on the compute device (placement ``p``)."""

    params_on_host = False   # on the host: the compute stream reads them only through ``load``
    store = None   # the DiskStore of shards in a swap file

    def bind(self, placement: Placement) -> None:
        self.p = placement

    def buffer(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.zeros(numel, dtype=dtype, device=device)

    def recover(self) -> None:
        """After a step cut short at any line (``Placement.recover``): nothing held (shards on disk)."""

    def filled(self, shard: torch.Tensor) -> None:
        """zero3, construction: ``shard`` holds its initial values (shards on disk leave host memory now)."""

    def initial_values(self, own: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        return own[lo:hi]

    @contextmanager
    def loading(self):
        """Around ``load`` and its gather; yields the waits the current stream makes before it consumes the unit."""
        yield []   # on the current stream: nothing to wait for

    def load(self, dst: torch.Tensor, shard: torch.Tensor) -> None:
        self.p.acc.on_device(dst, what="zero3 gather buffer")
        self.p.acc.copy(dst, shard)

    def write(self, shard: torch.Tensor, values: torch.Tensor) -> None:
        self.p.acc.copy(shard, values)

    def copy_back(self, info: Piece, dst: torch.Tensor, src: torch.Tensor, after: Event) -> Event | None:
        """``src`` -> ``dst`` on the H2D stream after ``after``; the copy's event (None: none queued)."""
        self.p.acc.on_device(dst, what="copy back destination")
        return copy_on(self.p.acc, self.p.h2d_stream, dst, src, after, non_blocking=self.p.pin)

    def flush(self) -> None:
        """Every copy back of the step was queued."""

    def read_errors(self) -> None:
        """After backward: every rank raises if some rank's shard read failed."""

    def swap_out(self) -> None:
        """End of setup: the shards go to their swap file, if any."""

    def memory(self, fp: Footprint, shards: Sequence[torch.Tensor]) -> None:
        fp.add("params", **{"host" if self.params_on_host else "device": tensor_bytes(shards)})

    def predict(self, fp: Footprint, sizes: Sequence[int], itemsize: int) -> None:
        """Move the estimator's ``params`` item (on the device) to where ``memory`` finds them."""
        if self.params_on_host:
            device, host = fp.items["params"]
            fp.items["params"] = (0, device + host)

    def close(self) -> None:
        pass


class Placement:
    """The offload target of one rank; on its own the device tier (offload=none)."""

    host_fraction = 0.0   # the first fraction of each partition is stepped off the device
    pin = False           # host buffers page-locked (copies to and from them asynchronous)
    overlap_step = False  # speculative host step during backward (``_pipeline``)
    grad_swap = False     # zero3's owned gradients live in the optimizer's swap file (``_disk``)
    swaps = False         # some state lives in swap files (offload=nvme)
    tier = Tier.DEVICE    # where the pieces off the device live
    tile: int | None = None   # no piece off the device is longer (None: only ``chunk`` bounds them)

    def __init__(self, shards: Shards | None = None, accelerator: Accelerator | None = None):
        self.shards = shards if shards is not None else Shards()
        self.dist = None      # (``connect``)
        self.acc: Accelerator | None = None
        self.infos: list[Piece] = []   # every piece, in master order
        self.partitions: list[torch.Tensor] = []   # the working partition of each group
        # A weak reference to the ``_pipeline.PiecePipeline`` hearing from the stage once ``make_update`` built it
        self.listener: Callable[[], Any] | None = None
        if accelerator is not None:
            self.bind(accelerator)

    def bind(self, acc: Accelerator) -> None:
        self.acc = acc
        self.stores = {Tier.HOST: HostStore(acc, self.pin)}   # (device pieces need none: stepped in place)
        # Copies between host and device, ordered by events: one stream per direction, so gradient
        # copies to the host never queue behind shard loads or copies back (nor the reverse).
        self.d2h_stream = acc.new_stream("offload d2h")   # gradient copies to the host
        self.h2d_stream = acc.new_stream("offload h2d")   # zero3 shard loads, copies back
        self.shards.bind(self)

    def _bind_device(self, device: torch.device) -> None:
        if self.acc is None:  # built without initialize (tests): the device the stage works on
            self.bind(for_device(device))

    def connect(self, dist) -> None:
        self.dist = dist

    def expect(self, sizes: Sequence[int], working: torch.dtype, master: torch.dtype) -> None:
        """zero3, before construction (``sizes``: each unit group's partition): stop now if swap files cannot fit."""

    def ranges(self, n: int, chunk: int | None) -> list[tuple[int, int, Tier]]:
        """(start, end, tier) of the pieces ``place`` cuts a partition of ``n`` elements into."""
        k = round(self.host_fraction * n)
        step = max(1, min(chunk or k, self.tile or k))
        # As few pieces as ``step`` allows, of one length within PIECE_ALIGN (a pool slot holds the longest:
        # a short remainder would leave slots never filled), cut on PIECE_ALIGN multiples where that fits.
        count = max(1, -(-k // step))
        unit = PIECE_ALIGN if -(-k // (count * PIECE_ALIGN)) * PIECE_ALIGN <= step else 1
        ends = [min(k, -(-k // unit) * i // count * unit) for i in range(count + 1)]
        cut = [(a, b, self.tier) for a, b in zip(ends, ends[1:]) if a < b]   # (none when k is 0)
        return cut + [(k, n, Tier.DEVICE)] if k < n else cut

    def place(self, own: torch.Tensor, master_dtype: torch.dtype, chunk: int | None = None,
              real: int | None = None) -> list[Piece]:
        """Master pieces of owned partition ``own`` (its first ``real`` elements hold parameters)."""
        self._bind_device(own.device)
        group, n = len(self.partitions), own.numel()
        real = n if real is None else real
        cut = self.ranges(n, chunk)
        pieces = self._off_device(own, master_dtype, [(a, b) for a, b, tier in cut if tier is not Tier.DEVICE])
        # kept with the working values (``to`` returns them as they are): fp32 training updates them in place
        pieces += [Piece(a, b, own[a:b].to(master_dtype), None) for a, b, tier in cut if tier is Tier.DEVICE]
        pieces = [replace(p, index=len(self.infos) + i, group=group, real=max(0, min(p.end, real) - p.start),
                          partition=own) for i, p in enumerate(pieces)]
        self.infos += pieces
        self.partitions.append(own)
        return pieces

    def _off_device(self, own: torch.Tensor, master_dtype: torch.dtype, cut: list[tuple[int, int]]) -> list[Piece]:
        return []   # the pieces of ranges ``cut`` of ``own``, stepped off the device: none here

    def pieces(self) -> list[Piece]:
        return list(self.infos)

    def swapped_indices(self) -> set[int]:
        """Positions (master order) of the pieces in the swap file."""
        return {i.index for i in self.infos if i.tier is Tier.DISK}

    def init_opt_state(self, tx, params: Sequence[torch.Tensor]) -> Any:
        state = tx.init(list(params))
        for i in self.infos:   # (torch makes a host master's state beside it: host memory, pageable)
            if i.tier is Tier.HOST:
                self.acc.register_host(*group_state(state, len(params), i.index), what="a host piece's optimizer state")
        return state

    def memory(self, fp: Footprint, opt_state: Any) -> None:
        """The pieces' separate masters, host buffers and optimizer state, by where they live."""
        for p in self.infos:
            state = tensor_bytes(group_state(opt_state, len(self.infos), p.index))
            if p.tier is Tier.DEVICE:
                separate = p.master.data_ptr() != p.partition[p.start:].data_ptr()
                fp.add("master_params", device=tensor_bytes([p.master]) if separate else 0)
                fp.add("optimizer_state", device=state)
            elif p.tier is Tier.HOST:
                fp.add("master_params", host=tensor_bytes([p.master]))
                fp.add("host_grad_buffers", host=tensor_bytes([p.grad]))
                fp.add("host_staging", host=tensor_bytes([p.staging] if p.staging is not None else []))
                fp.add("optimizer_state", host=state)
            elif not self.grad_swap:   # DISK: master, state and staging are in the pool; the gradient buffer is not
                fp.add("host_grad_buffers", host=tensor_bytes([p.grad]))
        if Tier.DISK in self.stores:
            self.stores[Tier.DISK].memory(fp, "nvme_optimizer_pool", "optimizer")

    def predict(self, fp: Footprint, sizes: Sequence[int], chunk: int | None, working: torch.dtype,
                master: torch.dtype, state: Sequence[int], real: Sequence[int] | None = None) -> set[str]:
        """What ``memory`` (and the pipeline's) will report, from sizes (``state``: optimizer bytes per element
        per state tensor; ``real``: leading elements of each size holding parameters); items new at the first step."""
        m, k, lazy = master.itemsize, sum(state), set()
        for n, r in zip(sizes, sizes if real is None else real):
            for a, b, tier in self.ranges(n, chunk):
                if tier is Tier.DEVICE:
                    if working != master:
                        fp.add("master_params", device=m * (b - a))
                    fp.add("optimizer_state", device=k * (b - a))
                elif tier is Tier.HOST:
                    fp.add("master_params", host=m * (b - a))
                    fp.add("host_grad_buffers", host=m * (b - a))
                    if working != master:   # written by the first optimizer step
                        fp.add("host_staging", host=working.itemsize * (b - a))
                        lazy.add("host_staging")
                    # allocated by the first speculative step (padding only: never final, never speculated)
                    if self.overlap_step and min(b, r) > a:
                        fp.add("overlap_undo", host=(m + k) * (b - a))
                        lazy.add("overlap_undo")
                    fp.add("optimizer_state", host=k * (b - a))
                else:   # DISK: master, state and staging are in the pool (``predict_pool``)
                    if not self.grad_swap:
                        fp.add("host_grad_buffers", host=m * (b - a))
                    fp.add("optimizer_state")   # (no bytes: the item keeps its place in the estimate's order)
        return lazy

    def predict_pool(self, fp: Footprint, sizes: Sequence[int], chunk: int | None, working: torch.dtype,
                     master: torch.dtype, state: Sequence[int]) -> None:
        """``predict``'s swap file and pool for the disk pieces (none here)."""

    def swap_grads(self, accum_dtype: torch.dtype, grad_accum: int) -> bool:
        """zero3: whether its owned gradient partitions live in the optimizer's swap file (then it calls
        ``load_grad``, ``save_grad``, ``finish_grads`` and ``grad_sq_norm_local``)."""
        return False

    def readable_grads(self, grads: Sequence[torch.Tensor]):
        """``grads`` (aligned with ``pieces()``), readable by the host one at a time."""
        return grads

    def grads_final(self, group: int, lo: int, hi: int, grad: torch.Tensor) -> None:
        if (listener := self._listener()) is not None:
            listener.ready(group, lo, hi, grad)

    def grads(self, parts: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Gradient pieces aligned with ``pieces()`` (master dtype); host pieces have a pipeline."""
        if (listener := self._listener()) is not None:
            return listener.grads(parts)
        return [parts[i.group][i.start:i.end].to(i.master.dtype) for i in self.infos]

    def _listener(self):
        return self.listener() if self.listener is not None else None

    def copy_grad(self, info: Piece, src: torch.Tensor, produced: Event | None = None) -> Event:
        """Queue ``src`` -> the piece's host gradient buffer on the D2H stream; its event: the host may read it."""
        self.acc.on_device(src, what="gradient copy source")
        self.acc.on_host(info.grad, what="gradient copy destination")
        return copy_on(self.acc, self.d2h_stream, info.grad, src, produced, non_blocking=self.pin)

    def working_used(self) -> Event:
        """After the compute stream's last use of the working partitions: copies back wait on it."""
        self.acc.use(writes=[] if self.shards.params_on_host else self.partitions)
        return recorded(self.acc)

    def copy_back(self, info: Piece, after: Event | None) -> Event | None:
        """The piece's updated values -> its working range; the copy's event (None: none off this stream)."""
        # (sliced now: a shard on disk is re-pointed at a pool slot while resident)
        dst = self.partitions[info.group][info.start:info.end]
        src = info.staging if info.staging is not None else info.master
        if src.data_ptr() == dst.data_ptr():
            return None   # fp32 device piece: the optimizer updated the working values in place
        if info.tier is Tier.DEVICE:
            self.acc.copy(dst, src)   # on the compute stream, in order
            return None
        self.acc.on_host(src, what="copy back source")
        return self.shards.copy_back(info, dst, src, after)

    def working_ready(self, copies: Sequence[Event]) -> None:
        """The compute stream waits for the copies back before the stage's gather reads them."""
        self.shards.flush()
        for ev in copies:
            ev.wait()
        self.acc.use(reads=[] if self.shards.params_on_host else self.partitions)

    def publish(self) -> None:
        """Every piece's updated values -> the working partitions (outside the pipeline)."""
        after, copies = self.working_used(), []
        for info in self.infos:
            store = self.stores.get(info.tier)
            if info.tier is Tier.DISK:   # resident while its values are copied back
                store.wait(store.acquire(info.index))
                if info.staging is not None:   # (not swapped: made from the master, as copy_16bit would)
                    info.staging.copy_(info.master)
            ev = self.copy_back(info, after)
            if ev is not None or info.tier is Tier.DISK:   # the host waits for this copy before writing the piece
                store.release(info.index, ev)
            copies += [ev] if ev is not None else []
        self.working_ready(copies)

    def out16(self) -> list[torch.Tensor] | None:
        """Per piece, where the optimizer also writes the 16-bit values (None unless some piece stages)."""
        if all(i.staging is None for i in self.infos):
            return None
        for store in self.stores.values():
            store.flush()
        return [i.staging if i.staging is not None else i.working for i in self.infos]

    def shard_buffer(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A zeroed zero3 parameter shard."""
        self._bind_device(device)
        return self.shards.buffer(numel, dtype, device)

    def write_partition(self, pieces: Sequence[Piece], shard: torch.Tensor, values: torch.Tensor,
                        changed: torch.Tensor) -> None:
        """``values`` -> ``shard`` and, where ``changed`` (a bool mask), the pieces' masters (framework.gathered's
        edits; blocking): an unchanged master keeps its wider values, not ``values``' rounding of them."""
        self.shards.write(shard, values)
        store = self.stores.get(Tier.DISK)
        for p in pieces:
            on_disk = p.tier is Tier.DISK
            if on_disk:   # resident while it is written
                store.wait(store.acquire(p.index))
            if p.master.data_ptr() != shard[p.start:].data_ptr():
                old = p.master.to(values.device)
                self.acc.copy(p.master, torch.where(changed[p.start:p.end], values[p.start:p.end].to(old.dtype), old))
            if on_disk:
                store.release(p.index, None)

    def make_update(self, tx, gather: Callable[[], None]):
        """The piece pipeline, listening to the stage from now on (None: no host pieces, as here)."""
        return None

    def agree_io_error(self, error: BaseException | None, what: str) -> None:
        """After the host step: raise ``error`` (a swapping tier: on every rank, if any failed)."""
        if error is not None:
            raise error

    def mapped_state(self, params: Sequence[torch.Tensor], opt_state: Any, *, write: bool
                     ) -> tuple[list[torch.Tensor], Any, Any]:
        """(params, opt_state, map) as a checkpoint reads or writes them (swap files: mapped views). ``write`` (a
        load: load_state_dict, load_weights, a checkpoint load) runs ``recover`` first on every load, healthy or
        not: a stream synchronize and an IO fence each time, acceptable because loads are rare."""
        if write:   # (a load also repairs what a step cut short left: zero3's shards on disk)
            self.recover()
        return list(params), opt_state, None

    def unmapped(self, fmap: Any) -> None:
        pass

    def recover(self) -> None:
        """After a step cut short at any line (Ctrl-C included), its workers stopped: every store's slots and IO
        settled afresh, so the retry or a load finds them whole (swap files; else nothing to do)."""
        if self.acc is None:
            return
        for stream in (self.h2d_stream, self.d2h_stream):   # copies from slots whose events the cut step lost
            with self.acc.stream(stream):
                recorded(self.acc).synchronize()   # sync point: after a failed step or a load only
        failed = None
        for store in (self.shards, *self.stores.values()):   # each settled; then the first failed write raised
            try:
                store.recover()
            except SwapIOError as e:
                failed = failed or e
        if failed is not None:
            raise failed

    def close(self) -> None:
        """Settle the stores; remove the swap files (also after an error)."""
        try:
            self.shards.close()
        finally:   # (a read failure it raises leaves no store open)
            for store in self.stores.values():
                store.close()
