"""fp32: everything in float32 (the reference for every equivalence test)."""
from dataclasses import dataclass

import torch

from framework.precision._policy import Policy, grad_accum_dtype
from framework.core.registry import Component


@dataclass(kw_only=True)
class FP32Config:
    grad_accum_dtype: str = "fp32"   # the only choice here; the key exists in every precision


def build(cfg: FP32Config) -> Policy:
    return Policy("fp32", torch.float32, torch.float32, torch.float32, None,
                  grad_accum_dtype=grad_accum_dtype(cfg.grad_accum_dtype, "fp32"))


COMPONENT = Component(config=FP32Config, build=build)
