"""The Update: how a train step turns reduced gradients into published parameters.

``train_step`` calls ``arm``, ``drain`` after the backward passes, then ``apply`` (scale, step, publish)
or ``skip``; ``abort`` if anything raised. ``apply`` calls ``applying`` just before its first change that
``abort`` cannot undo. ``offload._pipeline`` is a pipelined one that must give ``PlainUpdate``'s results.
"""
from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence

import torch
from torch import Tensor

from framework.core.footprint import Footprint
from framework.optimizers import GradientTransformation, step as optimizer_step


class Update(Protocol):
    tx: GradientTransformation   # the optimizer (a resume starts the state a checkpoint lacks from its init)
    def init(self, params: Sequence[Tensor]) -> Any: ...   # the optimizer state of ``params``
    def arm(self, opt_state: Any, params: Sequence[Tensor], lr: float, scale: float) -> None: ...
    def drain(self) -> None: ...
    def apply(self, grads: list[Tensor], coef: float, opt_state: Any, params: Sequence[Tensor],
              lr: float, applying: Callable[[], None] | None = None) -> Any: ...
    def skip(self) -> None: ...
    def abort(self) -> None: ...
    def memory(self, fp: Footprint) -> None: ...   # its own buffers, added to ``fp``
    def close(self) -> None: ...


class PlainUpdate(Update):
    """Steps and publishes in one go (its other calls are the protocol's no-ops)."""

    def __init__(self, tx: GradientTransformation, stage: Any):
        self.tx, self.stage = tx, stage

    def init(self, params: Sequence[Tensor]) -> Any:
        return self.tx.init(list(params))

    def apply(self, grads: list[Tensor], coef: float, opt_state: Any, params: Sequence[Tensor],
              lr: float, applying: Callable[[], None] | None = None) -> Any:
        if applying is not None:
            applying()
        if coef != 1.0:
            # (torch._foreach_*: no public multi-tensor op; torch.optim's own steps use the same ones)
            torch._foreach_mul_(grads, coef)
        opt_state = optimizer_step(self.tx, grads, opt_state, params, lr, self.stage.out16())
        self.stage.publish(list(params))
        return opt_state
