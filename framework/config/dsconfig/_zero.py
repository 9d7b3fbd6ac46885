"""Translation of ``zero_optimization`` (the stage, its bucket and stage-3 keys, the offload
sections) and ``aio`` onto the stage and offload groups."""
from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from framework.config.dsconfig._keys import (AIO_KEYS, ALIASES_ZERO, AUTO, OFFLOAD_OPTIMIZER_KEYS,
                                             OFFLOAD_PARAM_KEYS, STAGE3_KEYS, STAGES, ZERO_FEATURES, ZERO_KEYS,
                                             ZERO_PERF, ZERO_STAGE, switched_off)

if TYPE_CHECKING:
    from framework.config.dsconfig._translate import Translation


def zero(tr: Translation, node: Any, aio: Any) -> int:
    z = tr.section(node, "zero_optimization",
                   [*ZERO_KEYS, *STAGE3_KEYS, *(f"stage3_{k}" for k in STAGE3_KEYS)], ALIASES_ZERO)
    stage = tr.typed(z.get("stage", 0), "int", "zero_optimization.stage")
    if stage is None:
        return 0
    if stage not in STAGES:
        tr.error(f"zero_optimization.stage must be 0, 1, 2 or 3, got {stage}")
        return 0
    name = STAGES[stage]
    tr.choose("stage", name, "zero_optimization.stage")
    p = "zero_optimization."
    # Deprecated spellings -> the current keys.
    if "stage3_gather_fp16_weights_on_model_save" in z:
        z.setdefault("stage3_gather_16bit_weights_on_model_save", z.pop("stage3_gather_fp16_weights_on_model_save"))
    sections = {"offload_optimizer": z.get("offload_optimizer"), "offload_param": z.get("offload_param")}
    for switch, section in (("cpu_offload", "offload_optimizer"), ("cpu_offload_param", "offload_param")):
        if switch in z and tr.typed(z.pop(switch), "bool", p + switch) and sections[section] is None:
            sections[section] = {"device": "cpu"}
    offload_opt, offload_param = sections.values()
    if "cpu_offload_use_pin_memory" in z:
        pin = tr.typed(z.pop("cpu_offload_use_pin_memory"), "bool", p + "cpu_offload_use_pin_memory")
        for sec in (offload_opt, offload_param):
            if isinstance(sec, dict):
                sec.setdefault("pin_memory", pin)
    # Stage-3 keys with and without the prefix.
    for k in STAGE3_KEYS:
        long = f"stage3_{k}"
        if k in z and long in z and z[k] != z[long]:
            tr.error(f"{p}{k} and {p}{long} are the same key with different values ({json.dumps(z[k])} "
                     f"and {json.dumps(z[long])}); keep one")
        if k in z:
            z[long] = z.pop(k)
    zero_stage_keys(tr, z, name)
    offload(tr, offload_opt, offload_param, z.get("sub_group_size"), aio, stage)
    for key, off, what in ZERO_FEATURES:
        if key in z:
            if z[key] == off or (off is None and switched_off(z[key], key)):
                tr.inert_key(p + key, "switched off")
            else:
                tr.error(f"{p}{key}: {what} is not implemented here; remove it")
    if "leaf_module" in z:
        if switched_off(z["leaf_module"], "leaf_module") or z["leaf_module"] == {}:
            tr.inert_key(p + "leaf_module", "empty")
        else:
            tr.error(f"{p}leaf_module is not implemented here; use stage.gather_unit to name gather units")
    for key in ZERO_PERF:
        if key in z:
            tr.typed(z[key], "int" if "threshold" in key else "bool", p + key)
            tr.inert_key(p + key, "a speed/memory knob of DeepSpeed's with no counterpart here")
    return stage


def zero_stage_keys(tr: Translation, z: dict, name: str) -> None:
    p = "zero_optimization."
    # Where each key lands per stage; absent: accepted, changes nothing with this stage. zero1 and zero2
    # take the keys without the stage3_ prefix, zero3 those with it and two more.
    zero3 = name == "zero3"
    targets = {"reduce_bucket_size": "bucket_size", "overlap_comm": "overlap_comm"} if name == "ddp" else {
        k: k for k in ZERO_STAGE
        if k.startswith("stage3_") == zero3 or (zero3 and k in ("overlap_comm", "reduce_scatter"))}
    why = {"ddp": "stage 0 replicates everything",
           "zero1": "a stage-3 key", "zero2": "a stage-3 key",
           "zero3": "zero3 reduces each gather unit's gradients in one collective"}[name]
    for key, (kind, rule) in ZERO_STAGE.items():
        if key not in z:
            continue
        # Hugging Face fills the stage3_ sizes only under ZeRO-3; elsewhere an "auto" is left over.
        # accelerate fills the 16-bit save flag with its own default (false), which is ours.
        auto_ok = (bool(rule) and (zero3 or not key.startswith("stage3_"))) \
            or key == "stage3_gather_16bit_weights_on_model_save"
        value = tr.typed(z[key], kind, p + key, auto_ok=auto_ok)
        if value is None:
            continue
        if kind == "int" and value != AUTO and value < 0:
            tr.error(f"{p}{key} must be >= 0, got {value}")
        target = targets.get(key)
        if target is not None:
            tr.set(f"stage.{target}", value, p + key, rule=rule)
        else:
            tr.inert_key(p + key, why)
            if value == AUTO and rule:  # resolved like any other, though nothing reads it
                tr.set(f"_inert.{key}", value, p + key, rule=rule)


def offload(tr: Translation, opt: Any, param: Any, sub_group_size: Any, aio: Any, stage: int) -> None:
    p = "zero_optimization."
    o = tr.section(opt, p + "offload_optimizer", OFFLOAD_OPTIMIZER_KEYS) if opt is not None else {}
    q = tr.section(param, p + "offload_param", OFFLOAD_PARAM_KEYS) if param is not None else {}
    devices = []
    for sec, name in ((o, "offload_optimizer"), (q, "offload_param")):
        dev = tr.typed(sec.get("device", "none"), "str", f"{p}{name}.device")
        if dev is not None and dev not in ("none", "cpu", "nvme"):
            tr.error(f"{p}{name}.device must be none, cpu or nvme, got {json.dumps(dev)}")
            dev = None
        devices.append(dev or "none")
    od, pd = devices
    if pd != "none" and stage != 3:
        tr.error(f"{p}offload_param.device={pd} needs zero_optimization.stage 3 (parameters are partitioned "
                 f"only there), got stage {stage}")
    target = "nvme" if "nvme" in (od, pd) else "cpu" if "cpu" in (od, pd) else "none"
    if target != "none" and od == "none":
        tr.error(f"{p}offload_param.device={target} without offload_optimizer is not implemented here; add "
                 f"\"offload_optimizer\": {{\"device\": \"cpu\"}}" + (" (or nvme)" if target == "nvme" else ""))

    def both(key: str, kind: str) -> None:
        values = {}
        for sec, name, dev in ((o, "offload_optimizer", od), (q, "offload_param", pd)):
            if key in sec and dev != "none":
                v = tr.typed(sec[key], kind, f"{p}{name}.{key}")
                if v is not None:
                    values[f"{p}{name}.{key}"] = v
        if len(set(values.values())) > 1:
            tr.error(f"{' and '.join(values)} differ ({', '.join(map(json.dumps, values.values()))}); "
                     f"one value applies to both here")
        elif values:
            ds_key, v = next(iter(values.items()))
            tr.set(f"offload.{key}", v, ds_key)

    def one(sec: dict, name: str, key: str, ours: str, kind: str, applies: bool, why: str) -> None:
        if key not in sec:
            return
        v = tr.typed(sec[key], kind, f"{p}{name}.{key}")
        if v is None:
            return
        if applies:
            tr.set(f"offload.{ours}", v, f"{p}{name}.{key}")
        else:
            tr.inert_key(f"{p}{name}.{key}", why)

    for sec, name, dev in ((o, "offload_optimizer", od), (q, "offload_param", pd)):
        if dev == "none":
            for key in sec:
                if key != "device":
                    tr.inert_key(f"{p}{name}.{key}", "device none")
    if opt is not None or param is not None:  # absent sections leave the run's offload choice
        tr.choose("offload", target, f"{p}offload_optimizer.device / offload_param.device")
    if target == "none":
        if sub_group_size is not None:
            tr.typed(sub_group_size, "int", p + "sub_group_size")
            tr.inert_key(p + "sub_group_size", "tiles the NVMe optimizer step; no NVMe offload")
        aio_keys(tr, aio, applies=False)
        return
    nvme = target == "nvme"
    if nvme:
        tr.set("offload.optimizer", od, f"{p}offload_optimizer.device")
        tr.set("offload.params", pd, f"{p}offload_param.device")
        both("nvme_path", "str")
    else:  # offload=cpu takes params none|cpu
        tr.set("offload.params", pd, f"{p}offload_param.device")
        for sec, name, dev in ((o, "offload_optimizer", od), (q, "offload_param", pd)):
            if "nvme_path" in sec and dev != "none":
                tr.inert_key(f"{p}{name}.nvme_path", "device cpu")
    both("pin_memory", "bool")
    why = "device cpu: NVMe buffers"
    if od != "none":
        one(o, "offload_optimizer", "ratio", "ratio", "float", True, "")
        one(o, "offload_optimizer", "buffer_count", "buffer_count", "int", nvme, why)
        one(o, "offload_optimizer", "pipeline_read", "pipeline_read", "bool", nvme, why)
        one(o, "offload_optimizer", "pipeline_write", "pipeline_write", "bool", nvme, why)
        if "pipeline" in o:  # DeepSpeed's older spelling of both pipeline flags
            tr.warnings.append(f"'{p}offload_optimizer.pipeline' is deprecated; use pipeline_read and "
                               f"pipeline_write")
            one(o, "offload_optimizer", "pipeline", "pipeline_read", "bool", nvme, why)
            one(o, "offload_optimizer", "pipeline", "pipeline_write", "bool", nvme, why)
        for key in ("fast_init", "cpuadam_cores_perc"):
            if key in o:
                tr.inert_key(f"{p}offload_optimizer.{key}", "a speed knob of DeepSpeed's CPU optimizer")
        if "super_offload" in o and o["super_offload"] is not False:
            tr.error(f"{p}offload_optimizer.super_offload: SuperOffload is not implemented here; remove it")
    if pd != "none":
        one(q, "offload_param", "buffer_count", "param_buffer_count", "int", nvme, why)
        one(q, "offload_param", "buffer_size", "param_buffer_size", "int", nvme, why)
        one(q, "offload_param", "max_in_cpu", "max_in_cpu", "int", nvme, why)
    if sub_group_size is not None:
        v = tr.typed(sub_group_size, "int", p + "sub_group_size")
        if v is not None and nvme:
            tr.set("offload.sub_group_size", v, p + "sub_group_size")
        elif v is not None:
            tr.inert_key(p + "sub_group_size", "tiles the NVMe optimizer step; offload is cpu")
    aio_keys(tr, aio, applies=nvme)


def aio_keys(tr: Translation, aio: Any, applies: bool) -> None:
    if aio is None:
        return
    a = tr.section(aio, "aio", AIO_KEYS, {"thread_count": "intra_op_parallelism"})
    if "thread_count" in a:
        if "intra_op_parallelism" in a:
            tr.error("aio.thread_count and aio.intra_op_parallelism are the same key; keep intra_op_parallelism")
        a["intra_op_parallelism"] = a.pop("thread_count")
    for key, value in a.items():
        v = tr.typed(value, AIO_KEYS[key], f"aio.{key}")
        if v is None:
            continue
        if key == "use_gds":
            if v:
                tr.error("aio.use_gds: GPUDirect Storage is not implemented here; remove it")
            else:
                tr.inert_key("aio.use_gds", "false")
        elif applies:
            tr.set(f"offload.aio.{key}", v, f"aio.{key}")
        else:
            tr.inert_key(f"aio.{key}", "no NVMe offload")
