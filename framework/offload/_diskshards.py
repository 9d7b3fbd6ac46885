"""zero3's parameter shards on NVMe (``offload.params=nvme``): each shard spilled as construction
fills it, swapped out to its swap file at the end of setup, and made resident in a slot of a
``DiskStore`` pool while a gather loads it or the step copies back into it."""
from __future__ import annotations

import os
import tempfile

import torch

from framework.comm.accelerator import Event
from framework.core.errors import ConfigError, FrameworkError, SwapIOError
from framework.core.files import make_dirs, read_into, write_at
from framework.core.footprint import Footprint
from framework.offload._disk import NVMePlacement
from framework.offload._diskstore import DiskStore, park_tensor, pool_layout
from framework.offload._swapfile import nvme_fix, os_reason
from framework.offload._swapfolder import NVMeOffloadConfig, preflight
from framework.offload.base import Piece
from framework.offload.cpu import HostShards


class DiskShards(HostShards):
    """zero3 parameter shards in their swap file (module docstring)."""

    def __init__(self, spec: NVMeOffloadConfig):
        super().__init__()
        self.spec = spec
        self.keys: dict[int, int] = {}                   # id(shard) -> its key in the store
        self.spill: int | None = None                    # the construction spill's descriptor
        self.spilled: dict[int, int] = {}                # id(shard) -> its offset in the spill
        self.held: tuple[int, int] | None = None         # (group, key): a shard kept resident
        self.read_error: BaseException | None = None     # a failed read, until ranks agree on it
        self.spill_error: SwapIOError | None = None      # a failed spill, until the swap file's pre-flight agrees on it
        self.closed = False                              # the swap file is gone: its shards hold nothing

    def bind(self, placement: NVMePlacement) -> None:
        super().bind(placement)
        # read ahead in zero3's gather order of last time; the slot count is settled at pre-flight. Pinned whatever
        # pin_memory says, as HostShards: the hooks load from the slots
        self.store = DiskStore(placement.acc, pin=True, buffer_count=self.spec.param_buffer_count,
                               read_ahead=True, write_behind=True, name="parameter", learn_order=True)

    @property
    def swapped(self) -> bool:   # from the end of setup on; until then the shards are in host memory
        return self.store.file is not None

    def buffer(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        shard = super().buffer(numel, dtype, device)
        self.keys[id(shard)] = len(self.keys)   # filled by the stage, swapped out in ``swap_out``
        self.store.add(self.keys[id(shard)], [shard], park=False)
        return shard

    def filled(self, shard: torch.Tensor) -> None:
        """Appended to an unlinked temporary file, its memory released: nothing model-sized stays resident."""
        if id(shard) not in self.keys:
            return
        if self.spill_error is not None:   # (its values are not needed: the run stops at the end of setup)
            return park_tensor(shard)
        folder = self.p.folder()
        try:   # (the pre-flight saw a writable folder with room: another process may have taken either since)
            if self.spill is None:
                make_dirs(folder)   # (0700; removed at close when this run made it)
                self.spill, path = tempfile.mkstemp(prefix=".construction-", suffix=".spill", dir=folder)
                os.unlink(path)   # its space is freed when the descriptor closes, whatever ends the process
            at = self.spilled[id(shard)] = os.fstat(self.spill).st_size   # appended at its end
            write_at(self.spill, shard.detach(), at)   # (a host shard)
        except OSError as e:
            self._close_spill()
            # said by ``_preflight``, agreed: the other ranks are in construction's broadcasts, none may stop alone
            self.spill_error = SwapIOError(
                f"nvme: cannot spill the zero3 parameter shards to {folder} while the model is built (a temporary file "
                f"there, before their swap file is written): {os_reason(e)}; {nvme_fix(e)}", path=folder,
                what="construction spill", errno=e.errno)
        park_tensor(shard)

    def initial_values(self, own: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """Read back from the parameter swap file (``swap_out`` just wrote it there)."""
        key = self.keys.get(id(own))
        if key is None:   # not swapped: the shard holds its values (the others: after ``swap_out``)
            return own[lo:hi]
        file, out = self.store.file, torch.empty(hi - lo, dtype=own.dtype, device="cpu")
        short = read_into(file.descriptor(direct=False)[0], out, file.extent(f"{key}.0")[0] + lo * own.element_size())
        if short is not None:
            raise SwapIOError(f"swap file {file.path}: short read at {short}", path=str(file.path),
                              offset=short, what="initial master values", errno=None)
        return out

    def swap_out(self) -> None:
        """Before the optimizer's file (the spill is closed first: never both on disk)."""
        store = self.store
        self.p.write_swap(store, "params", self._preflight,
                          ((key, self._filler(store.entries[key].swapped[0])) for key in list(store.entries)),
                          "writing the parameter shards to their swap file")
        self._close_spill()

    def _filler(self, shard: torch.Tensor):   # ``DiskStore.create``'s fill: from the spill (None: its own values)
        at = self.spilled.get(id(shard))
        if at is None:
            return None

        def fill():   # (``write_swap`` stops every rank on its error)
            try:
                short = read_into(self.spill, shard, at)
                why = None if short is None else f"short read at {short}"
            except OSError as e:
                why = os_reason(e)
            if why is not None:
                raise SwapIOError(f"nvme: cannot read the zero3 parameter shards back from their construction spill "
                                  f"in {self.p.folder()} (offset {at}): {why}; check the disk, or set "
                                  f"offload.nvme_path to a folder on another one", path=self.p.folder(), offset=at,
                                  what="construction spill", errno=None)
        return fill

    def _close_spill(self) -> None:
        if self.spill is not None:
            os.close(self.spill)
            self.spill = None
        self.spilled.clear()

    def _preflight(self) -> None:
        """Room on the disk, a writable folder, buffers that hold the largest shard: one line otherwise."""
        if self.spill_error is not None:
            raise self.spill_error
        store = self.store
        largest = max(e.swapped[0].numel() for e in store.entries.values())
        _, slots, total, _ = store.layout(self.slots(largest))
        preflight(self.p.folder(), total, create=True)
        store.buffer_count = slots
        if store.buffer_count == 1 < len(store.entries):   # (a slot is reused once its copies are done)
            print(f"nvme: the zero3 parameter pool has 1 slot, so each shard load waits (in a hook) for the "
                  f"previous shard's copy to the device; allow at least the units prefetched + 1 slots "
                  f"(offload.param_buffer_count, offload.max_in_cpu >= that many x {largest} elements)", flush=True)

    def slots(self, largest: int) -> int:
        """Slots of the largest shard (not param_buffer_size: no pinned memory idles), as many as max_in_cpu allows.
        param_buffer_size (DeepSpeed's offload_param.buffer_size) is only a floor here: the engine refuses one below
        the largest shard, as DeepSpeed's buffers could not hold it."""
        if self.spec.param_buffer_size < largest:
            raise ConfigError(f"offload buffers too small: offload.param_buffer_size={self.spec.param_buffer_size} is "
                              f"smaller than the largest parameter shard ({largest} elements): set "
                              f"offload.param_buffer_size >= {largest}")
        slots = min(self.spec.param_buffer_count, self.spec.max_in_cpu // max(largest, 1))
        if slots < 1:
            raise ConfigError(f"offload buffers too small: offload.max_in_cpu={self.spec.max_in_cpu} is smaller "
                              f"than the largest parameter shard ({largest} elements): set "
                              f"offload.max_in_cpu >= {largest}")
        return slots

    def memory(self, fp: Footprint, shards) -> None:
        self.store.memory(fp, "nvme_param_pool", "params")

    def predict(self, fp: Footprint, sizes, itemsize: int) -> None:
        fp.items.pop("params")
        slot, slots, nbytes, _ = pool_layout([([itemsize * n], [], 0) for n in sizes], self.slots(max(sizes)))
        fp.add("nvme_param_pool", host=slots * slot)
        fp.add_disk("params", nbytes)

    def load(self, dst: torch.Tensor, shard: torch.Tensor) -> None:
        self._check_open(shard)
        if not self.swapped:
            return super().load(dst, shard)
        self.p.acc.on_device(dst, what="zero3 gather buffer")
        handle = self.store.acquire(self.keys[id(shard)])   # on the host before the gather (read ahead)
        try:
            self.store.wait(handle, host_writes=False)   # (only copied from: no wait for earlier copies)
            copied = self._copy_in(dst, shard)   # its slot is reused after the copy
        except SwapIOError as e:   # raised on every rank at ``read_errors``: the gather goes on, with zeros
            self.read_error, copied = self.read_error or e, None
            dst.zero_()
        self.store.release(handle, copied, dirty=False)

    def write(self, shard: torch.Tensor, values: torch.Tensor) -> None:
        self._check_open(shard)
        if not self.swapped:
            return super().write(shard, values)
        handle = self.store.acquire(self.keys[id(shard)])   # resident inside, written back after
        self.store.wait(handle)
        try:
            self.p.acc.copy(shard, values)
        finally:
            self.store.release(handle, None, dirty=True)

    def copy_back(self, info: Piece, dst: torch.Tensor, src: torch.Tensor, after: Event | None) -> Event | None:
        if not self.swapped:
            return super().copy_back(info, dst, src, after)
        # resident for host copies, written once
        self.p.acc.copy(self._hold(info.group)[info.start:info.end], src)
        return None

    def _hold(self, group: int) -> torch.Tensor:
        """Group ``group``'s shard, resident across its pieces' copies back and written back once (not per piece)."""
        shard = self.p.partitions[group]
        if self.held is not None and self.held[0] == group:
            return shard
        self.flush()
        self.held = (group, self.store.acquire(self.keys[id(shard)]))
        self.store.wait(self.held[1])
        return shard

    def flush(self, dirty: bool = True) -> None:
        held, self.held = self.held, None
        if held is not None:
            self.store.release(held[1], None, dirty=dirty)

    def recover(self) -> None:
        self.held = None   # (its slot freed below, unwritten: only a half-applied update changed it)
        if self.store is not None:
            self.store.recover()

    def read_errors(self) -> None:
        if self.swapped:
            error, self.read_error = self.read_error, None
            self.p.agree_io_error(error, "reading zero3 parameter shards")

    def _check_open(self, shard: torch.Tensor) -> None:   # after close a gather would read zeros silently
        if self.closed and id(shard) in self.keys:
            raise FrameworkError("this engine is closed and its zero3 parameter swap file (offload.params=nvme) is "
                                 "gone: run or save the module inside framework.gathered before engine.close() "
                                 "(inside its with block), or save_weights then")

    def close(self) -> None:
        """Raises a read failure no agreement saw (a gather's zeros were used unchecked), once closed."""
        self.closed = True
        self._close_spill()
        self.flush(dirty=False)   # (a step that failed between a copy back and ``flush``)
        self.store.close()
        error, self.read_error = self.read_error, None
        if error is not None:
            raise error

