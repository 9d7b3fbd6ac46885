"""Offload targets (conf/offload): none, cpu, nvme. Public beside them, for tools that measure what the targets
use (bench/, recipes/): the IO engine (``AsyncIO``, its page-aligned buffers ``aligned_empty``), the swap file
(``SwapFile``) and the pinned host arena (``HostStore``)."""
from framework.offload._aio import AsyncIO, aligned_empty, verify_map
from framework.offload._pipeline import PiecePipeline
from framework.offload._store import HostStore
from framework.offload._swapfile import SwapFile

__all__ = ["AsyncIO", "HostStore", "PiecePipeline", "SwapFile", "aligned_empty", "verify_map"]
