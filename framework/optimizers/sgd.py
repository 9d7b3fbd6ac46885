"""SGD with optional (Nesterov) momentum and dampening, as torch.optim.SGD (L2 weight decay)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from framework.core.errors import ConfigError
from framework.optimizers._transforms import GradientTransformation, check, optimizer, trace
from framework.core.registry import Component


@dataclass(frozen=True, kw_only=True)
class SGDConfig:
    lr: float = 1e-3
    momentum: float = 0.0
    dampening: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False
    decay_1d: bool = False  # also decay 1-D params (biases, norm weights)


def check_config(cfg: SGDConfig, *_) -> SGDConfig:
    """Build's check, and the component's: at compose time, before the scheduler's, which reads the lr."""
    # momentum >= 1 never forgets a gradient (the step grows without bound); dampening > 1 or < 0 turns the
    # new gradient's weight negative or above 1, ascent or blow-up (torch checks neither bound)
    check("sgd", cfg, betas=("momentum",), fractions=("dampening",))
    if cfg.nesterov and not (cfg.momentum > 0 and cfg.dampening == 0):
        raise ConfigError("optimizer.nesterov needs momentum > 0 and dampening == 0 for sgd, got "
                          f"momentum={cfg.momentum} dampening={cfg.dampening}")
    if cfg.momentum == 0 and cfg.dampening != 0:   # (torch ignores it silently)
        raise ConfigError(f"optimizer.dampening has no effect with momentum=0 for sgd, got dampening={cfg.dampening};"
                          " set optimizer.momentum or drop optimizer.dampening")
    return cfg


def build(cfg: SGDConfig, decay_mask: Sequence[bool]) -> GradientTransformation:
    check_config(cfg)
    # torch keeps no momentum buffer at all when momentum is 0
    direction = trace(cfg.momentum, cfg.dampening, cfg.nesterov) if cfg.momentum != 0 else None
    return optimizer(cfg, decay_mask, direction, decoupled=False)


COMPONENT = Component(config=SGDConfig, build=build, check=check_config)
