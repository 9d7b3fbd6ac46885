"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"), decoupled decay."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from framework.optimizers._transforms import (
    GradientTransformation, add_decayed_weights, chain, check_beta, check_common,
    cpu_fused, effective_mask, fused_dispatch, scale_by_lion, scale_by_lr)
from framework.core.registry import Component


@dataclass(kw_only=True)
class LionConfig:
    lr: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.99
    weight_decay: float = 0.0
    decay_1d: bool = False  # also decay 1-D params (biases, norm weights)


def build(cfg: LionConfig, decay_mask: Sequence[bool]) -> GradientTransformation:
    check_common("lion", cfg.lr, cfg.weight_decay)
    check_beta("lion", "beta1", cfg.beta1)
    check_beta("lion", "beta2", cfg.beta2)
    mask = effective_mask(decay_mask, cfg.decay_1d)
    tx = chain(scale_by_lion(cfg.beta1, cfg.beta2), add_decayed_weights(cfg.weight_decay, mask),
               scale_by_lr())
    # No CUDA kernel: off the CPU kernel's tensors, the transforms run.
    return tx._replace(fused=fused_dispatch(
        tx.update, cpu_fused("lion_step", 0, cfg.weight_decay, mask, beta1=cfg.beta1, beta2=cfg.beta2)))


COMPONENT = Component(config=LionConfig, build=build)
