"""AdamW (Loshchilov & Hutter): Adam with decoupled weight decay ``p -= lr * wd * p``."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from framework.optimizers._transforms import (
    GradientTransformation, add_decayed_weights, chain, check_beta, check_common,
    cpu_fused_adam, effective_mask, fused_adam, fused_dispatch, require, scale_by_adam, scale_by_lr)
from framework.core.registry import Component


@dataclass(kw_only=True)
class AdamWConfig:
    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.01
    decay_1d: bool = False  # also decay 1-D params (biases, norm weights)
    bias_correction: bool = True


def build(cfg: AdamWConfig, decay_mask: Sequence[bool]) -> GradientTransformation:
    check_common("adamw", cfg.lr, cfg.weight_decay)
    check_beta("adamw", "beta1", cfg.beta1)
    check_beta("adamw", "beta2", cfg.beta2)
    require(cfg.eps >= 0, f"optimizer.eps must be >= 0 for adamw, got {cfg.eps}")
    mask = effective_mask(decay_mask, cfg.decay_1d)
    # Decay sits between the Adam direction and -lr: p += -lr * (adam + wd * p).
    tx = chain(scale_by_adam(cfg.beta1, cfg.beta2, cfg.eps, cfg.bias_correction),
               add_decayed_weights(cfg.weight_decay, mask), scale_by_lr())
    cpu = cpu_fused_adam(cfg.beta1, cfg.beta2, cfg.eps, cfg.weight_decay, mask, decoupled=True,
                         bias_correction=cfg.bias_correction, index=0)
    # torch's fused kernel (the CUDA path) always corrects bias.
    cuda = fused_adam(cfg.beta1, cfg.beta2, cfg.eps, cfg.weight_decay, mask, decoupled=True,
                      index=0) if cfg.bias_correction else None
    return tx._replace(fused=fused_dispatch(tx.update, cpu, cuda))


COMPONENT = Component(config=AdamWConfig, build=build)
