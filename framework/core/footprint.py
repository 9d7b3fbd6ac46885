"""Per-rank bytes of model states and persistent buffers, by item and by where they live.

A built engine reports one (``Engine.memory``: the bytes of the tensors it holds) and the estimator
predicts one (``framework.memory.model.predict``) with the same item names, so the two compare item by
item. Items: params, frozen_params, grads, grad_accumulator, master_params, optimizer_state,
host_grad_buffers, host_staging, overlap_undo, bucket_buffers, gathered_persistent, buffers (the
module's), nvme_optimizer_pool, nvme_grad_staging (zero3's swapped gradients on their way to the swap
file), nvme_grad_read_back (read back; only with train.grad_accum > 1), nvme_param_pool. ``device`` is
the compute device and ``host`` host memory (on a CPU run both are the same memory, told apart by role);
``disk`` holds the swap files' bytes under offload=nvme.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(kw_only=True)
class Footprint:
    items: dict[str, tuple[int, int]] = field(default_factory=dict)   # name -> (device, host) bytes
    disk: dict[str, int] = field(default_factory=dict)                # name -> bytes in swap files

    def add(self, name: str, device: int = 0, host: int = 0) -> None:
        d, h = self.items.get(name, (0, 0))
        self.items[name] = (d + int(device), h + int(host))

    def add_disk(self, name: str, nbytes: int) -> None:
        self.disk[name] = self.disk.get(name, 0) + int(nbytes)

    def nonzero(self) -> tuple[dict[str, tuple[int, int]], dict[str, int]]:
        """(items, disk) without the empty entries: what two footprints are compared by."""
        return ({k: v for k, v in self.items.items() if v != (0, 0)}, {k: v for k, v in self.disk.items() if v})

    @property
    def resident(self) -> int:
        """Device and host bytes together."""
        return sum(d + h for d, h in self.items.values())

    def as_dict(self) -> dict:
        items, disk = self.nonzero()
        return {"items": {k: {"device": d, "host": h} for k, (d, h) in items.items()}, "disk": disk,
                "resident": self.resident}
