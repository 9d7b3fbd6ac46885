"""nanoGPT's schedule: linear warm-up, cosine decay to min_lr (default: the optimizer's lr / 10) at
decay_steps, then min_lr."""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable

from framework.core.errors import ConfigError
from framework.core.registry import Component
from framework.schedulers.warmup_lr import checked_by_build, long_warmup_notes


@dataclass(frozen=True, kw_only=True)
class WarmupCosineConfig:
    warmup_steps: int = 100
    min_lr: float | None = None  # None: optimizer.lr / 10
    decay_steps: int | None = None  # None: the run's number of optimizer steps


def build(cfg: WarmupCosineConfig, base_lr: float, total_steps: int) -> Callable[[int], float]:
    if not cfg.warmup_steps >= 0:
        raise ConfigError(f"scheduler.warmup_steps must be >= 0, got {cfg.warmup_steps}; give 0 for no warm-up")
    min_lr = base_lr / 10 if cfg.min_lr is None else cfg.min_lr
    if not (math.isfinite(min_lr) and 0 <= min_lr <= base_lr):
        raise ConfigError(f"scheduler.min_lr={min_lr} must be in [0, optimizer.lr={base_lr}]; set scheduler.min_lr "
                          f"<= optimizer.lr or scheduler=constant (min_lr: null is lr / 10)")
    if cfg.decay_steps is not None and not cfg.decay_steps > cfg.warmup_steps:
        raise ConfigError(f"scheduler.decay_steps must be > warmup_steps={cfg.warmup_steps}, got {cfg.decay_steps}; "
                          f"give a larger one, or null (the run's length)")
    # A run shorter than its warm-up (decay_steps defaults to the run length) has no cosine
    # phase; nanoGPT would divide by zero at step == warmup == decay, here that step is min_lr.
    warmup, decay = cfg.warmup_steps, total_steps if cfg.decay_steps is None else cfg.decay_steps

    def lr_at(step: int) -> float:
        if step < warmup:
            return base_lr * (step + 1) / (warmup + 1)
        if step >= decay:  # nanoGPT says step > decay; at step == decay the cosine is min_lr
            return min_lr
        ratio = (step - warmup) / (decay - warmup)
        return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (base_lr - min_lr)

    return lr_at


def notes(node: WarmupCosineConfig, config) -> list[str]:
    return long_warmup_notes("warmup_steps", node.warmup_steps, config.train.steps,
                             functools.partial(build, node, config.optimizer.lr))


COMPONENT = Component(config=WarmupCosineConfig, build=build, check=checked_by_build(build), notes=notes)
