"""nvme: ZeRO-Infinity. DeepSpeed's offload_optimizer / offload_param with device nvme.

The fp32 master partition and the optimizer state (``optimizer: nvme``) and, under zero3, the 16-bit
parameter shards (``params: nvme``) live in swap files under ``nvme_path``; the host holds only pools of
pinned, page-aligned buffers. The disk is one more tier of the offload store (``_diskstore.DiskStore``),
so the stages have no NVMe code path. ``params: auto`` (nvme under zero3, else none) is resolved here.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping

from framework.comm.accelerator import Accelerator
from framework.core.errors import ConfigError
from framework.core.files import SMALLEST_TILE
from framework.core.paths import user_path
from framework.core.registry import Component
from framework.core.room import check_name
from framework.offload._aio import MAX_BLOCK_SIZE, MAX_THREADS
from framework.offload._disk import DiskPlacement, NVMePlacement
from framework.offload._diskshards import DiskShards
from framework.offload._swapfile import ALIGN
from framework.offload._swapfolder import NVMeOffloadConfig
from framework.offload.base import Shards
from framework.offload.cpu import HostShards, check_ratio, check_zero3


def resolve(cfg: NVMeOffloadConfig, stage: str, nodes: Mapping[str, Any]) -> NVMeOffloadConfig:
    """Check ``cfg`` against ``stage`` (one line per error) and return it with ``params: auto`` resolved."""
    _refuse_empty_path(cfg)
    if stage == "ddp":
        raise ConfigError("config: offload=nvme needs a ZeRO stage (the replicated ddp stage keeps every "
                          "optimizer state on every rank); add +stage=zero1, +stage=zero2 or +stage=zero3")
    if cfg.optimizer not in ("cpu", "nvme"):
        raise ConfigError(f"config: offload.optimizer must be cpu or nvme, got {cfg.optimizer!r}")
    if cfg.params not in ("none", "cpu", "nvme", "auto"):
        raise ConfigError(f"config: offload.params must be none, cpu, nvme or auto, got {cfg.params!r}")
    params = cfg.params if cfg.params != "auto" else ("nvme" if stage == "zero3" else "none")
    check_zero3(params, stage)
    check_ratio(cfg.ratio)
    # offload.ratio=0: no optimizer tile is ever swapped (with offload.params=nvme refused below)
    if cfg.optimizer == "nvme" and cfg.ratio == 0 and params != "nvme":
        raise ConfigError(f"config: offload=nvme with offload.ratio=0 (every optimizer step on the device) and "
                          f"offload.params={params} puts nothing on NVMe; set offload.ratio>0, or use offload=none")
    if cfg.optimizer != "nvme" and params != "nvme":
        raise ConfigError(f"config: offload=nvme with offload.optimizer={cfg.optimizer} and offload.params={params} "
                          f"puts nothing on NVMe; use offload=cpu, or set offload.optimizer=nvme")
    if params != "none" and cfg.ratio < 1.0:   # (the device pieces would be slices of host or disk shards)
        where = "on NVMe" if params == "nvme" else "in host memory (offload.params=cpu)"
        raise ConfigError(f"config: offload.ratio<1 keeps part of each partition on the device, which zero3 "
                          f"parameter shards {where} cannot share; use offload.ratio=1 or offload.params=none")
    if cfg.overlap_step and cfg.optimizer == "nvme":
        raise ConfigError("config: offload.overlap_step=true needs whole optimizer pieces in host memory "
                          "(speculation keeps undo copies); use offload.optimizer=cpu or overlap_step=false")
    for key in ("sub_group_size", "buffer_count", "param_buffer_count", "param_buffer_size", "max_in_cpu"):
        least = 0 if key == "max_in_cpu" else 1
        if getattr(cfg, key) < least:
            raise ConfigError(f"config: offload.{key} must be >= {least}, got {getattr(cfg, key)}")
    if cfg.optimizer == "nvme" and cfg.sub_group_size < SMALLEST_TILE:
        raise ConfigError(f"config: offload.sub_group_size={cfg.sub_group_size} is smaller than one {ALIGN}-byte "
                          f"O_DIRECT page of fp32 elements, to which every tile is padded; set "
                          f"offload.sub_group_size>={SMALLEST_TILE}")
    default = NVMeOffloadConfig()   # a tier that is off: its keys would do nothing
    for tier, on, keys in (("params", params, ("param_buffer_count", "param_buffer_size", "max_in_cpu")),
                           ("optimizer", cfg.optimizer, ("sub_group_size", "buffer_count", "pipeline_read",
                                                         "pipeline_write"))):
        for key in keys:
            if on != "nvme" and getattr(cfg, key) != getattr(default, key):
                raise ConfigError(f"config: offload.{key} has no effect unless offload.{tier}=nvme; remove it")
    tiles = 1 + int(cfg.pipeline_read) + int(cfg.pipeline_write)   # stepping, read ahead, being written
    if cfg.buffer_count < tiles:
        raise ConfigError(f"config: offload.buffer_count={cfg.buffer_count} is too small for pipeline_read="
                          f"{str(cfg.pipeline_read).lower()} pipeline_write={str(cfg.pipeline_write).lower()}; "
                          f"set offload.buffer_count>={tiles}")
    a = cfg.aio
    if a.block_size < ALIGN or a.block_size % ALIGN or a.block_size > MAX_BLOCK_SIZE:
        raise ConfigError(f"config: offload.aio.block_size must be a positive multiple of {ALIGN} bytes "
                          f"(O_DIRECT) of at most {MAX_BLOCK_SIZE} (each IO thread keeps a buffer of it; "
                          f"DeepSpeed's default is 1048576), got {a.block_size}")
    if a.queue_depth < 1 or a.intra_op_parallelism < 1:
        raise ConfigError("config: offload.aio.queue_depth and offload.aio.intra_op_parallelism must be >= 1")
    if a.queue_depth * a.intra_op_parallelism > MAX_THREADS:
        raise ConfigError(f"config: offload.aio.queue_depth={a.queue_depth} x offload.aio.intra_op_parallelism="
                          f"{a.intra_op_parallelism} IO threads is more than {MAX_THREADS}; lower them "
                          "(DeepSpeed's defaults are 8 x 1)")
    for key, default, why in (("single_submit", False, "the IO engine always submits a batch of requests"),
                              ("overlap_events", True, "completions always overlap submission")):
        if getattr(a, key) != default:
            raise ConfigError(f"config: offload.aio.{key}={str(not default).lower()} has no effect here ({why}); "
                              f"remove it or set {str(default).lower()}")
    path = user_path(cfg.nvme_path) if cfg.nvme_path is not None else None
    if path is not None:   # (else a traceback after the run's header, the first time the folder is listed)
        check_name(path, "offload.nvme_path")
    return replace(cfg, params=params, nvme_path=path)


def _refuse_empty_path(cfg: NVMeOffloadConfig) -> None:   # else the swap files go, unnamed, to the working directory
    if cfg.nvme_path is not None and not cfg.nvme_path.strip():
        raise ConfigError("config: offload.nvme_path is empty: give a folder, or leave it unset for <run dir>/nvme")


def build(cfg: NVMeOffloadConfig, accelerator: Accelerator | None = None) -> NVMePlacement:
    if cfg.params == "auto":
        raise ConfigError("offload.params=auto is resolved against the stage by framework.config; "
                          "build from framework.compose(...), or set offload.params to none, cpu or nvme")
    _refuse_empty_path(cfg)   # (a config built without framework.config's checks)
    shards = DiskShards(cfg) if cfg.params == "nvme" else HostShards() if cfg.params == "cpu" else Shards()
    tier = DiskPlacement if cfg.optimizer == "nvme" else NVMePlacement
    return tier(cfg, shards, accelerator)


COMPONENT = Component(config=NVMeOffloadConfig, build=build, check=resolve)
