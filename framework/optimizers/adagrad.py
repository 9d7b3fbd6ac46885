"""Adagrad (Duchi et al.) as torch.optim.Adagrad: L2 weight decay and step-size decay."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from framework.optimizers._transforms import GradientTransformation, check, optimizer, positive_fp32, scale_by_rss
from framework.core.registry import Component


@dataclass(frozen=True, kw_only=True)
class AdagradConfig:
    lr: float = 1e-2
    lr_decay: float = 0.0
    weight_decay: float = 0.0
    initial_accumulator_value: float = 0.0
    eps: float = 1e-10
    decay_1d: bool = False  # also decay 1-D params (biases, norm weights)


def check_config(cfg: AdagradConfig, *_) -> AdagradConfig:
    """Build's check, and the component's: at compose time, before the scheduler's, which reads the lr. eps
    may be 0 only with an initial_accumulator_value positive in fp32 (the state's dtype): the sum of squares is
    never 0 then."""
    if not positive_fp32(cfg.initial_accumulator_value):   # (1e-50 is 0 there)
        return check("adagrad", cfg, nonneg=("lr_decay", "initial_accumulator_value"), positive=("eps",))
    return check("adagrad", cfg, nonneg=("lr_decay", "initial_accumulator_value", "eps"))


def build(cfg: AdagradConfig, decay_mask: Sequence[bool]) -> GradientTransformation:
    check_config(cfg)
    # No CUDA kernel: off the CPU kernel's tensors, the transforms run.
    return optimizer(cfg, decay_mask, scale_by_rss(cfg.initial_accumulator_value, cfg.eps, cfg.lr_decay),
                     decoupled=False, kernel="adagrad_step", hyper=dict(lr_decay=cfg.lr_decay, eps=cfg.eps))


COMPONENT = Component(config=AdagradConfig, build=build, check=check_config)
