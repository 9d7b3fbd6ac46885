"""DeepSpeed configs (framework.config.dsconfig): the Hugging Face guide's three configs, typos at every
level, "auto", the batch triple, precedence and provenance, Adam = AdamW."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from torch import nn

import framework
from framework.config import dsconfig
from framework.core.errors import ConfigError, FrameworkError
from framework.cli.launch import launch
from framework.loggers._base import RunInfo

DS = Path(__file__).resolve().parent / "ds"
TINY = ["model.n_layer=1", "model.d_model=32", "model.n_head=2", "model.context=16", "train.steps=3",
        "train.log_every=1", "train.eval_every=0", "train.eval_batches=1", "train.micro_batch=4", "logger=none"]


def hf(name: str) -> dict:
    return json.loads((DS / f"{name}.json").read_text())


def error_of(ds, overrides=(), **kw) -> str:
    with pytest.raises(ConfigError) as e:
        framework.compose(list(overrides), ds_config=ds, **kw)
    return str(e.value)


# --- the Hugging Face guide's configs ---------------------------------------------------------

@pytest.mark.parametrize("name,stage,params_on_host", [("hf_zero2_cpu_offload", "zero2", False),
                                                       ("hf_zero3_cpu_offload", "zero3", True)])
def test_hf_guide_config_trains(tmp_path, name, stage, params_on_host):
    cfg = framework.compose(TINY, ds_config=DS / f"{name}.json")
    assert cfg.choices["stage"] == stage and cfg.choices["offload"] == "cpu"
    assert cfg.offload.params == ("cpu" if params_on_host else "none")
    assert cfg.choices["optimizer"] == "adamw" and cfg.choices["scheduler"] == "warmup_lr"
    assert cfg.choices["precision"] == "fp32"  # fp16 "auto" follows the run's precision
    if stage == "zero3":  # phase 2 "auto" from the hidden size (32)
        assert cfg.stage.stage3_prefetch_bucket_size == int(0.9 * 32 * 32)
        assert cfg.stage.stage3_param_persistence_threshold == 320
        assert cfg.stage.stage3_gather_16bit_weights_on_model_save is True
    else:
        assert cfg.stage.reduce_bucket_size == 200_000_000 and cfg.stage.allgather_bucket_size == 200_000_000
    summary = launch(cfg, RunInfo(tmp_path, None, None))
    assert summary["steps"] == 3 and torch.isfinite(torch.tensor(summary["val_loss"]))
    saved = json.loads((tmp_path / "summary.json").read_text())
    src = saved["config_sources"]
    assert src["stage.name"] == "DeepSpeed file" and src["optimizer.lr"] == "auto"
    assert src["train.steps"] == "command line" and src["seed"] == "YAML" and src["dist.timeout_s"] == "YAML"
    assert src["optimizer.decay_1d"] == "DeepSpeed default"
    notes = [n for n in saved["ds_config_notices"] if n.startswith("note:")]
    (inert,), (warm,) = [n for n in notes if "steps_per_print" in n], [n for n in notes if "warm-up" in n]
    assert len(notes) == 2 and "fp16.loss_scale_window (the run is fp32)" in inert, notes
    # "auto" warm-up: the run's own (warmup_cosine's 100 steps), longer than this 3-step run (said once)
    assert "warm-up (warmup_num_steps=100) is longer than the run (train.steps=3)" in warm, notes


def test_hf_guide_nvme_config_maps():
    t = dsconfig.translate(hf("hf_zero3_nvme"))
    assert not t.errors and not t.unknown
    assert t.choices["stage"] == "zero3" and t.choices["offload"] == "nvme"
    s = {k: v.value for k, v in t.settings.items()}
    assert s["offload.optimizer"] == "nvme" and s["offload.params"] == "nvme"
    assert s["offload.nvme_path"] == "/local_nvme" and s["offload.pin_memory"] is True
    assert s["offload.buffer_count"] == 4 and s["offload.param_buffer_count"] == 5
    assert s["offload.param_buffer_size"] == 100_000_000 and s["offload.max_in_cpu"] == 1_000_000_000
    assert s["offload.sub_group_size"] == 1_000_000_000 and isinstance(s["offload.sub_group_size"], int)
    assert s["offload.aio.block_size"] == 262144 and s["offload.aio.queue_depth"] == 32
    assert s["offload.aio.intra_op_parallelism"] == 1  # from the deprecated thread_count
    assert any("'aio.thread_count' is deprecated; use 'intra_op_parallelism'" in w for w in t.warnings)
    assert s["stage.stage3_prefetch_bucket_size"] == dsconfig.AUTO


def test_an_empty_nvme_path_is_refused():
    """(as on the command line: the swap files would go to the working directory)"""
    ds = hf("hf_zero3_nvme")
    for sec in ("offload_optimizer", "offload_param"):
        ds["zero_optimization"][sec]["nvme_path"] = ""
    assert "offload.nvme_path is empty: give a folder" in error_of(ds, TINY)


def test_hf_guide_nvme_config_trains(tmp_path):
    ds = hf("hf_zero3_nvme")
    for sec in ("offload_optimizer", "offload_param"):
        ds["zero_optimization"][sec]["nvme_path"] = str(tmp_path / "nvme")
    cfg = framework.compose(TINY, ds_config=ds)
    o = cfg.offload
    assert cfg.choices["offload"] == "nvme" and (o.optimizer, o.params) == ("nvme", "nvme")
    assert (o.aio.block_size, o.aio.queue_depth, o.param_buffer_count) == (262144, 32, 5)
    try:
        summary = launch(cfg, RunInfo(tmp_path / "run", None, None))
    except FrameworkError as e:
        if "not built yet" in str(e):
            pytest.skip(str(e))
        raise
    assert summary["steps"] == 3 and torch.isfinite(torch.tensor(summary["val_loss"]))


# --- strictness -------------------------------------------------------------------------------

TYPOS = [
    (("gradient_clippping",), 1.0, "did you mean 'gradient_clipping'"),
    (("zero_optimization", "overlap_com"), True, "did you mean 'zero_optimization.overlap_comm'"),
    (("zero_optimization", "stage3_prefetch_bucket_sise"), 10, "stage3_prefetch_bucket_size"),
    (("zero_optimization", "offload_optimizer", "pin_memroy"), True, "offload_optimizer.pin_memory"),
    (("optimizer", "params", "weight_decy"), 0.1, "optimizer.params.weight_decay"),
    (("optimizer", "parmas"), {}, "optimizer.params"),
    (("scheduler", "params", "warmup_num_step"), 5, "scheduler.params.warmup_num_steps"),
    (("fp16", "loss_scale_windows"), 100, "fp16.loss_scale_window"),
    (("bf16", "enabeld"), True, "bf16.enabled"),
    (("aio", "queue_dept"), 8, "aio.queue_depth"),
    (("train_micro_batch_size_per_gpus",), 2, "train_micro_batch_size_per_gpu"),
    # DeepSpeed's keys are case-sensitive: another case is a typo, not a key to ignore (the run would go fp32)
    (("FP16",), {"enabled": True}, "did you mean 'fp16'"),
    (("BF16",), {"enabled": True}, "did you mean 'bf16'"),
    (("Bf16",), {"enabled": True}, "did you mean 'bf16'"),
    (("zero_optimization", "Stage"), 3, "did you mean 'zero_optimization.stage'"),
    # misnames no spelling distance finds
    (("zero",), {"stage": 2}, "did you mean 'zero_optimization'"),
    (("grad_clip",), 0.5, "did you mean 'gradient_clipping'"),
    (("clip_grad",), 0.5, "did you mean 'gradient_clipping'"),
    (("micro_batch_size",), 2, "did you mean 'train_micro_batch_size_per_gpu'"),
    (("optimizer", "params", "epsilon"), 1e-6, "did you mean 'optimizer.params.eps'"),
    (("fp16", "initial_loss_scale"), 12, "did you mean 'fp16.initial_scale_power'"),
    # Megatron's key is the scale itself: the hint gives the power it means
    (("fp16", "initial_loss_scale"), 4294967296, "did you mean 'fp16.initial_scale_power'?): it takes the power of "
                                                 "2, 32 for a scale of 4.29497e+09"),
    (("optimizer", "params", "learning_rate"), 1e-4, "did you mean 'optimizer.params.lr'"),
    (("optimizer", "name"), "AdamW", "did you mean 'optimizer.type'"),
    (("clip_grad_norm",), 0.5, "did you mean 'gradient_clipping'"),
    (("aio", "queue_size"), 8, "did you mean 'aio.queue_depth'"),
    # our own batch keys (DeepSpeed ignores them: the run would keep the YAML's batch)
    (("grad_accum",), 2, "did you mean 'gradient_accumulation_steps'"),
    (("grad_accum_steps",), 2, "did you mean 'gradient_accumulation_steps'"),
    (("micro_batch",), 2, "did you mean 'train_micro_batch_size_per_gpu'"),
    (("global_batch_size",), 8, "did you mean 'train_batch_size'"),
    # a top-level key meant as a section (DeepSpeed ignores it: the run would go without the section)
    (("zero_optim",), {"stage": 3}, "did you mean 'zero_optimization'"),
    (("optim",), {"type": "AdamW"}, "did you mean 'optimizer'"),
    (("sched",), {"type": "WarmupLR"}, "did you mean 'scheduler'"),
    (("zero_stage",), 3, "did you mean 'zero_optimization.stage'"),
    (("bf16_enabled",), True, "did you mean 'bf16.enabled'"),
    (("fp16_enabled",), True, "did you mean 'fp16.enabled'"),
    (("my_zero",), {"stage": 3, "overlap_comm": True}, "did you mean 'zero_optimization'"),
    (("my_opt",), {"type": "Adam", "params": {"lr": 1e-4}}, "did you mean 'optimizer'"),
    (("my_sched",), {"type": "WarmupLR", "params": {}}, "did you mean 'scheduler'"),
]


@pytest.mark.parametrize("path,value,needle", TYPOS, ids=[".".join(p) for p, _, _ in TYPOS])
def test_typo_at_every_level_names_the_key(path, value, needle):
    ds = hf("hf_zero3_nvme")  # has every section the typos go into
    ds["bf16"] = {"enabled": False}
    node = ds
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    msg = error_of(ds)
    assert "did you mean" in msg and needle in msg and path[-1] in msg, msg
    assert "\n" not in msg, msg  # one line


def test_unknown_key_far_from_any_is_one_warning_or_an_error_when_strict():
    # (top level and aio: DeepSpeed ignores such keys there; where it rejects them, so does this)
    # (an object whose keys are those of several sections names none of them: "enabled" is fp16's and bf16's)
    # (a key merely like a short section's name is not taken for it: compute is not compile, scaler not scheduler)
    ds = {"aio": {"my_private_knob": 3}, "totally_custom": {"x": 1}, "my_feature": {"enabled": True}, "compute": 1,
          "api": 2, "scaler": 3, "optimal": 4, "quantization_config": {}}
    cfg = framework.compose([], ds_config=ds)
    warnings = [n for n in cfg.notices if "does not know" in n]
    assert len(warnings) == 1 and all(k in warnings[0] for k in ("totally_custom", "aio.my_private_knob", "my_feature",
                                                                 "compute", "scaler", "quantization_config"))
    msg = error_of(ds, ["ds_config_strict=true"])
    assert "totally_custom" in msg and "my_private_knob" in msg


def test_a_file_without_a_scheduler_keeps_the_runs_schedule_under_its_lr():
    """No scheduler section: the run's scheduler (docs/deepspeed.md: what DeepSpeed leaves to its caller
    follows our config), whose default floor follows the file's lr, here below the old fixed 1e-4."""
    from framework.schedulers import warmup_cosine

    ds = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 2e-5}},
          "zero_optimization": {"stage": 2}}
    cfg = framework.compose(["train.steps=2"], ds_config=ds)
    assert cfg.choices["scheduler"] == "warmup_cosine" and cfg.optimizer.lr == 2e-5
    assert warmup_cosine.build(cfg.scheduler, cfg.optimizer.lr, 2)(200) == pytest.approx(2e-6)  # after the warm-up
    assert framework.compose(["scheduler=constant"], ds_config=ds).choices["scheduler"] == "constant"


MISPLACED = [
    ({"offload_optimizer": {"device": "cpu"}, "zero_optimization": {"stage": 2}},
     "'offload_optimizer' belongs under zero_optimization; move it there"),
    ({"optimizer": {"type": "AdamW", "lr": 3e-5}}, "'optimizer.lr' belongs under optimizer.params"),
    ({"scheduler": {"type": "WarmupLR", "warmup_num_steps": 5}},
     "'scheduler.warmup_num_steps' belongs under scheduler.params"),
    ({"stage": 2}, "'stage' belongs under zero_optimization"),
    ({"overlap_comm": True}, "'overlap_comm' belongs under zero_optimization"),
    ({"reduce_bucket_size": 5}, "'reduce_bucket_size' belongs under zero_optimization"),
    ({"sub_group_size": 5}, "'sub_group_size' belongs under zero_optimization"),
    ({"loss_scale": 0}, "'loss_scale' belongs under fp16"),
    ({"lr": 1e-3}, "'lr' belongs under optimizer.params"),
    ({"weight_decay": 0.1}, "'weight_decay' belongs under optimizer.params"),
    ({"nvme_path": "/x"}, "'nvme_path' belongs under zero_optimization.offload_optimizer or under "
                          "zero_optimization.offload_param"),
    ({"zero_optimization": {"stage": 2, "gradient_clipping": 1.0}},
     "'zero_optimization.gradient_clipping' belongs at the top level"),
    ({"zero_optimization": {"stage": 2, "device": "cpu"}}, "'zero_optimization.device' belongs under"),
    ({"optimizer": {"type": "AdamW", "params": {"warmup_num_steps": 5}}},
     "'optimizer.params.warmup_num_steps' belongs under scheduler.params"),
    # refused under optimizer.params too: the one fix is said wherever it stands
    *((ds, f"'{where}max_grad_norm': no DeepSpeed section takes it; use the top-level gradient_clipping")
      for ds, where in (({"max_grad_norm": 1.0}, ""), ({"optimizer": {"type": "AdamW", "max_grad_norm": 1}}, "optimizer."),
                        ({"zero_optimization": {"stage": 2, "max_grad_norm": 1}}, "zero_optimization."),
                        ({"fp16": {"max_grad_norm": 1}}, "fp16."),
                        ({"scheduler": {"type": "WarmupLR", "max_grad_norm": 1}}, "scheduler."))),
    # DeepSpeed reads only type and params there, and ignores the rest: refused, as a key must do something
    ({"optimizer": {"type": "AdamW", "my_knob": 1}}, "optimizer: unknown key my_knob (DeepSpeed ignores it here); "
                                                     "remove it"),
    ({"scheduler": {"type": "WarmupLR", "params": {}, "comment": "x"}}, "scheduler: unknown key comment (DeepSpeed "
                                                                        "ignores it here); remove it"),
    ({"optimizer": {}}, "optimizer.type is missing; give one of Adam, AdamW"),
    # fp16's loss-scaler keys under bf16 are to be removed, not moved: bf16 has no loss scale
    ({"bf16": {"enabled": True, "loss_scale": 0}}, "bf16: unknown key loss_scale (DeepSpeed rejects unknown keys "
                                                   "in bf16); remove it"),
]


@pytest.mark.parametrize("ds,needle", MISPLACED, ids=[json.dumps(d) for d, _ in MISPLACED])
def test_a_key_of_another_section_is_an_error_naming_where_it_belongs(ds, needle):
    # DeepSpeed ignores it there (or refuses it): the run would silently go without it
    msg = error_of(ds)
    assert msg == f"ds_config: {msg.removeprefix('ds_config: ')}" and needle in msg and "\n" not in msg, msg


@pytest.mark.parametrize("z,needle,agreeing", [
    ({"cpu_offload": True, "offload_optimizer": {"device": "none"}}, "cpu_offload and zero_optimization."
     "offload_optimizer.device are the same key with different values (true: device cpu, and \"none\")",
     {"device": "cpu"}),
    ({"cpu_offload": True, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}}, "(true: device cpu, and "
     "\"nvme\")", {"device": "cpu"}),
    ({"cpu_offload": False, "offload_optimizer": {"device": "cpu"}}, "(false: device none, and \"cpu\")",
     {"device": "none"}),
    ({"offload_optimizer": {"device": "nvme", "nvme_path": "/tmp", "pipeline": False, "pipeline_read": True}},
     "offload_optimizer.pipeline and zero_optimization.offload_optimizer.pipeline_read are the same key with "
     "different values (false and true)", {"device": "nvme", "nvme_path": "/tmp", "pipeline": True,
                                           "pipeline_read": True}),
    ({"offload_optimizer": {"device": "nvme", "nvme_path": "/tmp", "pipeline": True, "pipeline_write": False}},
     "pipeline_write are the same key with different values (true and false)",
     {"device": "nvme", "nvme_path": "/tmp", "pipeline": False, "pipeline_write": False}),
])
def test_a_deprecated_key_beside_its_new_key_with_another_value_is_an_error(z, needle, agreeing):
    msg = error_of({"zero_optimization": {"stage": 2, **z}})
    assert needle in msg and "\n" not in msg, msg
    framework.compose([], ds_config={"zero_optimization": {"stage": 2, **z, "offload_optimizer": agreeing}})


@pytest.mark.parametrize("ds,new", [
    ({"bfloat16": {"enabled": True}}, "'bf16'"),
    *(({"zero_optimization": {"stage": 2, "cpu_offload": on}}, "'offload_optimizer'") for on in (True, False)),
    # DeepSpeed no longer applies it (only warns): the section's pin_memory, or DeepSpeed's default false
    *(({"zero_optimization": {"stage": 2, "cpu_offload_use_pin_memory": True, "offload_optimizer": sec}},
       "ignored, as by DeepSpeed; use 'offload_optimizer.pin_memory'")
      for sec in ({"device": "cpu", "pin_memory": False}, {"device": "cpu"}, {"device": "none", "pin_memory": False})),
    ({"zero_optimization": {"stage": 3, "stage3_gather_fp16_weights_on_model_save": True}},
     "'stage3_gather_16bit_weights_on_model_save'"),
])
def test_deprecated_alias_accepted_with_a_warning(ds, new):
    cfg = framework.compose([], ds_config=ds)
    assert any("deprecated" in n and new in n for n in cfg.notices), cfg.notices
    if "bfloat16" in ds:
        assert cfg.choices["precision"] == "bf16"
    elif "cpu_offload_use_pin_memory" in ds["zero_optimization"]:
        offload = ds["zero_optimization"]["offload_optimizer"]["device"]
        assert cfg.choices["offload"] == offload and (offload == "none" or cfg.offload.pin_memory is False)
    elif ds["zero_optimization"]["stage"] == 2:   # as offload_optimizer.device cpu / none: the command line agrees
        device, other = ("cpu", "none") if ds["zero_optimization"]["cpu_offload"] else ("none", "cpu")
        assert cfg.choices["offload"] == device
        assert f"in the file means offload={device}" in error_of(ds, [f"offload={other}"])
    else:
        assert cfg.stage.stage3_gather_16bit_weights_on_model_save is True


@pytest.mark.parametrize("ds,needle", [
    ({"optimizer": {"type": "Lamb", "params": {"lr": 1e-3}}}, "LAMB is not implemented"),
    ({"optimizer": {"type": "OneBitAdam"}}, "1-bit Adam is not implemented"),
    ({"sparse_attention": {"mode": "fixed"}}, "sparse attention is not implemented"),
    ({"compression_training": {"weight_quantization": {}}}, "compression training is not implemented"),
    ({"pipeline": {"stages": 2}}, "pipeline parallelism is not implemented"),
    ({"tensor_parallel": {"autotp_size": 2}}, "tensor parallelism"),
    ({"moe": {"enabled": True}}, "mixture of experts is not implemented"),
    ({"scheduler": {"type": "OneCycle", "params": {}}}, "OneCycle is not implemented"),
    ({"zero_optimization": {"stage": 3, "zero_quantized_weights": True}}, "ZeRO++"),
    ({"optimizer": {"type": "AdamW", "params": {"max_grad_norm": 1.0}}}, "gradient_clipping"),
    ({"optimizer": {"type": "AdamWW"}}, "did you mean 'adamw'"),
    ({"zero_optimization": {"stage": 3, "leaf_module": {"classes": ["Block"]}}}, "use stage.gather_unit"),
    # DeepSpeed's other checkpoint engine, as nebula; DeepSpeed runs it whenever the key is there
    *(({"datastates_ckpt": v}, "'datastates_ckpt': DataStates-LLM asynchronous checkpointing is not implemented")
      for v in ({"host_cache_size": 16}, {}, {"enabled": False})),
])
def test_unimplemented_feature_is_an_error_saying_so(ds, needle):
    assert needle in error_of(ds)


def test_inert_keys_listed_once_and_switched_off_features_accepted():
    ds = {"steps_per_print": 10, "wall_clock_breakdown": True, "prescale_gradients": False, "_comment": "x",
          "sparse_attention": {"enabled": False}, "datastates_ckpt": False, "zero_optimization": {"stage": 0}}
    notes = [n for n in framework.compose([], ds_config=ds).notices if n.startswith("note:")]
    assert len(notes) == 1
    for key in ("steps_per_print", "wall_clock_breakdown", "prescale_gradients", "_comment", "sparse_attention",
                "datastates_ckpt"):
        assert key in notes[0]


@pytest.mark.parametrize("leaf", [{}, {"enabled": False}])
def test_switched_off_leaf_module_is_inert(leaf):
    ds = {"zero_optimization": {"stage": 3, "leaf_module": leaf}}
    (note,) = [n for n in framework.compose([], ds_config=ds).notices if n.startswith("note:")]
    assert "zero_optimization.leaf_module" in note


def test_broken_json_names_line_and_column(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{\n  "train_batch_size": 8,\n  "fp16": {"enabled": true,}\n}\n')
    msg = error_of(path)
    assert "line 3 column" in msg and str(path) in msg and "\n" not in msg
    path.write_text('{"train_batch_size": 8, "train_batch_size": 16}')
    assert "appears twice" in error_of(path)
    assert "no such file" in error_of(tmp_path / "missing.json")
    assert error_of("") == "ds_config: an empty path; give a DeepSpeed JSON file (or null for none)"
    for text, got in (("null", "null"), ("[1]", "an array")):
        path.write_text(text)
        assert error_of(path) == f"ds_config: {path}: the top level must be a JSON object, got {got}"
    path.write_text(" \n")
    assert error_of(path) == f"ds_config: {path} is empty; give a JSON object ({{}} for DeepSpeed's defaults)"
    path.write_bytes(b'\xef\xbb\xbf{"gradient_clipping": 0.5}')   # a byte-order mark, as some editors write
    assert framework.compose([], ds_config=path).train.grad_clip == 0.5
    assert error_of(tmp_path) == f"ds_config: {tmp_path} is a directory; give a DeepSpeed JSON file"
    if Path("/dev/null").exists():
        assert error_of("/dev/null") == "ds_config: /dev/null is not a regular file; give a DeepSpeed JSON file"
    # base64 of broken JSON: the JSON's error, not "no such file"
    import base64
    encoded = base64.urlsafe_b64encode(b'{"gradient_clipping": 1.0,}').decode()
    assert error_of(encoded).startswith("ds_config: the base64-encoded config: line 1 column 27: Expecting property")


def test_a_file_is_read_as_utf8_whatever_the_locale(tmp_path):
    import os
    import subprocess
    import sys

    (tmp_path / "ds.json").write_text('{"_comment": "caf\u00e9", "gradient_clipping": 0.5}', encoding="utf-8")
    (tmp_path / "c.yaml").write_text("note: caf\u00e9\n", encoding="utf-8")
    code = ("import sys; from pathlib import Path; from framework.config import dsconfig, plainconf; "
            "print(dsconfig.load(sys.argv[1])['gradient_clipping'], plainconf.load_yaml(Path(sys.argv[2]))['note'] "
            "== 'caf\\u00e9')")
    env = {**os.environ, "LC_ALL": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0"}
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "ds.json"), str(tmp_path / "c.yaml")],
                         env=env, capture_output=True, text=True, check=False)
    assert out.stdout.split() == ["0.5", "True"], out.stderr[-2000:]


def test_every_problem_in_one_block():
    msg = error_of({"optimizer": {"type": "Lamb"}, "zero_optimization": {"stage": 2, "overlap_com": True},
                    "fp16": {"enabled": "yes"}})
    assert msg.count("\n  - ") == 3 and "LAMB" in msg and "overlap_comm" in msg and "fp16.enabled" in msg


# --- optimizer semantics ----------------------------------------------------------------------

def _train(ds=None, overrides=(), steps=4) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 4))
    gen = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, 8, generator=gen), torch.randn(4, 4, generator=gen)) for _ in range(steps)]

    def loss_fn(module, micro):
        x, y = micro
        return nn.functional.mse_loss(module(x), y)

    base = ["train.steps=4", "train.micro_batch=4", "scheduler=constant", *overrides]
    kw = {"ds_config": ds} if ds is not None else {}
    with framework.initialize(model, loss_fn, overrides=base, **kw) as engine:
        state = engine.state
        for micro in data:
            state, _ = engine.train_step(state, framework.Batch((micro,)))
    return [p.detach().clone() for p in model.parameters()]


def test_deepspeed_adam_with_weight_decay_trains_bitwise_like_adamw():
    ds = {"optimizer": {"type": "Adam", "params": {"lr": 1e-2, "weight_decay": 0.1}}}
    ours = _train(overrides=["optimizer=adamw", "optimizer.lr=1e-2", "optimizer.weight_decay=0.1",
                             "optimizer.beta2=0.999", "optimizer.decay_1d=true", "train.grad_clip=1.0"])
    theirs = _train(ds)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    # adam_w_mode false: L2 decay (our adam), which is a different update.
    ds["optimizer"]["params"]["adam_w_mode"] = False
    l2 = _train(ds)
    l2_ours = _train(overrides=["optimizer=adam", "optimizer.lr=1e-2", "optimizer.weight_decay=0.1",
                                "optimizer.decay_1d=true", "train.grad_clip=1.0"])
    assert all(torch.equal(a, b) for a, b in zip(l2, l2_ours))
    assert not all(torch.equal(a, b) for a, b in zip(l2, theirs))


def test_optimizer_type_case_insensitive_and_deepspeed_defaults():
    cfg = framework.compose([], ds_config={"optimizer": {"type": "aDaMw"}})
    o = cfg.optimizer
    assert cfg.choices["optimizer"] == "adamw"
    assert (o.lr, o.beta1, o.beta2, o.eps, o.weight_decay) == (1e-3, 0.9, 0.999, 1e-8, 0.0)
    assert cfg.train.grad_clip == 1.0 and cfg.sources["train.grad_clip"] == "DeepSpeed default"  # DeepSpeed's default
    # DeepSpeed's one parameter group (decay_1d) decays nothing without weight decay: the run's own false stays,
    # the command line's weight_decay=0 included; decay_1d=true stated there is refused (it would do nothing)
    assert o.decay_1d is False and cfg.sources["optimizer.decay_1d"] == "YAML" and not cfg.notices
    decayed = {"optimizer": {"type": "AdamW", "params": {"weight_decay": 0.1}}}
    assert framework.compose([], ds_config=decayed).optimizer.decay_1d is True
    assert framework.compose(["optimizer.weight_decay=0"], ds_config=decayed).optimizer.decay_1d is False
    with pytest.raises(framework.ConfigError, match=r"^optimizer.decay_1d=true has no effect with "
                       r"optimizer.weight_decay=0 for adamw"):
        framework.compose(["optimizer.decay_1d=true"], ds_config={"optimizer": {"type": "AdamW"}})


@pytest.mark.parametrize("optimizer,name", [
    ({"type": "Lion", "params": {"lr": 1e-4, "weight_decay": 0.01}}, "lion"),
    ({"type": "Adam", "params": {"weight_decay": 0.01, "adam_w_mode": False}}, "adam"),
    ({"type": "AdamW", "params": {"weight_decay": 0.01}}, "adamw"),
    ({"type": "SGD", "params": {"lr": 1e-2, "weight_decay": 0.01}}, "sgd")])
def test_the_command_lines_decay_1d_is_judged_with_the_files_weight_decay(optimizer, name):
    """Whether decay_1d does anything is decided on the run's final config: the file's weight_decay (our YAML's
    adam, lion and sgd have none) laid on the run's."""
    cfg = framework.compose(["optimizer.decay_1d=true"], ds_config={"optimizer": optimizer})
    assert (cfg.choices["optimizer"], cfg.optimizer.weight_decay, cfg.optimizer.decay_1d) == (name, 0.01, True)
    with pytest.raises(framework.ConfigError, match=rf"^optimizer.decay_1d=true has no effect with "
                       rf"optimizer.weight_decay=0 for {name} "):
        framework.compose(["optimizer.decay_1d=true", "optimizer.weight_decay=0"], ds_config={"optimizer": optimizer})


# --- auto, batch triple, precedence -----------------------------------------------------------

@pytest.mark.parametrize("triple,world,expect", [
    ((32, 4, None), 2, (4, 4)),          # train and micro: accumulation = 32 / (4 x 2)
    ((32, None, 2), 2, (8, 2)),          # train and accumulation: micro = 32 / (2 x 2)
    ((16, None, None), 4, (4, 1)),       # only train: accumulation 1
    ((None, 3, None), 2, (3, 1)),        # only micro: accumulation 1
    ((None, 2, 5), 3, (2, 5)),
    ((24, 3, 4), 2, (3, 4)),
])
def test_batch_triple_any_two_give_the_third(triple, world, expect):
    keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    ds = {k: v for k, v in zip(keys, triple) if v is not None}
    cfg = framework.compose([], ds_config=ds, world=world)
    assert (cfg.train.micro_batch, cfg.train.grad_accum) == expect


def test_batch_triple_mismatch_names_all_numbers_and_world():
    msg = error_of({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4,
                    "gradient_accumulation_steps": 2}, world=4)
    for needle in ("train_batch_size=30", "train_micro_batch_size_per_gpu=4", "gradient_accumulation_steps=2",
                   "world size 4", "= 32"):
        assert needle in msg, msg
    assert "not divisible" in error_of({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4}, world=2)
    # A command-line micro batch against a whole triple in the file: the same check.
    msg = error_of({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4},
                   ["train.micro_batch=8"], world=1)
    # (the 8 named as the command line's: the file says 4)
    assert "but train.micro_batch=8 (command line) x gradient_accumulation_steps=4 x world size 1 = 32" in msg, msg
    assert "not divisible by train.micro_batch=5" in error_of({"train_batch_size": 16}, ["train.micro_batch=5"])


def test_a_world_given_as_a_function_is_asked_only_for_a_deepspeed_file():
    """The command line passes a sweep launcher's world as a function (composing its config costs a Hydra
    composition): asked where a DeepSpeed file's batch is divided over it, never for a run without one."""
    from framework.config import compose_layers

    asked = []

    def world():
        asked.append(1)
        return 4

    assert compose_layers(["train.micro_batch=2"], world=world)[1].train.micro_batch == 2 and not asked
    cfg = compose_layers([], ds_config={"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, world=world)[1]
    assert (cfg.train.micro_batch, cfg.train.grad_accum, asked) == (4, 2, [1])   # 32 / (4 x 4 ranks)


@pytest.mark.parametrize("ds,overrides,expect", [
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 8}, ["train.micro_batch=4"], (4, 8)),
    ({"train_batch_size": 32, "gradient_accumulation_steps": 2}, ["train.grad_accum=8"], (4, 8)),
    ({"train_batch_size": 32}, ["train.micro_batch=4"], (4, 8)),
    ({"train_batch_size": 32}, ["train.grad_accum=4"], (8, 4)),
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 8}, ["train.micro_batch=4", "train.grad_accum=8"],
     (4, 8)),
])
def test_batch_triple_derived_from_the_command_line_values(ds, overrides, expect):
    """The command line overrides the file before the missing member of the triple is derived
    (DeepSpeed's rule on the final values): train_batch_size stays what the file says."""
    cfg = framework.compose(overrides, ds_config=ds, world=1)
    assert (cfg.train.micro_batch, cfg.train.grad_accum) == expect


def test_auto_batch_fills_from_the_run():
    ds = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto"}
    cfg = framework.compose(["train.micro_batch=3", "train.grad_accum=2"], ds_config=ds, world=2)
    assert (cfg.train.micro_batch, cfg.train.grad_accum) == (3, 2)
    assert cfg.sources["train.micro_batch"] == "command line" and cfg.sources["train.grad_accum"] == "command line"


def test_precedence_defaults_file_command_line():
    ds = {"optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.05}},
          "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "gradient_clipping": 0.5}
    cfg = framework.compose(["optimizer.lr=1e-3", "train.steps=7"], ds_config=ds)
    assert cfg.optimizer.lr == 1e-3 and cfg.sources["optimizer.lr"] == "command line"
    assert cfg.optimizer.weight_decay == 0.05 and cfg.sources["optimizer.weight_decay"] == "DeepSpeed file"
    assert cfg.optimizer.eps == 1e-8 and cfg.sources["optimizer.eps"] == "DeepSpeed default"
    assert cfg.train.micro_batch == 4 and cfg.sources["train.micro_batch"] == "DeepSpeed file"
    assert cfg.train.grad_clip == 0.5 and cfg.train.steps == 7
    assert cfg.sources["train.eval_every"] == "YAML" and cfg.sources["stage.name"] == "default"
    assert cfg.sources["dist.backend"] == "YAML" and cfg.sources["model.name"] == "YAML"
    assert cfg.sources["optimizer.decay_1d"] == "DeepSpeed default"


def test_a_key_deleted_on_the_command_line_has_our_default_and_says_so():
    """``~KEY`` takes the key from every layer, the file's included: our default, labelled so (not the
    file's label on our value)."""
    ds = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.05}}, "gradient_clipping": 0.5}
    cfg = framework.compose(["~optimizer.beta2", "~optimizer.weight_decay", "~train.grad_clip"], ds_config=ds)
    o = cfg.optimizer
    assert (o.beta2, o.weight_decay, cfg.train.grad_clip) == (0.99, 0.1, 1.0)
    for key in ("optimizer.beta2", "optimizer.weight_decay", "train.grad_clip"):
        assert cfg.sources[key] == dsconfig.DEFAULT, key
    assert (cfg.optimizer.lr, cfg.sources["optimizer.lr"]) == (1e-4, dsconfig.DS_FILE)


def test_mismatches_listed_together():
    ds = {"optimizer": {"type": "AdamW", "params": {"lr": 3e-4}},
          "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_max_lr": 1e-3, "total_num_steps": 100}},
          "fp16": {"enabled": True}, "train_batch_size": 64, "train_micro_batch_size_per_gpu": 4,
          "gradient_accumulation_steps": 4}
    msg = error_of(ds, ["precision=bf16", "train.steps=10"], world=2)
    assert "does not match" in msg and msg.count("\n  - ") == 4, msg
    for needle in ("warmup_max_lr=0.001", "precision=bf16", "train_batch_size=64",
                   "total_num_steps=100 but train.steps=10"):   # Hugging Face's fill_match: must match
        assert needle in msg, msg


def test_what_hugging_face_runs_as_written_runs_here_with_a_note():
    """DeepSpeed's activation-checkpointing section (for models that call deepspeed.checkpointing),
    and an "auto" 16-bit save flag run, each with one note (fp16.auto_cast casts float inputs); real mistakes (a batch
    triple that does not add up, a typo, a schedule of another length than the run) stay errors."""
    ds = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "fp16": {"enabled": True, "auto_cast": True},
          "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_max_lr": 1e-4, "total_num_steps": "auto"}},
          "activation_checkpointing": {"partition_activations": True, "cpu_checkpointing": True},
          "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": "auto"}}
    cfg = framework.compose(["train.steps=3"], ds_config=ds)
    assert cfg.scheduler.total_num_steps == 3 and cfg.train.steps == 3
    assert cfg.stage.stage3_gather_16bit_weights_on_model_save is False
    assert cfg.sources["stage.stage3_gather_16bit_weights_on_model_save"] == "auto"
    notes = "\n".join(cfg.notices)
    assert cfg.precision.auto_cast is True   # fp16.auto_cast: floating inputs cast to fp16
    for key in ("activation_checkpointing.partition_activations",
                "activation_checkpointing.cpu_checkpointing"):
        assert key in notes, notes
    assert all("\n" not in n for n in cfg.notices)
    assert "did you mean" in error_of({"zero_optimization": {"stage": 3, "stage3_param_persitence_threshold": 1}})
    assert "train_batch_size=3 is not divisible" in error_of({"train_batch_size": 3}, world=2)
    ds["scheduler"]["params"]["total_num_steps"] = 100000
    assert "total_num_steps=100000 but train.steps=3" in error_of(ds, ["train.steps=3"])


def test_auto_scheduler_and_phase_two_fill():
    ds = {"optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
          "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                            "warmup_num_steps": "auto", "total_num_steps": "auto"}},
          "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"}}
    cfg = framework.compose(["optimizer.lr=2e-3", "train.steps=40", "model.d_model=48", "model.n_head=2",
                             "scheduler.warmup_num_steps=5"], ds_config=ds)
    s = cfg.scheduler
    assert (s.warmup_min_lr, s.warmup_max_lr, s.warmup_num_steps, s.total_num_steps) == (0.0, 2e-3, 5, 40)
    assert cfg.stage.reduce_bucket_size == 48 * 48 and cfg.sources["stage.reduce_bucket_size"] == "auto"


def test_auto_left_over_is_an_error():
    assert "\"auto\"" in error_of({"zero_optimization": {"stage": 2, "overlap_comm": "auto"}})
    # A model without a known hidden size cannot fill the bucket sizes.
    with pytest.raises(ConfigError, match="left over.*reduce_bucket_size"):
        framework.initialize(nn.Linear(4, 4), lambda m, b: m(b).sum(),
                             ds_config={"zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"}})


@pytest.mark.parametrize("make,hidden", [
    (lambda t: t.LlavaConfig(text_config={"model_type": "llama", "hidden_size": 64}), 64),   # text_config's
    (lambda t: t.ConvNextConfig(), 768),   # the largest of hidden_sizes
    (lambda t: t.GPT2Config(n_embd=48), 48),
], ids=["llava", "convnext", "gpt2"])
def test_auto_bucket_size_reads_the_hidden_size_as_transformers_does(make, hidden):
    module = nn.Linear(4, 4)
    module.config = make(pytest.importorskip("transformers"))
    ds = {"zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"}, "train_micro_batch_size_per_gpu": 1}
    with framework.initialize(module, lambda m, b: m(b).sum(), ds_config=ds) as engine:
        assert engine.config.stage.reduce_bucket_size == hidden * hidden


def test_offload_sections_and_mismatched_pin_memory():
    ds = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": False},
                                "offload_param": {"device": "cpu", "pin_memory": False}}}
    cfg = framework.compose([], ds_config=ds)
    assert cfg.choices["offload"] == "cpu" and cfg.offload.params == "cpu" and cfg.offload.pin_memory is False
    bad = copy.deepcopy(ds)
    bad["zero_optimization"]["offload_param"]["pin_memory"] = True
    assert "differ" in error_of(bad)
    # the optimizer section's ratio: taken at stage 3; below it a note (DeepSpeed reads it under stage 3 only);
    # with parameters in host memory, refused
    partial = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}}
    assert framework.compose([], ds_config=partial).offload.ratio == 0.5
    partial["zero_optimization"]["stage"] = 2
    cfg = framework.compose([], ds_config=partial)
    assert cfg.offload.ratio == 1.0 and any("offload_optimizer.ratio" in n and "stage 3" in n for n in cfg.notices), \
        cfg.notices
    # out of range: refused at every stage, as DeepSpeed's config model does (not a note below stage 3)
    for stage, ratio in [(1, 1.5), (2, -0.1), (3, 2)]:
        out = copy.deepcopy(partial)
        out["zero_optimization"].update(stage=stage, offload_optimizer={"device": "cpu", "ratio": ratio})
        assert f"zero_optimization.offload_optimizer.ratio must be in [0, 1] (the fraction of the optimizer step " \
               f"offloaded), got {ratio}" in error_of(out)
    # no pin_memory in the sections: DeepSpeed's default (false), not our YAML's (true)
    assert cfg.offload.pin_memory is False and cfg.sources["offload.pin_memory"] == "DeepSpeed default"
    assert framework.compose(["offload.pin_memory=true"], ds_config=partial).offload.pin_memory is True
    assert framework.compose(["offload=cpu"], ds_config={"zero_optimization": {"stage": 2}}).offload.pin_memory \
        is True   # (no offload section: the run's own offload, as it is)
    # no offload_param section: its device is DeepSpeed's default, which the command line overrides unremarked
    assert framework.compose([], ds_config=partial).sources["offload.params"] == "DeepSpeed default"
    partial["zero_optimization"].update(stage=3, offload_optimizer={"device": "cpu"})
    cfg = framework.compose(["offload.params=cpu"], ds_config=partial)
    assert cfg.offload.params == "cpu" and not any("offload_param" in n for n in cfg.notices), cfg.notices
    bad = copy.deepcopy(ds)
    bad["zero_optimization"]["offload_optimizer"]["ratio"] = 0.5
    assert "offload.ratio<1 keeps part of each partition's step on the device" in error_of(bad)
    # ratio 0 in the file: every step on the device as DeepSpeed runs it, so offload=none with a note (given
    # directly, offload=cpu offload.ratio=0 is refused); with parameters in host memory refused as any ratio < 1
    nothing = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0}}}
    cfg = framework.compose([], ds_config=nothing)
    assert cfg.choices["offload"] == "none" and cfg.sources["offload.name"] == dsconfig.DS_FILE
    assert any("zero_optimization.offload_optimizer (ratio 0" in n for n in cfg.notices), cfg.notices
    assert "offload_optimizer.ratio=0 in the file means offload=none" in error_of(nothing, ["offload=cpu"])
    assert "puts nothing in host memory" in error_of({"zero_optimization": {"stage": 3}}, ["offload=cpu", "offload.ratio=0"])
    bad["zero_optimization"]["offload_optimizer"]["ratio"] = 0
    assert "offload.ratio<1 keeps part of each partition's step on the device" in error_of(bad)


def test_nvme_buffer_keys_of_a_section_on_the_cpu_are_notes():
    """A section on the cpu beside one on nvme: its NVMe buffer keys do nothing (a note), the run loads."""
    ds = {"zero_optimization": {"stage": 3, "sub_group_size": 2000,
                                "offload_optimizer": {"device": "cpu", "buffer_count": 2, "pipeline_write": True},
                                "offload_param": {"device": "nvme", "nvme_path": "/tmp/x", "buffer_count": 3}}}
    cfg = framework.compose([], ds_config=ds)
    assert (cfg.offload.optimizer, cfg.offload.params, cfg.offload.param_buffer_count) == ("cpu", "nvme", 3)
    notes = " ".join(cfg.notices)
    for key in ("offload_optimizer.buffer_count", "offload_optimizer.pipeline_write", "zero_optimization.sub_group_size"):
        assert key in notes, notes
    ds["zero_optimization"].update(offload_optimizer={"device": "nvme", "nvme_path": "/tmp/x"},
                                   offload_param={"device": "cpu", "buffer_size": 10, "max_in_cpu": 5})
    cfg = framework.compose([], ds_config=ds)
    assert (cfg.offload.optimizer, cfg.offload.params, cfg.offload.sub_group_size) == ("nvme", "cpu", 2000)
    assert "offload_param.buffer_size" in " ".join(cfg.notices) and "offload_param.max_in_cpu" in " ".join(cfg.notices)
    # the deprecated pipeline sets both flags on nvme; on the cpu it is one note
    ds["zero_optimization"]["offload_optimizer"]["pipeline"] = True
    cfg = framework.compose([], ds_config=ds)
    assert cfg.offload.pipeline_read is True and cfg.offload.pipeline_write is True
    ds["zero_optimization"].update(offload_optimizer={"device": "cpu", "pipeline": True}, offload_param={})
    (note,) = [n for n in framework.compose([], ds_config=ds).notices if n.startswith("note:")]
    assert note.count("offload_optimizer.pipeline ") == 1, note


def test_a_tile_below_one_page_is_refused_naming_the_deepspeed_key():
    """Each NVMe optimizer tile is padded to 4 KiB pages: the refusal names the key the file wrote."""
    ds = {"zero_optimization": {"stage": 2, "sub_group_size": 1,
                                "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp/x"}}}
    assert error_of(ds) == ("ds_config: zero_optimization.sub_group_size=1 is smaller than one 4096-byte O_DIRECT "
                            "page of fp32 elements, to which every NVMe optimizer tile is padded; set it to at "
                            "least 1024")
    ds["zero_optimization"]["sub_group_size"] = 1024
    assert framework.compose([], ds_config=ds).offload.sub_group_size == 1024


def test_stage3_keys_with_and_without_prefix():
    a = framework.compose([], ds_config={"zero_optimization": {"stage": 3, "max_live_parameters": 1234,
                                                               "prefetch_bucket_size": 99}})
    b = framework.compose([], ds_config={"zero_optimization": {"stage": 3, "stage3_max_live_parameters": 1234,
                                                               "stage3_prefetch_bucket_size": 99}})
    assert a.stage == b.stage and a.stage.stage3_max_live_parameters == 1234
    assert "same key" in error_of({"zero_optimization": {"stage": 3, "max_live_parameters": 1,
                                                         "stage3_max_live_parameters": 2}})


def test_fp16_block_maps_to_our_loss_scaler():
    cfg = framework.compose([], ds_config={"fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 12,
                                                    "loss_scale_window": 50, "hysteresis": 3, "min_loss_scale": 2}})
    p = cfg.precision
    assert cfg.choices["precision"] == "fp16"
    got = (p.loss_scale, p.initial_scale_power, p.loss_scale_window, p.hysteresis, p.min_loss_scale)
    assert got == (0, 12, 50, 3, 2)


def test_a_static_loss_scale_leaves_the_dynamic_keys_inert():
    """With a static loss_scale the dynamic scaler's keys change nothing: those that differ from
    DeepSpeed's defaults are listed in the note and not set (precision=fp16 refuses them given
    directly); the defaults compared with are ScalerConfig's."""
    import dataclasses

    from framework.config.dsconfig._keys import SCALER_DEFAULTS
    from framework.precision.policies import ScalerConfig
    cfg = framework.compose([], ds_config={"fp16": {"enabled": True, "loss_scale": 128, "hysteresis": 5,
                                                    "loss_scale_window": 1000}})
    assert (cfg.precision.loss_scale, cfg.precision.hysteresis) == (128, 2)
    (note,) = [n for n in cfg.notices if n.startswith("note:")]
    assert "fp16.hysteresis (loss_scale 128 is static)" in note and "loss_scale_window" not in note
    assert SCALER_DEFAULTS == {f.name: f.default for f in dataclasses.fields(ScalerConfig) if f.name != "loss_scale"}
    # the final scale decides: the command line's dynamic scale takes the file's dynamic keys, a static one
    # leaves them inert
    ds = {"fp16": {"enabled": True, "loss_scale": 128, "initial_scale_power": 8, "loss_scale_window": 50,
                   "hysteresis": 4}}
    for dynamic in ("precision.loss_scale=0", "~precision.loss_scale"):   # deleted: the run's own (dynamic) scale
        cfg = framework.compose([dynamic], ds_config=ds)
        p = cfg.precision
        assert (p.loss_scale, p.initial_scale_power, p.loss_scale_window, p.hysteresis) == (0, 8, 50, 4), dynamic
        assert not any("static" in n for n in cfg.notices), (dynamic, cfg.notices)
    ds["fp16"]["loss_scale"] = 0
    cfg = framework.compose(["precision.loss_scale=64"], ds_config=ds)
    assert (cfg.precision.loss_scale, cfg.precision.hysteresis) == (64, 2)
    assert any("fp16.hysteresis (loss_scale 64 is static)" in n for n in cfg.notices), cfg.notices
    # consecutive_hysteresis under a final hysteresis of 1 forgives no overflow: inert from the file (the command
    # line's hysteresis decides), refused given directly
    ds = {"fp16": {"enabled": True, "hysteresis": 1, "consecutive_hysteresis": True}}
    cfg = framework.compose([], ds_config=ds)
    assert (cfg.precision.hysteresis, cfg.precision.consecutive_hysteresis) == (1, False)
    assert any("fp16.consecutive_hysteresis (hysteresis 1" in n for n in cfg.notices), cfg.notices
    cfg = framework.compose(["precision.hysteresis=3"], ds_config=ds)
    assert (cfg.precision.hysteresis, cfg.precision.consecutive_hysteresis) == (3, True)
    assert "has no effect with precision.hysteresis=1" in error_of(ds, ["precision.consecutive_hysteresis=true"])
    del ds["fp16"]["hysteresis"]
    cfg = framework.compose(["precision.hysteresis=1"], ds_config=ds)
    assert cfg.precision.consecutive_hysteresis is False and any("(hysteresis 1" in n for n in cfg.notices)


def test_bf16_communication_dtype_and_grad_accum_dtype():
    cfg = framework.compose([], ds_config={"bfloat16": {"enabled": True}, "communication_data_type": "fp32",
                                           "data_types": {"grad_accum_dtype": "bf16"}})
    assert cfg.choices["precision"] == "bf16" and cfg.precision.reduce_fp32 is True
    assert cfg.precision.grad_accum_dtype == "bf16" and cfg.sources["precision.reduce_fp32"] == "DeepSpeed file"
    assert "only fp16 is implemented" in error_of({"fp16": {"enabled": True}, "communication_data_type": "bf16"})
    # DeepSpeed lower-cases it: "FP32" is fp32 (for an fp32 run, what happens anyway)
    assert framework.compose([], ds_config={"communication_data_type": "FP32"}).choices["precision"] == "fp32"
    cfg = framework.compose([], ds_config={"bf16": {"enabled": True}, "communication_data_type": "BF16"})
    assert cfg.precision.reduce_fp32 is False
    assert "is not one DeepSpeed knows; give fp16, bf16 or fp32" in error_of({"communication_data_type": "fp8"})
    # null is not given, as DeepSpeed reads it (the precision decides)
    cfg = framework.compose([], ds_config={"bf16": {"enabled": True}, "communication_data_type": None})
    assert cfg.choices["precision"] == "bf16" and cfg.sources["precision.reduce_fp32"] != "DeepSpeed file"


def test_bf16_check_grad_overflow_skips_a_nonfinite_step_as_deepspeed():
    # DeepSpeed skips the step (train.on_nonfinite=warn); the command line still wins, with a note
    def compose(bf16, *overrides):
        return framework.compose(list(overrides), ds_config={"bf16": bf16})

    cfg = compose({"enabled": True, "check_grad_overflow": True})
    assert cfg.train.on_nonfinite == "warn" and cfg.sources["train.on_nonfinite"] == dsconfig.DS_FILE
    assert not any("check_grad_overflow" in n for n in cfg.notices), cfg.notices
    cfg = compose({"enabled": "auto", "check_grad_overflow": True}, "precision=bf16")
    assert cfg.train.on_nonfinite == "warn"
    cfg = compose({"enabled": True, "check_grad_overflow": True}, "train.on_nonfinite=stop")
    assert cfg.train.on_nonfinite == "stop" and cfg.sources["train.on_nonfinite"] == dsconfig.COMMAND_LINE
    assert any("bf16.check_grad_overflow=true in the file, train.on_nonfinite=stop on the command line" in n
               for n in cfg.notices), cfg.notices
    # false (DeepSpeed would apply the step) and a run that is not bf16: the run's train.on_nonfinite, with a note
    for bf16, why in (({"enabled": True, "check_grad_overflow": False}, "false: train.on_nonfinite decides"),
                      ({"enabled": False, "check_grad_overflow": True}, "bf16 is not enabled"),
                      ({"enabled": "auto", "check_grad_overflow": True}, "(the run is fp32)")):
        cfg = compose(bf16)
        assert cfg.train.on_nonfinite == "stop", bf16
        assert any(n.startswith("note:") and "bf16.check_grad_overflow" in n and why in n for n in cfg.notices), (
            bf16, cfg.notices)


def test_an_adam_eps_of_0_from_a_file_is_one_line():
    msg = error_of({"optimizer": {"type": "AdamW", "params": {"eps": 0}}})
    assert msg.startswith("optimizer.eps must be > 0 for adamw, got 0.0 (an eps of 0 makes the update 0/0") and "\n" not in msg
    assert msg.endswith(" (from ds_config's optimizer.params.eps)"), msg


@pytest.mark.parametrize("ds,start,ds_key", [
    ({"fp16": {"enabled": True, "loss_scale": -1}}, "precision.loss_scale must be >= 0", "fp16.loss_scale"),
    ({"gradient_clipping": -1}, "config: train.grad_clip must be >= 0", "gradient_clipping"),
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}},
      "aio": {"single_submit": True}}, "config: offload.aio.single_submit=true has no effect", "aio.single_submit"),
    ({"optimizer": {"type": "SGD", "params": {"lr": -1}}}, "optimizer.lr must be >= 0 for sgd", "optimizer.params.lr"),
])
def test_a_bad_value_from_the_file_names_the_files_key(ds, start, ds_key):
    msg = error_of(ds)
    assert msg.startswith(start) and msg.endswith(f" (from ds_config's {ds_key})") and "\n" not in msg, msg
    if ds_key == "gradient_clipping":   # the command line's value: our key alone
        assert error_of(ds, ["train.grad_clip=-2"]) == "config: train.grad_clip must be >= 0, got -2"


def test_a_refused_combination_of_the_files_choices_names_the_files_keys():
    ds = {"train_micro_batch_size_per_gpu": 2,
          "zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}}
    msg = error_of(ds)
    assert msg.startswith("config: offload=cpu is not supported with stage=ddp; valid: ") and "\n" not in msg, msg
    assert msg.endswith(" (from ds_config's zero_optimization.offload_optimizer.device and "
                        "zero_optimization.stage)"), msg   # (the keys the file has, not offload_param's)
    # the command line's choice is its own: only the file's key is named
    msg = error_of(ds, ["+stage=ddp"])
    assert msg.endswith(" (from ds_config's zero_optimization.offload_optimizer.device)"), msg


# --- defects found in review (round 9) ----------------------------------------------------------

def _folder(tmp_path, ds: dict, body: str = "") -> str:
    """A --config-dir whose primary config (mine.yaml) extends train.yaml and names the DeepSpeed file."""
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    (tmp_path / "mine.yaml").write_text(f"defaults:\n  - train\n  - _self_\nds_config: {path}\n{body}")
    return str(tmp_path)


def test_ds_config_and_strict_set_in_yaml_are_honoured(tmp_path):
    folder = _folder(tmp_path, {"zero_optimization": {"stage": 2}, "gradient_clipping": 0.25, "my_knob": 1})
    cfg = framework.compose([], config_dir=folder, config_name="mine")
    assert cfg.choices["stage"] == "zero2" and cfg.train.grad_clip == 0.25
    assert cfg.ds_config == str(tmp_path / "ds.json") and cfg.sources["train.grad_clip"] == "DeepSpeed file"
    assert any("my_knob" in n and "does not know" in n for n in cfg.notices), cfg.notices
    folder = _folder(tmp_path, {"zero_optimization": {"stage": 2}, "my_knob": 1}, "ds_config_strict: true\n")
    with pytest.raises(ConfigError, match="ds_config_strict=true.*my_knob"):
        framework.compose([], config_dir=folder, config_name="mine")
    # The command line still wins over the YAML for both keys.
    assert framework.compose(["ds_config_strict=false"], config_dir=folder, config_name="mine").choices["stage"] \
        == "zero2"
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"zero_optimization": {"stage": 1}}))
    cfg = framework.compose([f"ds_config={other}", "ds_config_strict=false"], config_dir=folder, config_name="mine")
    assert cfg.choices["stage"] == "zero1"
    # ~ds_config drops the YAML's file, as ds_config=null does
    for drop in ("~ds_config", "ds_config=null"):
        cfg = framework.compose([drop, "ds_config_strict=false"], config_dir=folder, config_name="mine")
        assert (cfg.ds_config, cfg.choices["stage"]) == (None, "ddp"), drop


def test_auto_warmup_comes_from_the_runs_own_warmup(tmp_path):
    ds = {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "auto"}}}
    # The run's own scheduler (warmup_cosine, 100 warm-up steps), not warmup_lr's YAML default (1000).
    cfg = framework.compose(["train.steps=500"], ds_config=ds)
    assert cfg.scheduler.warmup_num_steps == 100 and cfg.sources["scheduler.warmup_num_steps"] == "auto"
    assert not any("warm-up" in n for n in cfg.notices), cfg.notices
    cfg = framework.compose(["train.steps=50"], ds_config=ds)
    (note,) = [n for n in cfg.notices if "warm-up" in n]
    assert "warmup_num_steps=100" in note and "train.steps=50" in note and "\n" not in note
    # A run whose own scheduler has no warm-up: 1, as Hugging Face's max(1, warm-up steps).
    folder = _folder(tmp_path, ds, "train:\n  steps: 5\n")
    (tmp_path / "mine.yaml").write_text((tmp_path / "mine.yaml").read_text().replace(
        "  - train\n", "  - train\n  - override scheduler: constant\n"))
    cfg = framework.compose([], config_dir=folder, config_name="mine")
    assert cfg.scheduler.warmup_num_steps == 1 and cfg.choices["scheduler"] == "warmup_lr"


def test_explicit_total_and_warmup_steps_must_match_the_run(tmp_path):
    ds = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
          "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10, "total_num_steps": 100}}}
    # Choosing the file's own scheduler on the command line states no warm-up: the group's
    # default (1000) yields to the file's 10, as it does without the choice.
    msg = error_of(ds, ["train.steps=50", "scheduler=warmup_decay_lr"])
    assert msg == "ds_config: scheduler.params.total_num_steps=100 but train.steps=50 (give \"auto\" or " \
        "train.steps=100)", msg
    for choice in ([], ["scheduler=warmup_decay_lr"]):
        cfg = framework.compose(["train.steps=100", *choice], ds_config=ds)
        assert (cfg.scheduler.warmup_num_steps, cfg.scheduler.total_num_steps) == (10, 100)
    # A warm-up the YAML sets for the file's scheduler must match.
    folder = _folder(tmp_path, ds, "train:\n  steps: 100\nscheduler:\n  warmup_num_steps: 50\n")
    (tmp_path / "mine.yaml").write_text((tmp_path / "mine.yaml").read_text().replace(
        "  - train\n", "  - train\n  - override scheduler: warmup_decay_lr\n"))
    with pytest.raises(ConfigError, match="scheduler.params.warmup_num_steps=10 but the run's "
                                          "scheduler.warmup_num_steps is 50"):
        framework.compose([], config_dir=folder, config_name="mine")
    cfg = framework.compose(["scheduler.warmup_num_steps=10"], config_dir=folder, config_name="mine")
    assert (cfg.scheduler.warmup_num_steps, cfg.scheduler.total_num_steps) == (10, 100)
    # Set by the YAML even where it states the group's own value (warmup_lr's 1000); without it, the file's holds.
    def warmup_lr_recipe(body: str = "") -> str:
        folder = _folder(tmp_path, {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 500}}}, body)
        (tmp_path / "mine.yaml").write_text((tmp_path / "mine.yaml").read_text().replace(
            "  - train\n", "  - train\n  - override scheduler: warmup_lr\n"))
        return folder

    with pytest.raises(ConfigError, match="scheduler.params.warmup_num_steps=500 but the run's "
                                          "scheduler.warmup_num_steps is 1000"):
        framework.compose([], config_dir=warmup_lr_recipe("scheduler:\n  warmup_num_steps: 1000\n"), config_name="mine")
    folder = warmup_lr_recipe()
    assert framework.compose([], config_dir=folder, config_name="mine").scheduler.warmup_num_steps == 500


UNKNOWN_IN_VALIDATED = [
    (("zero_optimization", "comm_overlap"), "did you mean 'zero_optimization.overlap_comm'"),
    (("zero_optimization", "my_private_knob"), "zero_optimization: unknown key my_private_knob"),
    (("zero_optimization", "offload_optimizer", "my_knob"), "zero_optimization.offload_optimizer: unknown key my_knob"),
    (("zero_optimization", "offload_param", "my_knob"), "zero_optimization.offload_param: unknown key my_knob"),
    (("fp16", "my_knob"), "fp16: unknown key my_knob"),
    (("bf16", "my_knob"), "bf16: unknown key my_knob"),
    (("optimizer", "params", "my_knob"), "optimizer.params: unknown key my_knob"),
    (("scheduler", "params", "my_knob"), "scheduler.params: unknown key my_knob"),
]


@pytest.mark.parametrize("path,needle", UNKNOWN_IN_VALIDATED, ids=[".".join(p) for p, _ in UNKNOWN_IN_VALIDATED])
def test_unknown_key_where_deepspeed_rejects_it_is_an_error(path, needle):
    ds = hf("hf_zero3_nvme")
    ds["bf16"] = {"enabled": False}
    node = ds
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = 1
    msg = error_of(ds)
    assert needle in msg and "\n" not in msg, msg


DS019 = [
    ({"gradient_allreduce_op": "mean"}, None, "gradient_allreduce_op"),
    # the reason once, not nested in a second "not supported here (...)"
    ({"gradient_allreduce_op": "sum"}, "error", "ds_config: gradient_allreduce_op=\"sum\" is not supported here "
     "(gradients are averaged over the ranks); remove it or give \"mean\""),
    ({"data_types": {"param_dtype": "fp32", "buffer_dtype": "fp32"}}, None, "data_types.buffer_dtype"),
    ({"bf16": {"enabled": True}, "data_types": {"param_dtype": "bf16"}}, None, "data_types.param_dtype"),
    ({"data_types": {"param_dtype": "bf16"}}, "error", "data_types.param_dtype=bf16 with precision=fp32"),
    ({"data_types": {"keep_in_fp32_modules": []}}, None, "data_types.keep_in_fp32_modules"),
    ({"data_types": {"keep_in_fp32_modules": ["norm"]}}, None, "data_types.keep_in_fp32_modules (the run is fp32)"),
    ({"bf16": {"enabled": True}, "data_types": {"keep_in_fp32_modules": ["norm"]}}, "error",
     "data_types.keep_in_fp32_modules: keeping modules in fp32 under precision=bf16 is not implemented"),
    ({"disable_python_gc": 1}, None, "disable_python_gc"),
    ({"vocabulary_size": 50304}, None, "vocabulary_size"),
    ({"log_level": "info"}, None, "log_level"),
    ({"optimizer": {"type": "AdamW", "params": {"fp32_optimizer_states": True}}}, None, "fp32_optimizer_states"),
    ({"optimizer": {"type": "AdamW", "params": {"fp32_optimizer_states": False}}}, "error", "fp32_optimizer_states"),
    ({"managed_gradient_accumulation": True}, None, "managed_gradient_accumulation"),
    ({"managed_gradient_accumulation": False}, "error", "ds_config: managed_gradient_accumulation=false is not "
     "supported here (the engine always manages gradient accumulation); remove it or give true"),
    # false would rebuild the fp32 masters from the 16-bit weights at a resume: not a knob that changes nothing
    ({"zero_optimization": {"stage": 2, "load_from_fp32_weights": True}}, None,
     "zero_optimization.load_from_fp32_weights (a resume restores the saved fp32 masters)"),
    ({"zero_optimization": {"stage": 2, "load_from_fp32_weights": False}, "bf16": {"enabled": True}}, "error",
     "zero_optimization.load_from_fp32_weights=false (DeepSpeed rebuilds the fp32 masters"),
    # an fp32 run (or stage 0) has no 16-bit weights to rebuild from: false changes nothing there
    ({"zero_optimization": {"stage": 2, "load_from_fp32_weights": False}}, None,
     "zero_optimization.load_from_fp32_weights (changes nothing here: no 16-bit weights to rebuild masters from"),
    ({"zero_optimization": {"stage": 0, "load_from_fp32_weights": False}, "fp16": {"enabled": True}}, None,
     "zero_optimization.load_from_fp32_weights (changes nothing here"),
    # as in DeepSpeed, AdamW decouples the decay whatever adam_w_mode says (Adam with false is L2: it does something)
    ({"optimizer": {"type": "AdamW", "params": {"adam_w_mode": False}}}, None,
     "optimizer.params.adam_w_mode (type AdamW always decouples the weight decay, as in DeepSpeed; use type Adam "
     "for L2 decay)"),
    # keys starting with "_" are comments, in every section
    *(({section: {**body, "_comment": "x"}}, None, f"{section}._comment (a comment)") for section, body in (
        ("activation_checkpointing", {"partition_activations": False}), ("aio", {}), ("data_types", {}),
        ("optimizer", {"type": "AdamW"}), ("scheduler", {"type": "WarmupLR"}), ("fp16", {"enabled": False}),
        ("zero_optimization", {"stage": 2}), ("compile", {}))),
    ({"optimizer": {"type": "AdamW", "params": {"_lr": "x"}}}, None, "optimizer.params._lr (a comment)"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "_why": "x"}}}, None,
     "zero_optimization.offload_optimizer._why (a comment)"),
]


@pytest.mark.parametrize("ds,error,needle", DS019, ids=[json.dumps(d) for d, _, _ in DS019])
def test_deepspeed_019_keys_are_known(ds, error, needle):
    if error:
        msg = error_of(ds)
        assert needle in msg and "did you mean" not in msg and "\n" not in msg, msg
        return
    cfg = framework.compose([], ds_config=ds)
    assert not any("does not know" in n for n in cfg.notices), cfg.notices
    assert any(n.startswith("note:") and needle in n for n in cfg.notices), cfg.notices


def test_command_line_over_an_explicit_file_value_is_noted():
    ds = {"optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": "auto"}}, "gradient_clipping": 0.5,
          "train_micro_batch_size_per_gpu": 4}
    cfg = framework.compose(["optimizer.lr=1e-3", "train.grad_clip=0.5", "train.micro_batch=2",
                             "optimizer.weight_decay=0.2"], ds_config=ds)
    assert cfg.optimizer.lr == 1e-3 and cfg.train.micro_batch == 2   # the documented precedence stays
    (note,) = [n for n in cfg.notices if "command line" in n]
    for needle in ("optimizer.params.lr=0.0003 in the file, optimizer.lr=0.001 on the command line",
                   "train_micro_batch_size_per_gpu=4 in the file, train.micro_batch=2 on the command line"):
        assert needle in note, note
    assert "gradient_clipping" not in note and "weight_decay" not in note, note   # same value; "auto"


def test_zero1_contiguous_gradients_false_from_a_file_is_a_note():
    cfg = framework.compose([], ds_config={"zero_optimization": {"stage": 1, "contiguous_gradients": False}})
    assert cfg.choices["stage"] == "zero1" and cfg.stage.contiguous_gradients is True
    assert any(n.startswith("note:") and "zero_optimization.contiguous_gradients" in n for n in cfg.notices)
    with pytest.raises(ConfigError, match="stage.contiguous_gradients=false has no effect with stage=zero1"):
        framework.compose(["+stage=zero1", "stage.contiguous_gradients=false"])


def test_base64_config_and_torch_adam_weight_decay():
    import base64

    ds = {"zero_optimization": {"stage": 2}, "gradient_clipping": 0.25}
    encoded = base64.urlsafe_b64encode(json.dumps(ds).encode()).decode()
    # On the command line: quoted (Hydra's grammar takes no bare '='), or without the padding.
    for cfg in (framework.compose([], ds_config=encoded), framework.compose([f"ds_config='{encoded}'"]),
                framework.compose([f"ds_config={encoded.rstrip('=')}"])):
        assert cfg.choices["stage"] == "zero2" and cfg.train.grad_clip == 0.25
    assert "no such file" in error_of("not-a-file-nor-base64.json")
    long = hf("hf_zero3_nvme")   # longer in base64 than a file name may be
    assert dsconfig.load(base64.urlsafe_b64encode(json.dumps(long).encode()).decode()) == long
    # a key given twice is refused as in a file, not last-wins
    twice = base64.urlsafe_b64encode(b'{"gradient_clipping": 1.0, "gradient_clipping": 0.0}').decode()
    assert "key 'gradient_clipping' appears twice in one object" in error_of(twice)
    # torch_adam: DeepSpeed builds torch.optim.AdamW, whose weight_decay defaults to 0.01.
    for kind in ("AdamW", "Adam"):
        cfg = framework.compose([], ds_config={"optimizer": {"type": kind, "params": {"torch_adam": True}}})
        assert cfg.optimizer.weight_decay == 0.01 and cfg.sources["optimizer.weight_decay"] == "DeepSpeed default"
    cfg = framework.compose([], ds_config={"optimizer": {"type": "Adam", "params": {"torch_adam": True,
                                                                                  "adam_w_mode": False}}})
    assert cfg.optimizer.weight_decay == 0.0   # torch.optim.Adam's default
    # a boolean as other DeepSpeed booleans are here (1 would mean true to DeepSpeed, 0.0 decay to a bool check)
    for bad in (1, "true"):
        assert f"optimizer.params.torch_adam must be true or false, got {json.dumps(bad)}" in error_of(
            {"optimizer": {"type": "AdamW", "params": {"torch_adam": bad}}})


def test_an_integer_beyond_range_for_a_number_key_is_one_line():
    assert error_of({"gradient_clipping": 10 ** 400}) == ("ds_config: gradient_clipping (25 digits or more) is out of "
                                                          "range (integers must lie within +-2^63)")
    assert "gradient_clipping=9223372036854775808 is out of range" in error_of({"gradient_clipping": 2 ** 63})
    assert framework.compose([], ds_config={"gradient_clipping": 1e20}).train.grad_clip == 1e20   # (a float: as it is)


@pytest.mark.parametrize("kind", ["WarmupLR", "WarmupCosineLR"])
def test_a_warmup_of_one_step_runs_as_deepspeed_runs_it(kind):
    """DeepSpeed raises a warm-up below 2 steps to 2: 1 runs so, as 2 does; 0 it refuses (0.19.3 on), as here."""
    from framework.core.registry import registry

    def ds(steps):
        return {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                "scheduler": {"type": kind, "params": {"warmup_num_steps": steps,
                                                       **({"total_num_steps": 6} if kind == "WarmupCosineLR" else {})}}}

    lrs = []
    for steps in (1, 2):
        cfg = framework.compose(["train.steps=6"], ds_config=ds(steps))
        lr_at = registry("scheduler").get(cfg.choices["scheduler"]).build(cfg.scheduler, 1e-3, 6)
        lrs.append([lr_at(step) for step in range(6)])
    assert lrs[0] == lrs[1]
    assert "scheduler.warmup_num_steps must be >= 1" in error_of(ds(0), ["train.steps=6"])


@pytest.mark.parametrize("key", ["reduce_bucket_size", "allgather_bucket_size"])
def test_a_bucket_of_no_elements_is_refused_by_the_translator(key):
    msg = error_of({"zero_optimization": {"stage": 2, key: 0}})
    assert msg == f"ds_config: zero_optimization.{key} must be >= 1, got 0", msg
    # where no stage reads it (zero3 reduces per gather unit), 0 is what real configs write: accepted
    assert dsconfig.translate({"zero_optimization": {"stage": 3, "reduce_bucket_size": 0}}).errors == []


# --- configs from DeepSpeed's own guides and tools ------------------------------------------------

def test_boolean_zero_optimization_runs_as_deepspeed_reads_it():
    """DeepSpeed's Getting Started config says "zero_optimization": true (deprecated): stage 1, and a
    top-level allgather_size becomes allgather_bucket_size; false is stage 0."""
    cfg = framework.compose([], ds_config=DS / "ds_getting_started.json", world=2)
    assert cfg.choices["stage"] == "zero1" and cfg.choices["precision"] == "fp16"
    assert (cfg.train.micro_batch, cfg.train.grad_accum, cfg.optimizer.lr) == (4, 1, 0.00015)
    (w,) = [n for n in cfg.notices if "deprecated" in n]
    assert w.startswith("warning: ds_config:") and "'zero_optimization': true" in w and '{"stage": 1}' in w, w
    cfg = framework.compose([], ds_config={"zero_optimization": True, "allgather_size": 1000})
    assert cfg.stage.allgather_bucket_size == 1000 and cfg.sources["stage.allgather_bucket_size"] == "DeepSpeed file"
    cfg = framework.compose([], ds_config={"zero_optimization": False, "allgather_size": 1000})
    assert cfg.choices["stage"] == "ddp"
    assert any(n.startswith("note:") and "allgather_size" in n for n in cfg.notices), cfg.notices
    assert "zero_optimization must be a JSON object" in error_of({"zero_optimization": 1})


def test_offload_param_below_stage_3_is_inert_as_in_deepspeed():
    """DeepSpeed-Chat's stage-2 offload config names offload_param too; DeepSpeed ignores it below
    stage 3: a note, and offload_optimizer's choice stays."""
    cfg = framework.compose([], ds_config=DS / "dschat_zero2_offload.json", world=2)
    assert cfg.choices["stage"] == "zero2" and cfg.choices["offload"] == "cpu" and cfg.offload.params == "none"
    (note,) = [n for n in cfg.notices if n.startswith("note:")]
    assert "zero_optimization.offload_param (parameters are partitioned only under stage 3; DeepSpeed ignores " \
           "it)" in note, note
    for stage in (0, 1):
        cfg = framework.compose([], ds_config={"zero_optimization": {"stage": stage, "offload_param": {
            "device": "nvme", "nvme_path": "/tmp/x", "buffer_count": 3}}})
        assert cfg.choices["offload"] == "none" and "offload_param.buffer_count" not in " ".join(cfg.notices)


@pytest.mark.parametrize("spelling,precision,ours", [
    ("float32", "bf16", "fp32"), ("float", "fp16", "fp32"), ("torch.float32", "fp32", "fp32"),
    ("bfloat16", "bf16", "bf16"), ("torch.bfloat16", "bf16", "bf16"), ("half", "fp16", "fp16"),
    ("float16", "fp16", "fp16"), ("torch.float16", "fp16", "fp16"), ("fp16", "fp16", "fp16"),
])
def test_grad_accum_dtype_takes_deepspeeds_spellings(spelling, precision, ours):
    ds = {"data_types": {"grad_accum_dtype": spelling}, "gradient_accumulation_steps": 2}   # (read under ddp)
    if precision != "fp32":
        ds[precision] = {"enabled": True}
    cfg = framework.compose([], ds_config=ds)
    assert cfg.choices["precision"] == precision and cfg.precision.grad_accum_dtype == ours
    assert cfg.sources["precision.grad_accum_dtype"] == "DeepSpeed file"


@pytest.mark.parametrize("ds,needle", [
    ({"data_types": {"grad_accum_dtype": "bf16"}},
     "data_types.grad_accum_dtype=bf16 with precision=fp32: gradients accumulate here in fp32"),
    ({"fp16": {"enabled": True}, "data_types": {"grad_accum_dtype": "bfloat16"}},
     "data_types.grad_accum_dtype=bfloat16 with precision=fp16: gradients accumulate here in fp32 or fp16"),
    ({"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "int8"}},
     "data_types.grad_accum_dtype=int8 with precision=bf16"),
    ({"data_types": {"grad_accum_dtype": "float64"}},
     "data_types.grad_accum_dtype=\"float64\" is not a dtype DeepSpeed knows"),
])
def test_unsupported_grad_accum_dtype_is_one_line_naming_the_deepspeed_key(ds, needle):
    msg = error_of(ds)
    assert needle in msg and "\n" not in msg and "precision.grad_accum_dtype" not in msg, msg


@pytest.mark.parametrize("section", [{"deepcompile": False}, {}, {"deepcompile": False, "free_activation": True},
                                     {"disable": False, "backend": "inductor"}, {"enabled": False}])
def test_compile_section_without_deepcompile_is_a_note(section):
    cfg = framework.compose([], ds_config={"compile": section})
    assert any(n.startswith("note:") and "compile" in n for n in cfg.notices), cfg.notices
    assert not any("does not know" in n for n in cfg.notices), cfg.notices


def test_axolotl_torch_compile_config_runs_with_a_note():
    cfg = framework.compose(["train.micro_batch=2"], ds_config=DS / "axolotl_zero1_torch_compile.json")
    assert cfg.choices["stage"] == "zero1"
    (note,) = [n for n in cfg.notices if n.startswith("note:")]
    assert "compile.backend" in note and "compile.disable" in note, note


def test_deepcompile_on_is_refused_saying_so():
    assert "DeepCompile is not implemented" in error_of({"compile": {"deepcompile": True}})
    assert "did you mean 'compile.deepcompile'" in error_of({"compile": {"deep_compile": True}})


def test_both_spellings_of_the_16bit_save_flag_must_agree():
    z = {"stage": 3, "stage3_gather_fp16_weights_on_model_save": True, "stage3_gather_16bit_weights_on_model_save": False}
    msg = error_of({"zero_optimization": z})
    assert "stage3_gather_fp16_weights_on_model_save and zero_optimization.stage3_gather_16bit_weights_on_model_save" \
           in msg and "same key with different values" in msg and "keep one" in msg, msg
    z["stage3_gather_16bit_weights_on_model_save"] = True
    assert framework.compose([], ds_config={"zero_optimization": z}).stage.stage3_gather_16bit_weights_on_model_save
    # a bad value of the old spelling beside the current one: the conflict alone, not an error of the current key
    z["stage3_gather_fp16_weights_on_model_save"] = "yes"
    msg = error_of({"zero_optimization": z})
    assert "same key with different values" in msg and "must be true or false" not in msg, msg


def test_warmup_max_lr_mismatch_says_how_to_fix_it():
    ds = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
          "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 1e-3}}}
    msg = error_of(ds)
    assert "scheduler.params.warmup_max_lr=0.001 but the optimizer's lr is 0.0001 (give \"auto\" or make " \
           "optimizer.params.lr 0.001)" in msg, msg
    assert "(give \"auto\" or give optimizer.lr=0.001)" in error_of(ds, ["optimizer.lr=1e-4"])
    del ds["optimizer"]
    assert "(give \"auto\" or give optimizer.lr=0.001)" in error_of(ds, ["optimizer.lr=1e-4"])


def test_a_recipe_whose_defaults_choose_the_stage_takes_a_file_that_agrees(tmp_path):
    # The file's stage is not added a second time (Hydra refuses a group chosen twice); one that
    # disagrees with the recipe is a mismatch naming both, as with a command-line choice.
    (tmp_path / "my.yaml").write_text("defaults:\n  - train\n  - stage: zero3\n  - _self_\n")
    kw = {"config_dir": str(tmp_path), "config_name": "my"}
    cfg = framework.compose([], ds_config={"zero_optimization": {"stage": 3}}, **kw)
    assert cfg.choices["stage"] == "zero3" and cfg.sources["stage.name"] == dsconfig.YAML   # (not passed to Hydra)
    assert ("stage=zero3 in the run's config (its defaults list), but zero_optimization.stage in the file means "
            "stage=zero2") in error_of({"zero_optimization": {"stage": 2}}, **kw)


def test_a_key_deleted_in_a_group_the_file_chooses_composes(tmp_path):
    # The run's own config (read for its stage and warm-up before the file's choices join it) is
    # composed without the deletions: without the file's offload=cpu there is no offload.pin_memory.
    for name in ("real/dsexamples_megatron_ds_zero2_cpu_offload_config.json", "hf_zero2_cpu_offload.json"):
        for deleted in ("~offload.pin_memory", "~stage.overlap_comm"):
            cfg = framework.compose([deleted], ds_config=str(DS / name), world=2)
            assert (cfg.choices["stage"], cfg.choices["offload"]) == ("zero2", "cpu"), (name, deleted)
    # A file the run's YAML names; without one the deletion still applies (and still must name a key).
    folder = _folder(tmp_path, {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}})
    assert framework.compose(["~offload.pin_memory"], config_dir=folder, config_name="mine").choices["offload"] == "cpu"
    assert framework.compose(["~train.grad_clip"]).train.grad_clip is not None
    assert "'offload.pin_memory' does not exist" in error_of(None, ["~offload.pin_memory"])


@pytest.mark.parametrize("value,strict", [("true", True), ("yes", True), ("on", True), ("off", False)])
def test_ds_config_strict_counts_a_ds_config_argument_and_reads_as_validate_does(value, strict, tmp_path):
    ds = {"zero_optimization": {"stage": 2}}
    assert framework.compose([f"ds_config_strict={value}"], ds_config=ds).ds_config_strict is strict
    (path := tmp_path / "ds.json").write_text(json.dumps({**ds, "my_custom_key": 1}))
    given = [f"ds_config={path}", f"ds_config_strict={value}"]
    if strict:
        assert "keys DeepSpeed does not know (ds_config_strict=true): my_custom_key" in error_of(None, given)
    else:
        assert "my_custom_key" in "".join(framework.compose(given).notices)


def test_a_dict_config_with_python_typed_values_is_read_as_json_would_hold_it(tmp_path):
    # A Path, a numpy scalar, a tuple, an OmegaConf node; any other object is one error naming its key.
    np = pytest.importorskip("numpy")
    ds = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": tmp_path},
                                "offload_param": {"device": "nvme", "nvme_path": tmp_path}},
          "train_micro_batch_size_per_gpu": np.int64(4), "gradient_clipping": np.float32(0.5),
          "optimizer": {"type": "AdamW", "params": {"betas": (0.9, np.float64(0.95))}}}
    cfg = framework.compose([], ds_config=ds)
    assert (cfg.offload.nvme_path, cfg.train.micro_batch, cfg.train.grad_clip, cfg.optimizer.beta2) == (
        str(tmp_path), 4, 0.5, 0.95)
    omegaconf = pytest.importorskip("omegaconf")
    assert framework.compose([], ds_config=omegaconf.OmegaConf.create(
        {"train_micro_batch_size_per_gpu": 4})).train.micro_batch == 4
    assert error_of(omegaconf.OmegaConf.create({"zero_optimization": {"stage": "${nowhere}"}})) == (
        "ds_config: zero_optimization.stage: Interpolation key 'nowhere' not found")
    assert error_of({"zero_optimization": {"stage": torch.tensor(2)}}) == (
        "ds_config: zero_optimization.stage: a value of type Tensor is not a JSON value; give a string, number, "
        "boolean, null, list or dict")


@pytest.mark.parametrize("kind,peak", [("WarmupLR", 3e-4), ("WarmupDecayLR", 0.001)])
def test_warmup_max_lr_left_out_follows_deepspeed(kind, peak):
    # DeepSpeed (0.17.2 on): WarmupLR without warmup_max_lr warms up to the optimizer's lr;
    # WarmupDecayLR keeps its 0.001.
    from framework.engine.build import component

    params = {"warmup_num_steps": 10, "warmup_type": "linear", "total_num_steps": 20}
    params = {k: v for k, v in params.items() if kind == "WarmupDecayLR" or k != "total_num_steps"}
    ds = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 3e-4}},
          "scheduler": {"type": kind, "params": params}}
    cfg = framework.compose(["train.steps=20"], ds_config=ds, world=1)
    lr_at = component(cfg, "scheduler").build(cfg.scheduler, base_lr=cfg.optimizer.lr, total_steps=20)
    assert max(lr_at(s) for s in range(20)) == pytest.approx(peak)
    # the default 0.001 differs from the optimizer's lr: a note says where the peak comes from
    notes = [n for n in cfg.notices if "warmup_max_lr" in n]
    assert notes == ([] if kind == "WarmupLR" else [
        "note: ds_config: scheduler.params.warmup_max_lr is left out: the lr peaks at DeepSpeed's default 0.001, "
        "not the optimizer's lr 0.0003; give \"warmup_max_lr\": \"auto\" to peak at the optimizer's lr"]), notes
    if kind == "WarmupDecayLR":   # the same peak as the lr: nothing to say
        ds["optimizer"]["params"]["lr"] = 0.001
        assert not any("warmup_max_lr" in n for n in framework.compose(["train.steps=20"], ds_config=ds,
                                                                        world=1).notices)


def test_json_nested_too_deeply_to_parse_is_one_line(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{"optimizer": ' + '[' * 100_000 + ']' * 100_000 + '}')
    assert error_of(path) == f"ds_config: {path}: nested too deeply to parse; give a plain JSON object"


def test_zero3s_inert_bucket_keys_each_say_their_own_reason():
    """Under stage 3 allgather_bucket_size is about the parameters' gathers (each unit in one), reduce_bucket_size
    about the gradients' reduction (each unit's in one): each key's note gives its own."""
    inert = dsconfig.translate({"zero_optimization": {"stage": 3, "allgather_bucket_size": 5,
                                                      "reduce_bucket_size": 5}}).inert
    assert "zero_optimization.allgather_bucket_size (zero3 gathers each unit's parameters in one collective)" in inert
    assert "zero_optimization.reduce_bucket_size (zero3 reduces each gather unit's gradients in one collective)" \
        in inert, inert


@pytest.mark.parametrize("section,name", [({"bf16": {}}, "bf16"), ({"fp16": {"loss_scale_window": 7}}, "fp16")])
def test_a_precision_section_without_enabled_is_named_as_the_file_has_it(section, name):
    # the file has no "enabled" key: the line says so (not "fp16.enabled / bf16.enabled", keys it lacks)
    msg = error_of(section, [f"precision={name}"])
    assert (f'precision={name} on the command line, but {name} with no "enabled" (off by default) in the file '
            'means precision=fp32') in msg, msg
    assert "fp16.enabled / bf16.enabled" not in msg


def test_a_stated_false_enabled_is_named_by_its_key():
    assert "but bf16.enabled in the file means precision=fp32" in error_of({"bf16": {"enabled": False}},
                                                                          ["precision=bf16"])
