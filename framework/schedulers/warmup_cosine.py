"""nanoGPT's schedule: linear warm-up, cosine decay to min_lr at decay_steps, then min_lr."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from framework.core.errors import ConfigError
from framework.core.registry import Component


@dataclass(kw_only=True)
class WarmupCosineConfig:
    warmup_steps: int = 100
    min_lr: float = 1e-4
    decay_steps: int | None = None  # None: the run's number of optimizer steps


def build(cfg: WarmupCosineConfig, base_lr: float, total_steps: int) -> Callable[[int], float]:
    if not cfg.warmup_steps >= 0:
        raise ConfigError(f"scheduler.warmup_steps must be >= 0, got {cfg.warmup_steps}")
    if not (math.isfinite(cfg.min_lr) and 0 <= cfg.min_lr <= base_lr):
        raise ConfigError(f"scheduler.min_lr must be in [0, optimizer.lr={base_lr}], "
                          f"got {cfg.min_lr}")
    if cfg.decay_steps is not None and not cfg.decay_steps > cfg.warmup_steps:
        raise ConfigError(f"scheduler.decay_steps must be > warmup_steps={cfg.warmup_steps}, "
                          f"got {cfg.decay_steps}")
    warmup, min_lr = cfg.warmup_steps, cfg.min_lr
    # A run shorter than its warm-up (decay_steps defaults to the run length) has no cosine
    # phase; nanoGPT would divide by zero at step == warmup == decay, here that step is min_lr.
    decay = total_steps if cfg.decay_steps is None else cfg.decay_steps

    def lr_at(step: int) -> float:
        if step < warmup:
            return base_lr * (step + 1) / (warmup + 1)
        if step >= decay:  # nanoGPT says step > decay; at step == decay the cosine is min_lr
            return min_lr
        ratio = (step - warmup) / (decay - warmup)
        return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (base_lr - min_lr)

    return lr_at


COMPONENT = Component(config=WarmupCosineConfig, build=build)
