"""The offload target: where a rank's master partition, optimizer state and zero3 parameter shards
live, and how they move.

A sharded stage is built with its offload target and talks to it only through these calls (no
attribute of either is read or set by the other):

* setup: ``place(own, master_dtype, chunk, real=...)`` once per owned partition, in master order.
  It cuts the partition into pieces (the first ``host_fraction`` stepped off the device, in
  ``chunk``-element pieces; the rest on the device) and returns them; their masters are what the
  optimizer updates. zero3 also allocates its parameter shards here (``shard_buffer``) and loads
  them for a gather through ``loading`` / ``load_shard``.
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

Each tier (``conf/offload``) is one class, chosen once by its ``build``, overriding only what differs:

* ``Placement`` (here), offload=none: every partition is one piece on the device, stepped in place.
* ``cpu.HostPlacement``: the first ``offload.ratio`` of each partition in host memory (tier HOST).
* ``_swap.NVMePlacement`` (offload=nvme, optimizer=cpu): host pieces plus what every swapping tier
  needs (the swap folder, pre-flight, agreement on IO errors); ``_disk.DiskPlacement``
  (optimizer=nvme): pieces whose master and optimizer state live in a swap file (tier DISK).

Where zero3's parameter shards live (``offload.params``) is a second, independent choice: the
placement's ``shards``, a ``Shards`` (here: on the device), ``cpu.HostShards`` (pinned host memory)
or ``_disk.DiskShards`` (a swap file). What the pipeline needs about pieces it gets from
``pieces()`` (``PieceInfo``), not from the stage. Stores (``_store.py``) hold the pieces of each
tier; every copy and every stream or event decision goes through the accelerator
(``framework.comm.accelerator``).
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

import torch

from framework.comm.accelerator import Accelerator, Event, for_device
from framework.core.footprint import Footprint
from framework.core.utils import tensor_bytes
from framework.offload._store import DeviceStore, HostStore, Tier


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


class Shards:
    """Where zero3's parameter shards live between gathers: here, on the compute device. The
    placement ``p`` that holds it (``bind``) lends its accelerator, streams and host store."""

    params_on_host = False
    store = None   # the DiskStore of shards in a swap file

    def bind(self, placement: Placement) -> None:
        self.p = placement

    def buffer(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.zeros(numel, dtype=dtype, device=device)

    def filled(self, shard: torch.Tensor) -> None:
        """Construction wrote ``shard``'s initial values."""

    def initial_values(self, own: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """Elements [lo, hi) of partition ``own``'s initial working values (setup)."""
        return own[lo:hi]

    @contextmanager
    def loading(self):
        yield []   # on the current stream: nothing to wait for

    def load(self, dst: torch.Tensor, shard: torch.Tensor) -> None:
        self.p.acc.on_device(dst, what="zero3 gather buffer")
        self.p.acc.copy(dst, shard)

    def write(self, shard: torch.Tensor, values: torch.Tensor) -> None:
        self.p.acc.copy(shard, values)

    def working(self, partitions: list[torch.Tensor]) -> list[torch.Tensor]:
        """Of ``partitions``, those the compute stream reads and writes directly."""
        return partitions

    def copy_back(self, info: PieceInfo, dst: torch.Tensor, src: torch.Tensor, after: Event | None) -> Event | None:
        """A host piece's updated values ``src`` -> its working range ``dst``: on the H2D stream after
        ``after``; returns the copy's event (None: nothing queued off the current stream)."""
        acc = self.p.acc
        acc.on_device(dst, what="copy back destination")
        with acc.stream(self.p.h2d_stream):
            if after is not None:
                after.wait()
            acc.copy(dst, src, non_blocking=self.p.pin)
            done = acc.event()
            done.record()
        return done

    def flush(self) -> None:
        """Every copy back of the step was queued."""

    def read_errors(self) -> None:
        """Every rank raises if some rank's shard read failed (after backward)."""

    def swap_out(self) -> None:
        """End of setup: the shards go to their swap file, if they have one."""

    def memory(self, fp: Footprint, shards: Sequence[torch.Tensor]) -> None:
        fp.add("params", device=tensor_bytes(shards))

    def close(self) -> None:
        pass


class Placement:
    """The offload target of one rank. On its own it is the device tier (offload=none); the
    other tiers override ``_off_device`` (what becomes of the first ``host_fraction`` of each
    partition) and the hooks their swap files need."""

    host_fraction = 0.0   # the first fraction of each partition is stepped off the device
    pin = False           # host buffers page-locked (copies to and from them asynchronous)
    overlap_step = False  # speculative host step during backward (``_pipeline``)
    grad_swap = False     # zero3's owned gradients live in the optimizer's swap file (``_disk``)

    def __init__(self, shards: Shards | None = None, accelerator: Accelerator | None = None):
        self.shards = shards if shards is not None else Shards()
        self.dist = None      # (``connect``)
        self.acc: Accelerator | None = None
        self.infos: list[PieceInfo] = []
        self.partitions: list[torch.Tensor] = []   # the working partition of each group
        self.listener: GradListener | None = None
        if accelerator is not None:
            self.bind(accelerator)

    # --- accelerator and stores ------------------------------------------------------------

    def bind(self, acc: Accelerator) -> None:
        self.acc = acc
        self.stores = {Tier.HOST: HostStore(acc, self.pin), Tier.DEVICE: DeviceStore()}
        # Copies between host and device, ordered by events: one stream per direction, so gradient
        # copies to the host never queue behind shard loads or copies back (nor the reverse).
        self.d2h_stream = acc.new_stream("offload d2h")   # gradient copies to the host
        self.h2d_stream = acc.new_stream("offload h2d")   # zero3 shard loads, copies back
        self.shards.bind(self)

    def _bind_device(self, device: torch.device) -> None:
        if self.acc is None:  # built without initialize (tests): the device the stage works on
            self.bind(for_device(device))

    def connect(self, dist) -> None:
        """The process group of the stage (``initialize`` calls it)."""
        self.dist = dist

    def swaps(self) -> bool:
        """Whether some state lives in swap files (offload=nvme)."""
        return False

    def expect(self, numel: int, param_dtype: torch.dtype) -> None:
        """zero3, before construction (``numel``: about this rank's share of the parameters): a tier
        with swap files stops now with one line if the disk or host memory cannot hold them."""

    # --- setup -------------------------------------------------------------------------------

    def place(self, own: torch.Tensor, master_dtype: torch.dtype, chunk: int | None = None,
              real: int | None = None) -> list[Piece]:
        """Master pieces of one owned partition ``own`` (the working values), of which the first
        ``real`` elements hold parameters (default: all).

        The host part is cut into pieces of ``chunk`` elements: the unit in which the pipeline
        copies gradients, steps and copies back."""
        self._bind_device(own.device)
        group, n = len(self.partitions), own.numel()
        real = n if real is None else real
        k = round(self.host_fraction * n)
        pieces = self._off_device(own, master_dtype, k, chunk)
        if k < n:  # kept with the working values; fp32 training updates them in place
            rest = own[k:]
            pieces.append((Tier.DEVICE, Piece(k, n, rest if rest.dtype == master_dtype else rest.to(master_dtype),
                                              None)))
        for tier, p in pieces:
            self.infos.append(PieceInfo(len(self.infos), group, p.start, p.end, max(0, min(p.end, real) - p.start),
                                        tier, p, own))
        self.partitions.append(own)
        return [p for _, p in pieces]

    def _off_device(self, own: torch.Tensor, master_dtype: torch.dtype, k: int,
                    chunk: int | None) -> list[tuple[Tier, Piece]]:
        """The pieces of ``own[:k]``, stepped off the device (none here: ``k`` is 0)."""
        return []

    def pieces(self) -> list[PieceInfo]:
        """Every piece, in master order."""
        return list(self.infos)

    def has_host_pieces(self) -> bool:
        """Whether some piece is stepped by the host (in host memory or swapped from disk)."""
        return any(i.tier is not Tier.DEVICE for i in self.infos)

    def swapped_indices(self) -> set[int]:
        """Positions (master order) of the pieces in the swap file."""
        return {i.index for i in self.infos if i.tier is Tier.DISK}

    def swapped(self, piece: Piece) -> bool:
        """Whether ``piece`` lives in the swap file (tier DISK)."""
        return any(i.piece is piece and i.tier is Tier.DISK for i in self.infos)

    def init_opt_state(self, tx, params: Sequence[torch.Tensor]) -> Any:
        """The optimizer state of ``params`` (the pieces' masters, in order)."""
        return tx.init(list(params))

    # --- memory ----------------------------------------------------------------------------------

    def memory(self, fp: Footprint, opt_state: Any) -> None:
        """The pieces' masters (where separate from the working values), gradient and staging
        buffers and optimizer state (``opt_state``, aligned with ``pieces()``), by where they live."""
        from framework.optimizers import group_state

        for info in self.infos:
            self._piece_memory(fp, info, tensor_bytes(group_state(opt_state, len(self.infos), info.index)))

    def _piece_memory(self, fp: Footprint, info: PieceInfo, state: int) -> None:
        p = info.piece
        if info.tier is Tier.DEVICE:
            separate = p.master.data_ptr() != info.partition[info.start:].data_ptr()
            fp.add("master_params", device=tensor_bytes([p.master]) if separate else 0)
            fp.add("optimizer_state", device=state)
        else:   # tier HOST
            fp.add("master_params", host=tensor_bytes([p.master]))
            fp.add("host_grad_buffers", host=tensor_bytes([p.grad]))
            fp.add("host_staging", host=tensor_bytes([p.staging] if p.staging is not None else []))
            fp.add("optimizer_state", host=state)

    def shard_memory(self, fp: Footprint, shards: Sequence[torch.Tensor]) -> None:
        """zero3's parameter shards, where ``shards`` keeps them."""
        self.shards.memory(fp, shards)

    # --- zero3's owned gradients (``_disk``: in the optimizer's swap file) ---------------------

    def swap_grads(self, accum_dtype: torch.dtype) -> bool:
        """zero3, before placing its partitions: whether the owned gradient partitions live in the
        optimizer's swap file; then the stage calls ``load_grad`` / ``save_grad`` around each
        reduction, ``finish_grads`` after backward and ``grad_sq_norm_local`` for the norm."""
        return False

    def clear_grads(self) -> None:
        pass

    def readable_grads(self, grads: Sequence[torch.Tensor]):
        """``grads`` (aligned with ``pieces()``), readable by the host one at a time."""
        return grads

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
        acc = self.acc
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
        # the stage's gather wrote them, forward/backward read them
        self.acc.use(writes=self.shards.working(self.partitions))
        mark = self.acc.event()
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
        if info.tier is Tier.DEVICE:
            self.acc.copy(dst, src)   # on the compute stream, in order
            return None
        self.acc.on_host(src, what="copy back source")
        return self.shards.copy_back(info, dst, src, after)

    def working_ready(self, copies: Sequence[Event]) -> None:
        """The compute stream waits for the copies back before the stage's gather reads the working values."""
        self.shards.flush()
        for ev in copies:
            ev.wait()
        self.acc.use(reads=self.shards.working(self.partitions))

    def publish(self) -> None:
        """Every piece's updated values -> the working partitions (outside the pipeline: the plain
        update, or values loaded into the master pieces)."""
        after = self.working_used()
        copies = [ev for info in self.infos if (ev := self._publish(info, after)) is not None]
        self.working_ready(copies)

    def _publish(self, info: PieceInfo, after: Event) -> Event | None:
        ev = self.copy_back(info, after)
        if ev is not None:   # the host waits for this copy before writing the piece
            store = self.stores[info.tier]
            store.release(store.acquire(info.index), ev)
        return ev

    def out16(self) -> list[torch.Tensor] | None:
        """Where the optimizer also writes the updated values in the working dtype, one per master
        piece: a host piece's staging buffer (what travels back), else the working slice itself.
        None unless some host piece stages (16-bit training with offload). The caller's host code
        may write the staging buffers at once: copies still reading them are waited for."""
        if all(i.piece.staging is None for i in self.infos):
            return None
        for store in self.stores.values():
            store.flush()
        return [i.piece.staging if i.piece.staging is not None else i.working for i in self.infos]

    # --- zero3 parameter shards (``shards``) ----------------------------------------------------

    @property
    def params_on_host(self) -> bool:
        return self.shards.params_on_host

    def shard_buffer(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A zeroed zero3 parameter shard, where ``shards`` keeps them."""
        self._bind_device(device)
        return self.shards.buffer(numel, dtype, device)

    def shard_filled(self, shard: torch.Tensor) -> None:
        """zero3, construction: ``shard`` holds its initial values (shards on disk leave host memory now)."""
        self.shards.filled(shard)

    def loading(self):
        """Around ``load_shard`` and issuing the gather that reads the loaded slice; yields a list
        of waits the current stream makes before it consumes the unit (filled on leaving)."""
        return self.shards.loading()

    def load_shard(self, dst: torch.Tensor, shard: torch.Tensor) -> None:
        """``shard`` -> ``dst`` (this rank's slice of a gather buffer, on the device), inside ``loading``."""
        self.shards.load(dst, shard)

    def store_shard(self, shard: torch.Tensor, values: torch.Tensor) -> None:
        """``values`` (device) -> ``shard`` (framework.gathered's modifications; blocking)."""
        self.shards.write(shard, values)

    def reset_master(self, pieces: Sequence[Piece], shard: torch.Tensor, values: torch.Tensor) -> None:
        """``values`` (the partition, device) -> the master of every piece that is not ``shard`` itself."""
        for p in pieces:
            if p.master.data_ptr() != shard[p.start:].data_ptr():
                self.acc.copy(p.master, values[p.start:p.end])

    def read_errors(self) -> None:
        """Every rank raises if some rank's zero3 shard read failed since the last call (the pipeline
        calls it after backward, a point every rank reaches each step)."""
        self.shards.read_errors()

    # --- the update ------------------------------------------------------------------------------

    def make_update(self, tx, gather: Callable[[], None]):
        """The piece pipeline over the host pieces; it listens to the stage from now on."""
        from framework.offload._pipeline import PiecePipeline  # it builds on this module
        self.listener = PiecePipeline(tx, self, gather, speculative=self.overlap_step)
        return self.listener

    def step_errors(self, failed: BaseException | None) -> None:
        """After the host step: raise ``failed`` (a swapping tier: on every rank, if any failed)."""
        if failed is not None:
            raise failed

    def mapped_state(self, params: Sequence[torch.Tensor], opt_state: Any, *, write: bool
                     ) -> tuple[list[torch.Tensor], Any, Any]:
        """(params, opt_state, map): the state as a checkpoint reads (``write``: writes) it; a tier
        with a swap file replaces its pieces by views of the file mapped into memory (``map``, else
        None; after writing, pass it to ``unmapped``)."""
        return list(params), opt_state, None

    def unmapped(self, fmap: Any) -> None:
        """After writing through ``mapped_state(write=True)``: the next step reads the written values."""

    def close(self) -> None:
        """Settle the stores; remove the swap files (also after an error)."""
        self.shards.close()
        for store in self.stores.values():
            (store.close if hasattr(store, "close") else store.flush)()
