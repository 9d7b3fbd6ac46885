"""bf16: bf16 parameters, compute and gradient communication; fp32 master weights and optimizer."""
from dataclasses import dataclass

import torch

from framework.precision._policy import Policy
from framework.registry import Component


@dataclass(kw_only=True)
class BF16Config:
    # Reducing in fp32 costs twice the bytes on the wire but avoids bf16 summation error
    # across many ranks (a common surprise with bf16 accumulation).
    reduce_fp32: bool = False


def build(cfg: BF16Config) -> Policy:
    reduce = torch.float32 if cfg.reduce_fp32 else torch.bfloat16
    return Policy("bf16", torch.bfloat16, reduce, torch.float32, None)


COMPONENT = Component(config=BF16Config, build=build)
