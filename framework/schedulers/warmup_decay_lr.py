"""DeepSpeed's WarmupDecayLR: WarmupLR's warm-up, then linear decay to 0 at total_num_steps.

After warm-up ``gamma = max(0, (total - step) / max(1, total - warmup_num_steps))`` and
``lr = min + (max - min) * gamma``: the lr decays to warmup_min_lr, which is 0 by default.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from framework.core.errors import ConfigError
from framework.core.registry import Component
from framework.schedulers import warmup_lr


@dataclass(kw_only=True)
class WarmupDecayLRConfig(warmup_lr.WarmupLRConfig):
    total_num_steps: int | None = None  # None: the run's number of optimizer steps


def build(cfg: WarmupDecayLRConfig, base_lr: float, total_steps: int) -> Callable[[int], float]:
    def decay(step: int, num_steps: int) -> float:
        return max(0.0, (total - step) / max(1, total - num_steps))

    lr_at = warmup_lr.build(cfg, base_lr, total_steps, after=decay)   # checks the warm-up fields first
    total = total_steps if cfg.total_num_steps is None else cfg.total_num_steps
    if not total >= 1:
        raise ConfigError(f"scheduler.total_num_steps must be >= 1, got {total}")
    return lr_at


COMPONENT = Component(config=WarmupDecayLRConfig, build=build)
