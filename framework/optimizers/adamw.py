"""AdamW (Loshchilov & Hutter): Adam with decoupled weight decay ``p -= lr * wd * p``."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from framework.core.registry import Component
from framework.optimizers._transforms import GradientTransformation
from framework.optimizers.adam import AdamConfig, build_adam


@dataclass(kw_only=True)
class AdamWConfig(AdamConfig):
    weight_decay: float = 0.01


def build(cfg: AdamWConfig, decay_mask: Sequence[bool]) -> GradientTransformation:
    return build_adam(cfg, decay_mask, decoupled=True)


COMPONENT = Component(config=AdamWConfig, build=build)
