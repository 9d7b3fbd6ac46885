"""Adam (Kingma & Ba) with torch's L2 weight decay: ``g += wd * p`` before the moments.
``build(..., decoupled=True)`` is AdamW (``adamw``), whose decay is decoupled."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor
from torch.optim.adam import adam as torch_adam   # (the functional forms: public, unlike the kernels)
from torch.optim.adamw import adamw as torch_adamw

from framework.optimizers._transforms import GradientTransformation, ScaleByAdamState, check, optimizer, scale_by_adam
from framework.core.registry import Component


@dataclass(frozen=True, kw_only=True)
class AdamConfig:
    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    decay_1d: bool = False  # also decay 1-D params (biases, norm weights)
    bias_correction: bool = True


def check_config(cfg: AdamConfig, *_, decoupled: bool = False) -> AdamConfig:
    """Build's check, and the component's: at compose time, before the scheduler's, which reads the lr."""
    return check("adamw" if decoupled else "adam", cfg, betas=("beta1", "beta2"), positive=("eps",))


def build(cfg: AdamConfig, decay_mask: Sequence[bool], decoupled: bool = False) -> GradientTransformation:
    check_config(cfg, decoupled=decoupled)
    kernel = torch_adamw if decoupled else torch_adam

    def torch_fused(grads: list[Tensor], adam: ScaleByAdamState, params: Sequence[Tensor], lr: float,
                    mask: list[bool]) -> None:
        """torch's fused Adam(W) kernel over the flat groups, in place."""
        for decayed in (True, False):
            idx = [i for i, m in enumerate(mask) if m == decayed]
            if not idx:
                continue
            # The functional form increments each step (read for bias correction) before its kernel: pass the
            # count of steps taken so far.
            steps = [torch.full((), float(adam.count), device=params[i].device) for i in idx]
            kernel([params[i] for i in idx], [grads[i] for i in idx], [adam.mu[i] for i in idx],
                   [adam.nu[i] for i in idx], [], steps, fused=True, lr=lr, beta1=cfg.beta1, beta2=cfg.beta2,
                   weight_decay=cfg.weight_decay if decayed else 0.0, eps=cfg.eps, amsgrad=False, maximize=False)

    hyper = dict(beta1=cfg.beta1, beta2=cfg.beta2, eps=cfg.eps, decoupled=decoupled, bias_correction=cfg.bias_correction)
    # torch's fused kernel (the CUDA path) always corrects bias.
    return optimizer(cfg, decay_mask, scale_by_adam(cfg.beta1, cfg.beta2, cfg.eps, cfg.bias_correction),
                     decoupled=decoupled, kernel="adam_step", hyper=hyper,
                     cuda=torch_fused if cfg.bias_correction else None)


COMPONENT = Component(config=AdamConfig, build=build, check=check_config)
