"""Adagrad (Duchi et al.) as torch.optim.Adagrad: L2 weight decay and step-size decay."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from framework.optimizers._transforms import (
    GradientTransformation, add_decayed_weights, chain, check_common, cpu_fused,
    effective_mask, fused_dispatch, require, scale_by_lr, scale_by_rss)
from framework.core.registry import Component


@dataclass(kw_only=True)
class AdagradConfig:
    lr: float = 1e-2
    lr_decay: float = 0.0
    weight_decay: float = 0.0
    initial_accumulator_value: float = 0.0
    eps: float = 1e-10
    decay_1d: bool = False  # also decay 1-D params (biases, norm weights)


def build(cfg: AdagradConfig, decay_mask: Sequence[bool]) -> GradientTransformation:
    check_common("adagrad", cfg.lr, cfg.weight_decay)
    require(cfg.lr_decay >= 0, f"optimizer.lr_decay must be >= 0 for adagrad, got {cfg.lr_decay}")
    require(cfg.initial_accumulator_value >= 0, "optimizer.initial_accumulator_value must be >= 0 "
            f"for adagrad, got {cfg.initial_accumulator_value}")
    require(cfg.eps >= 0, f"optimizer.eps must be >= 0 for adagrad, got {cfg.eps}")
    mask = effective_mask(decay_mask, cfg.decay_1d)
    tx = chain(add_decayed_weights(cfg.weight_decay, mask),
               scale_by_rss(cfg.initial_accumulator_value, cfg.eps, cfg.lr_decay), scale_by_lr())
    # No CUDA kernel: off the CPU kernel's tensors, the transforms run.
    return tx._replace(fused=fused_dispatch(
        tx.update, cpu_fused("adagrad_step", 1, cfg.weight_decay, mask, lr_decay=cfg.lr_decay, eps=cfg.eps)))


COMPONENT = Component(config=AdagradConfig, build=build)
