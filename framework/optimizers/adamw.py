"""AdamW (Loshchilov & Hutter): Adam with decoupled weight decay ``p -= lr * wd * p``."""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from framework.core.registry import Component
from framework.optimizers import adam


@dataclass(kw_only=True)
class AdamWConfig(adam.AdamConfig):
    weight_decay: float = 0.01


build = partial(adam.build, decoupled=True)
COMPONENT = Component(config=AdamWConfig, build=build, check=partial(adam.check_config, decoupled=True))
