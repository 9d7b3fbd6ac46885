"""The nvme tier's config (``offload=nvme``): read by the component (``nvme.py``) and by the tiers it
builds (``_disk``, ``_diskshards``), which sit below it."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, kw_only=True)
class AIOConfig:
    """DeepSpeed's ``aio`` section: how the IO engine (``offload._aio``) splits and queues requests."""
    block_size: int = 1048576          # bytes per request (a multiple of 4096: O_DIRECT)
    # Their product is the number of IO threads, each taking the next block of any request from one queue
    # (DeepSpeed's two knobs kept for its configs: only the product matters here).
    queue_depth: int = 8
    intra_op_parallelism: int = 1
    # DeepSpeed's libaio knobs: the engine always batches and overlaps completion with submission,
    # which is what these defaults mean; another value is refused (it would do nothing).
    single_submit: bool = False
    overlap_events: bool = True


@dataclass(frozen=True, kw_only=True)
class NVMeOffloadConfig:
    optimizer: str = "nvme"            # fp32 master + optimizer state: cpu | nvme
    params: str = "auto"               # zero3 parameter shards: none | cpu | nvme | auto
    nvme_path: str | None = None       # None: <run dir>/nvme (printed at start-up with its size)
    pin_memory: bool = True
    ratio: float = 1.0                 # fraction of each partition whose optimizer step runs off the device
    overlap_step: bool = False         # speculative host step during backward (optimizer=cpu only)
    # Elements per optimizer tile. DeepSpeed's 10^9 makes a smaller partition one tile, resident for
    # its whole step (as much host memory as offload=cpu); 10^7 bounds the pool (about 4 x 140 MB)
    # and keeps requests large enough for disk speed. A DeepSpeed config's value still overrides it.
    sub_group_size: int = 10_000_000
    buffer_count: int = 4              # host tiles in the optimizer pool
    pipeline_read: bool = False        # read tile i+1 while tile i steps
    pipeline_write: bool = False       # write tile i-1 back while tile i steps
    # host buffers for zero3 parameter shards on NVMe; with at least the units prefetched + 1 the host
    # never waits in a hook for a shard's copy to the device before reusing its buffer
    param_buffer_count: int = 5
    param_buffer_size: int = 100_000_000  # elements per parameter buffer
    max_in_cpu: int = 1_000_000_000    # cap on host-resident parameter elements (params=nvme)
    aio: AIOConfig = field(default_factory=AIOConfig)
