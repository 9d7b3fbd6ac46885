"""DeepSpeed's warm-up schedules: WarmupLR (warm up, then hold), WarmupDecayLR (then linear decay to
warmup_min_lr at total_num_steps), WarmupCosineLR (then a cosine to cos_min_ratio; both ends are ratios of
the optimizer's lr). The warm-up's ``gamma`` is ``log(step + 1) / log(n)`` or ``step / n``, with
n = warmup_num_steps raised to at least 2 as DeepSpeed does.

DeepSpeed's constructor sets the first update's lr and its engine steps the schedule after each update, so
update ``k >= 1`` uses the formula at ``k - 1`` (``deepspeed_order``).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from framework.core.errors import ConfigError
from framework.core.registry import Component, closest_hint
from framework.core.utils import counted, finite_fp32, fp32_inf

WARMUP_TYPES = ("log", "linear")


@dataclass(frozen=True, kw_only=True)
class WarmupLRConfig:
    warmup_min_lr: float = 0.0
    warmup_max_lr: float | None = None  # None: the optimizer's lr
    warmup_num_steps: int = 1000
    warmup_type: str = "log"  # "log" or "linear"


@dataclass(frozen=True, kw_only=True)
class WarmupDecayLRConfig(WarmupLRConfig):
    total_num_steps: int | None = None  # None: the run's number of optimizer steps


@dataclass(frozen=True, kw_only=True)
class WarmupCosineLRConfig:
    warmup_min_ratio: float = 0.0
    warmup_num_steps: int = 1000
    cos_min_ratio: float = 0.0001
    warmup_type: str = "log"              # "log" or "linear"
    total_num_steps: int | None = None    # None: the run's number of optimizer steps


def _check_warmup(num_steps: int, kind: str) -> None:
    if kind not in WARMUP_TYPES:
        raise ConfigError(f"scheduler.warmup_type must be {' or '.join(WARMUP_TYPES)}, got "
                          f"{kind!r}{closest_hint(kind, WARMUP_TYPES)}")
    if not num_steps >= 1:   # as DeepSpeed (0.19.3 on) refuses it; 1 is raised to 2 by ``warmup``
        raise ConfigError(f"scheduler.warmup_num_steps must be >= 1 (DeepSpeed refuses 0 too), got "
                          f"{num_steps}; give 1 or more (scheduler=constant has no warm-up)")


def warmup(num_steps: int, kind: str) -> tuple[int, Callable[[int], float]]:
    """The warm-up's checked length (at least 2) and its ``gamma(step)`` in [0, 1) before it ends."""
    _check_warmup(num_steps, kind)
    num_steps = max(2, num_steps)
    if kind == "log":
        return num_steps, lambda step: math.log(step + 1) / math.log(num_steps)
    return num_steps, lambda step: step / num_steps


def run_total(total_num_steps: int | None, total_steps: int) -> int:
    total = total_steps if total_num_steps is None else total_num_steps
    if not total >= 1:
        raise ConfigError(f"scheduler.total_num_steps must be >= 1, got {total}; give 1 or more, or null (the run's length)")
    return total


def deepspeed_order(formula: Callable[[int], float], first: float) -> Callable[[int], float]:
    """The lr of applied update ``step`` as DeepSpeed's engine sets it: ``first``, then ``formula(step - 1)``."""
    return lambda step: first if step == 0 else formula(step - 1)


def build(cfg: WarmupLRConfig, base_lr: float, total_steps: int,
          after: Callable[[int, int], float] = lambda step, num_steps: 1.0) -> Callable[[int], float]:
    """``lr = min + (max - min) * gamma``: the warm-up's gamma, then ``after(step, num_steps)`` (hold)."""
    num_steps, gamma = warmup(cfg.warmup_num_steps, cfg.warmup_type)
    min_lr, max_lr = cfg.warmup_min_lr, base_lr if cfg.warmup_max_lr is None else cfg.warmup_max_lr
    for key, value in (("warmup_min_lr", min_lr), ("warmup_max_lr", max_lr)):
        if not (math.isfinite(value) and value >= 0):
            raise ConfigError(f"scheduler.{key} must be >= 0, got {value}")
        if not finite_fp32(value):   # (the lr meets the fp32 optimizer state: an inf update, NaN after it)
            raise ConfigError(f"scheduler.{key} must be finite in fp32 (the optimizer state's dtype), "
                              f"{fp32_inf(value)}")

    def lr_at(step: int) -> float:
        return min_lr + (max_lr - min_lr) * (gamma(step) if step < num_steps else after(step, num_steps))

    return deepspeed_order(lr_at, min_lr)


def build_decay(cfg: WarmupDecayLRConfig, base_lr: float, total_steps: int) -> Callable[[int], float]:
    lr_at = build(cfg, base_lr, total_steps,   # checks the warm-up fields first
                  after=lambda step, num_steps: max(0.0, (total - step) / max(1, total - num_steps)))
    total = run_total(cfg.total_num_steps, total_steps)
    return lr_at


def build_cosine(cfg: WarmupCosineLRConfig, base_lr: float, total_steps: int) -> Callable[[int], float]:
    num_steps, gamma = warmup(cfg.warmup_num_steps, cfg.warmup_type)
    for key in ("warmup_min_ratio", "cos_min_ratio"):
        value = getattr(cfg, key)
        if not (math.isfinite(value) and 0.0 <= value <= 1.0):
            raise ConfigError(f"scheduler.{key} must be in [0, 1] (a fraction of optimizer.lr), got {value}")
    span = max(1, run_total(cfg.total_num_steps, total_steps) - num_steps)
    lo, floor = cfg.warmup_min_ratio, cfg.cos_min_ratio

    def lr_at(step: int) -> float:
        if step < num_steps:
            return base_lr * (lo + (1.0 - lo) * gamma(step))
        progress = min(1.0, (step - num_steps + 1) / span)
        return base_lr * max(0.0, floor + (1.0 - floor) * (1.0 + math.cos(math.pi * progress)) / 2)

    return deepspeed_order(lr_at, 0.0)


def long_warmup_notes(key: str, warm: int, steps: int, schedule: Callable[[int], Callable[[int], float]]) -> list[str]:
    """The note for a run whose lr never reaches its warm-up's peak: the highest lr around the warm-up's end
    of a run long enough to pass it, against this run's. ``schedule(total_steps)``: the lr-of-update function."""

    if steps > warm + 2:   # the run passes the warm-up's end
        return []
    peak = max(map(schedule(warm + 3), range(max(0, warm - 1), warm + 3)))
    run = schedule(steps)
    if not max(map(run, range(max(0, min(warm - 1, steps - 1)), steps))) < peak:
        return []
    how = "is longer than" if warm > steps else "takes all of"
    return [f"note: the scheduler's warm-up ({key}={warm}) {how} the run (train.steps={steps}): the lr never "
            f"reaches its peak"]


def peaks_apart(warmup_max_lr: float | None, lr: float) -> bool:
    """Whether a warm-up peaks at a ``warmup_max_lr`` other than the optimizer's ``lr``: then no update reads that
    lr (WarmupLR and WarmupDecayLR set every update's lr from their own fields). A DeepSpeed file's stated peak
    is checked by this too."""
    return warmup_max_lr is not None and warmup_max_lr != lr


def peak_notes(node, config) -> list[str]:
    """The note for a set ``warmup_max_lr`` that makes ``optimizer.lr`` do nothing."""
    lr = config.optimizer.lr
    if not peaks_apart(node.warmup_max_lr, lr):
        return []
    return [f"note: the lr peaks at scheduler.warmup_max_lr={node.warmup_max_lr}; optimizer.lr={lr} is not used "
            f"(set scheduler.warmup_max_lr=null to peak at optimizer.lr)"]


def notes(build_at: Callable[..., Callable[[int], float]], node, config) -> list[str]:
    """A component's ``notes`` (bound to its ``build``: the lr it notes is its own schedule's)."""
    return long_warmup_notes("warmup_num_steps", node.warmup_num_steps, config.train.steps,
                             functools.partial(build_at, node, config.optimizer.lr))


def lr_notes(node, config) -> list[str]:
    """warmup_lr's ``notes``: the warm-up's, and a peak that is not optimizer.lr."""
    return notes(build, node, config) + peak_notes(node, config)


def cosine_notes(node, config) -> list[str]:
    """warmup_cosine_lr's ``notes``: the warm-up's, and where its lr holds at the floor. The cosine's progress
    reaches 1 at update ``total_num_steps`` (the warm-up's end + 1 where it is no longer than that)."""
    floor = f"cos_min_ratio x optimizer.lr ({node.cos_min_ratio * config.optimizer.lr:.2e})"
    return notes(build_cosine, node, config) + held_floor(
        node, config, floor, lambda total, warm: total if total > warm else warm + 1)


def decay_notes(node, config) -> list[str]:
    """warmup_decay_lr's ``notes``: the warm-up's, a peak that is not optimizer.lr, and where its lr holds at
    warmup_min_lr. Its gamma reaches 0 at iteration ``max(total_num_steps, warm-up)``, which DeepSpeed's order
    applies one update later."""
    floor = (f"warmup_min_lr ({node.warmup_min_lr:.2e})" if node.warmup_min_lr
             else "warmup_min_lr (0: those steps change no weight)")
    return notes(build_decay, node, config) + peak_notes(node, config) + held_floor(
        node, config, floor, lambda total, warm: max(total, warm) + 1)


def held_floor(node, config, floor: str, first_held: Callable[[int, int], int]) -> list[str]:
    """The note for a decay whose ``total_num_steps`` ends before the run: its lr holds at ``floor`` from the
    update ``first_held(total_num_steps, warm-up)`` (0-based) on, as DeepSpeed's does; said, since the steps
    there train at the floor (often 0) for no reason the user chose."""
    steps, total = config.train.steps, node.total_num_steps
    if total is None or total >= steps:
        return []
    warm, _ = warmup(node.warmup_num_steps, node.warmup_type)
    held = steps - first_held(total, warm)
    if held <= 0:
        return []
    return [f"note: scheduler.total_num_steps={total} is below train.steps={steps}: the lr holds at {floor} for the "
            f"last {counted(held, 'step')}; set scheduler.total_num_steps={steps} (or null: the run's length) to "
            f"decay over the whole run"]


def checked_by_build(build_at: Callable[..., Callable[[int], float]]):
    """A component's ``check``: its own ``build`` with the optimizer's lr, so every value check runs with the
    composed config's (before a run folder is made) and lives in one place. The run's length changes none of
    them (train.steps >= 1 is checked before), so one step stands for it."""

    def check(node, stage: str, nodes: Mapping[str, Any]):
        try:
            build_at(node, nodes["optimizer"].lr, 1)
        except ConfigError as e:
            raise ConfigError(f"config: {e}") from None
        return node

    return check


COMPONENTS = {name: Component(config=config, build=build_at, check=checked_by_build(build_at), notes=notes_of)
              for name, config, build_at, notes_of in (
                  ("warmup_lr", WarmupLRConfig, build, lr_notes),
                  ("warmup_decay_lr", WarmupDecayLRConfig, build_decay, decay_notes),
                  ("warmup_cosine_lr", WarmupCosineLRConfig, build_cosine, cosine_notes))}
