"""cpu: DeepSpeed's offload_optimizer (and, for zero3, offload_param) to host memory: the master and
optimizer state of the first ``ratio`` of every partition live in (pinned) host memory, stepped there
(``offload._pipeline``); ``params: cpu`` keeps zero3's shards there between gathers (``HostShards``).
"""
from __future__ import annotations

import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

from framework.comm.accelerator import Accelerator, Event
from framework.core.errors import ConfigError
from framework.core.registry import Component
from framework.offload._pipeline import PiecePipeline
from framework.offload._store import Tier, recorded
from framework.offload.base import Piece, Placement, Shards


class HostPlacement(Placement):
    """The first ``host_fraction`` of each partition in host memory, stepped by the host (tier HOST)."""

    tier = Tier.HOST

    def __init__(self, host_fraction: float, pin: bool, shards: Shards | None = None, overlap_step: bool = False,
                 accelerator: Accelerator | None = None):
        self.host_fraction, self.pin, self.overlap_step = host_fraction, pin, overlap_step
        super().__init__(shards, accelerator)

    def make_update(self, tx, gather: Callable[[], None]) -> PiecePipeline | None:
        if all(i.tier is Tier.DEVICE for i in self.infos):
            if self.host_fraction > 0 and self.partitions:   # a ratio too small for every partition
                n = max(p.numel() for p in self.partitions)   # (the same on every rank: all raise, before a step)
                raise ConfigError(f"config: offload.ratio={self.host_fraction:g} moves no element of any partition off "
                                  f"the device (the largest has {n} elements), so nothing would be offloaded; set "
                                  f"offload.ratio>={1 / n:.3g} (1/{n}), or offload=none to step on the device")
            return None
        pipeline = PiecePipeline(tx, self, gather)
        # held weakly: autograd's hooks keep this placement alive, while the pipeline goes with its owner
        self.listener = weakref.ref(pipeline)
        return pipeline

    def _off_device(self, own: torch.Tensor, master_dtype: torch.dtype, cut: list[tuple[int, int]]) -> list[Piece]:
        """Each piece's gradient buffer, master and 16-bit staging: one pinned arena for the partition."""
        host, staged = self.stores[Tier.HOST], own.dtype != master_dtype
        host.reserve([(b - a, dt) for a, b in cut for dt in (master_dtype, master_dtype, *([own.dtype] if staged else []))])
        pieces = []
        for a, b in cut:
            grad = host.allocate(b - a, master_dtype).zero_()
            master = host.allocate(b - a, master_dtype)
            self.acc.copy(master, own[a:b])   # blocking: setup
            staging = host.allocate(b - a, own.dtype) if staged else None
            pieces.append(Piece(a, b, master, grad, staging, Tier.HOST))
        return pieces


class HostShards(Shards):
    """zero3 parameter shards in pinned host memory (``offload.params=cpu``): loaded on the H2D stream,
    written by host copies once the loads that read them are done. Pinned whatever ``offload.pin_memory``
    says: the hooks load them, and a copy from pageable memory would make the host wait for the device."""

    params_on_host = True

    def __init__(self):
        self.reads: dict[int, Event] = {}   # host shard storage address -> its last load's copy

    def buffer(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self.p.stores[Tier.HOST].allocate(numel, dtype, pin=True).zero_()

    @contextmanager
    def loading(self):
        """The load and its gather go on the H2D stream (a prefetch hides both)."""
        acc, waits = self.p.acc, []
        fresh = recorded(acc)
        with acc.stream(self.p.h2d_stream):
            fresh.wait()
            yield waits
            issued = recorded(acc)
        waits.append(issued.wait)

    def load(self, dst: torch.Tensor, shard: torch.Tensor) -> None:
        self.p.acc.on_device(dst, what="zero3 gather buffer")
        self.reads[shard.untyped_storage().data_ptr()] = self._copy_in(dst, shard)

    def _copy_in(self, dst: torch.Tensor, shard: torch.Tensor) -> Event:
        acc = self.p.acc
        acc.on_host(shard, what="zero3 host shard")
        acc.copy(dst, shard, non_blocking=True)   # the gather reads it on this stream next
        return recorded(acc)

    def write(self, shard: torch.Tensor, values: torch.Tensor) -> None:
        """A host copy, once the copy that last read ``shard`` (if any) is done."""
        done = self.reads.pop(shard.untyped_storage().data_ptr(), None)
        if done is not None:
            done.synchronize()
        self.p.acc.copy(shard, values)

    def copy_back(self, info: Piece, dst: torch.Tensor, src: torch.Tensor, after: Event | None) -> Event | None:
        self.write(dst, src)   # a host copy, once its loads are done
        return None


@dataclass(frozen=True, kw_only=True)
class CPUOffloadConfig:
    params: str = "none"        # zero3 parameter shards: none (device) | cpu (host memory between gathers)
    ratio: float = 1.0          # fraction of each partition whose optimizer step runs on the host
    # page-locked optimizer buffers (CUDA; without them their copies cannot be asynchronous); the zero3 parameter
    # shards the hooks load (params=cpu) are pinned either way
    pin_memory: bool = True
    # also start each piece's host step during backward, speculatively (identical results), for undo
    # copies of those pieces in host memory (master + optimizer state: 12 bytes/param with Adam)
    overlap_step: bool = False


def check_ratio(ratio: float) -> None:
    if not 0.0 <= ratio <= 1.0:
        raise ConfigError(f"config: offload.ratio must be in [0, 1], got {ratio}")


def check_zero3(params: str, stage: str) -> None:
    """Parameter shards off the device (``params`` not none) are zero3's."""
    if params != "none" and stage != "zero3":
        raise ConfigError(f"config: offload.params={params} (parameter offload) needs +stage=zero3, got "
                          f"stage={stage}; use offload.params=none or +stage=zero3")


def build(cfg: CPUOffloadConfig, accelerator: Accelerator | None = None) -> HostPlacement:
    check_ratio(cfg.ratio)   # (a config built without framework.config's checks)
    return HostPlacement(cfg.ratio, cfg.pin_memory, HostShards() if cfg.params == "cpu" else Shards(),
                         overlap_step=cfg.overlap_step, accelerator=accelerator)


def check(node: CPUOffloadConfig, stage: str, nodes: Mapping[str, Any]) -> CPUOffloadConfig:
    """``offload.params`` against the stage (the configuration's check for this target)."""
    check_ratio(node.ratio)
    if node.params not in ("none", "cpu"):
        hint = {"nvme": " (parameter shards on disk: offload=nvme)",
                "True": " (the former offload.params=true is offload.params=cpu)",
                "False": " (the former offload.params=false is offload.params=none)"}.get(str(node.params), "")
        raise ConfigError(f"config: offload.params must be none or cpu with offload=cpu, got "
                          f"{node.params!r}{hint}")
    check_zero3(node.params, stage)
    if node.params == "cpu" and node.ratio < 1.0:   # the device pieces would be stepped on host slices
        raise ConfigError("config: offload.ratio<1 keeps part of each partition's step on the device, which zero3 "
                          "parameter shards in host memory (offload.params=cpu) cannot share; use offload.ratio=1 "
                          "or offload.params=none")
    if node.ratio == 0.0:   # (params=cpu with it is refused above): the step and the state stay on the device
        raise ConfigError("config: offload=cpu with offload.ratio=0 (every optimizer step on the device) and "
                          "offload.params=none puts nothing in host memory; set offload.ratio>0, or use offload=none")
    return node


COMPONENT = Component(config=CPUOffloadConfig, build=build, check=check)
