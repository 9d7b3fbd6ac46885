"""AdamW (Loshchilov & Hutter): Adam with decoupled weight decay ``p -= lr * wd * p``."""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from framework.core.registry import Component
from framework.optimizers import adam


@dataclass(frozen=True, kw_only=True)
class AdamWConfig(adam.AdamConfig):
    # nanoGPT's baby-GPT settings, as adamw.yaml (torch's AdamW: beta2 0.999, weight decay 0.01)
    beta2: float = 0.99
    weight_decay: float = 0.1


build = partial(adam.build, decoupled=True)
COMPONENT = Component(config=AdamWConfig, build=build, check=partial(adam.check_config, decoupled=True))
