"""DeepSpeed's WarmupCosineLR: a warm-up of the lr ratio, then cosine decay to cos_min_ratio.

The lr is ``base_lr * ratio(step)``. For ``step < warmup_num_steps`` (raised to at least 2, as
DeepSpeed does) ``ratio = warmup_min_ratio + (1 - warmup_min_ratio) * gamma`` with WarmupLR's
gamma (log or linear); after it ``ratio = cos_min_ratio + (1 - cos_min_ratio) * (1 + cos(pi * p)) / 2``
with ``p = min(1, (step - warmup_num_steps + 1) / max(1, total_num_steps - warmup_num_steps))``,
so the ratio stays at cos_min_ratio once the decay window ends. Unlike nanoGPT's schedule
(``warmup_cosine``) both ends are ratios of the optimizer's lr.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from framework.core.errors import ConfigError
from framework.core.registry import Component
from framework.schedulers.warmup_lr import check_warmup, warmup_gamma


@dataclass(kw_only=True)
class WarmupCosineLRConfig:
    warmup_min_ratio: float = 0.0
    warmup_num_steps: int = 1000
    cos_min_ratio: float = 0.0001
    warmup_type: str = "log"              # "log" or "linear"
    total_num_steps: int | None = None    # None: the run's number of optimizer steps


def build(cfg: WarmupCosineLRConfig, base_lr: float, total_steps: int) -> Callable[[int], float]:
    check_warmup(cfg.warmup_num_steps, cfg.warmup_type)
    for key in ("warmup_min_ratio", "cos_min_ratio"):
        value = getattr(cfg, key)
        if not (math.isfinite(value) and 0.0 <= value <= 1.0):
            raise ConfigError(f"scheduler.{key} must be in [0, 1], got {value}")
    total = total_steps if cfg.total_num_steps is None else cfg.total_num_steps
    if not total >= 1:
        raise ConfigError(f"scheduler.total_num_steps must be >= 1, got {total}")
    num_steps, kind = max(2, cfg.warmup_num_steps), cfg.warmup_type   # raised to 2 as in WarmupLR
    lo, floor = cfg.warmup_min_ratio, cfg.cos_min_ratio
    span = max(1, total - num_steps)

    def lr_at(step: int) -> float:
        if step < num_steps:
            return base_lr * (lo + (1.0 - lo) * warmup_gamma(step, num_steps, kind))
        progress = min(1.0, (step - num_steps + 1) / span)
        return base_lr * max(0.0, floor + (1.0 - floor) * (1.0 + math.cos(math.pi * progress)) / 2)

    return lr_at


COMPONENT = Component(config=WarmupCosineLRConfig, build=build)
