"""none: master partitions, optimizer state and parameters stay on the training device
(``base.Placement`` as it is)."""
from dataclasses import dataclass

from framework.comm.accelerator import Accelerator
from framework.core.registry import Component
from framework.offload.base import Placement


@dataclass(frozen=True, kw_only=True)
class NoOffloadConfig:
    pass


def build(cfg: NoOffloadConfig, accelerator: Accelerator | None = None) -> Placement:
    return Placement(accelerator=accelerator)


COMPONENT = Component(config=NoOffloadConfig, build=build)
