"""The walk over a DeepSpeed config, section by section, collecting in a ``Translation`` the group
choices, the settings of our keys, errors and notices; nothing is composed."""
from __future__ import annotations

import json
import math
from typing import Any, Mapping

from framework.config.dsconfig._keys import (ACT_KEYS, AIO_KEYS, AS_HERE, ALIASES_TOP, ALIASES_ZERO, AUTO, BF16_KEYS,
                                             DEEPCOMPILE_KEYS, DS_DEFAULT, DS_FILE, DTYPES, FEATURES, FP16_KEYS,
                                             FP16_SCALER, INERT_TOP, MAPPED_TOP, NOT_IMPLEMENTED_OPTIMIZERS,
                                             OFFLOAD_OPTIMIZER_KEYS, OFFLOAD_PARAM_KEYS, OPTIMIZER_INERT,
                                             OPTIMIZER_REFUSED, OPTIMIZERS, SCHEDULER_NAMES, SCHEDULERS, STAGE3_KEYS,
                                             STAGES, TORCH_COMPILE_KEYS, ZERO_FEATURES, ZERO_KEYS, ZERO_PERF,
                                             ZERO_STAGE, REQUIRED, close, switched_off)
from framework.config.dsconfig._record import Translation
from framework.core.files import DIRECT_ALIGN, SMALLEST_TILE

Z = "zero_optimization."


def translate(ds: dict) -> Translation:
    tr = Translation()
    top = tr.section(ds, "", [*MAPPED_TOP, *INERT_TOP, *AS_HERE, *FEATURES], ALIASES_TOP)
    if "bfloat16" in top:
        if "bf16" in top:
            tr.error("both 'bf16' and its deprecated alias 'bfloat16' are given; keep 'bf16'")
        top["bf16"] = top.pop("bfloat16")
    tr.inert_keys(top, INERT_TOP)
    for key, (inert, why, what) in AS_HERE.items():
        if key in top:
            tr.inert_or_error(top[key] == inert, key, f"{key}={json.dumps(top[key])} is not supported here "
                              f"({what}); remove it or give {json.dumps(inert)}", why)
    for key, what in FEATURES.items():
        if key in top:
            tr.inert_or_error(switched_off(top[key], key), key, f"'{key}': {what} is not implemented here; remove it")
    if isinstance(on := top.get("zero_optimization"), bool):
        # DeepSpeed's deprecated form: true is stage 1 (allgather_size sizes its allgather bucket), false stage 0
        tr.warnings.append(f"'zero_optimization': {json.dumps(on)} is deprecated; use "
                           f"'zero_optimization': {{\"stage\": {int(on)}}}")
        top["zero_optimization"] = {"stage": int(on)}
        if on and "allgather_size" in top:
            top["zero_optimization"]["allgather_bucket_size"] = top.pop("allgather_size")
    if "allgather_size" in top:
        tr.inert_key("allgather_size", "DeepSpeed reads it only with \"zero_optimization\": true")
    if "zero_optimization" in top:
        zero(tr, top["zero_optimization"], top.get("aio"))
    else:
        aio_keys(tr, top.get("aio"), applies=False)
    precision(tr, top)
    if isinstance(z := top.get("zero_optimization"), dict) and "load_from_fp32_weights" in z:
        load_from_fp32(tr, z)
    for key, walk in (("optimizer", optimizer), ("scheduler", scheduler)):
        if top.get(key) is not None:
            walk(tr, top[key])
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        value = tr.typed(top[key], "int", key, auto_ok=True) if key in top else None
        if value is not None and value != AUTO and value < 1:
            tr.error(f"{key} must be >= 1, got {value}")
        elif value is not None:
            tr.batch[key] = value
    if "gradient_clipping" not in top:  # DeepSpeed's GRADIENT_CLIPPING_DEFAULT
        tr.set("train.grad_clip", 1.0, "gradient_clipping", DS_DEFAULT)
    elif (v := tr.typed(top["gradient_clipping"], "float", "gradient_clipping", auto_ok=True)) is not None:
        tr.set("train.grad_clip", v, "gradient_clipping")
    if top.get("activation_checkpointing") is not None:
        # As under Hugging Face's Trainer: these configure deepspeed.checkpointing, which only a model that
        # calls it (Megatron) uses; the run goes on without them.
        a = tr.section(top["activation_checkpointing"], "activation_checkpointing", ACT_KEYS)
        tr.inert_keys(a, dict.fromkeys(a, "configures deepspeed.checkpointing, which is not used "
                                          "(model.activation_checkpointing turns checkpointing on)"),
                      "activation_checkpointing.")
    if top.get("compile") is not None:
        compile_section(tr, top["compile"])
    return tr


def zero(tr: Translation, node: Any, aio: Any) -> None:
    z = tr.section(node, "zero_optimization",
                   [*ZERO_KEYS, *STAGE3_KEYS, *(f"stage3_{k}" for k in STAGE3_KEYS)], ALIASES_ZERO, strict=True)
    stage = tr.typed(z.get("stage", 0), "int", Z + "stage")
    if stage not in STAGES:
        if stage is not None:   # (None: a bad value, already an error)
            tr.error(f"zero_optimization.stage must be 0, 1, 2 or 3, got {stage}")
        return
    tr.choose("stage", STAGES[stage], Z + "stage")
    # Deprecated and unprefixed spellings -> the keys read below.
    for short, long in (("stage3_gather_fp16_weights_on_model_save", "stage3_gather_16bit_weights_on_model_save"),
                        *((k, f"stage3_{k}") for k in STAGE3_KEYS)):
        if short in z and long in z and z[short] != z[long]:
            tr.error(f"{Z}{short} and {Z}{long} are the same key with different values ({json.dumps(z[short])} "
                     f"and {json.dumps(z[long])}); keep one")
        if short in z:
            z.setdefault(long, z.pop(short))   # (on a conflict the current key's value stays: one error)
    for switch, section in (("cpu_offload", "offload_optimizer"), ("cpu_offload_param", "offload_param")):
        on = tr.typed(z.pop(switch), "bool", Z + switch) if switch in z else None
        device = z[section].get("device", "none") if isinstance(z.get(section), dict) else None
        if on is not None and device not in (None, "cpu" if on else "none"):
            tr.error(f"{Z}{switch} and {Z}{section}.device are the same key with different values "
                     f"({json.dumps(on)}: device {'cpu' if on else 'none'}, and {json.dumps(device)}); keep {section}")
        elif on is not None and z.get(section) is None:   # (false: as a stated device none)
            z[section] = {"device": "cpu" if on else "none"}
    if "cpu_offload_use_pin_memory" in z:   # DeepSpeed warns and reads only the sections' pin_memory
        tr.typed(z.pop("cpu_offload_use_pin_memory"), "bool", Z + "cpu_offload_use_pin_memory")
        tr.warnings.append(f"'{Z}cpu_offload_use_pin_memory' is deprecated and ignored, as by DeepSpeed; use "
                           f"'offload_optimizer.pin_memory' / 'offload_param.pin_memory'")
    zero_stage_keys(tr, z, STAGES[stage])
    offload(tr, z, aio, stage)
    for key, off, what in ZERO_FEATURES:
        if key in z:
            tr.inert_or_error(z[key] == off or (off is None and switched_off(z[key], key)), Z + key,
                              f"{Z}{key}: {what} is not implemented here; remove it")
    if "leaf_module" in z:
        tr.inert_or_error(switched_off(z["leaf_module"], "leaf_module"), Z + "leaf_module", f"{Z}leaf_module is not "
                          "implemented here; use stage.gather_unit to name gather units", "empty")
    for key in (k for k in ZERO_PERF if k in z):
        tr.typed(z[key], "int" if "threshold" in key else "bool", Z + key)
        tr.inert_key(Z + key, "a speed/memory knob of DeepSpeed's with no counterpart here")


def load_from_fp32(tr: Translation, z: dict) -> None:
    """Not a speed knob: false has DeepSpeed's ZeRO rebuild the fp32 masters from the 16-bit weights at a load,
    losing precision, where this code always restores the saved masters (read after the precision is chosen)."""
    fp32 = tr.typed(z["load_from_fp32_weights"], "bool", Z + "load_from_fp32_weights")
    if fp32 is None:   # (not a boolean: that error alone)
        return
    sixteen = z.get("stage", 0) in (1, 2, 3) and tr.choices.get("precision") in ("fp16", "bf16")
    tr.inert_or_error(fp32 is not False or not sixteen, Z + "load_from_fp32_weights",
                      f"{Z}load_from_fp32_weights=false (DeepSpeed rebuilds the fp32 masters from the 16-bit "
                      f"weights at a load, losing precision) is not supported here: a resume always restores "
                      f"the saved fp32 masters; remove it or give true", "a resume restores the saved fp32 masters"
                      if fp32 is not False else "changes nothing here: no 16-bit weights to rebuild masters from, "
                      "or stage 0, which does not read it")


def zero_stage_keys(tr: Translation, z: dict, name: str) -> None:
    # Where each key lands per stage (absent: inert with it): zero1 and zero2 take the keys without the
    # stage3_ prefix, zero3 those with it and two more.
    zero3 = name == "zero3"
    targets = {"reduce_bucket_size": "reduce_bucket_size", "overlap_comm": "overlap_comm"} if name == "ddp" else {
        k: k for k in ZERO_STAGE
        if k.startswith("stage3_") == zero3 or (zero3 and k in ("overlap_comm", "reduce_scatter"))}
    why = {"ddp": "stage 0 replicates everything", "zero1": "a stage-3 key", "zero2": "a stage-3 key",
           "zero3": "zero3 reduces each gather unit's gradients in one collective"}[name]
    for key, (kind, rule) in ZERO_STAGE.items():
        # Hugging Face fills the stage3_ sizes only under ZeRO-3; elsewhere an "auto" is left over.
        # accelerate fills the 16-bit save flag with its own default (false), which is ours.
        auto_ok = (bool(rule) and (zero3 or not key.startswith("stage3_"))) \
            or key == "stage3_gather_16bit_weights_on_model_save"
        value = tr.typed(z[key], kind, Z + key, auto_ok=auto_ok) if key in z else None
        if value is None:
            continue
        target = targets.get(key)
        # A bucket of elements: a stage that reads it needs one; where it is inert (zero3's reduce_bucket_size)
        # real configs set 0, as DeepSpeed accepts.
        floor = 1 if target is not None and key in ("reduce_bucket_size", "allgather_bucket_size") else 0
        if kind == "int" and value != AUTO and value < floor:
            tr.error(f"{Z}{key} must be >= {floor}, got {value}")
        if name == "zero1" and key == "contiguous_gradients" and value is False:
            # DeepSpeed runs it; zero1's gradients are contiguous anyway (the key itself is refused)
            tr.inert_key(Z + key, "zero1's gradients always accumulate in one contiguous flat buffer")
        elif target is not None:
            tr.set(f"stage.{target}", value, Z + key, rule=rule)
        else:   # (zero3's allgather_bucket_size is about the parameters' gathers, not the gradients')
            tr.inert_key(Z + key, "zero3 gathers each unit's parameters in one collective"
                         if zero3 and key == "allgather_bucket_size" else why)
            if value == AUTO and rule:  # resolved like any other, though nothing reads it
                tr.set(f"_inert.{key}", value, Z + key, rule=rule)


def offload(tr: Translation, z: dict, aio: Any, stage: int) -> None:
    opt, param = z.get("offload_optimizer"), z.get("offload_param")
    o = tr.section(opt, Z + "offload_optimizer", OFFLOAD_OPTIMIZER_KEYS, strict=True) if opt is not None else {}
    q = tr.section(param, Z + "offload_param", OFFLOAD_PARAM_KEYS, strict=True) if param is not None else {}
    sections = []   # (its keys, its name, its device)
    for sec, name in ((o, "offload_optimizer"), (q, "offload_param")):
        dev = tr.typed(sec.get("device", "none"), "str", f"{Z}{name}.device")
        if dev is not None and dev not in ("none", "cpu", "nvme"):
            tr.error(f"{Z}{name}.device must be none, cpu or nvme, got {json.dumps(dev)}")
        sections.append((sec, name, dev if dev in ("cpu", "nvme") else "none"))
    if sections[1][2] != "none" and stage != 3:
        # As in DeepSpeed, whose stages 1 and 2 read only offload_optimizer: the whole section is inert.
        tr.inert_key(f"{Z}offload_param", "parameters are partitioned only under stage 3; DeepSpeed ignores it")
        sections[1] = ({}, "offload_param", "none")
    ratio, why = o.get("ratio"), " / ".join(f"{Z}{name}.device" for sec, name in (
        (o, "offload_optimizer"), (q, "offload_param")) if "device" in sec) or f"{Z}offload_optimizer"
    if stage == 3 and sections == [(o, "offload_optimizer", "cpu"), (q, "offload_param", "none")] and \
            ratio == 0 and not isinstance(ratio, bool):
        # DeepSpeed then steps all of the optimizer on the device, and nothing else is in host memory: offload=none
        tr.inert_key(f"{Z}offload_optimizer", "ratio 0: every optimizer step on the device, as DeepSpeed runs it; "
                                             "offload=none")
        sections[0], why = ({}, "offload_optimizer", "none"), f"{Z}offload_optimizer.ratio=0"
    od, pd = (dev for _, _, dev in sections)
    target = "nvme" if "nvme" in (od, pd) else "cpu" if "cpu" in (od, pd) else "none"
    if target != "none" and od == "none":
        tr.error(f"{Z}offload_param.device={target} without offload_optimizer is not implemented here; add "
                 f"\"offload_optimizer\": {{\"device\": \"cpu\"}}" + (" (or nvme)" if target == "nvme" else ""))
    for sec, name, dev in sections:
        if dev == "none":
            tr.inert_keys(sec, {k: "device none" for k in sec if k != "device"}, f"{Z}{name}.")
    if opt is not None or param is not None:  # absent sections leave the run's offload choice
        tr.choose("offload", target, why)
    # (with target none both devices are none: only the offload_*.device checks above apply)
    if target != "none":   # (no device stated, or a section DeepSpeed ignores: its default, none)
        tr.set("offload.params", pd, f"{Z}offload_param.device", DS_FILE if "device" in sections[1][0] else DS_DEFAULT)
    if target == "nvme":
        tr.set("offload.optimizer", od, f"{Z}offload_optimizer.device")
    for key, kind, inert in (("nvme_path", "str", "" if target == "nvme" else "device cpu"),
                             ("pin_memory", "bool", "")):   # one value for both sections in use, or inert (why)
        values = {}
        for sec, name, dev in sections:
            if key in sec and dev != "none" and inert:
                tr.inert_key(f"{Z}{name}.{key}", inert)
            elif key in sec and dev != "none" and (v := tr.typed(sec[key], kind, f"{Z}{name}.{key}")) is not None:
                values[f"{Z}{name}.{key}"] = v
        if len(set(values.values())) > 1:
            tr.error(f"{' and '.join(values)} differ ({', '.join(map(json.dumps, values.values()))}); "
                     f"one value applies to both here")
        elif values:
            tr.set(f"offload.{key}", *next(iter(values.items()))[::-1])
        elif key == "pin_memory" and target != "none":   # DeepSpeed's default (its offload sections'), not ours
            tr.set("offload.pin_memory", False, f"{Z}offload_optimizer.pin_memory", DS_DEFAULT)
    if od != "none":
        if "pipeline" in o:  # DeepSpeed's older spelling of both pipeline flags
            tr.warnings.append(f"'{Z}offload_optimizer.pipeline' is deprecated; use pipeline_read and "
                               f"pipeline_write")
            for key in (k for k in ("pipeline_read", "pipeline_write") if k in o and o[k] != o["pipeline"]):
                tr.error(f"{Z}offload_optimizer.pipeline and {Z}offload_optimizer.{key} are the same key with "
                         f"different values ({json.dumps(o['pipeline'])} and {json.dumps(o[key])}); keep {key}")
        # DeepSpeed reads ratio (partial offload) under stage 3 only: below it the whole step is offloaded. Its
        # config model checks the range at every stage, so a value outside it is refused here at every stage too.
        r = o.get("ratio")
        if isinstance(r, (int, float)) and not isinstance(r, bool) and math.isfinite(r) and not 0 <= r <= 1:
            tr.error(f"{Z}offload_optimizer.ratio must be in [0, 1] (the fraction of the optimizer step offloaded), "
                     f"got {json.dumps(r)}")
        else:
            tr.put(o, "ratio", "float", "offload.ratio", f"{Z}offload_optimizer.", stage == 3,
                   "partial offload is a stage 3 feature of DeepSpeed, which ignores it below: the whole step is "
                   "offloaded")
        # (DeepSpeed key, our offload key, kind): they size the NVMe buffers of their section.
        for key, ours, kind in (("buffer_count", "buffer_count", "int"),
                                ("pipeline_read", "pipeline_read", "bool"),
                                ("pipeline_write", "pipeline_write", "bool"),
                                ("pipeline", "pipeline_read", "bool")):
            tr.put(o, key, kind, f"offload.{ours}", f"{Z}offload_optimizer.", od == "nvme", "device cpu: NVMe buffers")
        if (s := tr.settings.get("offload.pipeline_read")) is not None and s.ds_key == f"{Z}offload_optimizer.pipeline":
            tr.settings["offload.pipeline_write"] = s   # (the deprecated key sets both: read once, one note)
        tr.inert_keys(o, dict.fromkeys(("fast_init", "cpuadam_cores_perc"),
                                       "a speed knob of DeepSpeed's CPU optimizer"), f"{Z}offload_optimizer.")
        if "super_offload" in o and o["super_offload"] is not False:
            tr.error(f"{Z}offload_optimizer.super_offload: SuperOffload is not implemented here; remove it")
    if pd != "none":
        for key, ours in (("buffer_count", "param_buffer_count"), ("buffer_size", "param_buffer_size"),
                          ("max_in_cpu", "max_in_cpu")):
            tr.put(q, key, "int", f"offload.{ours}", f"{Z}offload_param.", pd == "nvme", "device cpu: NVMe buffers")
    if z.get("sub_group_size") is not None:
        tr.put(z, "sub_group_size", "int", "offload.sub_group_size", Z, od == "nvme", "tiles the NVMe optimizer step; "
               + ("no NVMe offload" if target == "none" else "the optimizer is not on nvme"))
        tile = tr.settings.get("offload.sub_group_size")
        if tile is not None and tile.value < SMALLEST_TILE:   # (as offload=nvme's check, with the key written)
            tr.error(f"{Z}sub_group_size={tile.value} is smaller than one {DIRECT_ALIGN}-byte O_DIRECT page of fp32 "
                     f"elements, to which every NVMe optimizer tile is padded; set it to at least {SMALLEST_TILE}")
    aio_keys(tr, aio, applies=target == "nvme")


def aio_keys(tr: Translation, aio: Any, applies: bool) -> None:
    if aio is None:
        return
    a = tr.section(aio, "aio", AIO_KEYS, {"thread_count": "intra_op_parallelism"})
    if "thread_count" in a:
        if "intra_op_parallelism" in a:
            tr.error("aio.thread_count and aio.intra_op_parallelism are the same key; keep intra_op_parallelism")
        a["intra_op_parallelism"] = a.pop("thread_count")
    for key, value in a.items():
        if key != "use_gds":
            tr.put(a, key, AIO_KEYS[key], f"offload.aio.{key}", "aio.", applies, "no NVMe offload")
        elif (v := tr.typed(value, "bool", "aio.use_gds")) is not None:
            tr.inert_or_error(not v, "aio.use_gds", "aio.use_gds: GPUDirect Storage is not implemented here; remove it",
                              "false")


def precision(tr: Translation, top: dict) -> None:
    secs = {n: tr.section(top[n], n, keys, strict=True) for n, keys in (("fp16", FP16_KEYS), ("bf16", BF16_KEYS))
            if n in top}
    on = {n: tr.typed(sec.get("enabled", False), "bool", f"{n}.enabled", auto_ok=True) for n, sec in secs.items()}
    if on.get("fp16") is True and on.get("bf16") is True:
        tr.error("fp16.enabled and bf16.enabled are both true; enable one")
    if (chosen := next((n for n in ("fp16", "bf16") if on.get(n) is True), None)) is not None:
        tr.choose("precision", chosen, f"{chosen}.enabled")
    elif AUTO in on.values():
        # Hugging Face phase 1: "enabled" follows the run's precision (resolve: a stated false contradicts it)
        tr.set("_precision_auto", {n: on.get(n) for n in ("fp16", "bf16")}, "fp16.enabled / bf16.enabled")
    elif secs:   # named as the file has them: a section without "enabled" is off (DeepSpeed's default)
        tr.choose("precision", "fp32", " / ".join(
            f"{n}.enabled" if "enabled" in sec else f'{n} with no "enabled" (off by default)'
            for n, sec in secs.items()))
    fp16, bf16 = secs.get("fp16"), secs.get("bf16")
    if fp16 is not None:
        for key, kind in {**FP16_SCALER, "auto_cast": "bool"}.items():   # -> precision.KEY of an fp16 run
            tr.put(fp16, key, kind, f"_fp16.{key}", "fp16.", on["fp16"] is not False, "fp16 is not enabled")
        key = "fp16_master_weights_and_grads"
        if key in fp16 and tr.typed(fp16[key], "bool", f"fp16.{key}"):
            tr.error(f"fp16.{key}=true is not implemented here (master weights and gradients are fp32); remove it")
    if bf16 is not None:
        tr.put(bf16, "immediate_grad_update", "bool", "", "bf16.", False, "the bf16 step here is always the same")
        # true: DeepSpeed skips a step whose gradients are not finite, as train.on_nonfinite=warn does (of a bf16
        # run: resolve); false: it applies that step, here train.on_nonfinite (stop by default) decides.
        key = "check_grad_overflow"
        if key in bf16 and (v := tr.typed(bf16[key], "bool", f"bf16.{key}")) is not None:
            if v and on["bf16"] is not False:
                tr.set("_bf16.train.on_nonfinite", "warn", f"bf16.{key}=true")
            else:
                tr.inert_key(f"bf16.{key}", "false: train.on_nonfinite decides, stop by default" if not v
                             else "bf16 is not enabled")
        for key in ("bf16_master_weights_and_grads", "bf16_optimizer_states"):
            if key in bf16 and tr.typed(bf16[key], "bool", f"bf16.{key}"):
                tr.error(f"bf16.{key}=true is not implemented here (master weights and optimizer state are "
                         f"fp32); remove it")
    if top.get("communication_data_type") is not None:   # (DeepSpeed reads null as not given)
        tr.put(top, "communication_data_type", "str", "_comm_dtype", "")
    if "data_types" in top:
        dtypes = ("grad_accum_dtype", "param_dtype", "buffer_dtype")   # checked against the run's precision (resolve)
        d = tr.section(top["data_types"], "data_types", (*dtypes, "keep_in_fp32_modules"))
        for key in dtypes:
            v = tr.typed(d[key], "str", f"data_types.{key}") if key in d else None
            if v is not None and v not in DTYPES:
                tr.error(f"data_types.{key}={json.dumps(v)} is not a dtype DeepSpeed knows; give fp32, fp16 or "
                         f"bf16 (or float32, float16, bfloat16, half, torch.float32...)")
            elif v is not None:
                tr.set(f"_dtype.{key}", v, f"data_types.{key}")
        if d.get("keep_in_fp32_modules"):
            tr.set("_keep_fp32", d["keep_in_fp32_modules"], "data_types.keep_in_fp32_modules")
        elif "keep_in_fp32_modules" in d:
            tr.inert_key("data_types.keep_in_fp32_modules", "empty")


def optimizer(tr: Translation, node: Any) -> None:
    o = tr.section(node, "optimizer", ("type", "params", "legacy_fusion"), strict=True)
    tr.inert_keys(o, {"legacy_fusion": "selects a kernel"}, "optimizer.")
    low = _type(tr, o, "optimizer", OPTIMIZERS, NOT_IMPLEMENTED_OPTIMIZERS,
                {k: k for k in [*OPTIMIZERS, *NOT_IMPLEMENTED_OPTIMIZERS]}, "Adam, AdamW, Adagrad, Lion or SGD")
    if low is None:
        return
    defaults = OPTIMIZERS[low]
    extra = ("adam_w_mode",) if low in ("adam", "adamw") else ()
    params = tr.section(o.get("params", {}), "optimizer.params",
                        [*defaults, *extra, *OPTIMIZER_INERT, *OPTIMIZER_REFUSED], strict=True)
    tr.inert_keys(params, OPTIMIZER_INERT, "optimizer.params.")
    for key, (off, why) in OPTIMIZER_REFUSED.items():
        if key in params:
            tr.inert_or_error(params[key] == off, f"optimizer.params.{key}", f"optimizer.params.{key}: {why}",
                              "the default")
    # DeepSpeed: "Adam" is AdamW (decoupled decay) unless adam_w_mode is false; "AdamW" always is.
    name = low
    if extra:
        mode = tr.typed(params.get("adam_w_mode", True), "bool", "optimizer.params.adam_w_mode")
        name = "adamw" if low == "adamw" or mode is not False else "adam"
        if low == "adamw" and mode is False:
            tr.inert_key("optimizer.params.adam_w_mode", "type AdamW always decouples the weight decay, as in "
                                                         "DeepSpeed; use type Adam for L2 decay")
    tr.choose("optimizer", name, "optimizer.type")
    if tr.typed(params.get("torch_adam", False), "bool", "optimizer.params.torch_adam") and name == "adamw":
        defaults = {**defaults, "weight_decay": 0.01}   # DeepSpeed builds torch.optim.AdamW
    # DeepSpeed passes all parameters in one group: biases and norm weights decay too.
    tr.set("optimizer.decay_1d", True, "optimizer.params", DS_DEFAULT)
    for key, default in defaults.items():
        value = params.get(key, default)
        ds_key = f"optimizer.params.{key}"
        src = DS_FILE if key in params else DS_DEFAULT
        if key == "betas" and value == AUTO:
            tr.set("optimizer.beta1", AUTO, ds_key)
            tr.set("optimizer.beta2", AUTO, ds_key)
        elif key == "betas" and isinstance(value, list) and len(value) == 2 \
                and all(isinstance(b, (int, float)) and not isinstance(b, bool) for b in value):
            tr.set("optimizer.beta1", float(value[0]), ds_key + "[0]", src)
            tr.set("optimizer.beta2", float(value[1]), ds_key + "[1]", src)
        elif key == "betas":
            tr.error(f"{ds_key} must be a list of two numbers, got {json.dumps(value)}")
        elif (v := tr.typed(value, "bool" if isinstance(default, bool) else "float", ds_key,
                            auto_ok=key in ("lr", "eps", "weight_decay"))) is not None:
            tr.set(f"optimizer.{key}", v, ds_key, src)


def scheduler(tr: Translation, node: Any) -> None:
    s = tr.section(node, "scheduler", ("type", "params"), strict=True)
    low = _type(tr, s, "scheduler", SCHEDULERS, {k: v for k, v in SCHEDULER_NAMES.items() if k not in SCHEDULERS},
                SCHEDULER_NAMES, "WarmupLR, WarmupDecayLR or WarmupCosineLR")
    if low is None:
        return
    name, defaults = SCHEDULERS[low]
    tr.choose("scheduler", name, "scheduler.type")
    params = tr.section(s.get("params", {}), "scheduler.params", [*defaults, "last_batch_iteration"], strict=True)
    if "last_batch_iteration" in params:
        v = tr.typed(params["last_batch_iteration"], "int", "scheduler.params.last_batch_iteration")
        tr.inert_or_error(v is None or v == -1, "scheduler.params.last_batch_iteration",
                          "scheduler.params.last_batch_iteration: resuming a schedule this way is not implemented "
                          "here (the step is part of the train state); remove it", "-1: a fresh schedule")
    rules = ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "total_num_steps")   # "auto" fills these
    for key, default in defaults.items():
        ds_key = f"scheduler.params.{key}"
        kind = {"warmup_num_steps": "int", "total_num_steps": "int", "warmup_type": "str"}.get(key, "float")
        if key not in params and default is REQUIRED:
            tr.error(f"{ds_key} is required by {SCHEDULER_NAMES[low]} (give a number, or \"auto\": train.steps)")
        elif key not in params:
            tr.set(f"scheduler.{key}", default, ds_key, DS_DEFAULT)
        elif (v := tr.typed(params[key], kind, ds_key, auto_ok=key in rules)) is not None:
            tr.set(f"scheduler.{key}", v, ds_key, rule=key if v == AUTO else "")


def _type(tr: Translation, node: dict, section: str, have: Mapping, missing: Mapping[str, str],
          spelled: Mapping[str, str], use: str) -> str | None:
    """The section's ``type``, lower case, when we have it; else None, with an error naming what is
    not implemented, or the closest type we have (``spelled``: lower case -> as DeepSpeed writes it)."""
    kind = tr.typed(node["type"], "str", f"{section}.type") if "type" in node else None
    low = kind.lower() if kind is not None else None
    if "type" not in node:
        tr.error(f"{section}.type is missing; give one of {use}")
    elif low in missing:
        tr.error(f"{section}.type {kind}: {missing[low]} is not implemented here; use {use}")
    elif kind is not None and low not in have:
        near = close(low, spelled)
        hint = f" (did you mean {spelled[near]!r}?)" if near else ""
        tr.error(f"{section}.type {kind!r} is not a DeepSpeed {section} we have{hint}; use {use}")
    return low if low in have else None


def compile_section(tr: Translation, node: Any) -> None:
    c = tr.section(node, "compile", [*DEEPCOMPILE_KEYS, *TORCH_COMPILE_KEYS], strict=True)
    if tr.typed(c.get("deepcompile", False), "bool", "compile.deepcompile"):
        tr.error("compile.deepcompile=true: DeepCompile is not implemented here; remove it or give false")
        return
    old = "torch.compile settings of DeepSpeed before 0.16, which 0.19 rejects; the model is not compiled here " \
          "(a speed difference only)"
    for key in c:
        tr.inert_key(f"compile.{key}", "false" if key == "deepcompile" else old if key in TORCH_COMPILE_KEYS
                     else "DeepCompile is off")
    if not c:
        tr.inert_key("compile", "empty")
