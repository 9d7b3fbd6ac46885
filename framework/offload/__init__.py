"""Offload targets (conf/offload): none, cpu, nvme. Public beside them, for tools that measure what the targets
use (bench/, recipes/): the IO engine (``AsyncIO``, its page-aligned buffers ``aligned_empty``), the swap file
(``SwapFile``) and the pinned host arena (``HostStore``); ``remove_stale`` removes the swap files of dead
processes from a folder (the launcher's, after a rank was killed). ``verify_map`` checks a swap file's mapped
extents against their checksums (checkpoints and weights that read a swap file through its mapping check what
they read), and ``PiecePipeline`` is the host offload's gradient-to-step pipeline (tests/_mutations.py breaks it
on purpose)."""
from framework.offload._aio import AsyncIO, aligned_empty, verify_map
from framework.offload._pipeline import PiecePipeline
from framework.offload._store import HostStore
from framework.offload._swapfile import SwapFile, remove_stale

__all__ = ["AsyncIO", "HostStore", "PiecePipeline", "SwapFile", "aligned_empty", "remove_stale", "verify_map"]
