"""bf16: bf16 parameters, compute and gradient communication; fp32 master weights and optimizer."""
from dataclasses import dataclass

import torch

from framework.precision._policy import Policy, grad_accum_dtype
from framework.core.registry import Component


@dataclass(kw_only=True)
class BF16Config:
    # Reducing in fp32 costs twice the bytes on the wire but avoids bf16 summation error
    # across many ranks (a common surprise with bf16 accumulation).
    reduce_fp32: bool = False
    # Micro-batch gradients are summed in fp32 (bf16 sums lose digits with train.grad_accum);
    # bf16 saves that memory (4 bytes per parameter under ddp/zero1 when grad_accum > 1,
    # 2 per owned element under zero2/zero3).
    grad_accum_dtype: str = "fp32"


def build(cfg: BF16Config) -> Policy:
    reduce = torch.float32 if cfg.reduce_fp32 else torch.bfloat16
    return Policy("bf16", torch.bfloat16, reduce, torch.float32, None,
                  grad_accum_dtype=grad_accum_dtype(cfg.grad_accum_dtype, "bf16"))


COMPONENT = Component(config=BF16Config, build=build)
