"""offload=nvme's disk tier: optimizer tiles (``DiskPlacement``) and zero3 parameter shards
(``DiskShards``) in swap files, made resident in pools of pinned host buffers by a ``DiskStore``.

The pipeline acquires a tile (read into a slot), steps it and releases it (written back). zero3's
shards are spilled as construction fills them and swapped out at the end of setup.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from framework.comm.accelerator import Accelerator, Event
from framework.core.errors import ConfigError, SwapIOError
from framework.core.footprint import Footprint
from framework.core.utils import tensor_bytes
from framework.offload._diskstore import DiskStore, pool_layout
from framework.offload._gradswap import GradSwap, Spill, read_into
from framework.offload._room import agree_swap_room
from framework.offload._store import Tier
from framework.offload._swap import NVMePlacement, parked
from framework.offload.base import Piece, PieceInfo
from framework.offload.cpu import HostShards


class DiskPlacement(NVMePlacement):
    """offload=nvme, ``optimizer: nvme``: the first ``host_fraction`` of each partition in tiles of at
    most ``sub_group_size`` elements in the optimizer's swap file (tier DISK)."""

    def __init__(self, *args, **kwargs):
        self.gradswap: GradSwap | None = None   # (``swap_grads``) owned gradients in the swap file
        self._initial: dict[int, tuple] = {}    # disk piece -> (partition, lo, hi) of its working values (setup)
        super().__init__(*args, **kwargs)

    def bind(self, acc: Accelerator) -> None:
        super().bind(acc)
        spec = self.spec
        self.stores[Tier.DISK] = DiskStore(acc, pin=self.pin, buffer_count=spec.buffer_count, read_ahead=spec.read_ahead,
                                           write_behind=spec.write_behind, name="optimizer")

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
            self._initial[len(self.infos) + len(pieces)] = (own, a, b)
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
        self.open_swap(store, "optim", lambda: self._preflight(store))
        if self.gradswap is not None:
            self.gradswap.bind(store, disk, self.acc)
        failed = None
        try:
            for info in disk:   # initial values: the working values and a fresh state, written out
                def fill(info=info):
                    self.acc.copy(info.piece.master, self.shards.initial_values(*self._initial[info.index]))   # blocking: setup
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

    def _preflight(self, store: DiskStore) -> None:
        """Room on the disk, a writable folder, buffers that hold the largest tile: one line otherwise."""
        from framework.offload._swapfile import preflight

        total, slot = sum(store.extents().values()), store.slot_bytes()
        preflight(self.folder(), total, slot, slot, self.spec.buffer_count, min_buffer_count=self.spec.buffer_count,
                  create=True)
        # never more slots than tiles (with the default sub_group_size a partition is one tile)
        store.buffer_count = pool_layout(store.sizes(), self.spec.buffer_count)[1]
        self.check_ram(store.buffer_count * slot + store.bounce_bytes(), "")

    def memory(self, fp: Footprint, opt_state: Any) -> None:
        super().memory(fp, opt_state)
        store_memory(fp, self.stores[Tier.DISK], "nvme_optimizer_pool", "optimizer")

    def _piece_memory(self, fp: Footprint, info: PieceInfo, state: int) -> None:
        if info.tier is not Tier.DISK:
            super()._piece_memory(fp, info, state)
        elif not self.grad_swap:   # master, state and staging are in the pool; the gradient buffer is not
            fp.add("host_grad_buffers", host=tensor_bytes([info.piece.grad]))

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


class DiskShards(HostShards):
    """zero3 parameter shards in their swap file, resident in a pool slot while a gather loads them
    (read ahead in gather order) or the step copies back into them."""

    def __init__(self, spec):
        super().__init__()
        self.spec = spec
        self.keys: dict[int, int] = {}                   # id(shard) -> its key in the store
        self.spill: Spill | None = None                  # shards spilled during construction
        self.held: tuple[int, object] | None = None      # (group, handle): a shard kept resident
        self.read_error: BaseException | None = None     # a failed read, until ranks agree on it

    def bind(self, placement: NVMePlacement) -> None:
        super().bind(placement)
        # Read ahead in the order the shards were loaded last time (zero3's gather order); the
        # slot count is settled at pre-flight (``max_in_cpu``).
        self.store = DiskStore(placement.acc, pin=placement.pin, buffer_count=self.spec.param_buffer_count,
                               read_ahead=True, write_behind=True, name="parameter", learn_order=True)

    @property
    def swapped(self) -> bool:
        """From the end of setup on; until then the shards are in host memory."""
        return self.store.file is not None

    def buffer(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        shard = super().buffer(numel, dtype, device)
        self.keys[id(shard)] = len(self.keys)   # filled by the stage, swapped out in ``swap_out``
        self.store.add(self.keys[id(shard)], [shard], park=False)
        return shard

    def filled(self, shard: torch.Tensor) -> None:
        """Spilled and its memory released, so construction streams."""
        if self.keys.get(id(shard)) is None:
            return
        if self.spill is None:
            from framework.core.files import make_dirs

            folder = self.p.folder()
            make_dirs(folder)   # (0700; removed at close when this run made it)
            self.spill = Spill(folder)
        self.spill.put(shard)
        shard.set_(parked(shard.numel(), shard.dtype).untyped_storage(), 0, shard.shape, (0,))

    def initial_values(self, own: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """From the parameter swap file once the shard is there, else from the spill, else ``own`` itself."""
        key = self.keys.get(id(own))
        if key is not None and self.swapped:   # setup: the bytes were just written through this file
            file, out = self.store.file, torch.empty(hi - lo, dtype=own.dtype, device="cpu")   # read from the file on the host
            short = read_into(file.descriptor(direct=False)[0], out, file.extent(f"{key}.0")[0] + lo * own.element_size())
            if short is not None:
                raise SwapIOError(f"swap file {file.path}: short read at {short}", path=str(file.path),
                                  offset=short, what="initial master values", errno=None)
            return out
        if self.spill is not None and self.spill.has(own):
            return self.spill.read(own, lo, hi)
        return own[lo:hi]

    def swap_out(self) -> None:
        """Before the optimizer's file: the spill is consumed and closed first (never both on disk),
        and the masters' initial values are read back from this file."""
        p, store = self.p, self.store
        agree_swap_room(p.dist, p.folder(), p.swap_stores(), self._preflight)
        failed = None
        try:
            # (with an optimizer file to follow, the ranks agree on both when it is opened)
            p.open_swap(store, "params", self._preflight, collective=Tier.DISK not in p.stores)
            for key in list(store.order):
                store.create(key, self._filler(store.entries[key].swapped[0]))
            store.flush()
            self._close_spill()
        except Exception as e:   # noqa: BLE001
            failed = e
        p.agree(failed, "writing the parameter shards to their swap file")

    def _filler(self, shard: torch.Tensor):
        """``DiskStore.create``'s fill for a shard: from its spill (None: its own values)."""
        if self.spill is None or not self.spill.has(shard):
            return None
        return lambda: self.spill.read(shard, 0, shard.numel(), out=shard)

    def _close_spill(self) -> None:
        if self.spill is not None:
            self.spill.close()
            self.spill = None

    def _preflight(self) -> None:
        """Room on the disk, a writable folder, buffers that hold the largest shard: one line otherwise."""
        from framework.offload._swapfile import preflight

        store, spec = self.store, self.spec
        size = next(iter(store.entries.values())).swapped[0].element_size()
        largest = max(e.swapped[0].numel() for e in store.entries.values())
        preflight(self.p.folder(), sum(store.extents().values()), largest * size, spec.param_buffer_size * size,
                  spec.param_buffer_count, itemsize=size, size_key="offload.param_buffer_size",
                  count_key="offload.param_buffer_count", create=True)
        # Slots are as large as the largest shard (not param_buffer_size: no pinned memory idles);
        # max_in_cpu caps how many shards are resident at once.
        store.buffer_count = pool_layout(store.sizes(), min(spec.param_buffer_count, spec.max_in_cpu // largest))[1]
        if store.buffer_count == 1 < len(store.entries):
            # A slot is reused only once its last copy to the device has finished (polled, see
            # ``DiskStore._free_slot``): with one slot every shard load waits for the previous one.
            print(f"nvme: the zero3 parameter pool has 1 slot, so each shard load waits (in a hook) for the "
                  f"previous shard's copy to the device; allow at least the units prefetched + 1 slots "
                  f"(offload.param_buffer_count, offload.max_in_cpu >= that many x {largest} elements)", flush=True)
        if store.buffer_count < 1:
            raise ConfigError(f"offload buffers too small: offload.max_in_cpu={spec.max_in_cpu} is smaller "
                              f"than the largest parameter shard ({largest} elements): set "
                              f"offload.max_in_cpu >= {largest}")

    def memory(self, fp: Footprint, shards) -> None:
        store_memory(fp, self.store, "nvme_param_pool", "params")

    def load(self, dst: torch.Tensor, shard: torch.Tensor) -> None:
        if not self.swapped:
            return super().load(dst, shard)
        self.p.acc.on_device(dst, what="zero3 gather buffer")
        handle = self.store.acquire(self.keys[id(shard)])   # on the host before the gather (read ahead)
        try:
            self.store.wait(handle, host_writes=False)   # (only copied from: no wait for earlier copies)
        except SwapIOError as e:
            # Raised on every rank at the next agreement (``read_errors``): this rank still takes
            # part in the gather, with zeros, so no peer waits in it forever.
            self.read_error = self.read_error or e
            self.store.release(handle, None, dirty=False)
            dst.zero_()
            return
        self.store.release(handle, self._copy_in(dst, shard), dirty=False)   # its slot is reused after the copy

    def write(self, shard: torch.Tensor, values: torch.Tensor) -> None:
        if not self.swapped:
            return super().write(shard, values)
        handle = self.store.acquire(self.keys[id(shard)])   # resident inside, written back after
        self.store.wait(handle)
        try:
            self.p.acc.copy(shard, values)
        finally:
            self.store.release(handle, None, dirty=True)

    def copy_back(self, info: PieceInfo, dst: torch.Tensor, src: torch.Tensor, after: Event | None) -> Event | None:
        if not self.swapped:
            return super().copy_back(info, dst, src, after)
        # resident for host copies, written once
        self.p.acc.copy(self._hold(info.group)[info.start:info.end], src)
        return None

    def _hold(self, group: int) -> torch.Tensor:
        """Group ``group``'s shard, kept resident across the copies back of its pieces and written back
        once (a write per piece rewrote the whole shard each time: 22 bytes per parameter a step, not 2)."""
        shard = self.p.partitions[group]
        if self.held is not None and self.held[0] == group:
            return shard
        self.flush()
        handle = self.store.acquire(self.keys[id(shard)])
        self.held = (group, handle)
        self.store.wait(handle)
        return shard

    def flush(self) -> None:
        """The shard ``_hold`` keeps (if any) -> written back, released."""
        held, self.held = self.held, None
        if held is not None:
            self.store.release(held[1], None, dirty=True)

    def read_errors(self) -> None:
        if self.swapped:
            error, self.read_error = self.read_error, None
            self.p.agree(error, "reading zero3 parameter shards")

    def close(self) -> None:
        self._close_spill()
        if self.held is not None:   # (a step that failed between a copy back and ``flush``)
            self.store.release(self.held[1], None, dirty=False)
            self.held = None
        self.store.close()


def store_memory(fp: Footprint, store: DiskStore, pool: str, file: str) -> None:
    """A disk store's pool (host memory: its slots and bounce buffer) and its swap file."""
    m = store.memory()
    fp.add(pool, host=m["pool"])
    fp.add_disk(file, m["file"])
