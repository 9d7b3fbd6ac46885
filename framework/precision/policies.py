"""The precisions (conf/precision: fp32, bf16, fp16): a policy says which dtype each kind of tensor has
(stages never decide dtypes); the loss-scale state is a value ``next_scale`` updates (DeepSpeed's rule)."""
from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from functools import partial
from typing import Any, Mapping

import torch

from framework.core.errors import ConfigError, TrainingError
from framework.core.registry import Component
from framework.core.utils import counted, few, map_tensors


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
    # Micro-batch gradients are summed in this dtype (fp32 by default, as DeepSpeed's BF16 optimizer).
    grad_accum_dtype: torch.dtype = torch.float32
    auto_cast: bool = False      # fp16's auto_cast: the module's floating inputs cast to param_dtype

    def cast_forward(self, module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """A forward pre-hook under ``auto_cast``: the forward's arguments cast (a loss's targets are not)."""
        return self.cast_inputs(args), self.cast_inputs(kwargs)

    def cast_inputs(self, micro: Any) -> Any:
        """``micro`` with its floating tensors (in containers, as ``map_tensors`` walks them) in ``param_dtype`` under
        ``auto_cast``."""
        if not self.auto_cast:
            return micro
        return map_tensors(micro, lambda t: t.to(self.param_dtype) if t.is_floating_point() else t)

    @property
    def dynamic(self) -> bool:
        """Dynamic loss scaling (fp16 without a static ``loss_scale``)."""
        return self.scaler is not None and self.scaler.loss_scale == 0

    def init_state(self) -> PrecisionState:
        if self.scaler is None:
            return PrecisionState()
        s = self.scaler
        scale = s.loss_scale if s.loss_scale > 0 else float(2 ** s.initial_scale_power)   # host sync: no (an int)
        return PrecisionState(cur_scale=scale, cur_hysteresis=s.hysteresis)

    def continued(self, saved: PrecisionState) -> PrecisionState:
        """The initial scale for a run resumed from a state saved without dynamic scaling, keeping the saved
        step and skip counts; the scale first grows a full loss_scale_window of clean steps from here."""
        fresh = self.init_state()
        return replace(fresh, cur_iter=saved.cur_iter, skipped_steps=saved.skipped_steps,
                       last_overflow_iter=saved.cur_iter - 1 if self.dynamic else fresh.last_overflow_iter)


# The precision names as dtypes; ``python -m framework.export --dtype`` takes the same names.
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def scale_power(value) -> int | None:
    """The power of 2 a loss scale ``value`` is, where it cannot be a power itself (above initial_scale_power's
    range, 127) and is one: what a value given as a scale (Megatron's habit) means there. Else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 127):
        return None
    power = math.log2(value)
    return int(power) if power.is_integer() else None   # host sync: no (a Python float)


def next_scale(cfg: ScalerConfig | None, st: PrecisionState, overflow: bool,
               culprits=lambda: []) -> PrecisionState:
    """One step of DeepSpeed's dynamic loss scaling: its hysteresis, and the scale doubling after
    ``loss_scale_window`` + 1 clean steps since the last overflow, as its fp16 optimizer counts them (its ZeRO
    scaler, ``DynamicLossScaler``, doubles one step sooner). Steps with non-finite gradients are always skipped
    (the scale stays 1 for fp32/bf16) and counted; ``culprits`` lazily names the overflowing parameters."""
    if cfg is None or cfg.loss_scale > 0:  # no scaling or a static scale: only count skips
        return replace(st, cur_iter=st.cur_iter + 1, skipped_steps=st.skipped_steps + overflow)
    scale, hyst = st.cur_scale, st.cur_hysteresis
    if overflow:
        if cfg.hysteresis == 1 or hyst == 1:
            if scale <= cfg.min_loss_scale:   # (the step named 1-based, as train_step names it)
                shown = few(list(culprits()), 8, str)
                raise TrainingError(
                    f"fp16 loss scale is at min_loss_scale={cfg.min_loss_scale:g} and gradients still overflow "
                    f"at step {st.cur_iter + 1} (non-finite gradients in: {shown or 'unknown'}); after "
                    f"{counted(st.skipped_steps, 'skipped step')}. Lower the learning rate, use precision=bf16, or "
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


@dataclass(frozen=True, kw_only=True)
class FP32Config:
    """fp32: everything in float32 (the reference for every equivalence test)."""

    grad_accum_dtype: str = "fp32"   # the only choice here; the key exists in every precision


@dataclass(frozen=True, kw_only=True)
class BF16Config:
    """bf16: bf16 parameters, compute and gradient communication; fp32 master weights and optimizer."""

    # twice the bytes on the wire, no bf16 summation error across many ranks; every stage's optimizer reads the
    # fp32 sums (ddp/zero1 without grad_accum: an fp32 buffer of 4 bytes per owned element)
    reduce_fp32: bool = False
    # Micro-batch gradients summed in fp32 (bf16 sums lose digits); bf16 saves that memory.
    grad_accum_dtype: str = "fp32"


@dataclass(frozen=True, kw_only=True)
class FP16Config(ScalerConfig):
    """fp16 with DeepSpeed's dynamic loss scaling; fp32 master weights and optimizer."""

    grad_accum_dtype: str = "fp32"   # micro-batch gradients summed in fp32 (or fp16, see BF16Config)
    auto_cast: bool = False   # DeepSpeed's fp16.auto_cast: the forward's floating inputs cast to fp16


def check(name: str, cfg, stage: str = "", nodes: Mapping[str, Any] | None = None) -> Any:
    """Precision ``name``'s node, refused before a run starts where a key is out of range (the build relies on it)."""
    allowed = sorted({"fp32", name})
    if cfg.grad_accum_dtype not in allowed:
        raise ConfigError(f"precision.grad_accum_dtype={cfg.grad_accum_dtype!r} is not valid with precision={name}; "
                          f"use {' or '.join(allowed)}")
    if name != "fp16":
        return cfg
    for key, value, bad, rule in (("loss_scale", cfg.loss_scale, cfg.loss_scale < 0, ">= 0 (0: dynamic)"),
                                  ("min_loss_scale", cfg.min_loss_scale, cfg.min_loss_scale <= 0, "> 0"),
                                  ("hysteresis", cfg.hysteresis, cfg.hysteresis < 1, ">= 1"),
                                  ("loss_scale_window", cfg.loss_scale_window, cfg.loss_scale_window < 1, ">= 1")):
        if bad:
            raise ConfigError(f"precision.{key} must be {rule}, got {value:g}")
    if not 0 <= cfg.initial_scale_power <= 127:   # 2**128 is not a float32 (nor a float beyond 2**1023)
        scale = cfg.initial_scale_power   # (a loss scale given for its power: say which power it is)
        power = scale_power(scale)
        hint = "" if power is None else f"; it is the power of 2 (a scale of {scale} is initial_scale_power {power})"
        raise ConfigError(f"precision.initial_scale_power must be in [0, 127], got {scale}{hint}")
    if not cfg.loss_scale <= 2 ** 32:   # (NaN too) a static scale never comes down: every overflow is skipped
        raise ConfigError(f"precision.loss_scale={cfg.loss_scale:g} is above 2**32: fp16 gradients scaled by it "
                          f"overflow on every step and a static scale never lowers itself, so no step would "
                          f"update; use a power of two such as 1024 or 65536, or 0 (dynamic)")
    if cfg.loss_scale == 0 and cfg.min_loss_scale > 2 ** cfg.initial_scale_power:
        raise ConfigError(f"precision.min_loss_scale={cfg.min_loss_scale:g} is above the initial scale "
                          f"2**precision.initial_scale_power={2 ** cfg.initial_scale_power}: the scale starts below "
                          f"its minimum; lower precision.min_loss_scale or raise precision.initial_scale_power")
    unused = [f.name for f in fields(ScalerConfig) if f.name != "loss_scale" and getattr(cfg, f.name) != f.default]
    if cfg.loss_scale > 0 and unused:
        raise ConfigError(f"precision.{unused[0]}={getattr(cfg, unused[0])} has no effect with a static "
                          f"precision.loss_scale={cfg.loss_scale:g} (only the dynamic scaler, loss_scale=0, uses it); "
                          f"remove it or set precision.loss_scale=0")
    if cfg.consecutive_hysteresis and cfg.hysteresis == 1:   # every overflow lowers the scale: none to restore
        raise ConfigError("precision.consecutive_hysteresis=true has no effect with precision.hysteresis=1 (every "
                          "overflow lowers the scale at once); remove it or set precision.hysteresis>1")
    return cfg


def _policy(name: str, cfg, scaler: ScalerConfig | None = None) -> Policy:
    """Precision ``name`` (``cfg`` checked by ``check``): fp32 masters, gradients reduced in ``name`` (or fp32:
    ``reduce_fp32``)."""
    reduce = torch.float32 if getattr(cfg, "reduce_fp32", False) else DTYPES[name]
    return Policy(name, DTYPES[name], reduce, torch.float32, scaler, grad_accum_dtype=DTYPES[cfg.grad_accum_dtype])


def fp16(cfg: FP16Config) -> Policy:
    policy = _policy("fp16", cfg, scaler=ScalerConfig(**{f.name: getattr(cfg, f.name) for f in fields(ScalerConfig)}))
    return replace(policy, auto_cast=cfg.auto_cast)


COMPONENTS = {"fp32": Component(config=FP32Config, build=partial(_policy, "fp32"), check=partial(check, "fp32")),
              "bf16": Component(config=BF16Config, build=partial(_policy, "bf16"), check=partial(check, "bf16")),
              "fp16": Component(config=FP16Config, build=fp16, check=partial(check, "fp16"))}
