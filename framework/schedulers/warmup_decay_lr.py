"""DeepSpeed's WarmupDecayLR: WarmupLR's warm-up, then linear decay to 0 at total_num_steps.

After warm-up ``gamma = max(0, (total - step) / max(1, total - warmup_num_steps))`` and
``lr = min + (max - min) * gamma``: the lr decays to warmup_min_lr, which is 0 by default.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from framework.core.errors import ConfigError
from framework.core.registry import Component
from framework.schedulers.warmup_lr import WarmupLRConfig, check_warmup, warmup_gamma


@dataclass(kw_only=True)
class WarmupDecayLRConfig(WarmupLRConfig):
    total_num_steps: int | None = None  # None: the run's number of optimizer steps


def build(cfg: WarmupDecayLRConfig, base_lr: float, total_steps: int) -> Callable[[int], float]:
    max_lr = base_lr if cfg.warmup_max_lr is None else cfg.warmup_max_lr
    check_warmup(cfg.warmup_num_steps, cfg.warmup_type, cfg.warmup_min_lr, max_lr)
    total = total_steps if cfg.total_num_steps is None else cfg.total_num_steps
    if not total >= 1:
        raise ConfigError(f"scheduler.total_num_steps must be >= 1, got {total}")
    min_lr, num_steps, kind = cfg.warmup_min_lr, max(2, cfg.warmup_num_steps), cfg.warmup_type
    decay_span = max(1, total - num_steps)

    def lr_at(step: int) -> float:
        if step < num_steps:
            gamma = warmup_gamma(step, num_steps, kind)
        else:
            gamma = max(0.0, (total - step) / decay_span)
        return min_lr + (max_lr - min_lr) * gamma

    return lr_at


COMPONENT = Component(config=WarmupDecayLRConfig, build=build)
