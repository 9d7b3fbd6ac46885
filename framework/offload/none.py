"""none: master partitions, optimizer state and parameters stay on the training device."""
from dataclasses import dataclass

from framework.comm.accelerator import Accelerator
from framework.offload.base import Placement
from framework.core.registry import Component


@dataclass(kw_only=True)
class NoOffloadConfig:
    pass


def build(cfg: NoOffloadConfig, accelerator: Accelerator | None = None) -> Placement:
    return Placement(host_fraction=0.0, pin=False, params_on_host=False, accelerator=accelerator)


COMPONENT = Component(config=NoOffloadConfig, build=build)
