"""fp32: everything in float32 (the reference for every equivalence test)."""
from dataclasses import dataclass

import torch

from framework.precision._policy import Policy
from framework.registry import Component


@dataclass(kw_only=True)
class FP32Config:
    pass


def build(cfg: FP32Config) -> Policy:
    return Policy("fp32", torch.float32, torch.float32, torch.float32, None)


COMPONENT = Component(config=FP32Config, build=build)
