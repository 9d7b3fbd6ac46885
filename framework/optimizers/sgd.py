"""SGD with optional (Nesterov) momentum and dampening, as torch.optim.SGD (L2 weight decay)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from framework.optimizers._transforms import (
    GradientTransformation, add_decayed_weights, chain, check_common, effective_mask, require,
    scale_by_lr, trace)
from framework.core.registry import Component


@dataclass(kw_only=True)
class SGDConfig:
    lr: float = 1e-3
    momentum: float = 0.0
    dampening: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False
    decay_1d: bool = False  # also decay 1-D params (biases, norm weights)


def build(cfg: SGDConfig, decay_mask: Sequence[bool]) -> GradientTransformation:
    check_common("sgd", cfg.lr, cfg.weight_decay)
    require(cfg.momentum >= 0, f"optimizer.momentum must be >= 0 for sgd, got {cfg.momentum}")
    require(not cfg.nesterov or (cfg.momentum > 0 and cfg.dampening == 0),
            "optimizer.nesterov needs momentum > 0 and dampening == 0 for sgd, got "
            f"momentum={cfg.momentum} dampening={cfg.dampening}")
    steps = [add_decayed_weights(cfg.weight_decay, effective_mask(decay_mask, cfg.decay_1d))]
    if cfg.momentum != 0:  # torch keeps no momentum buffer at all when momentum is 0
        steps.append(trace(cfg.momentum, cfg.dampening, cfg.nesterov))
    return chain(*steps, scale_by_lr())


COMPONENT = Component(config=SGDConfig, build=build)
