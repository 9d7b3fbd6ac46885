"""fp16 with DeepSpeed's dynamic loss scaling; fp32 master weights and optimizer."""
from dataclasses import dataclass

import torch

from framework.core.errors import ConfigError
from framework.precision._policy import Policy, ScalerConfig, grad_accum_dtype
from framework.core.registry import Component


@dataclass(kw_only=True)
class FP16Config:
    loss_scale: float = 0.0          # 0 = dynamic
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_loss_scale: float = 1.0
    grad_accum_dtype: str = "fp32"   # micro-batch gradients summed in fp32 (or fp16, see bf16.py)


def build(cfg: FP16Config) -> Policy:
    if cfg.loss_scale < 0 or cfg.min_loss_scale <= 0 or cfg.hysteresis < 1 or cfg.loss_scale_window < 1:
        raise ConfigError("precision: need loss_scale >= 0, min_loss_scale > 0, hysteresis >= 1 and "
                          "loss_scale_window >= 1")
    if not 0 <= cfg.initial_scale_power <= 127:   # 2**128 is not a float32 (nor a float beyond 2**1023)
        raise ConfigError(f"precision.initial_scale_power must be in [0, 127], got {cfg.initial_scale_power}")
    scaler = ScalerConfig(cfg.loss_scale, cfg.initial_scale_power, cfg.loss_scale_window,
                          cfg.hysteresis, cfg.consecutive_hysteresis, cfg.min_loss_scale)
    return Policy("fp16", torch.float16, torch.float16, torch.float32, scaler,
                  grad_accum_dtype=grad_accum_dtype(cfg.grad_accum_dtype, "fp16"))


COMPONENT = Component(config=FP16Config, build=build)
