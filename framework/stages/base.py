"""The Stage protocol: how parameters, gradients and optimizer inputs are laid out and moved.

``train_step`` calls these methods in a fixed order and never asks which stage it drives.
Stages never know which optimizer runs; optimizers never know about sharding.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from framework.core.footprint import Footprint
from framework.optimizers import GradientTransformation
from framework.precision import Policy
from framework.stages._spec import PieceSpec
from framework.engine.update import PlainUpdate, Update


@dataclass(frozen=True)
class Setup:
    """What ``Stage.setup`` hands back: the master tensors the optimizer updates (one flat
    tensor per parameter group, or this rank's partition of it) and each group's kind."""

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
        """Global squared L2 norm across all ranks (non-finite if any element is) of the gradients
        the last ``reduce_grads`` finished. Each stage says which tensors it reads (the ZeRO
        stages: whole partitions, so that how the offload target cut them into pieces does not
        change the rounding)."""

    def nonfinite_names(self, grads: list[torch.Tensor]) -> list[str]:
        """Names of parameters with non-finite gradients on any rank (slow path, for errors)."""

    def publish(self, master: list[torch.Tensor]) -> None:
        """Copy updated master values into the working parameters the module computes with."""

    def piece_specs(self) -> list[PieceSpec]:
        """What each master piece holds, by parameter name, aligned with ``Setup.master``
        (framework.stages._spec): the name-keyed layout behind ``TrainState.params``."""

    def zero_grads(self) -> None: ...

    def memory(self, opt_state) -> Footprint:
        """This rank's model states and persistent buffers (``opt_state``: the optimizer state of
        the master pieces) by item and by where they live (framework.core.footprint)."""

    def make_update(self, tx: GradientTransformation) -> Update:
        """How optimizer steps are applied and published (framework.engine.update)."""

    def out16(self) -> list[torch.Tensor] | None:
        """Where the optimizer step also writes the updated values in the working dtype, one per
        master piece (the offload target's staging buffers), or None."""

    def stats(self) -> dict:
        """Stage metrics for the last step (e.g. zero3's prefetch hit rate); may be empty."""

    def consolidated_state_dict(self) -> dict | None:
        """Full working-dtype weights under every parameter name, on rank 0 (None elsewhere). Collective."""

    def weights_on_save(self) -> bool:
        """Whether each save also writes consolidated working-dtype weights (zero3's
        ``stage3_gather_16bit_weights_on_model_save``; framework.persist.weights.save_on_model_save)."""

    def close(self) -> None:
        """Remove the hooks this stage registered on the module (``Engine.close``)."""


class HookOwner:
    """``close`` for a stage that keeps the handles of the hooks it registered in ``hook_handles``."""

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
