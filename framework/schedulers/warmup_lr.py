"""DeepSpeed's WarmupLR: warm up from warmup_min_lr to warmup_max_lr, then hold.

``lr = min + (max - min) * gamma`` with, for ``step < warmup_num_steps``,
``gamma = log(step + 1) / log(warmup_num_steps)`` ("log") or ``step / warmup_num_steps``
("linear"), and ``gamma = 1`` after. Like DeepSpeed, warmup_num_steps is raised to at
least 2 (a log warm-up over one step would divide by log(1) = 0).
``build``'s ``after`` gives WarmupDecayLR its decay.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from framework.core.errors import ConfigError
from framework.core.registry import Component

WARMUP_TYPES = ("log", "linear")


@dataclass(kw_only=True)
class WarmupLRConfig:
    warmup_min_lr: float = 0.0
    warmup_max_lr: float | None = None  # None: the optimizer's lr
    warmup_num_steps: int = 1000
    warmup_type: str = "log"  # "log" or "linear"


def check_warmup(num_steps: int, kind: str, min_lr: float = 0.0, max_lr: float = 0.0) -> None:
    """One-line ConfigErrors for the warm-up fields (also of warmup_decay_lr and warmup_cosine_lr)."""
    if kind not in WARMUP_TYPES:
        raise ConfigError(f"scheduler.warmup_type must be one of {', '.join(WARMUP_TYPES)}, "
                          f"got {kind!r}")
    if not num_steps >= 1:
        raise ConfigError(f"scheduler.warmup_num_steps must be >= 1, got {num_steps}")
    if not (math.isfinite(min_lr) and min_lr >= 0):
        raise ConfigError(f"scheduler.warmup_min_lr must be >= 0, got {min_lr}")
    if not (math.isfinite(max_lr) and max_lr >= 0):
        raise ConfigError(f"scheduler.warmup_max_lr must be >= 0, got {max_lr}")


def warmup_gamma(step: int, num_steps: int, kind: str) -> float:
    """Warm-up progress in [0, 1) for ``step < num_steps`` (num_steps already >= 2)."""
    if kind == "log":
        return math.log(step + 1) / math.log(num_steps)
    return step / num_steps


def build(cfg: WarmupLRConfig, base_lr: float, total_steps: int,
          after: Callable[[int, int], float] = lambda step, num_steps: 1.0) -> Callable[[int], float]:
    """``lr = min + (max - min) * gamma``: the warm-up's gamma, then ``after(step, num_steps)`` (hold)."""
    max_lr = base_lr if cfg.warmup_max_lr is None else cfg.warmup_max_lr
    check_warmup(cfg.warmup_num_steps, cfg.warmup_type, cfg.warmup_min_lr, max_lr)
    min_lr, num_steps, kind = cfg.warmup_min_lr, max(2, cfg.warmup_num_steps), cfg.warmup_type

    def lr_at(step: int) -> float:
        gamma = warmup_gamma(step, num_steps, kind) if step < num_steps else after(step, num_steps)
        return min_lr + (max_lr - min_lr) * gamma

    return lr_at


COMPONENT = Component(config=WarmupLRConfig, build=build)
