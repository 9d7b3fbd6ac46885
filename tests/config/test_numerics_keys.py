"""Numerics config keys: grad_accum_dtype values, and DeepSpeed keys whose other
value would do nothing here (refused with one line that names the key and the fix)."""
import pytest
import torch

from framework import ConfigError, compose
from framework.engine.build import component


def test_round_robin_gradients_is_accepted():
    """zero2 lays parameters out round-robin (tests/dist/test_zero12.py); zero1 copies after backward
    on every rank at once, so the key changes nothing there and one note says why."""
    assert compose(["+stage=zero2", "stage.round_robin_gradients=true"]).notices == ()
    cfg = compose(["+stage=zero1", "stage.round_robin_gradients=true"])
    assert len(cfg.notices) == 1 and "changes nothing with zero1" in cfg.notices[0]
    assert compose(["+stage=zero1", "stage.round_robin_gradients=false"]).notices == ()


def test_zero1_contiguous_gradients_false_is_refused():
    with pytest.raises(ConfigError, match=r"stage\.contiguous_gradients=false has no effect with stage=zero1 .*"
                                          r"remove it, or use \+stage=zero2$"):
        compose(["+stage=zero1", "stage.contiguous_gradients=false"])
    compose(["+stage=zero2", "stage.contiguous_gradients=false"])  # zero2 implements both values


@pytest.mark.parametrize("precision,value,dtype", [
    ("fp32", None, torch.float32), ("bf16", None, torch.float32), ("fp16", None, torch.float32),
    ("bf16", "bf16", torch.bfloat16), ("fp16", "fp16", torch.float16), ("bf16", "fp32", torch.float32)])
def test_grad_accum_dtype_reaches_the_policy(precision, value, dtype):
    overrides = [f"precision={precision}"] + ([f"precision.grad_accum_dtype={value}"] if value else [])
    cfg = compose(overrides)
    assert component(cfg, "precision").build(cfg.precision).grad_accum_dtype == dtype


@pytest.mark.parametrize("precision,value", [("fp32", "bf16"), ("bf16", "fp16"), ("fp16", "bf16"), ("bf16", "fp64")])
def test_grad_accum_dtype_other_values_are_refused(precision, value):
    with pytest.raises(ConfigError, match=rf"precision\.grad_accum_dtype='{value}' is not valid with "
                                          rf"precision={precision}; use "):
        compose([f"precision={precision}", f"precision.grad_accum_dtype={value}"])


@pytest.mark.parametrize("overrides,message", [
    (["precision=fp16", "precision.hysteresis=0"], r"precision\.hysteresis must be >= 1, got 0"),
    (["precision=fp16", "precision.loss_scale_window=0"], r"precision\.loss_scale_window must be >= 1"),
    (["precision=fp16", "precision.initial_scale_power=128"], r"precision\.initial_scale_power must be in \[0, 127\]"),
    (["precision=fp16", "precision.loss_scale=128", "precision.hysteresis=3"], r"precision\.hysteresis=3 has no effect"),
    (["+stage=ddp", "stage.bucket_size=0"], r"stage\.bucket_size must be >= 1 element, got 0"),
    (["+stage=zero1", "stage.allgather_bucket_size=0"], r"stage\.allgather_bucket_size must be >= 1 element, got 0"),
    (["+stage=zero2", "stage.reduce_bucket_size=0"], r"stage\.reduce_bucket_size must be >= 1 element, got 0"),
    (["+stage=zero3", "stage.stage3_prefetch_bucket_size=-1"], r"stage\.stage3_prefetch_bucket_size must be >= 0")])
def test_out_of_range_stage_and_precision_keys_are_refused_when_composed(overrides, message):
    """Checked with the config (before a run, or a sweep's first job, starts), not only when the engine is built."""
    with pytest.raises(ConfigError, match=message):
        compose(overrides)
