"""Translation of the training sections: ``fp16``/``bf16`` and the data types onto precision,
``optimizer``, ``scheduler``, and ``activation_checkpointing`` (inert here)."""
from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Mapping

from framework.config.dsconfig._keys import (AUTO, BF16_KEYS, DS_DEFAULT, DS_FILE, FP16_KEYS, FP16_SCALER, ACT_KEYS,
                                             NOT_IMPLEMENTED_OPTIMIZERS, OPTIMIZER_INERT, OPTIMIZER_REFUSED,
                                             OPTIMIZERS, SCHEDULER_NAMES, SCHEDULERS, close)

if TYPE_CHECKING:
    from framework.config.dsconfig._translate import Translation


def precision(tr: Translation, top: dict) -> None:
    fp16 = tr.section(top["fp16"], "fp16", FP16_KEYS) if "fp16" in top else None
    bf16 = tr.section(top["bf16"], "bf16", BF16_KEYS) if "bf16" in top else None
    on16 = False if fp16 is None else tr.typed(fp16.get("enabled", False), "bool", "fp16.enabled", auto_ok=True)
    onbf = False if bf16 is None else tr.typed(bf16.get("enabled", False), "bool", "bf16.enabled", auto_ok=True)
    if on16 is True and onbf is True:
        tr.error("fp16.enabled and bf16.enabled are both true; enable one")
    if on16 is True:
        tr.choose("precision", "fp16", "fp16.enabled")
    elif onbf is True:
        tr.choose("precision", "bf16", "bf16.enabled")
    elif AUTO in (on16, onbf):
        # Hugging Face phase 1: "enabled" follows the run's precision (resolve() decides); a
        # section that says false (not absent) contradicts a run in that precision.
        stated = {"fp16": None if fp16 is None else on16, "bf16": None if bf16 is None else onbf}
        tr.set("_precision_auto", stated, "fp16.enabled / bf16.enabled", rule="precision")
    elif fp16 is not None or bf16 is not None:
        tr.choose("precision", "fp32", "fp16.enabled / bf16.enabled")
    if fp16 is not None:
        for key, kind in FP16_SCALER.items():
            if key in fp16:
                v = tr.typed(fp16[key], kind, f"fp16.{key}")
                if v is not None and on16 is False:
                    tr.inert_key(f"fp16.{key}", "fp16 is not enabled")
                elif v is not None:
                    tr.set(f"_fp16.{key}", v, f"fp16.{key}")
        if "auto_cast" in fp16 and tr.typed(fp16["auto_cast"], "bool", "fp16.auto_cast"):
            tr.inert_key("fp16.auto_cast", "casts floating inputs to fp16; the inputs here are token ids and "
                                             "precision=fp16 computes in fp16 already")
        key = "fp16_master_weights_and_grads"
        if key in fp16 and tr.typed(fp16[key], "bool", f"fp16.{key}"):
            tr.error(f"fp16.{key}=true is not implemented here (master weights and gradients are fp32); remove it")
    if bf16 is not None:
        for key in ("immediate_grad_update", "check_grad_overflow"):
            if key in bf16:
                tr.typed(bf16[key], "bool", f"bf16.{key}")
                tr.inert_key(f"bf16.{key}", "the bf16 step here is always the same")
        for key in ("bf16_master_weights_and_grads", "bf16_optimizer_states"):
            if key in bf16 and tr.typed(bf16[key], "bool", f"bf16.{key}"):
                tr.error(f"bf16.{key}=true is not implemented here (master weights and optimizer state are "
                         f"fp32); remove it")
    if "communication_data_type" in top:
        v = tr.typed(top["communication_data_type"], "str", "communication_data_type")
        if v is not None:
            tr.set("_comm_dtype", v, "communication_data_type")
    if "data_types" in top:
        d = tr.section(top["data_types"], "data_types", ("grad_accum_dtype",))
        if "grad_accum_dtype" in d:
            v = tr.typed(d["grad_accum_dtype"], "str", "data_types.grad_accum_dtype")
            if v is not None:
                tr.set("precision.grad_accum_dtype", v, "data_types.grad_accum_dtype")


def optimizer(tr: Translation, node: Any) -> None:
    if node is None:
        return
    o = tr.section(node, "optimizer", ("type", "params", "legacy_fusion"))
    if "legacy_fusion" in o:
        tr.inert_key("optimizer.legacy_fusion", "selects a kernel")
    low = _type(tr, o, "optimizer", OPTIMIZERS, NOT_IMPLEMENTED_OPTIMIZERS,
                {k: k for k in [*OPTIMIZERS, *NOT_IMPLEMENTED_OPTIMIZERS]}, "Adam, AdamW, Adagrad, Lion or SGD")
    if low is None:
        return
    defaults = OPTIMIZERS[low]
    extra = ("adam_w_mode",) if low in ("adam", "adamw") else ()
    params = tr.section(o.get("params", {}), "optimizer.params",
                        [*defaults, *extra, *OPTIMIZER_INERT, *OPTIMIZER_REFUSED])
    for key, why in OPTIMIZER_INERT.items():
        if key in params:
            tr.inert_key(f"optimizer.params.{key}", why)
    for key, (off, why) in OPTIMIZER_REFUSED.items():
        if key in params and params[key] != off:
            tr.error(f"optimizer.params.{key}: {why}")
    # DeepSpeed: "Adam" is AdamW (decoupled decay) unless adam_w_mode is false; "AdamW" always is.
    name = low
    if low in ("adam", "adamw"):
        mode = tr.typed(params.get("adam_w_mode", True), "bool", "optimizer.params.adam_w_mode")
        name = "adamw" if low == "adamw" or mode is not False else "adam"
    tr.choose("optimizer", name, "optimizer.type")
    # DeepSpeed passes all parameters in one group: biases and norm weights decay too.
    tr.set("optimizer.decay_1d", True, "optimizer.params", DS_DEFAULT)
    for key, default in defaults.items():
        value = params.get(key, default)
        ds_key = f"optimizer.params.{key}"
        src = DS_FILE if key in params else DS_DEFAULT
        if key == "betas":
            if value == AUTO:
                tr.set("optimizer.beta1", AUTO, ds_key, rule="optimizer.beta1")
                tr.set("optimizer.beta2", AUTO, ds_key, rule="optimizer.beta2")
            elif (isinstance(value, list) and len(value) == 2
                  and all(isinstance(b, (int, float)) and not isinstance(b, bool) for b in value)):
                tr.set("optimizer.beta1", float(value[0]), ds_key, src)
                tr.set("optimizer.beta2", float(value[1]), ds_key, src)
            else:
                tr.error(f"{ds_key} must be a list of two numbers, got {json.dumps(value)}")
            continue
        kind = "bool" if isinstance(default, bool) else "float"
        v = tr.typed(value, kind, ds_key, auto_ok=key in ("lr", "eps", "weight_decay"))
        if v is not None:
            tr.set(f"optimizer.{key}", v, ds_key, src, rule=f"optimizer.{key}" if v == AUTO else "")


def scheduler(tr: Translation, node: Any) -> None:
    if node is None:
        return
    s = tr.section(node, "scheduler", ("type", "params"))
    low = _type(tr, s, "scheduler", SCHEDULERS, {k: v for k, v in SCHEDULER_NAMES.items() if k not in SCHEDULERS},
                SCHEDULER_NAMES, "WarmupLR, WarmupDecayLR or WarmupCosineLR")
    if low is None:
        return
    name, defaults = SCHEDULERS[low]
    tr.choose("scheduler", name, "scheduler.type")
    params = tr.section(s.get("params", {}), "scheduler.params", [*defaults, "last_batch_iteration"])
    if "last_batch_iteration" in params:
        v = tr.typed(params["last_batch_iteration"], "int", "scheduler.params.last_batch_iteration")
        if v is not None and v != -1:
            tr.error("scheduler.params.last_batch_iteration: resuming a schedule this way is not "
                     "implemented here (the step is part of the train state); remove it")
        else:
            tr.inert_key("scheduler.params.last_batch_iteration", "-1: a fresh schedule")
    rules = ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "total_num_steps")   # "auto" fills these
    for key, default in defaults.items():
        ds_key = f"scheduler.params.{key}"
        if key not in params:
            if default is None:
                tr.error(f"{ds_key} is required by {SCHEDULER_NAMES[low]} (give a number, or \"auto\": "
                         f"train.steps)")
            else:
                tr.set(f"scheduler.{key}", default, ds_key, DS_DEFAULT)
            continue
        kind = {"warmup_num_steps": "int", "total_num_steps": "int", "warmup_type": "str"}.get(key, "float")
        v = tr.typed(params[key], kind, ds_key, auto_ok=key in rules)
        if v is not None:
            tr.set(f"scheduler.{key}", v, ds_key, rule=key if v == AUTO else "")


def _type(tr: Translation, node: dict, section: str, have: Mapping, missing: Mapping[str, str],
          spelled: Mapping[str, str], use: str) -> str | None:
    """The section's ``type``, lower case, when we have it; else None, with an error naming what is
    not implemented, or the closest type we have (``spelled``: lower case -> as DeepSpeed writes it)."""
    kind = tr.typed(node.get("type"), "str", f"{section}.type")
    if kind is None:
        return None
    low = kind.lower()
    if low in missing:
        tr.error(f"{section}.type {kind}: {missing[low]} is not implemented here; use {use}")
        return None
    if low not in have:
        near = close(low, spelled)
        hint = f" (did you mean {spelled[near]!r}?)" if near else ""
        tr.error(f"{section}.type {kind!r} is not a DeepSpeed {section} we have{hint}; use {use}")
        return None
    return low


def activation_checkpointing(tr: Translation, node: Any) -> None:
    if node is None:
        return
    a = tr.section(node, "activation_checkpointing", ACT_KEYS)
    for key in a:
        # As under Hugging Face's Trainer: these configure deepspeed.checkpointing, which only a
        # model that calls it (Megatron) uses; the run goes on without them.
        tr.inert_key(f"activation_checkpointing.{key}", "configures deepspeed.checkpointing, which is not used "
                     "(model.activation_checkpointing turns checkpointing on)")
