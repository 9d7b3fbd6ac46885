"""The optimizer's lr at every step."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from framework.core.registry import Component


@dataclass(frozen=True, kw_only=True)
class ConstantConfig:
    pass


def build(cfg: ConstantConfig, base_lr: float, total_steps: int) -> Callable[[int], float]:
    return lambda step: base_lr


COMPONENT = Component(config=ConstantConfig, build=build)
