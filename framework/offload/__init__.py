"""Offload targets (conf/offload): none, cpu, nvme."""
from framework.offload._diskstore import pool_layout
from framework.offload._pipeline import PiecePipeline
from framework.offload._aio import verify_map

__all__ = ["PiecePipeline", "pool_layout", "verify_map"]
