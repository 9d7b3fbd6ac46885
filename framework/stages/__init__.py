"""Sharding stages (conf/stage): ddp (replicated), zero1, zero2 and zero3 (partitioned)."""

# The layout functions the rest of the package (state, checkpoints, the memory model) shares with
# the stages, so that they allocate and describe the same layout.
from framework.stages._flat import (ALIGN, ParameterInit, PieceSpec, buffer_dtypes, check_shape, cover, initializer,
                                    make_layout, param_count, param_groups, unit_groups, whole_memory)
from framework.stages._units import plan_units
from framework.stages._grads import bucket_buffers
from framework.stages._shards import zero3_sharded
from framework.stages.base import PlainUpdate, Update

__all__ = ["ALIGN", "ParameterInit", "PieceSpec", "PlainUpdate", "Update", "bucket_buffers", "buffer_dtypes",
           "check_shape", "cover", "initializer", "make_layout", "param_count", "param_groups", "plan_units",
           "unit_groups", "whole_memory", "zero3_sharded"]
