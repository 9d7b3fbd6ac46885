"""Numerics config keys: grad_accum_dtype values, and DeepSpeed keys whose other
value would do nothing here (refused with one line that names the key and the fix)."""
import json

import pytest
import torch

from framework import ConfigError, compose
from framework.engine.build import component


def test_round_robin_gradients_is_accepted():
    """zero2 with offload lays parameters out round-robin to spread the host copies (tests/dist/test_zero12.py);
    without offload that only reorders ownership, and zero1 copies after backward on every rank at once: there
    the key changes nothing a user sees and one note says why."""
    assert compose(["+stage=zero2", "offload=cpu", "stage.round_robin_gradients=true"]).notices == ()
    cfg = compose(["+stage=zero2", "stage.round_robin_gradients=true"])
    assert len(cfg.notices) == 1 and "without offload only reorders which rank owns" in cfg.notices[0], cfg.notices
    cfg = compose(["+stage=zero1", "stage.round_robin_gradients=true"])
    assert len(cfg.notices) == 1 and "changes nothing with zero1" in cfg.notices[0]
    assert compose(["+stage=zero1", "stage.round_robin_gradients=false"]).notices == ()


def test_a_tiny_bucket_gets_one_note():
    """A bucket of a few elements is one collective (and with offload one host step) each: thousands a step.
    (zero1 makes the same note.)"""
    stage = "zero2"
    cfg = compose([f"+stage={stage}", "stage.reduce_bucket_size=20", "stage.allgather_bucket_size=999"])
    said = "note: stage.reduce_bucket_size=20 and stage.allgather_bucket_size=999 (elements): one collective per bucket"
    assert len(cfg.notices) == 1 and cfg.notices[0].startswith(said), cfg.notices
    assert compose([f"+stage={stage}", "stage.reduce_bucket_size=1000"]).notices == ()
    # the host step per reduce bucket share is named only with offload and a small reduce bucket
    host = "(with offload also one host step per reduce_bucket_size / world elements)"
    assert host not in cfg.notices[0]
    for small, offload, named in (("reduce", "cpu", True), ("allgather", "cpu", False), ("allgather", "none", False)):
        said = compose([f"+stage={stage}", f"stage.{small}_bucket_size=20", f"offload={offload}"]).notices
        assert len(said) == 1 and (host in said[0]) == named, (small, offload, said)
    # NCCL gathers the parameters in one in-place call: an allgather_bucket_size of its own does nothing there, said
    # so (not as a small bucket); at its default nothing is said
    inert = ("note: stage.allgather_bucket_size=999 changes nothing on nccl: NCCL gathers the partitions in one "
             "in-place call (the key bounds gloo's broadcasts only); drop it")
    said = compose([f"+stage={stage}", "dist.backend=nccl", "stage.reduce_bucket_size=20",
                    "stage.allgather_bucket_size=999"]).notices
    assert len(said) == 2 and said[0] == inert and said[1].startswith("note: stage.reduce_bucket_size=20 (elements)")
    assert compose([f"+stage={stage}", "dist.backend=nccl", "stage.allgather_bucket_size=999"]).notices == (inert,)
    assert compose([f"+stage={stage}", "dist.backend=nccl"]).notices == ()


def test_a_zero3_reuse_distance_below_the_prefetch_bucket_gets_one_note():
    """A unit stays gathered while max(reuse distance, prefetch bucket - its size) elements come between its uses:
    a reuse distance below the bucket changes little or nothing, said once; at or above it (the default), nothing."""
    said = compose(["+stage=zero3", "stage.stage3_max_reuse_distance=0"]).notices
    assert len(said) == 1 and said[0].startswith("note: stage.stage3_max_reuse_distance=0 is below "
                                                 "stage.stage3_prefetch_bucket_size=50,000,000: a unit stays"), said
    assert compose(["+stage=zero3"]).notices == ()
    assert compose(["+stage=zero3", "stage.stage3_max_reuse_distance=0",
                    "stage.stage3_prefetch_bucket_size=0"]).notices == ()


def test_zero1_contiguous_gradients_false_is_refused():
    with pytest.raises(ConfigError, match=r"stage\.contiguous_gradients=false has no effect with stage=zero1 .*"
                                          r"remove it, or use \+stage=zero2$"):
        compose(["+stage=zero1", "stage.contiguous_gradients=false"])
    compose(["+stage=zero2", "stage.contiguous_gradients=false"])  # zero2 implements both values


@pytest.mark.parametrize("precision,value,dtype", [
    ("fp32", None, torch.float32), ("bf16", None, torch.float32), ("fp16", None, torch.float32),
    ("bf16", "bf16", torch.bfloat16), ("fp16", "fp16", torch.float16), ("bf16", "fp32", torch.float32)])
def test_grad_accum_dtype_reaches_the_policy(precision, value, dtype):
    overrides = [f"precision={precision}", "train.grad_accum=2"] + ([f"precision.grad_accum_dtype={value}"] if value
                                                                   else [])
    cfg = compose(overrides)
    assert component(cfg, "precision").build(cfg.precision).grad_accum_dtype == dtype


@pytest.mark.parametrize("overrides,refused", [
    # ddp and zero1 sum nothing in it with one micro batch a step (their gradient buffers have the working dtype)
    (["precision=bf16", "precision.grad_accum_dtype=bf16"], True),
    (["precision=bf16", "precision.grad_accum_dtype=bf16", "~train.grad_accum"], True),   # (composed twice)
    (["precision=fp16", "precision.grad_accum_dtype=fp16", "+stage=zero1", "offload=cpu"], True),
    (["precision=bf16", "precision.grad_accum_dtype=bf16", "train.grad_accum=2"], False),   # earlier micro batches
    (["precision=bf16", "precision.grad_accum_dtype=bf16", "precision.reduce_fp32=true"], False),   # the fp32 sums
    (["precision=bf16", "precision.grad_accum_dtype=bf16", "+stage=zero2"], False),   # zero2/3 keep gradients in it
    (["precision=fp16", "precision.grad_accum_dtype=fp16", "+stage=zero3"], False),
    (["precision=bf16", "precision.grad_accum_dtype=fp32"], False)])   # (the default)
def test_grad_accum_dtype_where_it_does_nothing_is_refused(overrides, refused):
    if not refused:
        assert compose(overrides).precision.grad_accum_dtype == overrides[1].rpartition("=")[2]
        return
    stage = "zero1" if "+stage=zero1" in overrides else "ddp"
    with pytest.raises(ConfigError, match=rf"^config: precision\.grad_accum_dtype={overrides[0][10:]} has no effect "
                                          rf"with stage={stage} and train\.grad_accum=1 \(one micro batch a step: "
                                          r"nothing is summed in it\); remove it, or set train\.grad_accum > 1$"):
        compose(overrides)


def test_a_deepspeed_files_grad_accum_dtype_where_it_does_nothing_is_a_note():
    """As DeepSpeed runs the file: its key is inert (a note), where ours stated would be refused."""
    ds = {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "bf16"}}
    cfg = compose([], ds_config=ds)
    assert cfg.precision.grad_accum_dtype == "fp32" and cfg.sources["precision.grad_accum_dtype"] != "DeepSpeed file"
    assert cfg.notices == ("note: ds_config: accepted, change nothing here: data_types.grad_accum_dtype (stage ddp "
                           "with one micro batch a step sums nothing in it)",)
    for more in (["train.grad_accum=2"], ["+stage=zero2"], ["precision.reduce_fp32=true"]):
        assert compose(more, ds_config=ds).precision.grad_accum_dtype == "bf16", more
    assert compose([], ds_config={**ds, "gradient_accumulation_steps": 2}).precision.grad_accum_dtype == "bf16"
    with pytest.raises(ConfigError, match=r"^config: precision\.grad_accum_dtype=bf16 has no effect with stage=ddp"):
        compose(["precision.grad_accum_dtype=bf16"], ds_config=ds)   # the command line's own


@pytest.mark.parametrize("ds,world", [
    ({"zero_optimization": {"stage": 0}, "gradient_accumulation_steps": 4}, 1),
    ({"zero_optimization": {"stage": 1}, "gradient_accumulation_steps": 4}, 1),
    ({"zero_optimization": {"stage": 1}, "train_batch_size": 16}, 2),   # 2 a micro batch x 2 ranks x 4
    ({"zero_optimization": {"stage": 0}, "communication_data_type": "fp32"}, 2),   # bf16's fp32 sums (reduce_fp32)
    ({"zero_optimization": {"stage": 1}, "communication_data_type": "fp32"}, 2)])
def test_the_command_lines_grad_accum_dtype_is_judged_with_the_deepspeed_files_values(ds, world, tmp_path):
    """Whether the key does anything is decided on the run's final config: the file's values laid on the run's."""
    ds = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True}, **ds}
    cfg = compose(["precision.grad_accum_dtype=bf16"], ds_config=ds, world=world)
    assert cfg.precision.grad_accum_dtype == "bf16" and cfg.choices["precision"] == "bf16"
    # the same with the file named in the run's YAML, and the key set there (the precision chosen: a run's own
    # config is validated, without the file's choices, for where the file is named)
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    (tmp_path / "mine.yaml").write_text(f"defaults:\n  - train\n  - _self_\nds_config: {tmp_path / 'ds.json'}\n"
                                        "precision:\n  grad_accum_dtype: bf16\n")
    cfg = compose(["precision=bf16"], world=world, config_dir=str(tmp_path), config_name="mine")
    assert cfg.precision.grad_accum_dtype == "bf16"


@pytest.mark.parametrize("precision,value", [("fp32", "bf16"), ("bf16", "fp16"), ("fp16", "bf16"), ("bf16", "fp64")])
def test_grad_accum_dtype_other_values_are_refused(precision, value):
    with pytest.raises(ConfigError, match=rf"precision\.grad_accum_dtype='{value}' is not valid with "
                                          rf"precision={precision}; use "):
        compose([f"precision={precision}", f"precision.grad_accum_dtype={value}"])


@pytest.mark.parametrize("overrides,message", [
    (["precision=fp16", "precision.hysteresis=0"], r"precision\.hysteresis must be >= 1, got 0"),
    (["precision=fp16", "precision.loss_scale_window=0"], r"precision\.loss_scale_window must be >= 1"),
    (["precision=fp16", "precision.initial_scale_power=128"], r"precision\.initial_scale_power must be in \[0, 127\]"),
    # a loss scale given for its power (Megatron's habit): the power is named
    (["precision=fp16", "precision.initial_scale_power=65536"],
     r"got 65536; it is the power of 2 \(a scale of 65536 is initial_scale_power 16\)$"),
    (["precision=fp16", "precision.loss_scale=128", "precision.hysteresis=3"], r"precision\.hysteresis=3 has no effect"),
    (["+stage=ddp", "stage.reduce_bucket_size=0"], r"stage\.reduce_bucket_size must be >= 1 element, got 0"),
    (["+stage=zero1", "stage.allgather_bucket_size=0"], r"stage\.allgather_bucket_size must be >= 1 element, got 0"),
    (["+stage=zero2", "stage.reduce_bucket_size=0"], r"stage\.reduce_bucket_size must be >= 1 element, got 0"),
    (["+stage=zero3", "stage.stage3_prefetch_bucket_size=-1"], r"stage\.stage3_prefetch_bucket_size must be >= 0")])
def test_out_of_range_stage_and_precision_keys_are_refused_when_composed(overrides, message):
    """Checked with the config (before a run, or a sweep's first job, starts), not only when the engine is built."""
    with pytest.raises(ConfigError, match=message):
        compose(overrides)
