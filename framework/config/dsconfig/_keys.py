"""The keys DeepSpeed knows (DeepSpeed 0.19), section by section, and what each means here:
mapped onto our config, accepted but inert (with why), or a feature not implemented."""
from __future__ import annotations

from typing import Any

from framework.core.registry import closest


AUTO = "auto"
# Provenance labels (summary.json "config_sources" and the W&B config).
DEFAULT, YAML, DS_FILE, DS_DEFAULT, AUTO_FILLED, COMMAND_LINE = (
    "default", "YAML", "DeepSpeed file", "DeepSpeed default", "auto", "command line")

STAGES = {0: "ddp", 1: "zero1", 2: "zero2", 3: "zero3"}
# DeepSpeed's dtype spellings (its DtypeEnum) -> our precision names (int8: none of ours).
DTYPES = {**dict.fromkeys(("fp32", "float32", "float", "torch.float32"), "fp32"),
          **dict.fromkeys(("fp16", "float16", "half", "torch.float16"), "fp16"),
          **dict.fromkeys(("bf16", "bfloat16", "torch.bfloat16"), "bf16"), **dict.fromkeys(("int8", "torch.int8"), "int8")}


# Keys that change nothing here (listed once at start-up), with why.
INERT_TOP = {
    "steps_per_print": "DeepSpeed's own progress prints (train.log_every sets ours)",
    "wall_clock_breakdown": "DeepSpeed's timers",
    "memory_breakdown": "DeepSpeed's memory prints (summary.json has the ledger and peaks)",
    "dump_state": "DeepSpeed's debug print",
    "zero_allow_untested_optimizer": "every optimizer here runs with every stage",
    "zero_force_ds_cpu_optimizer": "the host step always uses our CPU kernels",
    **dict.fromkeys(("prescale_gradients", "gradient_predivide_factor"),
                    "the gradient average is the same up to rounding"),
    "disable_allgather": "a legacy flag",
    **dict.fromkeys(("monitor_config", "tensorboard", "wandb"), "DeepSpeed's monitors (use logger=wandb)"),
    "csv_monitor": "DeepSpeed's monitors (metrics.jsonl is written)", "comet": "DeepSpeed's monitors (use logger=wandb)",
    **dict.fromkeys(("comms_logger", "comms_config"), "DeepSpeed's communication logger"),
    "flops_profiler": "DeepSpeed's profiler", "timers": "DeepSpeed's timers", "checkpoint": "DeepSpeed's checkpoint format",
    "dataloader_drop_last": "DeepSpeed's data loader (the data component batches)",
    "seq_parallel_communication_data_type": "sequence parallelism is not used",
    "use_data_before_expert_parallelism": "expert parallelism is not used",
    "graph_harvesting": "a CUDA-graph option of DeepSpeed's engine",
    "disable_python_gc": "when Python's garbage collector runs",
    "vocabulary_size": "DeepSpeed's own use of the vocabulary size (the model config sets ours)",
    "log_level": "DeepSpeed's log verbosity",
}
# DeepSpeed features not implemented here: an error unless the value switches them off.
FEATURES = {
    "amp": "apex AMP (use fp16 or bf16)", "torch_autocast": "torch autocast mode (use fp16 or bf16)",
    "sparse_attention": "sparse attention", "compression_training": "compression training",
    "pipeline": "pipeline parallelism", "tensor_parallel": "tensor parallelism (AutoTP)", "moe": "mixture of experts",
    "expert_parallel": "expert parallelism", "sequence_parallel_size": "sequence parallelism",
    "curriculum_learning": "curriculum learning", "data_efficiency": "data efficiency (curriculum, random-LTD)",
    "progressive_layer_drop": "progressive layer drop", "quantize_training": "quantization-aware training",
    "eigenvalue": "eigenvalue computation", "hybrid_engine": "the RLHF hybrid engine",
    "nebula": "Nebula checkpointing", "datastates_ckpt": "DataStates-LLM asynchronous checkpointing",
    "weight_quantization": "weight quantization", "elasticity": "elastic training",
    "autotuning": "the autotuner", "sparse_gradients": "sparse gradients",
}
# The compile section: DeepCompile's switch and the settings it reads (DeepSpeed 0.19), and older
# DeepSpeed's torch.compile settings, which 0.19 no longer reads.
DEEPCOMPILE_KEYS = ("deepcompile", "free_activation", "free_activation_threshold", "offload_activation",
                    "offload_opt_states", "double_buffer", "symmetric_memory", "debug_log", "offload_parameters",
                    "sync_before_reduce", "sync_after_reduce", "sync_before_allgather", "sync_after_allgather",
                    "keep_int_input_tensors", "keep_all_input_tensors", "passes")
TORCH_COMPILE_KEYS = ("enabled", "backend", "kwargs", "fullgraph", "dynamic", "mode", "options", "disable")
# Keys whose one value is what happens here anyway (a note) and whose other values would change
# the math in a way not implemented (an error): key -> (that value, why it is inert, why the others are refused:
# a bare reason, set in "<key>=<value> is not supported here (<reason>); remove it or give <value>").
AS_HERE = {
    "gradient_allreduce_op": ("mean", "gradients are averaged over the ranks here",
                              "gradients are averaged over the ranks"),
    "managed_gradient_accumulation": (True, "the default", "the engine always manages gradient accumulation"),
}
MAPPED_TOP = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
              "gradient_clipping", "optimizer", "scheduler", "fp16", "bf16", "zero_optimization", "aio",
              "data_types", "communication_data_type", "activation_checkpointing", "compile")
ALIASES_TOP = {"bfloat16": "bf16", "allgather_size": "zero_optimization.allgather_bucket_size"}

# zero_optimization keys that set a stage key: DeepSpeed key -> (kind, the "auto" rule filling it; h: the
# model's hidden size). Where each lands per stage: ``_translate.zero_stage_keys``.
ZERO_STAGE = {"reduce_bucket_size": ("int", "h*h"), "allgather_bucket_size": ("int", ""),
              "stage3_prefetch_bucket_size": ("int", "0.9*h*h"), "stage3_max_live_parameters": ("int", ""),
              "stage3_max_reuse_distance": ("int", ""), "stage3_param_persistence_threshold": ("int", "10*h"),
              "overlap_comm": ("bool", ""), "contiguous_gradients": ("bool", ""), "reduce_scatter": ("bool", ""),
              "round_robin_gradients": ("bool", ""), "stage3_gather_16bit_weights_on_model_save": ("bool", "")}
# zero_optimization keys that only tune speed or memory in DeepSpeed and have no counterpart here.
ZERO_PERF = ("use_multi_rank_bucket_allreduce", "compute_grad_norm", "ignore_unused_parameters", "parameter_alignment",
             "memory_efficient_linear", "pipeline_loading_checkpoint", "override_module_apply",
             "log_trace_cache_warnings", "enable_sanity_checks", "save_muon_momentum_buffer_in_memory",
             "mics_hierarchical_params_gather",
             "stage3_model_persistence_threshold", "stage3_module_granularity_threshold",
             "stage3_use_all_reduce_for_fetch_params", "stage3_allgather_sequential", "allgather_partitions")
# zero_optimization features: (key, value that switches it off, what it is).
ZERO_FEATURES = (("zenflow", None, "ZenFlow"), ("legacy_stage1", False, "legacy stage 1"),
                 ("elastic_checkpoint", False, "elastic checkpointing"),
                 ("zero_hpz_partition_size", 1, "ZeRO++ hierarchical partitioning (hpZ)"),
                 ("zero_quantized_weights", False, "ZeRO++ quantized weights (qwZ)"),
                 ("zero_quantized_nontrainable_weights", False, "ZeRO++ quantized weights"),
                 ("zero_quantized_gradients", False, "ZeRO++ quantized gradients (qgZ)"),
                 ("zeropp_loco_param", None, "ZeRO++ LoCo"), ("mics_shard_size", -1, "MiCS"))
# Stage-3 keys, which DeepSpeed accepts with and without the "stage3_" prefix.
STAGE3_KEYS = tuple(k.removeprefix("stage3_") for k in (*ZERO_STAGE, *ZERO_PERF) if k.startswith("stage3_"))
ZERO_KEYS = ("stage", "offload_param", "offload_optimizer", "sub_group_size", "leaf_module",
             "cpu_offload_use_pin_memory",   # deprecated, and ignored by DeepSpeed (a warning)
             "load_from_fp32_weights",       # false: rebuild the masters from the 16-bit weights at a load
             *(k for k in (*ZERO_STAGE, *ZERO_PERF) if not k.startswith("stage3_")), *(f[0] for f in ZERO_FEATURES))
ALIASES_ZERO = {"cpu_offload": "offload_optimizer", "cpu_offload_param": "offload_param",
                "stage3_gather_fp16_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save"}
OFFLOAD_OPTIMIZER_KEYS = ("device", "nvme_path", "buffer_count", "pin_memory", "pipeline_read", "pipeline_write",
                          "fast_init", "ratio", "super_offload", "cpuadam_cores_perc", "pipeline")
OFFLOAD_PARAM_KEYS = ("device", "nvme_path", "buffer_count", "buffer_size", "max_in_cpu", "pin_memory")
AIO_KEYS = {"block_size": "int", "queue_depth": "int", "intra_op_parallelism": "int", "single_submit": "bool",
            "overlap_events": "bool", "use_gds": "bool"}
# fp16 loss-scaler keys (precision.* under fp16) and their kinds.
FP16_SCALER = {"loss_scale": "float", "initial_scale_power": "int", "loss_scale_window": "int", "hysteresis": "int",
               "consecutive_hysteresis": "bool", "min_loss_scale": "float"}
# DeepSpeed's defaults of the dynamic scaler's keys (precision.ScalerConfig's too: a test holds them equal).
SCALER_DEFAULTS = {"initial_scale_power": 16, "loss_scale_window": 1000, "hysteresis": 2,
                   "consecutive_hysteresis": False, "min_loss_scale": 1.0}
FP16_KEYS = ("enabled", "auto_cast", *FP16_SCALER, "fp16_master_weights_and_grads")
BF16_KEYS = ("enabled", "immediate_grad_update", "check_grad_overflow", "bf16_master_weights_and_grads",
             "bf16_optimizer_states")
ACT_KEYS = ("partition_activations", "cpu_checkpointing", "contiguous_memory_optimization", "number_checkpoints",
            "synchronize_checkpoint_boundary", "profile")

# DeepSpeed optimizer type (lower case) -> its DeepSpeed defaults.
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
OPTIMIZER_INERT = {"torch_adam": "selects torch's implementation; the math is the same", "fused": "selects a kernel",
                   "foreach": "selects a kernel", "differentiable": "autograd through the step",
                   "capturable": "CUDA-graph capture", "set_grad_none": "gradients are freed by the stages anyway"}
OPTIMIZER_REFUSED = {"amsgrad": (False, "AMSGrad is not implemented"),
                     "fp32_optimizer_states": (True, "optimizer states below fp32 are not implemented"),
                     "maximize": (False, "maximize is not implemented"),
                     "max_grad_norm": (None, "DeepSpeed rejects it too: use the top-level gradient_clipping")}
# Keys no other DeepSpeed section takes either, with what to use instead, said wherever they stand (not "move it
# there": under optimizer.params it is refused as above).
NOWHERE = {"max_grad_norm": "no DeepSpeed section takes it; use the top-level gradient_clipping"}
# DeepSpeed scheduler type (lower case) -> (our scheduler, its DeepSpeed defaults; REQUIRED: no default).
# DeepSpeed's WarmupLR warms up to the optimizer's lr when warmup_max_lr is left out (since 0.17.2;
# None here, as in our YAML); WarmupDecayLR keeps 0.001.
REQUIRED = object()
WARMUP_DEFAULTS = {"warmup_min_lr": 0.0, "warmup_max_lr": 0.001, "warmup_num_steps": 1000, "warmup_type": "log"}
SCHEDULERS = {
    "warmuplr": ("warmup_lr", {**WARMUP_DEFAULTS, "warmup_max_lr": None}),
    "warmupdecaylr": ("warmup_decay_lr", {**WARMUP_DEFAULTS, "total_num_steps": REQUIRED}),
    "warmupcosinelr": ("warmup_cosine_lr", {"warmup_min_ratio": 0.0, "warmup_num_steps": 1000,
                                            "cos_min_ratio": 0.0001, "warmup_type": "log",
                                            "total_num_steps": REQUIRED}),
}
# As DeepSpeed spells them; those not in SCHEDULERS are not implemented.
SCHEDULER_NAMES = {"warmuplr": "WarmupLR", "warmupdecaylr": "WarmupDecayLR", "warmupcosinelr": "WarmupCosineLR",
                   "onecycle": "OneCycle", "lrrangetest": "LRRangeTest"}


# Names people give these keys (other frameworks' spellings) that no spelling distance finds.
MISNAMES = {"zero": "zero_optimization", "grad_clip": "gradient_clipping", "clip_grad": "gradient_clipping",
            "epsilon": "eps", "initial_loss_scale": "initial_scale_power", "learning_rate": "lr", "name": "type",
            "micro_batch_size": "train_micro_batch_size_per_gpu", "clip_grad_norm": "gradient_clipping",
            "queue_size": "queue_depth",
            # batch keys (ours: train.grad_accum, train.micro_batch): DeepSpeed ignores them, the run's batch would stay
            **dict.fromkeys(("grad_accum", "grad_accum_steps", "gradient_accumulation"), "gradient_accumulation_steps"),
            "micro_batch": "train_micro_batch_size_per_gpu", "global_batch_size": "train_batch_size"}


def _places() -> dict[str, tuple[str, ...]]:
    """Each key DeepSpeed knows -> the sections that hold it ("": the top level): a key found in another
    section than its own was misplaced (DeepSpeed would ignore it there, or refuse it)."""
    sections = {
        "": (*MAPPED_TOP, *INERT_TOP, *AS_HERE, *FEATURES, *ALIASES_TOP),
        "zero_optimization": (*ZERO_KEYS, *STAGE3_KEYS, *(f"stage3_{k}" for k in STAGE3_KEYS), *ALIASES_ZERO),
        "zero_optimization.offload_optimizer": OFFLOAD_OPTIMIZER_KEYS,
        "zero_optimization.offload_param": OFFLOAD_PARAM_KEYS,
        "optimizer": ("type", "params"),
        "optimizer.params": (*(k for d in OPTIMIZERS.values() for k in d), "adam_w_mode", *OPTIMIZER_INERT,
                             *OPTIMIZER_REFUSED),
        "scheduler": ("type", "params"),
        "scheduler.params": (*(k for _, d in SCHEDULERS.values() for k in d), "last_batch_iteration"),
        "fp16": FP16_KEYS, "bf16": BF16_KEYS, "aio": (*AIO_KEYS, "thread_count"),
    }
    out: dict[str, tuple[str, ...]] = {}
    for section, keys in sections.items():
        for key in dict.fromkeys(keys):
            out[key] = (*out.get(key, ()), section)
    return out


PLACES = _places()


def misplaced(key: str, path: str) -> str | None:
    """Where ``key``, unknown in section ``path``, belongs when another section holds it: "under X" (or
    "at the top level")."""
    # (fp16's loss-scaler keys in bf16 stay unknown keys there, to be removed: bf16 has no loss scale)
    where = [p for p in PLACES.get(key, ()) if p != path and {p, path} != {"fp16", "bf16"}]
    if not where:
        return None
    return " or ".join(f"under {p}" if p else "at the top level" for p in where)


def close(key: str, valid) -> str | None:
    # DeepSpeed's keys are case-sensitive: "FP16" is not "fp16" there, so the case alone makes a
    # key close (else it would be ignored and the run would go fp32). Then the usual misnames; then
    # stricter than for our own keys: DeepSpeed's sections hold many short, similar names; the
    # same words in another order (comm_overlap for overlap_comm) count as close too.
    valid, low, words = list(valid), key.lower(), sorted(key.split("_"))
    return (next((v for v in valid if v.lower() == low), None) or closest(key, valid, 0.75, MISNAMES)
            or next((v for v in valid if sorted(v.split("_")) == words), None))


def section_meant(key: str, value: Any) -> str | None:
    """The section an unknown top-level key was meant to be (DeepSpeed ignores such a key: the section would
    silently be left out), or one of its keys: the section's name with that key (zero_stage: zero_optimization.stage,
    bf16_enabled), its name cut short or extended (zero_optim, sched, optimizers), an object holding only that
    section's keys ({"stage": 3}; an optimizer's or a scheduler's by its type), or a misspelt long name."""
    sections = sorted({p for places in PLACES.values() for p in places if p and "." not in p} |
                      {"activation_checkpointing", "compile"})
    for i in (i for i, c in enumerate(key) if c == "_"):
        head, rest = key[:i], key[i + 1:]
        if len(head) >= 3 and (s := next((s for s in sections if s.startswith(head) and s in PLACES.get(rest, ())),
                                         None)):
            return f"{s}.{rest}"
    named = [s for s in sections if len(key) >= 3 and (s.startswith(key) or key.startswith(s))]
    if not named and isinstance(value, dict) and (keys := [k for k in value if not str(k).startswith("_")]):
        named = [s for s in sections if all(s in PLACES.get(k, ()) for k in keys)]
        kind = str(value.get("type", "")).lower()
        if {"optimizer", "scheduler"} <= set(named) and kind in (*OPTIMIZERS, *NOT_IMPLEMENTED_OPTIMIZERS):
            named.remove("scheduler")
        elif {"optimizer", "scheduler"} <= set(named) and kind in SCHEDULER_NAMES:
            named.remove("optimizer")
    # a misspelling of a long name (zero_optimisation); not a mere likeness to a short one (compute: compile)
    return named[0] if len(named) == 1 else closest(key, [s for s in sections if len(s) > 8], 0.8)


def switched_off(value: Any, key: str) -> bool:
    if key == "sequence_parallel_size":
        return value in (None, 1)
    if key == "datastates_ckpt":   # DeepSpeed runs it whenever the key is there (newer DeepSpeed: unless false)
        return value is False
    if isinstance(value, dict):
        return value == {} or value.get("enabled") is False
    return value in (None, False, 0)
