"""DeepSpeed JSON configs, mapped onto the composed config.

    python -m framework.train ds_config=ds_zero2.json train.steps=100     # the file, then overrides
    framework.initialize(model, loss_fn, ds_config="ds_zero3.json")         # or a dict

Precedence: our defaults and YAML < the DeepSpeed file < command-line overrides. What the
DeepSpeed engine itself decides follows DeepSpeed's defaults for keys a file leaves out
(``gradient_clipping`` absent means no clipping; an ``optimizer`` section without
``weight_decay`` means 0); what DeepSpeed leaves to its client (the model, the data, an optimizer
or scheduler the file does not name) follows our config. "auto" values are filled by Hugging
Face's two-phase rules: phase 1 from the run's config (batch sizes, optimizer hyper-parameters,
gradient clipping, fp16/bf16), phase 2 from the model's hidden size and the step count. Where
the file states a value that the run also derives (the batch product, the warm-up peak against
the optimizer's lr, the schedule length against ``train.steps``, a group chosen on the command
line), the two must match; all mismatches are reported together. An "auto" no rule fills is an
error.

Strictness: an unknown key close to a known one is an error naming both; a key that resembles
nothing DeepSpeed knows is listed in one warning (``ds_config_strict=true`` makes it an error);
deprecated aliases are accepted with a warning naming the new key; DeepSpeed features not
implemented here are errors saying so; keys that change nothing here are listed once.

This module is pure: ``load`` parses, ``translate`` maps the file to group choices and settings
(no config composition), ``resolve`` fills "auto" and checks against the run's config.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from framework.core.errors import ConfigError
from framework.core.registry import closest

AUTO = "auto"
# Provenance labels (summary.json "config_sources" and the W&B config).
DEFAULT, YAML, DS_FILE, DS_DEFAULT, AUTO_FILLED, COMMAND_LINE = (
    "default", "YAML", "DeepSpeed file", "DeepSpeed default", "auto", "command line")

STAGES = {0: "ddp", 1: "zero1", 2: "zero2", 3: "zero3"}


# --------------------------------------------------------------------------------------------
# Loading


def load(source: str | Path | Mapping) -> dict:
    """The config as a dict: a JSON file (duplicate keys refused) or a mapping (copied)."""
    if isinstance(source, Mapping):
        return json.loads(json.dumps(source))  # a deep, plain copy; non-JSON values fail here
    path = Path(source)
    if not path.is_file():
        raise ConfigError(f"ds_config: no such file: {path}")

    def no_duplicates(pairs: list) -> dict:
        out = {}
        for key, value in pairs:
            if key in out:
                raise ConfigError(f"ds_config: {path}: key {key!r} appears twice in one object")
            out[key] = value
        return out

    try:
        data = json.loads(path.read_text(), object_pairs_hook=no_duplicates)
    except json.JSONDecodeError as e:
        raise ConfigError(f"ds_config: {path}: line {e.lineno} column {e.colno}: {e.msg} "
                          f"(strict JSON: no comments or trailing commas)") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"ds_config: {path}: not UTF-8 text ({e.reason})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"ds_config: {path}: the top level must be a JSON object, got {type(data).__name__}")
    return data


# --------------------------------------------------------------------------------------------
# The keys DeepSpeed knows (DeepSpeed 0.19), section by section


# Keys that change nothing here (listed once at start-up), with why.
INERT_TOP = {
    "steps_per_print": "DeepSpeed's own progress prints (train.log_every sets ours)",
    "wall_clock_breakdown": "DeepSpeed's timers",
    "memory_breakdown": "DeepSpeed's memory prints (summary.json has the ledger and peaks)",
    "dump_state": "DeepSpeed's debug print",
    "zero_allow_untested_optimizer": "every optimizer here runs with every stage",
    "zero_force_ds_cpu_optimizer": "the host step always uses our CPU kernels",
    "prescale_gradients": "the gradient average is the same up to rounding",
    "gradient_predivide_factor": "the gradient average is the same up to rounding",
    "disable_allgather": "a legacy flag",
    "monitor_config": "DeepSpeed's monitors (use logger=wandb)",
    "tensorboard": "DeepSpeed's monitors (use logger=wandb)",
    "wandb": "DeepSpeed's monitors (use logger=wandb)",
    "csv_monitor": "DeepSpeed's monitors (metrics.jsonl is written)",
    "comet": "DeepSpeed's monitors (use logger=wandb)",
    "comms_logger": "DeepSpeed's communication logger",
    "comms_config": "DeepSpeed's communication logger",
    "flops_profiler": "DeepSpeed's profiler",
    "timers": "DeepSpeed's timers",
    "checkpoint": "DeepSpeed's checkpoint format",
    "dataloader_drop_last": "DeepSpeed's data loader (the data component batches)",
    "seq_parallel_communication_data_type": "sequence parallelism is not used",
    "use_data_before_expert_parallelism": "expert parallelism is not used",
    "graph_harvesting": "a CUDA-graph option of DeepSpeed's engine",
    "_comment": "a comment",
}
# DeepSpeed features not implemented here: an error unless the value switches them off.
FEATURES = {
    "amp": "apex AMP (use fp16 or bf16)",
    "torch_autocast": "torch autocast mode (use fp16 or bf16)",
    "sparse_attention": "sparse attention",
    "compression_training": "compression training",
    "pipeline": "pipeline parallelism",
    "tensor_parallel": "tensor parallelism (AutoTP)",
    "moe": "mixture of experts",
    "expert_parallel": "expert parallelism",
    "sequence_parallel_size": "sequence parallelism",
    "curriculum_learning": "curriculum learning",
    "data_efficiency": "data efficiency (curriculum, random-LTD)",
    "progressive_layer_drop": "progressive layer drop",
    "quantize_training": "quantization-aware training",
    "eigenvalue": "eigenvalue computation",
    "hybrid_engine": "the RLHF hybrid engine",
    "nebula": "Nebula checkpointing",
    "weight_quantization": "weight quantization",
    "elasticity": "elastic training",
    "autotuning": "the autotuner",
    "compile": "DeepCompile",
    "sparse_gradients": "sparse gradients",
}
MAPPED_TOP = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
              "gradient_clipping", "optimizer", "scheduler", "fp16", "bf16", "zero_optimization", "aio",
              "data_types", "communication_data_type", "activation_checkpointing")
ALIASES_TOP = {"bfloat16": "bf16"}

ZERO_KEYS = ("stage", "contiguous_gradients", "reduce_scatter", "reduce_bucket_size", "use_multi_rank_bucket_allreduce",
             "allgather_partitions", "allgather_bucket_size", "overlap_comm", "compute_grad_norm",
             "load_from_fp32_weights", "elastic_checkpoint", "offload_param", "offload_optimizer", "zenflow",
             "sub_group_size", "ignore_unused_parameters", "legacy_stage1", "round_robin_gradients",
             "parameter_alignment", "zero_hpz_partition_size", "zero_quantized_weights",
             "zero_quantized_nontrainable_weights", "zero_quantized_gradients", "zeropp_loco_param",
             "mics_shard_size", "mics_hierarchical_params_gather", "memory_efficient_linear",
             "pipeline_loading_checkpoint", "override_module_apply", "log_trace_cache_warnings",
             "enable_sanity_checks", "save_muon_momentum_buffer_in_memory", "leaf_module")
# Stage-3 keys, which DeepSpeed accepts with and without the "stage3_" prefix.
STAGE3_KEYS = ("prefetch_bucket_size", "param_persistence_threshold", "model_persistence_threshold",
               "max_live_parameters", "max_reuse_distance", "gather_16bit_weights_on_model_save",
               "module_granularity_threshold", "use_all_reduce_for_fetch_params", "allgather_sequential")
ALIASES_ZERO = {"cpu_offload": "offload_optimizer", "cpu_offload_param": "offload_param",
                "cpu_offload_use_pin_memory": "offload_optimizer.pin_memory / offload_param.pin_memory",
                "stage3_gather_fp16_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save"}
# zero_optimization keys that only tune speed or memory in DeepSpeed and have no counterpart here.
ZERO_PERF = ("use_multi_rank_bucket_allreduce", "compute_grad_norm", "load_from_fp32_weights",
             "ignore_unused_parameters", "parameter_alignment", "memory_efficient_linear",
             "pipeline_loading_checkpoint", "override_module_apply", "log_trace_cache_warnings",
             "enable_sanity_checks", "save_muon_momentum_buffer_in_memory", "mics_hierarchical_params_gather",
             "model_persistence_threshold", "module_granularity_threshold", "use_all_reduce_for_fetch_params",
             "allgather_sequential", "allgather_partitions")
# zero_optimization features: (key, value that switches it off, what it is).
ZERO_FEATURES = (("zenflow", None, "ZenFlow"), ("legacy_stage1", False, "legacy stage 1"),
                 ("elastic_checkpoint", False, "elastic checkpointing"),
                 ("zero_hpz_partition_size", 1, "ZeRO++ hierarchical partitioning (hpZ)"),
                 ("zero_quantized_weights", False, "ZeRO++ quantized weights (qwZ)"),
                 ("zero_quantized_nontrainable_weights", False, "ZeRO++ quantized weights"),
                 ("zero_quantized_gradients", False, "ZeRO++ quantized gradients (qgZ)"),
                 ("zeropp_loco_param", None, "ZeRO++ LoCo"), ("mics_shard_size", -1, "MiCS"))
OFFLOAD_OPTIMIZER_KEYS = ("device", "nvme_path", "buffer_count", "pin_memory", "pipeline_read", "pipeline_write",
                          "fast_init", "ratio", "super_offload", "cpuadam_cores_perc", "pipeline")
OFFLOAD_PARAM_KEYS = ("device", "nvme_path", "buffer_count", "buffer_size", "max_in_cpu", "pin_memory")
AIO_KEYS = ("block_size", "queue_depth", "intra_op_parallelism", "single_submit", "overlap_events", "use_gds")
FP16_KEYS = ("enabled", "auto_cast", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
             "consecutive_hysteresis", "min_loss_scale", "fp16_master_weights_and_grads")
BF16_KEYS = ("enabled", "immediate_grad_update", "check_grad_overflow", "bf16_master_weights_and_grads",
             "bf16_optimizer_states")
ACT_KEYS = ("partition_activations", "cpu_checkpointing", "contiguous_memory_optimization", "number_checkpoints",
            "synchronize_checkpoint_boundary", "profile")

# DeepSpeed optimizer type (lower case) -> (our optimizer, its DeepSpeed defaults).
ADAM_DEFAULTS = {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0, "bias_correction": True}
OPTIMIZERS = {
    "adam": ADAM_DEFAULTS, "adamw": ADAM_DEFAULTS,
    "lion": {"lr": 1e-3, "betas": [0.9, 0.999], "weight_decay": 0.0},
    "adagrad": {"lr": 1e-2, "eps": 1e-10, "weight_decay": 0.0, "lr_decay": 0.0, "initial_accumulator_value": 0.0},
    "sgd": {"lr": 1e-3, "momentum": 0.0, "dampening": 0.0, "weight_decay": 0.0, "nesterov": False},
}
NOT_IMPLEMENTED_OPTIMIZERS = {"lamb": "LAMB", "onebitadam": "1-bit Adam", "zerooneadam": "0/1 Adam",
                              "onebitlamb": "1-bit LAMB", "muadam": "MuAdam", "muadamw": "MuAdamW",
                              "musgd": "MuSGD", "muon": "Muon", "adafactor": "Adafactor", "fusedadam": "FusedAdam"}
# Optimizer params that select an implementation, not the math.
OPTIMIZER_INERT = {"torch_adam": "selects torch's implementation; the math is the same",
                   "fused": "selects a kernel", "foreach": "selects a kernel",
                   "differentiable": "autograd through the step",
                   "capturable": "CUDA-graph capture", "set_grad_none": "gradients are freed by the stages anyway"}
OPTIMIZER_REFUSED = {"amsgrad": (False, "AMSGrad is not implemented"),
                     "maximize": (False, "maximize is not implemented"),
                     "max_grad_norm": (None, "DeepSpeed rejects it too: use the top-level gradient_clipping")}
SCHEDULERS = {
    "warmuplr": ("warmup_lr", {"warmup_min_lr": 0.0, "warmup_max_lr": 0.001, "warmup_num_steps": 1000,
                               "warmup_type": "log"}),
    "warmupdecaylr": ("warmup_decay_lr", {"warmup_min_lr": 0.0, "warmup_max_lr": 0.001, "warmup_num_steps": 1000,
                                          "warmup_type": "log", "total_num_steps": None}),
    "warmupcosinelr": ("warmup_cosine_lr", {"warmup_min_ratio": 0.0, "warmup_num_steps": 1000,
                                            "cos_min_ratio": 0.0001, "warmup_type": "log", "total_num_steps": None}),
}
SCHEDULER_NAMES = {"warmuplr": "WarmupLR", "warmupdecaylr": "WarmupDecayLR", "warmupcosinelr": "WarmupCosineLR",
                   "onecycle": "OneCycle", "lrrangetest": "LRRangeTest"}
NOT_IMPLEMENTED_SCHEDULERS = ("onecycle", "lrrangetest")


def _close(key: str, valid) -> str | None:
    # Stricter than for our own keys: DeepSpeed's sections hold many short, similar names.
    return closest(key, valid, cutoff=0.75)


# --------------------------------------------------------------------------------------------
# Translation: the file -> group choices and settings of our keys


@dataclass(frozen=True)
class Setting:
    value: Any          # a plain value, or AUTO
    ds_key: str         # where it is in the DeepSpeed file
    source: str         # DS_FILE or DS_DEFAULT
    rule: str = ""      # for AUTO: which Hugging Face rule fills it


@dataclass
class Translation:
    choices: dict[str, str] = field(default_factory=dict)       # group -> registry name
    choice_keys: dict[str, str] = field(default_factory=dict)   # group -> the DeepSpeed key that chose it
    settings: dict[str, Setting] = field(default_factory=dict)  # our dotted key -> setting
    batch: dict[str, Any] = field(default_factory=dict)         # the batch triple as the file states it
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)           # deprecated aliases
    unknown: list[str] = field(default_factory=list)            # keys resembling nothing DeepSpeed knows
    inert: list[str] = field(default_factory=list)              # accepted, change nothing here

    def notices(self, strict: bool, inert: tuple[str, ...] | list[str] = (), notes=()) -> list[str]:
        """The one-line warnings to print at start-up (unknown keys are errors when strict)."""
        out = [f"warning: ds_config: {w}" for w in self.warnings]
        if self.unknown and not strict:
            out.append("warning: ds_config: keys DeepSpeed does not know, ignored (ds_config_strict=true makes "
                       "this an error): " + ", ".join(self.unknown))
        if self.inert or inert:
            out.append("note: ds_config: accepted, change nothing here: " + "; ".join([*self.inert, *inert]))
        out += [f"note: ds_config: {n}" for n in notes]
        return out


class _Translator:
    def __init__(self) -> None:
        self.t = Translation()

    # helpers --------------------------------------------------------------------------------
    def error(self, msg: str) -> None:
        self.t.errors.append(msg)

    def section(self, node: Any, path: str, known, aliases: Mapping[str, str] | None = None) -> dict:
        """The section's keys after alias and typo checks (unknown keys dropped)."""
        if not isinstance(node, dict):
            self.error(f"{path} must be a JSON object, got {json.dumps(node)}")
            return {}
        out, aliases = {}, aliases or {}
        for key, value in node.items():
            full = f"{path}.{key}" if path else key
            if key in known:
                out[key] = value
            elif key in aliases:
                self.t.warnings.append(f"'{full}' is deprecated; use '{aliases[key]}'")
                out[key] = value
            else:
                near = _close(key, [*known, *aliases])
                if near is not None:
                    self.error(f"unknown key '{full}' (did you mean '{(path + '.') if path else ''}{near}'?)")
                else:
                    self.t.unknown.append(full)
        return out

    def set(self, key: str, value: Any, ds_key: str, source: str = DS_FILE, rule: str = "") -> None:
        self.t.settings[key] = Setting(value, ds_key, source, rule)

    def choose(self, group: str, name: str, ds_key: str) -> None:
        self.t.choices[group] = name
        self.t.choice_keys[group] = ds_key

    def inert(self, ds_key: str, why: str) -> None:
        self.t.inert.append(f"{ds_key} ({why})")

    def typed(self, value: Any, kind: str, ds_key: str, auto_ok: bool = False) -> Any:
        """Check and convert a JSON value: 'int' (integral floats such as 1e9 accepted), 'float',
        'bool', 'str'. None when the value is bad (the error is recorded)."""
        if value == AUTO:
            if auto_ok:
                return AUTO
            self.error(f"{ds_key} is \"auto\" but no rule fills it here; give a value")
            return None
        ok = None
        if isinstance(value, float) and not math.isfinite(value) and kind in ("int", "float"):
            # Python's json reads NaN and Infinity (and 1e309 as inf): a NaN limit disables the
            # comparison it feeds (gradient_clipping: NaN would never clip).
            self.error(f"{ds_key} must be a finite number, got {json.dumps(value)}")
            return None
        if kind == "int" and not isinstance(value, bool):
            if isinstance(value, int):
                ok = value
            elif isinstance(value, float) and value.is_integer():
                ok = int(value)
            if ok is not None and not -2 ** 63 <= ok < 2 ** 63:
                self.error(f"{ds_key}={json.dumps(value)} is out of range (integers must lie within +-2^63)")
                return None
        elif kind == "float" and isinstance(value, (int, float)) and not isinstance(value, bool):
            ok = float(value)
        elif kind == "bool" and isinstance(value, bool):
            ok = value
        elif kind == "str" and isinstance(value, str):
            ok = value
        if ok is None:
            want = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string"}[kind]
            self.error(f"{ds_key} must be {want}, got {json.dumps(value)}")
        return ok

    # sections -------------------------------------------------------------------------------
    def run(self, ds: dict) -> Translation:
        top = self.section(ds, "", [*MAPPED_TOP, *INERT_TOP, *FEATURES], ALIASES_TOP)
        if "bfloat16" in top:
            if "bf16" in top:
                self.error("both 'bf16' and its deprecated alias 'bfloat16' are given; keep 'bf16'")
            top["bf16"] = top.pop("bfloat16")
        for key, why in INERT_TOP.items():
            if key in top:
                self.inert(key, why)
        for key, what in FEATURES.items():
            if key in top and not _switched_off(top[key], key):
                self.error(f"'{key}': {what} is not implemented here; remove it")
            elif key in top:
                self.inert(key, "switched off")
        if "zero_optimization" in top:
            self.zero(top["zero_optimization"], top.get("aio"))
        elif "aio" in top:
            self._aio(top["aio"], applies=False)
        self.precision(top)
        self.optimizer(top.get("optimizer"))
        self.scheduler(top.get("scheduler"))
        for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
            if key in top:
                value = self.typed(top[key], "int", key, auto_ok=True)
                if value is not None and value != AUTO and value < 1:
                    self.error(f"{key} must be >= 1, got {value}")
                elif value is not None:
                    self.t.batch[key] = value
        if "gradient_clipping" in top:
            value = self.typed(top["gradient_clipping"], "float", "gradient_clipping", auto_ok=True)
            if value is not None:
                self.set("train.grad_clip", value, "gradient_clipping", rule="train.grad_clip")
        else:  # DeepSpeed clips only when asked
            self.set("train.grad_clip", 0.0, "gradient_clipping", DS_DEFAULT)
        self.activation_checkpointing(top.get("activation_checkpointing"))
        return self.t

    def zero(self, node: Any, aio: Any) -> int:
        z = self.section(node, "zero_optimization",
                         [*ZERO_KEYS, *STAGE3_KEYS, *(f"stage3_{k}" for k in STAGE3_KEYS)], ALIASES_ZERO)
        stage = self.typed(z.get("stage", 0), "int", "zero_optimization.stage")
        if stage is None:
            return 0
        if stage not in STAGES:
            self.error(f"zero_optimization.stage must be 0, 1, 2 or 3, got {stage}")
            return 0
        name = STAGES[stage]
        self.choose("stage", name, "zero_optimization.stage")
        p = "zero_optimization."
        # Deprecated spellings -> the current keys.
        if "stage3_gather_fp16_weights_on_model_save" in z:
            z.setdefault("stage3_gather_16bit_weights_on_model_save", z.pop("stage3_gather_fp16_weights_on_model_save"))
        offload_opt, offload_param = z.get("offload_optimizer"), z.get("offload_param")
        if "cpu_offload" in z:
            on = self.typed(z.pop("cpu_offload"), "bool", p + "cpu_offload")
            if offload_opt is None and on:
                offload_opt = {"device": "cpu"}
        if "cpu_offload_param" in z:
            on = self.typed(z.pop("cpu_offload_param"), "bool", p + "cpu_offload_param")
            if offload_param is None and on:
                offload_param = {"device": "cpu"}
        if "cpu_offload_use_pin_memory" in z:
            pin = self.typed(z.pop("cpu_offload_use_pin_memory"), "bool", p + "cpu_offload_use_pin_memory")
            for sec in (offload_opt, offload_param):
                if isinstance(sec, dict):
                    sec.setdefault("pin_memory", pin)
        # Stage-3 keys with and without the prefix.
        for k in STAGE3_KEYS:
            long = f"stage3_{k}"
            if k in z and long in z and z[k] != z[long]:
                self.error(f"{p}{k} and {p}{long} are the same key with different values ({json.dumps(z[k])} "
                           f"and {json.dumps(z[long])}); keep one")
            if k in z:
                z[long] = z.pop(k)
        self.zero_stage_keys(z, name)
        self.offload(offload_opt, offload_param, z.get("sub_group_size"), aio, stage)
        for key, off, what in ZERO_FEATURES:
            if key in z:
                if z[key] == off or (off is None and _switched_off(z[key], key)):
                    self.inert(p + key, "switched off")
                else:
                    self.error(f"{p}{key}: {what} is not implemented here; remove it")
        if "leaf_module" in z:
            if _switched_off(z["leaf_module"], "leaf_module") or z["leaf_module"] == {}:
                self.inert(p + "leaf_module", "empty")
            else:
                self.error(f"{p}leaf_module is not implemented here; use stage.gather_unit to name gather units")
        for key in ZERO_PERF:
            full = key if key in z else f"stage3_{key}"
            if full in z:
                self.typed(z[full], "int" if "threshold" in key else "bool", p + full)
                self.inert(p + full, "a speed/memory knob of DeepSpeed's with no counterpart here")
        return stage

    def zero_stage_keys(self, z: dict, name: str) -> None:
        p = "zero_optimization."
        ints = {"reduce_bucket_size": "h*h", "allgather_bucket_size": "", "stage3_prefetch_bucket_size": "0.9*h*h",
                "stage3_max_live_parameters": "", "stage3_max_reuse_distance": "",
                "stage3_param_persistence_threshold": "10*h"}
        bools = ("overlap_comm", "contiguous_gradients", "reduce_scatter", "round_robin_gradients",
                 "stage3_gather_16bit_weights_on_model_save")
        # Where each key lands per stage; absent: accepted, changes nothing with this stage.
        targets = {
            "ddp": {"reduce_bucket_size": "bucket_size", "overlap_comm": "overlap_comm"},
            "zero1": {k: k for k in ("reduce_bucket_size", "allgather_bucket_size", "overlap_comm",
                                     "contiguous_gradients", "reduce_scatter", "round_robin_gradients")},
            "zero3": {k: k for k in ("overlap_comm", "reduce_scatter", "stage3_prefetch_bucket_size",
                                     "stage3_max_live_parameters", "stage3_max_reuse_distance",
                                     "stage3_param_persistence_threshold",
                                     "stage3_gather_16bit_weights_on_model_save")},
        }
        targets["zero2"] = targets["zero1"]
        why = {"ddp": "stage 0 replicates everything",
               "zero1": "a stage-3 key", "zero2": "a stage-3 key",
               "zero3": "zero3 reduces each gather unit's gradients in one collective"}[name]
        for key in (*ints, *bools):
            if key not in z:
                continue
            rule = ints.get(key, "")
            # Hugging Face fills the stage3_ sizes only under ZeRO-3; elsewhere an "auto" is left over.
            # accelerate fills the 16-bit save flag with its own default (false), which is ours.
            auto_ok = (bool(rule) and (name == "zero3" or not key.startswith("stage3_"))) \
                or key == "stage3_gather_16bit_weights_on_model_save"
            value = self.typed(z[key], "int" if key in ints else "bool", p + key, auto_ok=auto_ok)
            if value is None:
                continue
            if key in ints and value != AUTO and value < 0:
                self.error(f"{p}{key} must be >= 0, got {value}")
            target = targets[name].get(key)
            if target is not None:
                self.set(f"stage.{target}", value, p + key, rule=rule)
            else:
                self.inert(p + key, why)
                if value == AUTO and rule:  # resolved like any other, though nothing reads it
                    self.set(f"_inert.{key}", value, p + key, rule=rule)

    def offload(self, opt: Any, param: Any, sub_group_size: Any, aio: Any, stage: int) -> None:
        p = "zero_optimization."
        o = self.section(opt, p + "offload_optimizer", OFFLOAD_OPTIMIZER_KEYS) if opt is not None else {}
        q = self.section(param, p + "offload_param", OFFLOAD_PARAM_KEYS) if param is not None else {}
        devices = []
        for sec, name in ((o, "offload_optimizer"), (q, "offload_param")):
            dev = self.typed(sec.get("device", "none"), "str", f"{p}{name}.device")
            if dev is not None and dev not in ("none", "cpu", "nvme"):
                self.error(f"{p}{name}.device must be none, cpu or nvme, got {json.dumps(dev)}")
                dev = None
            devices.append(dev or "none")
        od, pd = devices
        if pd != "none" and stage != 3:
            self.error(f"{p}offload_param.device={pd} needs zero_optimization.stage 3 (parameters are partitioned "
                       f"only there), got stage {stage}")
        target = "nvme" if "nvme" in (od, pd) else "cpu" if "cpu" in (od, pd) else "none"
        if target == "nvme" and od == "none":
            self.error(f"{p}offload_param.device=nvme without offload_optimizer is not implemented here; add "
                       f"\"offload_optimizer\": {{\"device\": \"cpu\"}} (or nvme)")
        if target == "cpu" and od == "none":
            self.error(f"{p}offload_param.device=cpu without offload_optimizer is not implemented here; add "
                       f"\"offload_optimizer\": {{\"device\": \"cpu\"}}")

        def both(key: str, kind: str) -> None:
            values = {}
            for sec, name, dev in ((o, "offload_optimizer", od), (q, "offload_param", pd)):
                if key in sec and dev != "none":
                    v = self.typed(sec[key], kind, f"{p}{name}.{key}")
                    if v is not None:
                        values[f"{p}{name}.{key}"] = v
            if len(set(values.values())) > 1:
                self.error(f"{' and '.join(values)} differ ({', '.join(map(json.dumps, values.values()))}); "
                           f"one value applies to both here")
            elif values:
                ds_key, v = next(iter(values.items()))
                self.set(f"offload.{key}", v, ds_key)

        def one(sec: dict, name: str, key: str, ours: str, kind: str, applies: bool, why: str) -> None:
            if key not in sec:
                return
            v = self.typed(sec[key], kind, f"{p}{name}.{key}")
            if v is None:
                return
            if applies:
                self.set(f"offload.{ours}", v, f"{p}{name}.{key}")
            else:
                self.inert(f"{p}{name}.{key}", why)

        for sec, name, dev in ((o, "offload_optimizer", od), (q, "offload_param", pd)):
            if dev == "none":
                for key in sec:
                    if key != "device":
                        self.inert(f"{p}{name}.{key}", "device none")
        if opt is not None or param is not None:  # absent sections leave the run's offload choice
            self.choose("offload", target, f"{p}offload_optimizer.device / offload_param.device")
        if target == "none":
            if sub_group_size is not None:
                self.typed(sub_group_size, "int", p + "sub_group_size")
                self.inert(p + "sub_group_size", "tiles the NVMe optimizer step; no NVMe offload")
            self._aio(aio, applies=False)
            return
        nvme = target == "nvme"
        if nvme:
            self.set("offload.optimizer", od, f"{p}offload_optimizer.device")
            self.set("offload.params", pd, f"{p}offload_param.device")
            both("nvme_path", "str")
        else:  # offload=cpu takes params none|cpu
            self.set("offload.params", pd, f"{p}offload_param.device")
            for sec, name, dev in ((o, "offload_optimizer", od), (q, "offload_param", pd)):
                if "nvme_path" in sec and dev != "none":
                    self.inert(f"{p}{name}.nvme_path", "device cpu")
        both("pin_memory", "bool")
        if od != "none":
            why = "device cpu: NVMe buffers"
            one(o, "offload_optimizer", "ratio", "ratio", "float", True, "")
            one(o, "offload_optimizer", "buffer_count", "buffer_count", "int", nvme, why)
            one(o, "offload_optimizer", "pipeline_read", "pipeline_read", "bool", nvme, why)
            one(o, "offload_optimizer", "pipeline_write", "pipeline_write", "bool", nvme, why)
            if "pipeline" in o:  # DeepSpeed's older spelling of both pipeline flags
                self.t.warnings.append(f"'{p}offload_optimizer.pipeline' is deprecated; use pipeline_read and "
                                       f"pipeline_write")
                one(o, "offload_optimizer", "pipeline", "pipeline_read", "bool", nvme, why)
                one(o, "offload_optimizer", "pipeline", "pipeline_write", "bool", nvme, why)
            for key in ("fast_init", "cpuadam_cores_perc"):
                if key in o:
                    self.inert(f"{p}offload_optimizer.{key}", "a speed knob of DeepSpeed's CPU optimizer")
            if "super_offload" in o and o["super_offload"] is not False:
                self.error(f"{p}offload_optimizer.super_offload: SuperOffload is not implemented here; remove it")
        if pd != "none":
            why = "device cpu: NVMe buffers"
            one(q, "offload_param", "buffer_count", "param_buffer_count", "int", nvme, why)
            one(q, "offload_param", "buffer_size", "param_buffer_size", "int", nvme, why)
            one(q, "offload_param", "max_in_cpu", "max_in_cpu", "int", nvme, why)
        if sub_group_size is not None:
            v = self.typed(sub_group_size, "int", p + "sub_group_size")
            if v is not None and nvme:
                self.set("offload.sub_group_size", v, p + "sub_group_size")
            elif v is not None:
                self.inert(p + "sub_group_size", "tiles the NVMe optimizer step; offload is cpu")
        self._aio(aio, applies=nvme)

    def _aio(self, aio: Any, applies: bool) -> None:
        if aio is None:
            return
        a = self.section(aio, "aio", AIO_KEYS, {"thread_count": "intra_op_parallelism"})
        if "thread_count" in a:
            if "intra_op_parallelism" in a:
                self.error("aio.thread_count and aio.intra_op_parallelism are the same key; keep intra_op_parallelism")
            a["intra_op_parallelism"] = a.pop("thread_count")
        kinds = {"block_size": "int", "queue_depth": "int", "intra_op_parallelism": "int",
                 "single_submit": "bool", "overlap_events": "bool", "use_gds": "bool"}
        for key, value in a.items():
            v = self.typed(value, kinds[key], f"aio.{key}")
            if v is None:
                continue
            if key == "use_gds":
                if v:
                    self.error("aio.use_gds: GPUDirect Storage is not implemented here; remove it")
                else:
                    self.inert("aio.use_gds", "false")
            elif applies:
                self.set(f"offload.aio.{key}", v, f"aio.{key}")
            else:
                self.inert(f"aio.{key}", "no NVMe offload")

    def precision(self, top: dict) -> None:
        fp16 = self.section(top["fp16"], "fp16", FP16_KEYS) if "fp16" in top else None
        bf16 = self.section(top["bf16"], "bf16", BF16_KEYS) if "bf16" in top else None
        on16 = False if fp16 is None else self.typed(fp16.get("enabled", False), "bool", "fp16.enabled", auto_ok=True)
        onbf = False if bf16 is None else self.typed(bf16.get("enabled", False), "bool", "bf16.enabled", auto_ok=True)
        if on16 is True and onbf is True:
            self.error("fp16.enabled and bf16.enabled are both true; enable one")
        if on16 is True:
            self.choose("precision", "fp16", "fp16.enabled")
        elif onbf is True:
            self.choose("precision", "bf16", "bf16.enabled")
        elif AUTO in (on16, onbf):
            # Hugging Face phase 1: "enabled" follows the run's precision (resolve() decides); a
            # section that says false (not absent) contradicts a run in that precision.
            stated = {"fp16": None if fp16 is None else on16, "bf16": None if bf16 is None else onbf}
            self.set("_precision_auto", stated,
                     "fp16.enabled / bf16.enabled", rule="precision")
        elif fp16 is not None or bf16 is not None:
            self.choose("precision", "fp32", "fp16.enabled / bf16.enabled")
        if fp16 is not None:
            kinds = {"loss_scale": "float", "initial_scale_power": "int", "loss_scale_window": "int",
                     "hysteresis": "int", "consecutive_hysteresis": "bool", "min_loss_scale": "float"}
            for key, kind in kinds.items():
                if key in fp16:
                    v = self.typed(fp16[key], kind, f"fp16.{key}")
                    if v is not None and on16 is False:
                        self.inert(f"fp16.{key}", "fp16 is not enabled")
                    elif v is not None:
                        self.set(f"_fp16.{key}", v, f"fp16.{key}")
            if "auto_cast" in fp16 and self.typed(fp16["auto_cast"], "bool", "fp16.auto_cast"):
                self.inert("fp16.auto_cast", "casts floating inputs to fp16; the inputs here are token ids and "
                                             "precision=fp16 computes in fp16 already")
            for key in ("fp16_master_weights_and_grads",):
                if key in fp16 and self.typed(fp16[key], "bool", f"fp16.{key}"):
                    self.error(f"fp16.{key}=true is not implemented here (master weights and gradients are fp32); "
                               f"remove it")
        if bf16 is not None:
            for key in ("immediate_grad_update", "check_grad_overflow"):
                if key in bf16:
                    self.typed(bf16[key], "bool", f"bf16.{key}")
                    self.inert(f"bf16.{key}", "the bf16 step here is always the same")
            for key in ("bf16_master_weights_and_grads", "bf16_optimizer_states"):
                if key in bf16 and self.typed(bf16[key], "bool", f"bf16.{key}"):
                    self.error(f"bf16.{key}=true is not implemented here (master weights and optimizer state are "
                               f"fp32); remove it")
        if "communication_data_type" in top:
            v = self.typed(top["communication_data_type"], "str", "communication_data_type")
            if v is not None:
                self.set("_comm_dtype", v, "communication_data_type")
        if "data_types" in top:
            d = self.section(top["data_types"], "data_types", ("grad_accum_dtype",))
            if "grad_accum_dtype" in d:
                v = self.typed(d["grad_accum_dtype"], "str", "data_types.grad_accum_dtype")
                if v is not None:
                    self.set("precision.grad_accum_dtype", v, "data_types.grad_accum_dtype")

    def optimizer(self, node: Any) -> None:
        if node is None:
            return
        o = self.section(node, "optimizer", ("type", "params", "legacy_fusion"))
        if "legacy_fusion" in o:
            self.inert("optimizer.legacy_fusion", "selects a kernel")
        kind = self.typed(o.get("type"), "str", "optimizer.type")
        if kind is None:
            return
        low = kind.lower()
        if low in NOT_IMPLEMENTED_OPTIMIZERS:
            self.error(f"optimizer.type {kind}: {NOT_IMPLEMENTED_OPTIMIZERS[low]} is not implemented here; use "
                       f"Adam, AdamW, Adagrad, Lion or SGD")
            return
        if low not in OPTIMIZERS:
            near = _close(low, [*OPTIMIZERS, *NOT_IMPLEMENTED_OPTIMIZERS])
            hint = f" (did you mean {near!r}?)" if near else ""
            self.error(f"optimizer.type {kind!r} is not a DeepSpeed optimizer we have{hint}; use Adam, AdamW, "
                       f"Adagrad, Lion or SGD")
            return
        defaults = OPTIMIZERS[low]
        extra = ("adam_w_mode",) if low in ("adam", "adamw") else ()
        params = self.section(o.get("params", {}), "optimizer.params",
                              [*defaults, *extra, *OPTIMIZER_INERT, *OPTIMIZER_REFUSED])
        for key, why in OPTIMIZER_INERT.items():
            if key in params:
                self.inert(f"optimizer.params.{key}", why)
        for key, (off, why) in OPTIMIZER_REFUSED.items():
            if key in params and params[key] != off:
                self.error(f"optimizer.params.{key}: {why}")
        # DeepSpeed: "Adam" is AdamW (decoupled decay) unless adam_w_mode is false; "AdamW" always is.
        name = low
        if low in ("adam", "adamw"):
            mode = self.typed(params.get("adam_w_mode", True), "bool", "optimizer.params.adam_w_mode")
            name = "adamw" if low == "adamw" or mode is not False else "adam"
        self.choose("optimizer", name, "optimizer.type")
        # DeepSpeed passes all parameters in one group: biases and norm weights decay too.
        self.set("optimizer.decay_1d", True, "optimizer.params", DS_DEFAULT)
        for key, default in defaults.items():
            given = key in params
            value = params.get(key, default)
            ds_key = f"optimizer.params.{key}"
            src = DS_FILE if given else DS_DEFAULT
            auto_ok = key in ("lr", "betas", "eps", "weight_decay")
            if key == "betas":
                if value == AUTO:
                    self.set("optimizer.beta1", AUTO, ds_key, rule="optimizer.beta1")
                    self.set("optimizer.beta2", AUTO, ds_key, rule="optimizer.beta2")
                elif (isinstance(value, list) and len(value) == 2
                      and all(isinstance(b, (int, float)) and not isinstance(b, bool) for b in value)):
                    self.set("optimizer.beta1", float(value[0]), ds_key, src)
                    self.set("optimizer.beta2", float(value[1]), ds_key, src)
                else:
                    self.error(f"{ds_key} must be a list of two numbers, got {json.dumps(value)}")
                continue
            kind = "bool" if isinstance(default, bool) else "float"
            v = self.typed(value, kind, ds_key, auto_ok=auto_ok)
            if v is not None:
                self.set(f"optimizer.{key}", v, ds_key, src, rule=f"optimizer.{key}" if v == AUTO else "")

    def scheduler(self, node: Any) -> None:
        if node is None:
            return
        s = self.section(node, "scheduler", ("type", "params"))
        kind = self.typed(s.get("type"), "str", "scheduler.type")
        if kind is None:
            return
        low = kind.lower()
        if low in NOT_IMPLEMENTED_SCHEDULERS:
            self.error(f"scheduler.type {kind}: {SCHEDULER_NAMES[low]} is not implemented here; use WarmupLR, "
                       f"WarmupDecayLR or WarmupCosineLR")
            return
        if low not in SCHEDULERS:
            near = _close(low, SCHEDULER_NAMES)
            hint = f" (did you mean {SCHEDULER_NAMES[near]!r}?)" if near else ""
            self.error(f"scheduler.type {kind!r} is not a DeepSpeed scheduler we have{hint}; use WarmupLR, "
                       f"WarmupDecayLR or WarmupCosineLR")
            return
        name, defaults = SCHEDULERS[low]
        self.choose("scheduler", name, "scheduler.type")
        params = self.section(s.get("params", {}), "scheduler.params", [*defaults, "last_batch_iteration"])
        if "last_batch_iteration" in params:
            v = self.typed(params["last_batch_iteration"], "int", "scheduler.params.last_batch_iteration")
            if v is not None and v != -1:
                self.error("scheduler.params.last_batch_iteration: resuming a schedule this way is not "
                           "implemented here (the step is part of the train state); remove it")
            else:
                self.inert("scheduler.params.last_batch_iteration", "-1: a fresh schedule")
        rules = {"warmup_min_lr": "warmup_min_lr", "warmup_max_lr": "warmup_max_lr",
                 "warmup_num_steps": "warmup_num_steps", "total_num_steps": "total_num_steps"}
        for key, default in defaults.items():
            ds_key = f"scheduler.params.{key}"
            if key not in params:
                if default is None:
                    self.error(f"{ds_key} is required by {SCHEDULER_NAMES[low]} (give a number, or \"auto\": "
                               f"train.steps)")
                else:
                    self.set(f"scheduler.{key}", default, ds_key, DS_DEFAULT)
                continue
            kind = {"warmup_num_steps": "int", "total_num_steps": "int", "warmup_type": "str"}.get(key, "float")
            v = self.typed(params[key], kind, ds_key, auto_ok=key in rules)
            if v is not None:
                self.set(f"scheduler.{key}", v, ds_key, rule=rules.get(key, "") if v == AUTO else "")

    def activation_checkpointing(self, node: Any) -> None:
        if node is None:
            return
        a = self.section(node, "activation_checkpointing", ACT_KEYS)
        for key, value in a.items():
            ds_key = f"activation_checkpointing.{key}"
            # As under Hugging Face's Trainer: these configure deepspeed.checkpointing, which only a
            # model that calls it (Megatron) uses; the run goes on without them.
            self.inert(ds_key, "configures deepspeed.checkpointing, which is not used "
                               "(model.activation_checkpointing turns checkpointing on)")


def _switched_off(value: Any, key: str) -> bool:
    if key == "sequence_parallel_size":
        return value in (None, 1)
    if isinstance(value, dict):
        return value == {} or value.get("enabled") is False
    return value in (None, False, 0)


def translate(ds: dict) -> Translation:
    """Map a loaded DeepSpeed config; errors and notices are collected in the result."""
    return _Translator().run(ds)


# --------------------------------------------------------------------------------------------
# Resolution against the run's config


@dataclass(frozen=True)
class RunFacts:
    """What the run's config (defaults, YAML, command line; no DeepSpeed layer) says: the
    "training arguments" of Hugging Face's rules."""
    world: int
    hidden_size: int | None             # None: unknown (a user model without a config)
    value: Callable[[str], Any]         # dotted key -> the run config's value
    cli_keys: frozenset[str]            # keys the command line sets
    cli_choices: Mapping[str, str]      # groups the command line chooses


@dataclass
class Resolved:
    values: dict[str, Any]              # our dotted key -> value to override (Hydra order: before the command line)
    sources: dict[str, str]             # our dotted key -> provenance label
    inert: list[str]                    # file keys that turned out to change nothing (fp16 keys of a bf16 run)
    notes: list[str] = field(default_factory=list)   # where the run differs from the file's intent


def resolve(t: Translation, run: RunFacts) -> Resolved:
    """Fill "auto", derive the batch triple, check must-match relations; one ConfigError lists
    every mismatch."""
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    mismatches: list[str] = []
    leftover: list[str] = []
    notes: list[str] = []
    h = run.hidden_size

    def final(key: str) -> Any:
        """The value a key will have: command line > DeepSpeed layer > the run's config."""
        if key in run.cli_keys or key not in values:
            return run.value(key)
        return values[key]

    # Group choices: a command-line choice that contradicts the file is a mismatch.
    for group, name in t.choices.items():
        cli = run.cli_choices.get(group)
        if cli is not None and cli != name:
            mismatches.append(f"{group}={cli} on the command line, but {t.choice_keys[group]} in the file means "
                              f"{group}={name}")

    # fp16/bf16 "auto": Hugging Face phase 1 takes the run's precision.
    precision = t.choices.get("precision") or run.cli_choices.get("precision") or run.value("precision.name")
    settings = dict(t.settings)
    pa = settings.pop("_precision_auto", None)
    if pa is not None:
        if pa.value.get(precision) is False:
            mismatches.append(f"precision={precision} in the run's config, but the file says {precision}.enabled "
                              f"false")
        sources["precision.name"] = AUTO_FILLED
    fp16_keys = {k: s for k, s in settings.items() if k.startswith("_fp16.")}
    for k in fp16_keys:
        settings.pop(k)
    inert = []
    if precision == "fp16":
        for k, s in fp16_keys.items():
            settings["precision." + k.split(".", 1)[1]] = s
    else:
        inert += [f"{s.ds_key} (the run is {precision})" for s in fp16_keys.values()]
    comm_setting = settings.pop("_comm_dtype", None)
    if comm_setting is not None:
        comm = comm_setting.value
        want = {"fp32": "fp32", "fp16": "fp16", "bf16": "bf16"}.get(comm)
        native = {"fp32": "fp32", "fp16": "fp16", "bf16": "bf16"}[precision]
        if precision == "bf16" and want in ("fp32", "bf16"):
            settings["precision.reduce_fp32"] = Setting(want == "fp32", "communication_data_type", DS_FILE)
        elif want != native:
            mismatches.append(f"communication_data_type={comm} with precision={precision}: only {native}"
                              f"{' or fp32' if precision == 'bf16' else ''} is implemented")

    for key, s in settings.items():
        if key.startswith("_inert."):
            if s.value == AUTO and _fill(s.rule, h) is None:
                leftover.append(f"{s.ds_key} (needs the model's hidden size)")
            continue
        if s.value == AUTO:
            if s.rule in ("h*h", "0.9*h*h", "10*h"):  # phase 2: from the model
                v = _fill(s.rule, h)
                if v is None:
                    leftover.append(f"{s.ds_key} (the model's hidden size is unknown: give a number)")
                    continue
                values[key], sources[key] = v, AUTO_FILLED
            elif s.rule == "warmup_min_lr":
                values[key], sources[key] = 0.0, AUTO_FILLED        # fill only
            else:
                sources[key] = AUTO_FILLED                          # the run's own value stays
            continue
        if key in run.cli_keys:
            continue                                                # the command line wins
        values[key], sources[key] = s.value, s.source

    # Scheduler relations (phase 1 and 2: must match).
    lr = final("optimizer.lr")
    s = t.settings.get("scheduler.warmup_max_lr")
    if s is not None:
        if s.value == AUTO:
            values["scheduler.warmup_max_lr"], sources["scheduler.warmup_max_lr"] = lr, AUTO_FILLED
        elif s.source == DS_FILE and "scheduler.warmup_max_lr" not in run.cli_keys and s.value != lr:
            mismatches.append(f"scheduler.params.warmup_max_lr={s.value} but the optimizer's lr is {lr}")
    s = t.settings.get("scheduler.total_num_steps")
    if s is not None:
        steps = final("train.steps")
        if s.value == AUTO:
            values["scheduler.total_num_steps"], sources["scheduler.total_num_steps"] = steps, AUTO_FILLED
        elif "scheduler.total_num_steps" not in run.cli_keys and s.value != steps:
            # Hugging Face fills only an "auto" here and runs the file's schedule as written.
            notes.append(f"scheduler.params.total_num_steps={s.value} but train.steps={steps}: the schedule runs "
                         f"as written, so this run " + (f"stops at step {steps} of it" if steps < s.value else
                         f"holds the schedule's last lr after step {s.value}") +
                         " (total_num_steps \"auto\" or train.steps=" + f"{s.value} makes them agree)")
    s = t.settings.get("scheduler.warmup_num_steps")
    if s is not None and s.value == AUTO:
        values["scheduler.warmup_num_steps"] = max(1, int(run.value("scheduler.warmup_num_steps")))
        sources["scheduler.warmup_num_steps"] = AUTO_FILLED

    _batch(t.batch, run, final, values, sources, mismatches)
    if leftover:
        mismatches.append("\"auto\" left over: " + ", ".join(leftover))
    if mismatches:
        if len(mismatches) == 1:
            raise ConfigError(f"ds_config: {mismatches[0]}")
        raise ConfigError("ds_config: the file does not match the run's config:\n" +
                          "\n".join(f"  - {m}" for m in mismatches))
    return Resolved(values, sources, inert, notes)


def _fill(rule: str, h: int | None) -> int | None:
    if h is None:
        return None
    return {"h*h": h * h, "0.9*h*h": int(0.9 * h * h), "10*h": 10 * h}[rule]


def _batch(b: dict, run: RunFacts, final: Callable[[str], Any], values: dict, sources: dict,
           mismatches: list) -> None:
    """DeepSpeed's batch triple: train = micro x accumulation x world. A missing one is derived from
    the other two (only micro given: accumulation 1; only train given: accumulation 1); "auto"
    (phase 1) takes micro and accumulation from the run's config and train from the product."""
    world = run.world
    tb, mb, ga = (b.get(k) for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                     "gradient_accumulation_steps"))
    derived = {}
    if mb == AUTO:
        sources["train.micro_batch"] = AUTO_FILLED
    elif mb is not None:
        derived["train.micro_batch"] = mb
    if ga == AUTO:
        sources["train.grad_accum"] = AUTO_FILLED
    elif ga is not None:
        derived["train.grad_accum"] = ga
    if isinstance(tb, int):
        if mb is None and ga is None:
            derived["train.grad_accum"] = 1
            if tb % world:
                mismatches.append(f"train_batch_size={tb} is not divisible by the world size {world}")
            derived["train.micro_batch"] = max(1, tb // world)
        elif ga is None and isinstance(mb, int):
            if tb % (mb * world):
                mismatches.append(f"train_batch_size={tb} is not divisible by train_micro_batch_size_per_gpu={mb} "
                                  f"x world size {world}")
            derived["train.grad_accum"] = max(1, tb // (mb * world))
        elif mb is None and isinstance(ga, int):
            if tb % (ga * world):
                mismatches.append(f"train_batch_size={tb} is not divisible by gradient_accumulation_steps={ga} "
                                  f"x world size {world}")
            derived["train.micro_batch"] = max(1, tb // (ga * world))
    elif tb is None and isinstance(mb, int) and ga is None:
        derived["train.grad_accum"] = 1
    for key, v in derived.items():
        if key not in run.cli_keys:
            values[key], sources[key] = v, DS_FILE
    if isinstance(tb, int):
        m, g = final("train.micro_batch"), final("train.grad_accum")
        if m * g * world != tb and not any("divisible" in x for x in mismatches):
            mismatches.append(f"train_batch_size={tb} but train_micro_batch_size_per_gpu={m} x "
                              f"gradient_accumulation_steps={g} x world size {world} = {m * g * world}")


# --------------------------------------------------------------------------------------------
# Hydra overrides


def hydra_value(v: Any) -> str:
    """A value in Hydra's override grammar."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return "'" + v.replace("\\", "\\\\").replace("'", "\\'") + "'"
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(hydra_value(x) for x in v) + "]"
    raise TypeError(f"no Hydra spelling for {v!r}")
