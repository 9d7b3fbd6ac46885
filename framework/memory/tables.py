"""DeepSpeed's model-state estimators from P (distinct parameters at logical shape) and L (most parameters
one module registers itself): ``zero2_rows``/``zero3_rows`` are ``estimate_zero{2,3}_model_states_mem_needs``
with its integer rounding, so the printed GiB agree to the last digit; ``nvme_rows`` adds ZeRO-Infinity's
disk bytes and pinned pools, which those tables leave out."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from torch import nn

from framework.core.errors import ConfigError
from framework.core.units import GiB
from framework.stages import param_count

BUFFER_FACTOR = 1.5   # DeepSpeed's additional_buffer_factor (host memory only)

# --- counting -----------------------------------------------------------------------------

_SUFFIX = {"": 1, "K": 10 ** 3, "M": 10 ** 6, "B": 10 ** 9, "G": 10 ** 9, "T": 10 ** 12}


COUNT_SPELLINGS = "e.g. 2.78e9, 2783M, 32K or 1.4B"
WHOLE_NUMBER = "a whole number >= 1, e.g. 8"   # (for what is not a parameter count: ranks, micro batches)


def parse_count(text: str, what: str = "count", whole: bool = False) -> int:
    """``2.78e9``, ``2783M``, ``32K``, ``1.4B``, ``1_000_000`` -> an integer count (a fraction is an error).
    ``what``: the key as the message names it (with its tool's prefix); ``whole``: digits only, no suffix or
    exponent (for what is not a parameter count)."""
    write = WHOLE_NUMBER if whole else COUNT_SPELLINGS
    m = re.fullmatch(r"\s*([0-9][0-9_]*(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?)\s*([kKmMbBgGtT]?)\s*", str(text))
    if not m:
        raise ConfigError(f"{what}={text!r} is not a count; write {write}")
    value = float(m.group(1).replace("_", "")) * _SUFFIX[m.group(2).upper()]
    if not math.isfinite(value):   # 1e400 reads as infinity
        raise ConfigError(f"{what}={text!r} is too large to be a count")
    if abs(value - round(value)) > 1e-9 * max(1.0, value):   # tolerates 2.783M's float error, not 1.5
        raise ConfigError(f"{what}={text!r} is not a whole number")
    if whole and not re.fullmatch(r"\s*[0-9][0-9_]*\s*", str(text)):   # (ranks=1K: a typo, likely)
        raise ConfigError(f"{what}={text!r} is not a plain whole number; write {write}")
    return int(round(value))


@dataclass(frozen=True)
class Counts:
    params: int          # P: distinct parameters
    largest_layer: int   # L: most parameters registered by one module itself (not its children)


def count_module(module: nn.Module) -> Counts:
    """P and L of ``module``, parameters deduplicated by identity (DeepSpeed's ``data_ptr()`` is 0 on meta)."""
    return Counts(param_count(module), max((param_count(m, recurse=False) for m in module.modules()), default=0))


# --- DeepSpeed's tables ----------------------------------------------------------------------

@dataclass(frozen=True)
class Row:
    cpu: int        # bytes per node (DeepSpeed's "per CPU"; NVMe rows: pinned pools [+ cpu param shards])
    gpu: int        # bytes per GPU
    options: str
    disk: int | None = None   # NVMe rows: bytes per node on the NVMe path


def zero2_rows(params: float, gpus_per_node: int = 1, nodes: int = 1,
               factor: float = BUFFER_FACTOR) -> list[Row]:
    """DeepSpeed's ZeRO-2 estimate, offload_optimizer cpu then none."""
    t = gpus_per_node * nodes
    offload = Row(int(params * max(4 * t, 16) * factor), int(2 * params), "offload_optimizer=cpu")
    # 2 (16-bit params) on every GPU; 18 = 16-bit grads 2 + fp32 grads 4 + fp32 master 4 + Adam 8, partitioned
    plain = Row(int(params * 4 * gpus_per_node * factor), int(2 * params + int(18 * params / t)),
                "offload_optimizer=none")
    return [offload, plain]


def zero3_rows(params: float, largest_layer: float, gpus_per_node: int = 1, nodes: int = 1,
               factor: float = BUFFER_FACTOR) -> list[Row]:
    """DeepSpeed's ZeRO-3 estimate, rows and products in its order (``P * 18 * (1 / nodes)`` and
    ``P * (18 * (1 / nodes))`` differ in the last bit for 3, 5 or 7 nodes, which int() keeps)."""
    t, per_node = gpus_per_node * nodes, 1 / nodes
    layer = 4 * largest_layer   # the largest layer gathered: 16-bit params and grads
    rows = []
    # host bytes per parameter (None: the gathered layer's, or all parameters, per GPU); GPU bytes per parameter
    for opt, par, host, dev in (("cpu", "cpu", 18, 0), ("cpu", "none", 16, 2), ("none", "none", None, 18)):
        for zero_init in (True, False):
            if host is None:
                cpu = (largest_layer if zero_init else params) * 4 * gpus_per_node * factor
            else:
                cpu = (params * host * per_node if zero_init
                       else params * max(4 * gpus_per_node, host * per_node)) * factor
            rows.append(Row(int(cpu), int(layer + int(dev * params / t)),
                            f"offload_param={par}, offload_optimizer={opt}, zero_init={int(zero_init)}"))
    return rows


# --- NVMe (ZeRO-Infinity) rows -----------------------------------------------------------------

@dataclass(frozen=True)
class NVMeKeys:
    """The ``offload=nvme`` keys that size host pools (DeepSpeed's names in comments)."""

    sub_group_size: int = 1_000_000_000   # elements per optimizer tile (zero_optimization.sub_group_size)
    buffer_count: int = 4                 # optimizer tiles in host memory (offload_optimizer.buffer_count)
    param_buffer_count: int = 5           # offload_param.buffer_count
    param_buffer_size: int = 100_000_000  # offload_param.buffer_size (elements)


def nvme_rows(params: int, largest_layer: int, gpus_per_node: int = 1, nodes: int = 1,
              keys: NVMeKeys = NVMeKeys(), optimizer_bytes: int = 8, param_bytes: int = 2,
              pools: tuple[int, int, int] | None = None) -> list[Row]:
    """Per-node disk bytes and host pools of ZeRO-Infinity for zero3 (our model, every term named).

    On disk per rank: fp32 master + optimizer state (4 + ``optimizer_bytes`` per element) and the fp32
    gradient partition. ``pools``: a model's host bytes per rank for parameters on NVMe, CPU, GPU
    (``model.nvme_pools``); without it ``buffer_count`` tiles of min(sub_group_size,
    partition) elements of master + state + gradient + staging, one tile's gradient bounce buffer, and
    ``param_buffer_count`` slots of min(param_buffer_size, partition) with parameters on NVMe (on the CPU:
    the shards), but not the two pinned buffers gradient partitions are copied through on their way to disk
    (each of the largest group's partition: the model's grouping decides it). ``param_bytes``: the working
    precision. GPU as DeepSpeed's zero_init rows: the largest
    layer gathered (params and grads), plus the shard when parameters stay there."""
    t = gpus_per_node * nodes
    part = -(-params // t)   # elements of one rank's partition
    state = 4 + optimizer_bytes
    staging = 0 if param_bytes == 4 else param_bytes   # an fp32 step writes the working copy itself
    tile = min(keys.sub_group_size, part)
    opt_host = gpus_per_node * (keys.buffer_count * tile * (state + 4 + staging) + 4 * tile)
    slots = keys.param_buffer_count * min(keys.param_buffer_size, part)
    rows = []
    # per rank, elements of working-precision parameters in host memory, on disk, on the GPU
    for i, (par, host, disk, gpu) in enumerate((("nvme", slots, part, 0), ("cpu", part, 0, 0), ("none", 0, 0, part))):
        host = gpus_per_node * pools[i] if pools is not None else opt_host + gpus_per_node * host * param_bytes
        rows.append(Row(host, 2 * param_bytes * largest_layer + gpu * param_bytes,
                        f"offload_param={par}, offload_optimizer=nvme",
                        gpus_per_node * part * (state + 4) + gpus_per_node * disk * param_bytes))
    return rows


def format_rows(rows: list[Row]) -> str:
    """DeepSpeed's layout, ``per CPU | per GPU | Options`` (NVMe rows add ``NVMe/node``), in GiB."""

    nvme = bool(rows) and rows[0].disk is not None
    lines = ["  per CPU  |  per GPU |" + ("  NVMe/node |" if nvme else "") + "   Options"]
    lines += [f" {r.cpu / GiB:7.2f}GiB | {r.gpu / GiB:6.2f}GiB | " + (f"{r.disk / GiB:7.2f}GiB | " if nvme else "")
              + r.options for r in rows]
    return "\n".join(lines)
