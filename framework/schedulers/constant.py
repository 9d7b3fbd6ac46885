"""The optimizer's lr at every step."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from framework.core.registry import Component


@dataclass(kw_only=True)
class ConstantConfig:
    pass


def build(cfg: ConstantConfig, base_lr: float, total_steps: int) -> Callable[[int], float]:
    def lr_at(step: int) -> float:
        return base_lr

    return lr_at


COMPONENT = Component(config=ConstantConfig, build=build)
