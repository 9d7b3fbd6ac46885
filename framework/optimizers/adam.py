"""Adam (Kingma & Ba) with torch's L2 weight decay: ``g += wd * p`` before the moments."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from framework.optimizers._transforms import (
    GradientTransformation, add_decayed_weights, chain, check_beta, check_common,
    cpu_fused_adam, effective_mask, fused_adam, fused_dispatch, require, scale_by_adam, scale_by_lr)
from framework.core.registry import Component


@dataclass(kw_only=True)
class AdamConfig:
    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    decay_1d: bool = False  # also decay 1-D params (biases, norm weights)
    bias_correction: bool = True


def build(cfg: AdamConfig, decay_mask: Sequence[bool]) -> GradientTransformation:
    check_common("adam", cfg.lr, cfg.weight_decay)
    check_beta("adam", "beta1", cfg.beta1)
    check_beta("adam", "beta2", cfg.beta2)
    require(cfg.eps >= 0, f"optimizer.eps must be >= 0 for adam, got {cfg.eps}")
    mask = effective_mask(decay_mask, cfg.decay_1d)
    tx = chain(add_decayed_weights(cfg.weight_decay, mask),
               scale_by_adam(cfg.beta1, cfg.beta2, cfg.eps, cfg.bias_correction), scale_by_lr())
    cpu = cpu_fused_adam(cfg.beta1, cfg.beta2, cfg.eps, cfg.weight_decay, mask, decoupled=False,
                         bias_correction=cfg.bias_correction, index=1)
    # torch's fused kernel (the CUDA path) always corrects bias.
    cuda = fused_adam(cfg.beta1, cfg.beta2, cfg.eps, cfg.weight_decay, mask, decoupled=False,
                      index=1) if cfg.bias_correction else None
    return tx._replace(fused=fused_dispatch(tx.update, cpu, cuda))


COMPONENT = Component(config=AdamConfig, build=build)
