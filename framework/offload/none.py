"""none: optimizer state and parameters stay on the training device."""
from dataclasses import dataclass

import torch

from framework.registry import Component


@dataclass(kw_only=True)
class NoOffloadConfig:
    pass


@dataclass(frozen=True)
class NoOffload:
    name: str = "none"

    def place(self, t: torch.Tensor) -> torch.Tensor:
        return t


def build(cfg: NoOffloadConfig) -> NoOffload:
    return NoOffload()


COMPONENT = Component(config=NoOffloadConfig, build=build)
