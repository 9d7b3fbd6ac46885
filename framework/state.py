"""TrainState: everything that changes from step to step, and nothing else.

The container is immutable; tensors inside may be updated in place by ``train_step`` (like
donated buffers in JAX), so always continue from the state it returns.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from framework.precision import PrecisionState


@dataclass(frozen=True)
class TrainState:
    step: int                        # train_step calls so far (optimizer steps, skipped ones included)
    params: tuple[torch.Tensor, ...]  # master parameters as the stage lays them out (flat, per group/partition)
    opt_state: Any                   # the optimizer transformation's state
    precision: PrecisionState        # loss scale and skipped-step bookkeeping
    rng: tuple[torch.Tensor, ...]    # generator states after the last step: CPU, then the device's (dropout)
    data: int                        # data position: global batches consumed

    @property
    def applied_steps(self) -> int:
        """Optimizer updates actually applied; the LR schedule is indexed by this."""
        return self.step - self.precision.skipped_steps


def capture_rng(device: torch.device) -> tuple[torch.Tensor, ...]:
    if device.type == "cuda":
        return torch.get_rng_state(), torch.cuda.get_rng_state(device)
    return (torch.get_rng_state(),)


def restore_rng(rng: tuple[torch.Tensor, ...], device: torch.device) -> None:
    torch.set_rng_state(rng[0])
    if device.type == "cuda":
        torch.cuda.set_rng_state(rng[1], device)
