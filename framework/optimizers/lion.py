"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"), decoupled decay."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from framework.optimizers._transforms import GradientTransformation, check, optimizer, scale_by_lion
from framework.core.registry import Component


@dataclass(frozen=True, kw_only=True)
class LionConfig:
    lr: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.99
    weight_decay: float = 0.0
    decay_1d: bool = False  # also decay 1-D params (biases, norm weights)


def check_config(cfg: LionConfig, *_) -> LionConfig:
    """Build's check, and the component's: at compose time, before the scheduler's, which reads the lr."""
    return check("lion", cfg, betas=("beta1", "beta2"))


def build(cfg: LionConfig, decay_mask: Sequence[bool]) -> GradientTransformation:
    check_config(cfg)
    # No CUDA kernel: off the CPU kernel's tensors, the transforms run.
    return optimizer(cfg, decay_mask, scale_by_lion(cfg.beta1, cfg.beta2), decoupled=True, kernel="lion_step",
                     hyper=dict(beta1=cfg.beta1, beta2=cfg.beta2))


COMPONENT = Component(config=LionConfig, build=build, check=check_config)
