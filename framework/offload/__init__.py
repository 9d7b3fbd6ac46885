"""Offload targets (conf/offload): none, cpu, nvme."""
from framework.offload._pipeline import PiecePipeline
from framework.offload._aio import verify_map

__all__ = ["PiecePipeline", "verify_map"]
