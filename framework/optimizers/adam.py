"""Adam (Kingma & Ba) with torch's L2 weight decay: ``g += wd * p`` before the moments.
``build_adam`` also builds AdamW (``adamw``), whose decay is decoupled."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from framework.optimizers._transforms import (
    GradientTransformation, add_decayed_weights, chain, check_beta, check_common,
    cpu_fused, effective_mask, fused_adam, fused_dispatch, require, scale_by_adam, scale_by_lr)
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


def build_adam(cfg: AdamConfig, decay_mask: Sequence[bool], decoupled: bool) -> GradientTransformation:
    name = "adamw" if decoupled else "adam"
    check_common(name, cfg.lr, cfg.weight_decay)
    check_beta(name, "beta1", cfg.beta1)
    check_beta(name, "beta2", cfg.beta2)
    require(cfg.eps >= 0, f"optimizer.eps must be >= 0 for {name}, got {cfg.eps}")
    mask = effective_mask(decay_mask, cfg.decay_1d)
    decay = add_decayed_weights(cfg.weight_decay, mask)
    adam = scale_by_adam(cfg.beta1, cfg.beta2, cfg.eps, cfg.bias_correction)
    # Decoupled decay sits between the Adam direction and -lr: p += -lr * (adam + wd * p).
    tx = chain(adam, decay, scale_by_lr()) if decoupled else chain(decay, adam, scale_by_lr())
    index = 0 if decoupled else 1   # where the Adam state sits in the chain
    cpu = cpu_fused("adam_step", index, cfg.weight_decay, mask, beta1=cfg.beta1, beta2=cfg.beta2, eps=cfg.eps,
                    decoupled=decoupled, bias_correction=cfg.bias_correction)
    # torch's fused kernel (the CUDA path) always corrects bias.
    cuda = fused_adam(cfg.beta1, cfg.beta2, cfg.eps, cfg.weight_decay, mask, decoupled=decoupled,
                      index=index) if cfg.bias_correction else None
    return tx._replace(fused=fused_dispatch(tx.update, cpu, cuda))


def build(cfg: AdamConfig, decay_mask: Sequence[bool]) -> GradientTransformation:
    return build_adam(cfg, decay_mask, decoupled=False)


COMPONENT = Component(config=AdamConfig, build=build)
