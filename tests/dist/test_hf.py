"""Hugging Face models (GPT-2 and Llama from tiny configs) on 2 gloo ranks.

* ddp, zero1, zero2, zero3 and zero3 with CPU offload, all built on the meta device through
  ``model=hf``, match the plain model trained by a plain PyTorch loop on one process, step by
  step (fp32: losses and gradient norms to 1e-6 relative, final parameters to 1e-6 relative /
  1e-7 absolute); with AdamW and clipping, and (gpt2) with plain SGD at a constant lr, unclipped,
  where a wrong gradient scale shows in the parameters.
* Greedy ``generate`` under zero3 (forward passes with gathers, no backward, HF's KV cache)
  gives the plain model's tokens; a partitioned parameter's repr names its full shape and shard.
* Pretrained folders (``model.pretrained``) and ``engine.save_pretrained`` round trips: these use
  ``framework.persist.weights`` (contract C) and are skipped until it exists.
"""
from __future__ import annotations

import importlib.util

import pytest
import torch

import framework
from tests._hf import BASE, ZERO3, build, gathered_params, hf_cfg, plain_losses, write_config

RTOL = 1e-6
OFFLOAD_PARAMS = "offload.params=cpu"   # zero3 parameter shards on the host too
STAGES = {
    "ddp": [],
    "zero1": ["+stage=zero1"],
    "zero2": ["+stage=zero2", "stage.reduce_bucket_size=1000"],      # several buckets
    "zero3": ["+stage=zero3", *ZERO3],
    "zero3-offload": ["+stage=zero3", *ZERO3, "offload=cpu", OFFLOAD_PARAMS],
    # transformers' checkpointing recomputes each layer's forward inside backward, outside our hooks.
    "zero3-checkpointing": ["+stage=zero3", *ZERO3, "model.activation_checkpointing=true"],
}
TRAIN = ["train.steps=3", "train.grad_accum=2", "train.grad_clip=0.5"]
SGD = [*TRAIN, "optimizer=sgd", "optimizer.lr=0.5", "scheduler=constant", "train.grad_clip=0"]
needs_weights = pytest.mark.skipif(importlib.util.find_spec("framework.persist.weights") is None,
                                   reason="needs framework.persist.weights (contract C, branch weights)")


def _train_all(dist, path, train):
    out = {}
    for name, overrides in STAGES.items():
        cfg = hf_cfg(path, *train, *overrides)
        model, data = build(cfg)
        from framework.engine.build import component
        torch.manual_seed(cfg.seed + dist.rank)   # a seed per rank: every stage materialises rank 0's values
        engine = framework.initialize(model, component(cfg, "model").loss, cfg, dist)
        state, losses, norms = engine.state, [], []
        for _ in range(cfg.train.steps):
            batch = data.train_batch(state.data, micro_batch=cfg.train.micro_batch, grad_accum=cfg.train.grad_accum,
                                     rank=dist.rank, world=dist.world)
            state, m = engine.train_step(state, batch)
            losses.append(m["loss"])
            norms.append(m["grad_norm"])
        out[name] = (losses, norms, gathered_params(model))
        engine.close()
    return out


@pytest.mark.parametrize("arch,train", [("gpt2", TRAIN), ("llama", TRAIN), ("gpt2", SGD)],
                         ids=["gpt2", "llama", "gpt2-sgd"])
def test_every_stage_matches_plain_loop(pools, tmp_path, arch, train):
    path = write_config(arch, tmp_path)
    results = pools(2).run(_train_all, path, train, timeout=240)
    ref_norms = []
    ref_losses, ref_model = plain_losses(hf_cfg(path, *train), world=2, norms=ref_norms)
    ref = dict(ref_model.named_parameters())
    for rank, res in enumerate(results):
        for stage, (losses, norms, params) in res.items():
            for i, (a, b) in enumerate(zip(losses, ref_losses, strict=True)):
                assert a == pytest.approx(b, rel=RTOL), f"{arch} {stage} rank {rank} step {i}: {a} vs plain {b}"
            for i, (a, b) in enumerate(zip(norms, ref_norms, strict=True)):
                assert a == pytest.approx(b, rel=RTOL), \
                    f"{arch} {stage} rank {rank} step {i}: grad norm {a} vs plain {b}"
            assert params.keys() == ref.keys()
            for n, p in params.items():
                torch.testing.assert_close(p, ref[n].detach(), rtol=RTOL, atol=1e-7,
                                           msg=lambda m: f"{arch} {stage} rank {rank} {n}: {m}")


def _generate(dist, path):
    from framework.engine.build import component

    cfg = hf_cfg(path, "+stage=zero3", *ZERO3)
    model, _ = build(cfg)
    engine = framework.initialize(model, component(cfg, "model").loss, cfg, dist)
    weight = model.transformer.h[0].mlp.c_fc.weight
    text = repr(weight)
    # The tied head and embedding stay one parameter: one partition, one unit.
    assert model.lm_head.weight is model.transformer.wte.weight
    assert model.lm_head.weight.unit_name == "transformer.wte+lm_head"
    prompt = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]]) + 10 * dist.rank   # different prompts per rank
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None)
    ours = model.generate(prompt, **kw)                          # KV cache on (the default)
    synced = model.generate(prompt, synced_gpus=True, use_cache=False, **kw)
    engine.close()
    return text, tuple(weight.shape), ours, synced, prompt


def test_generate_under_zero3_matches_plain_and_repr(pools, tmp_path):
    path = write_config("gpt2", tmp_path)
    out = pools(2).run(_generate, path, timeout=120)
    plain, _ = build(hf_cfg(path), meta=False)
    for rank, (text, shape, ours, synced, prompt) in enumerate(out):
        expected = plain.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None)
        assert torch.equal(ours, expected) and torch.equal(synced, expected), (rank, ours, expected)
        # Block 0's 2-D weights in one flat group: c_attn 3072, attn.c_proj 1024, c_fc 4096, mlp.c_proj
        # 4096 elements = 12288, 6144 per rank; c_fc (elements 4096..8192) is split in the middle.
        assert shape == (0,)
        assert text.startswith("ShardedParameter(shape=(32, 128)") and "sharded" in text, text
        assert f"this rank holds elements [{2048 * rank}, {2048 * (rank + 1)}) of 4096" in text, text


# --- pretrained folders and export (framework.persist.weights) ------------------------------------------


def _save_then_load(dist, path, out_dir):
    """Train zero3 a little, save_pretrained, then run the command-line loop on model.pretrained."""
    from framework.engine.build import component
    from framework.loggers._base import RunInfo
    from framework.cli.loop import train

    cfg = hf_cfg(path, "+stage=zero3", *ZERO3, "train.steps=2")
    model, data = build(cfg)
    engine = framework.initialize(model, component(cfg, "model").loss, cfg, dist)
    state = engine.state
    for _ in range(2):
        batch = data.train_batch(state.data, micro_batch=2, grad_accum=1, rank=dist.rank, world=dist.world)
        state, _ = engine.train_step(state, batch)
    engine.save_pretrained(out_dir)
    params = gathered_params(model)
    engine.close()
    loaded = framework.compose([*BASE, f"model.pretrained={out_dir}", "+stage=zero3", *ZERO3, "train.steps=1",
                                "stage.stage3_gather_16bit_weights_on_model_save=true"])
    summary = train(loaded, RunInfo(out_dir.parent / "run", None, None), dist)   # train_loss: step 0's loss
    return params, summary["train_loss"], (summary.get("exported"), summary.get("exported_dtype"))


@needs_weights
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_save_pretrained_round_trip_and_pretrained_first_loss(pools, tmp_path, arch):
    from transformers import AutoModelForCausalLM

    from framework.models.hf import causal_lm_loss

    path = write_config(arch, tmp_path / "config")
    out_dir = tmp_path / "export"
    results = pools(2).run(_save_then_load, path, out_dir, timeout=180)
    params, first_loss, (exported, exported_dtype) = results[0]
    # Export -> from_pretrained: bitwise the gathered parameters (fp32).
    hf = AutoModelForCausalLM.from_pretrained(out_dir, local_files_only=True)
    loaded = dict(hf.named_parameters())
    assert loaded.keys() == params.keys()
    for n, p in params.items():
        assert torch.equal(loaded[n], p), n
    # model.pretrained under zero3 on 2 ranks: the first loss is the plain model's on that batch.
    cfg = hf_cfg(path)
    _, data = build(cfg)
    batch = data.train_batch(0, micro_batch=4, grad_accum=1, rank=0, world=1)
    with torch.no_grad():
        expected = causal_lm_loss(hf, batch.micro[0]).item()
    assert first_loss == pytest.approx(expected, rel=RTOL)
    # The end-of-run export (stage3_gather_16bit_weights_on_model_save) of that run loads the same way.
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / exported, local_files_only=True)
    assert exported_dtype == "fp32"   # (the working dtype the done: line names, whatever "16bit" says)
    assert type(again) is type(hf) and again.config.vocab_size == hf.config.vocab_size
