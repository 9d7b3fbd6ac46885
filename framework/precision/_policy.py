"""Precision policy and the dynamic loss scaler (DeepSpeed's rule as a pure function).

A policy says which dtype each kind of tensor has; stages take it as input and never decide
dtypes themselves. The loss-scale state is an immutable value updated by ``next_scale``.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from framework.core.errors import ConfigError, TrainingError
from framework.core.utils import few


@dataclass(frozen=True)
class ScalerConfig:
    """DeepSpeed fp16 keys: loss_scale 0 = dynamic, else a static scale."""

    loss_scale: float = 0.0
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_loss_scale: float = 1.0


@dataclass(frozen=True)
class PrecisionState:
    """What precision carries from step to step (part of TrainState)."""

    cur_scale: float = 1.0
    cur_iter: int = 0
    last_overflow_iter: int = -1
    cur_hysteresis: int = 1
    skipped_steps: int = 0


@dataclass(frozen=True)
class Policy:
    name: str
    param_dtype: torch.dtype     # working copy the module computes with
    reduce_dtype: torch.dtype    # gradients on the wire
    master_dtype: torch.dtype    # what the optimizer updates
    scaler: ScalerConfig | None  # None: no loss scaling (the scale stays 1)
    # Gradients are summed across the micro batches of a step in this dtype (each micro batch's
    # backward still produces param_dtype gradients): fp32 by default, as DeepSpeed's BF16
    # optimizer does; param_dtype sums in 16 bits (less memory, rounding that grows with
    # train.grad_accum).
    grad_accum_dtype: torch.dtype = torch.float32

    def init_state(self) -> PrecisionState:
        if self.scaler is None:
            return PrecisionState()
        s = self.scaler
        scale = s.loss_scale if s.loss_scale > 0 else float(2 ** s.initial_scale_power)
        return PrecisionState(cur_scale=scale, cur_hysteresis=s.hysteresis)

    def describe(self) -> str:
        dt = lambda d: str(d).removeprefix("torch.")  # noqa: E731
        scaling = "none" if self.scaler is None else (
            "dynamic" if self.scaler.loss_scale == 0 else f"static {self.scaler.loss_scale:g}")
        return (f"precision {self.name}: params {dt(self.param_dtype)}, reduce {dt(self.reduce_dtype)}, "
                f"gradient accumulation {dt(self.grad_accum_dtype)}, master/optimizer {dt(self.master_dtype)}, "
                f"loss scaling {scaling}")


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def grad_accum_dtype(value: str, working: str) -> torch.dtype:
    """``precision.grad_accum_dtype``: fp32, or the working dtype (``working``) itself."""
    allowed = sorted({"fp32", working})
    if value not in allowed:
        raise ConfigError(f"precision.grad_accum_dtype={value!r} is not valid with precision={working}; use "
                          f"{' or '.join(allowed)}")
    return DTYPES[value]


def next_scale(cfg: ScalerConfig | None, st: PrecisionState, overflow: bool,
               culprits=lambda: []) -> PrecisionState:
    """One step of DeepSpeed's dynamic loss scaler (its DynamicLossScaler: the rule is written out below).

    Steps with non-finite gradients are always skipped (also for fp32/bf16, where the scale
    stays 1): ``skipped_steps`` counts them. ``culprits`` lazily names the parameters whose
    gradients overflowed, for the error raised at the minimum scale.
    """
    if cfg is None or cfg.loss_scale > 0:  # no scaling or a static scale: only count skips
        return replace(st, cur_iter=st.cur_iter + 1, skipped_steps=st.skipped_steps + overflow)
    scale, hyst = st.cur_scale, st.cur_hysteresis
    if overflow:
        if cfg.hysteresis == 1 or hyst == 1:
            if scale <= cfg.min_loss_scale:
                names = list(culprits())
                shown = few(names, 8, str)
                raise TrainingError(
                    f"fp16 loss scale is at min_loss_scale={cfg.min_loss_scale:g} and gradients still overflow "
                    f"at step {st.cur_iter} (non-finite gradients in: {shown or 'unknown'}); after "
                    f"{st.skipped_steps} skipped steps. Lower the learning rate, use precision=bf16, or "
                    f"lower precision.min_loss_scale")
            scale = max(scale / 2, cfg.min_loss_scale)
        else:
            hyst -= 1
        return PrecisionState(scale, st.cur_iter + 1, st.cur_iter, hyst, st.skipped_steps + 1)
    if cfg.consecutive_hysteresis:
        hyst = cfg.hysteresis
    stable = st.cur_iter - st.last_overflow_iter - 1
    if stable > 0 and stable % cfg.loss_scale_window == 0:
        if not cfg.consecutive_hysteresis:
            hyst = cfg.hysteresis
        scale *= 2
    return PrecisionState(scale, st.cur_iter + 1, st.last_overflow_iter, hyst, st.skipped_steps)
