"""Batch: what one train_step consumes (shared by data sources and the step)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Batch:
    micro: tuple                 # grad_accum micro batches; each is passed as loss_fn(module, micro)
    position: int | None = None  # data position after this batch (None: the state's position + 1)
