"""Resolution against the run's config: "auto" filled by Hugging Face's rules, the batch triple
derived, the values the file states checked against the ones the run derives."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from framework.core.errors import ConfigError
from framework.config.dsconfig._keys import AUTO, AUTO_FILLED, DS_DEFAULT, DS_FILE, DTYPES, SCALER_DEFAULTS
from framework.config.dsconfig._record import Setting, Translation
from framework.config.schema import reads_grad_accum_dtype
from framework.schedulers.warmup_lr import peaks_apart


@dataclass(frozen=True)
class RunFacts:
    """The run's config without the DeepSpeed layer: the "training arguments" of Hugging Face's rules."""
    world: int
    hidden_size: int | None             # None: unknown (a user model without a config)
    value: Callable[[str], Any]         # dotted key -> the run config's value
    cli_keys: frozenset[str]            # keys the command line sets
    cli_choices: Mapping[str, str]      # groups the command line chooses
    # (the run's own warm-up steps, whether its YAML sets them for the file's scheduler: then a stated
    # warmup_num_steps must match); None: not needed
    warmup: tuple[int, bool] | None = None
    cli_deleted: frozenset[str] = frozenset()   # keys the command line deletes (~key): the file does not set them


@dataclass
class Resolved:
    values: dict[str, Any]              # our dotted key -> value to override (Hydra order: before the command line)
    sources: dict[str, str]             # our dotted key -> provenance label
    inert: list[str]                    # file keys that turned out to change nothing (fp16 keys of a bf16 run)
    notes: list[str]                    # where the run differs from the file's intent
    ds_keys: dict[str, str]             # our dotted key -> the file's key whose stated value it takes


def resolve(t: Translation, run: RunFacts) -> Resolved:
    """Fill "auto", derive the batch triple, check must-match relations; one ConfigError lists every mismatch."""
    values, sources, mismatches, leftover, notes, overridden, ds_keys = {}, {}, [], [], [], [], {}
    h = run.hidden_size
    # Hugging Face's phase 2: sizes from the model's hidden size (None: unknown)
    sizes = {"h*h": h * h, "0.9*h*h": int(0.9 * h * h), "10*h": 10 * h} if h is not None else {}

    def final(key: str) -> Any:
        """The value a key will have: command line > DeepSpeed layer > the run's config."""
        return run.value(key) if key in run.cli_keys or key not in values else values[key]

    # Group choices: a command-line choice that contradicts the file is a mismatch.
    for group, name in t.choices.items():
        if (cli := run.cli_choices.get(group, name)) != name:
            mismatches.append(f"{group}={cli} on the command line, but {t.choice_keys[group]} in the file means "
                              f"{group}={name}")

    # fp16/bf16 "auto": Hugging Face phase 1 takes the run's precision.
    precision = t.choices.get("precision") or run.cli_choices.get("precision") or run.value("precision.name")
    settings = dict(t.settings)
    if (pa := settings.pop("_precision_auto", None)) is not None:
        if pa.value.get(precision) is False:
            mismatches.append(f"precision={precision} in the run's config, but the file says {precision}.enabled "
                              f"false")
        sources["precision.name"] = AUTO_FILLED
    fp16_keys = {k.removeprefix("_fp16."): settings.pop(k) for k in [k for k in settings if k.startswith("_fp16.")]}
    inert = [] if precision == "fp16" else [f"{s.ds_key} (the run is {precision})" for s in fp16_keys.values()]
    if precision == "fp16":
        owned = run.cli_keys | run.cli_deleted   # (set or deleted there: the run config's value, not the file's)
        # the scale the run will have: the command line's (or, deleted there, the run config's) over the file's
        scale = run.value("precision.loss_scale") if "precision.loss_scale" in owned else \
            getattr(fp16_keys.get("loss_scale"), "value", None)
        if isinstance(scale, (int, float)) and scale > 0:
            # a static scale: the dynamic scaler's keys change nothing (their defaults pass as they are)
            unused = [k for k, s in fp16_keys.items() if k in SCALER_DEFAULTS and s.value != SCALER_DEFAULTS[k]]
            inert += [f"{fp16_keys.pop(k).ds_key} (loss_scale {scale:g} is static)" for k in unused]
        # the file's consecutive_hysteresis under a hysteresis of 1 (the final one): no overflow to forgive
        consecutive = fp16_keys.get("consecutive_hysteresis")
        if consecutive is not None and consecutive.value is True and "precision.consecutive_hysteresis" not in owned:
            stated = None if "precision.hysteresis" in owned else fp16_keys.get("hysteresis")
            try:   # (the run's own: absent where its precision contradicts the file's, a mismatch below)
                hysteresis = run.value("precision.hysteresis") if stated is None else stated.value
            except KeyError:
                hysteresis = None
            if hysteresis == 1:
                inert.append(f"{fp16_keys.pop('consecutive_hysteresis').ds_key} (hysteresis 1: every overflow "
                             f"lowers the scale at once)")
        settings.update({f"precision.{k}": s for k, s in fp16_keys.items()})
    for key in [k for k in settings if k.startswith("_bf16.")]:   # bf16's keys of a bf16 run
        if precision == "bf16":
            settings[key.removeprefix("_bf16.")] = settings.pop(key)
        else:
            inert.append(f"{settings.pop(key).ds_key} (the run is {precision})")
    if (comm := settings.pop("_comm_dtype", None)) is not None:
        value = comm.value.lower()   # as DeepSpeed reads it ("FP32" is fp32)
        if value not in ("fp16", "bf16", "fp32"):
            mismatches.append(f"communication_data_type={json.dumps(comm.value)} is not one DeepSpeed knows; give "
                              f"fp16, bf16 or fp32")
        elif precision == "bf16" and value in ("fp32", "bf16"):
            settings["precision.reduce_fp32"] = Setting(value == "fp32", "communication_data_type", DS_FILE)
        elif value != precision:
            mismatches.append(f"communication_data_type={comm.value} with precision={precision}: only {precision}"
                              f"{' or fp32' if precision == 'bf16' else ''} is implemented")

    if (d := settings.pop("_dtype.grad_accum_dtype", None)) is not None:   # fp32 or the working dtype
        allowed = list(dict.fromkeys(("fp32", precision)))
        if DTYPES[d.value] in allowed:
            settings["precision.grad_accum_dtype"] = Setting(DTYPES[d.value], d.ds_key, d.source)
        else:
            mismatches.append(f"{d.ds_key}={d.value} with precision={precision}: gradients accumulate here in "
                              f"{' or '.join(allowed)}; give {' or '.join(allowed)} or remove it")
    for key in ("param_dtype", "buffer_dtype"):
        d = settings.pop(f"_dtype.{key}", None)
        if d is not None and DTYPES[d.value] == precision:
            inert.append(f"{d.ds_key} (the run is {precision})")
        elif d is not None:
            mismatches.append(f"{d.ds_key}={d.value} with precision={precision}: give {precision} or remove it")
    keep = settings.pop("_keep_fp32", None)
    if keep is not None and precision == "fp32":
        inert.append(f"{keep.ds_key} (the run is fp32)")
    elif keep is not None:
        mismatches.append(f"{keep.ds_key}: keeping modules in fp32 under precision={precision} is not implemented "
                          f"here; remove it")

    for key, s in settings.items():
        if key.startswith("_inert."):   # an "auto" with a size rule, resolved though nothing reads it
            if h is None:
                leftover.append(f"{s.ds_key} (needs the model's hidden size)")
        elif s.value == AUTO and s.rule in ("h*h", "0.9*h*h", "10*h") and h is None:
            leftover.append(f"{s.ds_key} (the model's hidden size is unknown: give a number)")
        elif s.value == AUTO:
            if s.rule in sizes or s.rule == "warmup_min_lr":      # warmup_min_lr: fill only, 0
                values[key] = sizes.get(s.rule, 0.0)
            sources[key] = AUTO_FILLED                          # (else the run's own value stays)
        elif key in run.cli_keys:                                   # the command line wins
            if s.source == DS_FILE and run.value(key) != s.value:
                stated = s.ds_key if "=" in s.ds_key else f"{s.ds_key}={_show(s.value)}"   # (a mapped value's own)
                overridden.append(f"{stated} in the file, {key}={_show(run.value(key))} "
                                  f"on the command line")
        else:
            values[key], sources[key] = s.value, s.source
            if s.source == DS_FILE:
                ds_keys[key] = s.ds_key

    # DeepSpeed's one parameter group (decay_1d) decays nothing without weight decay (the final one: the command
    # line's may be 0): the run's own decay_1d stays, the same run as DeepSpeed's
    if values.get("optimizer.decay_1d") and not final("optimizer.weight_decay"):
        del values["optimizer.decay_1d"], sources["optimizer.decay_1d"]

    # Scheduler relations (phase 1 and 2): "auto" takes the run's value, a stated one must match it.
    lr, steps = final("optimizer.lr"), final("train.steps")
    s = t.settings.get("scheduler.warmup_max_lr")
    if s is not None and s.value == AUTO:
        values["scheduler.warmup_max_lr"], sources["scheduler.warmup_max_lr"] = lr, AUTO_FILLED
    elif s is not None and s.source == DS_FILE and "scheduler.warmup_max_lr" not in run.cli_keys and \
            peaks_apart(s.value, lr):
        # the lr from the file's optimizer section, or else from the run's config
        fix = f"make optimizer.params.lr {s.value}" if "optimizer.lr" in t.settings and \
            "optimizer.lr" not in run.cli_keys else f"give optimizer.lr={s.value}"
        mismatches.append(f"scheduler.params.warmup_max_lr={s.value} but the optimizer's lr is {lr} (give "
                          f"\"auto\" or {fix})")
    elif s is not None and s.source == DS_DEFAULT and "scheduler.warmup_max_lr" not in run.cli_keys and \
            peaks_apart(s.value, lr):
        # DeepSpeed's own default (WarmupDecayLR's 0.001), kept as DeepSpeed runs it; stated, the same value
        # would be refused above, so say where the peak comes from (in place of the scheduler's own note)
        notes.append(f"scheduler.params.warmup_max_lr is left out: the lr peaks at DeepSpeed's default {s.value}, "
                     f"not the optimizer's lr {lr}; give \"warmup_max_lr\": \"auto\" to peak at the optimizer's lr")
    s = t.settings.get("scheduler.total_num_steps")
    if s is not None and s.value == AUTO:
        values["scheduler.total_num_steps"], sources["scheduler.total_num_steps"] = steps, AUTO_FILLED
    elif s is not None and "scheduler.total_num_steps" not in run.cli_keys and s.value != steps:
        mismatches.append(f"scheduler.params.total_num_steps={s.value} but train.steps={steps} (give \"auto\" "
                          f"or train.steps={s.value})")
    s = t.settings.get("scheduler.warmup_num_steps")
    if s is not None and run.warmup is not None:
        own, chosen = run.warmup
        if s.value == AUTO:
            values["scheduler.warmup_num_steps"], sources["scheduler.warmup_num_steps"] = max(1, own), AUTO_FILLED
        elif chosen and s.source == DS_FILE and s.value != own:
            mismatches.append(f"scheduler.params.warmup_num_steps={s.value} but the run's scheduler.warmup_num_steps "
                              f"is {own} (give \"auto\" or scheduler.warmup_num_steps={s.value})")

    _batch(t.batch, run, final, values, sources, mismatches, overridden)
    if overridden:
        notes.append("the command line overrides the file: " + "; ".join(overridden))
    if leftover:
        mismatches.append("\"auto\" left over: " + ", ".join(leftover))
    if len(mismatches) == 1:
        raise ConfigError(f"ds_config: {mismatches[0]}")
    if mismatches:
        raise ConfigError("ds_config: the file does not match the run's config:\n" +
                          "\n".join(f"  - {m}" for m in mismatches))
    # A working-dtype grad_accum_dtype where the stage (the file's, agreed above) sums nothing in it: inert, the
    # file's key sets nothing (stated in YAML or on the command line it is refused: checks)
    accum, stage = values.get("precision.grad_accum_dtype"), run.value("stage.name")
    if accum not in (None, "fp32") and not reads_grad_accum_dtype(
            stage, final("train.grad_accum"), precision == "bf16" and final("precision.reduce_fp32")):
        del values["precision.grad_accum_dtype"], sources["precision.grad_accum_dtype"]
        ds_keys.pop("precision.grad_accum_dtype", None)
        inert.append(f"data_types.grad_accum_dtype (stage {stage} with one micro batch a step sums nothing in it)")
    return Resolved(values, sources, inert, notes, ds_keys)


def _show(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def _batch(b: dict, run: RunFacts, final: Callable[[str], Any], values: dict, sources: dict,
           mismatches: list, overridden: list) -> None:
    """DeepSpeed's batch triple: train = micro x accumulation x world. A missing one is derived from
    the other two (only micro given: accumulation 1; only train given: accumulation 1); "auto"
    (phase 1) takes micro and accumulation from the run's config and train from the product."""
    world, tb = run.world, b.get("train_batch_size")
    names = {"train.micro_batch": "train_micro_batch_size_per_gpu", "train.grad_accum": "gradient_accumulation_steps"}
    stated = {key: b.get(name) for key, name in names.items()}
    mb, ga = stated.values()
    sources.update({key: AUTO_FILLED for key, v in stated.items() if v == AUTO})
    derived = {key: v for key, v in stated.items() if v is not None and v != AUTO}
    if isinstance(tb, int) and None in (mb, ga) and AUTO not in (mb, ga):
        # The missing member from the final values of the others: the command line's over the file's.
        known = {k: (f"{k}={run.value(k)}", run.value(k)) if k in run.cli_keys else (f"{names[k]}={v}", v)
                 for k, v in stated.items() if k in run.cli_keys or v is not None}
        key = None   # both known: the missing one is on the command line, checked below
        if len(known) == 1:
            (given, (other, n)), = known.items()
            key = "train.grad_accum" if given == "train.micro_batch" else "train.micro_batch"
        elif not known:
            key, other, n = "train.micro_batch", "", 1
            derived["train.grad_accum"] = 1
        if key is not None:
            if tb % (n * world):
                mismatches.append(f"train_batch_size={tb} is not divisible by " +
                                  (f"{other} x world size {world}" if other else f"the world size {world}"))
            derived[key] = max(1, tb // (n * world))
    elif tb is None and isinstance(mb, int) and ga is None:
        derived["train.grad_accum"] = 1
    for key, v in derived.items():
        if key not in run.cli_keys:
            values[key], sources[key] = v, DS_FILE
        elif stated[key] == v and run.value(key) != v:
            overridden.append(f"{names[key]}={v} in the file, {key}={run.value(key)} on the command line")
    if isinstance(tb, int):
        m, g = final("train.micro_batch"), final("train.grad_accum")
        if m * g * world != tb and not any("divisible" in x for x in mismatches):
            # (each factor under the name of where it came from: the command line's is not the file's)
            said = [f"{k}={v} (command line)" if k in run.cli_keys else f"{names[k]}={v}"
                    for k, v in (("train.micro_batch", m), ("train.grad_accum", g))]
            mismatches.append(f"train_batch_size={tb} but {said[0]} x {said[1]} x world size {world} = {m * g * world}")
