"""The Update: how a train step turns reduced gradients into published parameters.

``train_step`` calls, in this order: ``arm`` before the micro batches, ``drain`` after their
backward passes, then either ``apply`` (scale the gradients by the clipping/unscaling
coefficient, step the optimizer, publish the new values to the working parameters) or
``skip`` (non-finite gradients); ``abort`` if anything raised in between, so that a failed step
leaves the optimizer as it was; ``close`` when the engine is closed (stops any worker).
``PlainUpdate`` does exactly that, in one go. A stage may provide a pipelined one instead
(``offload._pipeline``: the host step of CPU offload overlapped with backward and with the copy
back) that must give identical results.
"""
from __future__ import annotations

from typing import Any, Protocol, Sequence

import torch
from torch import Tensor

from framework.core.footprint import Footprint
from framework.optimizers import GradientTransformation, step as optimizer_step


class Update(Protocol):
    def init(self, params: Sequence[Tensor]) -> Any: ...   # the optimizer state of ``params``
    def arm(self, opt_state: Any, params: Sequence[Tensor], lr: float, scale: float) -> None: ...
    def drain(self) -> None: ...
    def apply(self, grads: list[Tensor], coef: float, opt_state: Any, params: Sequence[Tensor],
              lr: float) -> Any: ...
    def skip(self) -> None: ...
    def abort(self) -> None: ...
    def memory(self, fp: Footprint) -> None: ...   # its own buffers, added to ``fp``
    def close(self) -> None: ...


class PlainUpdate:
    def __init__(self, tx: GradientTransformation, stage: Any):
        self.tx, self.stage = tx, stage

    def init(self, params: Sequence[Tensor]) -> Any:
        return self.tx.init(list(params))

    def arm(self, opt_state: Any, params: Sequence[Tensor], lr: float, scale: float) -> None:
        pass

    def drain(self) -> None:
        pass

    def apply(self, grads: list[Tensor], coef: float, opt_state: Any, params: Sequence[Tensor],
              lr: float) -> Any:
        if coef != 1.0:
            torch._foreach_mul_(grads, coef)
        opt_state = optimizer_step(self.tx, grads, opt_state, params, lr, self.stage.out16())
        self.stage.publish(list(params))
        return opt_state

    def skip(self) -> None:
        pass

    def abort(self) -> None:
        pass

    def memory(self, fp: Footprint) -> None:
        pass

    def close(self) -> None:
        pass
