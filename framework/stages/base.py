"""The Stage protocol: how parameters, gradients and optimizer inputs are laid out and moved.

``train_step`` never asks which stage it drives; stages never know which optimizer runs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from framework.core.footprint import Footprint
from framework.optimizers import GradientTransformation
from framework.precision import Policy
from framework.stages._flat import PieceSpec
from framework.engine.update import PlainUpdate, Update


@dataclass(frozen=True)
class Setup:
    """The master tensors the optimizer updates and each one's group kind."""

    master: list[torch.Tensor]
    kinds: list[str]          # 'decay' or 'no_decay', aligned with ``master``


class Stage(Protocol):
    def setup(self, module: nn.Module, policy: Policy) -> Setup:
        """Take ownership of the module's parameters (flatten, shard, bind views)."""

    def backward(self, loss: torch.Tensor, *, sync: bool) -> None:
        """Backpropagate one micro batch; ``sync`` marks the accumulation boundary."""

    def reduce_grads(self) -> list[torch.Tensor]:
        """Finish gradient reduction; return gradients aligned with ``Setup.master`` (master dtype)."""

    def grad_sq_norm(self) -> torch.Tensor:
        """Global squared L2 norm of the gradients the last ``reduce_grads`` finished (non-finite if
        any element is)."""

    def nonfinite_names(self, grads: list[torch.Tensor]) -> list[str]:
        """Names of parameters with non-finite gradients on any rank (slow path, for errors)."""

    def publish(self, master: list[torch.Tensor]) -> None:
        """Copy updated master values into the working parameters the module computes with."""

    def piece_specs(self) -> list[PieceSpec]:
        """What each master piece holds by parameter name (the layout behind ``TrainState.params``)."""

    def zero_grads(self) -> None: ...

    def memory(self, opt_state) -> Footprint:
        """This rank's model states and persistent buffers (``opt_state``: the optimizer state of
        the master pieces) by item and by where they live (framework.core.footprint)."""

    def make_update(self, tx: GradientTransformation) -> Update: ...

    def out16(self) -> list[torch.Tensor] | None:
        """Where the optimizer step also writes the updated values in the working dtype, or None."""

    def stats(self) -> dict:
        """Stage metrics for the last step (e.g. zero3's prefetch hit rate); may be empty."""

    def consolidated_state_dict(self) -> dict | None:
        """Full working-dtype weights under every parameter name, on rank 0 (None elsewhere). Collective."""

    def weights_on_save(self) -> bool:
        """Whether each save also writes consolidated working-dtype weights (zero3's option)."""

    def close(self) -> None:
        """Remove the hooks this stage registered on the module."""


class HookOwner:
    """``close`` for a stage that keeps its hooks' handles in ``hook_handles``."""

    hook_handles: list

    def close(self) -> None:
        for h in self.hook_handles:
            h.remove()
        self.hook_handles.clear()


class WholeParameters(HookOwner):
    """Defaults for stages whose working parameters are whole on every rank (ddp, zero1, zero2)."""

    module: nn.Module
    dist: object

    def stats(self) -> dict:
        return {}

    def make_update(self, tx: GradientTransformation) -> Update:
        return PlainUpdate(tx, self)

    def out16(self) -> list[torch.Tensor] | None:
        return None  # publish converts the master values itself

    def weights_on_save(self) -> bool:
        return False  # no such key: the plain module's own state_dict already holds full weights

    def consolidated_state_dict(self) -> dict | None:
        if not self.dist.is_main:
            return None
        # host sync: consolidation, between steps
        return {n: p.detach().to("cpu", copy=True) for n, p in self.module.named_parameters(remove_duplicate=False)}
