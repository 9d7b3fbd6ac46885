"""Peak memory of partitioned construction and pretrained loading of an HF model (4 gloo ranks).

Measured, not added up: each rank returns unused heap to the OS (``malloc_trim``), resets its
peak resident set (``/proc/self/clear_refs``), notes its current RSS, runs the step and reads
the peak back (the high-water mark behind ``getrusage``, see ``_peak``); a load, which maps the
files, counts anonymous memory alone (``bench.nvme_checkpoint._Peak``). The model (a Llama, ~136 MiB of fp32 weights) is several times
the limit each rank must stay under: its shard (a quarter), the largest gather unit (one decoder
layer) and a fixed slack for the allocator and Python objects.
"""
from __future__ import annotations

import ctypes
import importlib.util
import resource

import pytest
import torch

import framework
from bench.nvme_checkpoint import _Peak
from tests._hf import build, hf_cfg, write_config

BIG = dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=20, num_attention_heads=6,
           num_key_value_heads=3, vocab_size=4096, max_position_embeddings=64)
SLACK = 12 * 2**20   # allocator and Python objects (measured: ~4 MiB)
# As in a real model only the norms stay gathered (the default 100,000 would keep this small model's
# k/v projections whole on every rank).
PERSIST = "stage.stage3_param_persistence_threshold=1000"
WORLD = 4


def _reset_peak() -> int:
    """Give freed heap back, reset the peak RSS; return the current RSS in bytes."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")   # resets the resident-set high-water mark (what getrusage reports)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _peak() -> int:
    """Peak RSS since the reset, in bytes: the process's high-water mark (VmHWM). getrusage's
    ru_maxrss is the same counter, except that it also keeps the mark a thread saw when it exited,
    which a reset cannot clear (gloo and transformers start and end threads)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) * 1024   # kB


def _sizes(model) -> tuple[int, int]:
    """(full fp32 bytes, bytes of the largest decoder layer)."""
    full = 4 * sum(p.numel() for p in model.parameters())
    layer = max(4 * sum(p.numel() for p in m.parameters()) for m in model.model.layers)
    return full, layer


def _construct(dist, path):
    from framework.engine.build import component
    from framework.engine.materialize import materialize_buffers

    cfg = hf_cfg(path, "model.context=64", "+stage=zero3", PERSIST)
    model, _ = build(cfg)
    full, layer = _sizes(model)
    stage = component(cfg, "stage").build(cfg.stage, dist=dist, offload=component(cfg, "offload").build(cfg.offload))
    policy = component(cfg, "precision").build(cfg.precision)
    before = _reset_peak()
    materialize_buffers(model, dist.device, policy.param_dtype)
    stage.setup(model, policy)      # the construction: one tensor at a time, this rank's shard kept
    grown = _peak() - before
    shard = sum(g.shard.numel() * g.shard.element_size() for g in stage.groups)
    name = "model.layers.3.mlp.up_proj.weight"
    p = dict(model.named_parameters())[name]
    with framework.gathered([p]):
        value = p.detach().clone()
    return full, layer, shard, grown, value


def test_partitioned_construction_peak_memory(pools, tmp_path):
    path = write_config("llama", tmp_path, **BIG)
    out = pools(WORLD).run(_construct, path, timeout=240)
    plain, _ = build(hf_cfg(path, "model.context=64"), meta=False)   # the same init path, whole
    for rank, (full, layer, shard, grown, value) in enumerate(out):
        limit = shard + layer + SLACK
        assert full > 2.5 * limit, "the model must be several times the limit"
        assert grown < limit, (f"rank {rank}: peak RSS grew {grown / 2**20:.1f} MiB > limit {limit / 2**20:.1f} MiB "
                               f"(shard {shard / 2**20:.1f}, layer {layer / 2**20:.1f}, model {full / 2**20:.1f})")
        assert torch.equal(value, dict(plain.named_parameters())["model.layers.3.mlp.up_proj.weight"])


needs_weights = pytest.mark.skipif(importlib.util.find_spec("framework.persist.weights") is None,
                                   reason="needs framework.persist.weights (contract C, branch weights)")


def _load(dist, path, folder):
    from framework.engine.build import component
    from framework.persist.weights import load_weights

    cfg = hf_cfg(path, "model.context=64", "+stage=zero3", PERSIST)
    model, _ = build(cfg)
    full, layer = _sizes(model)
    engine = framework.initialize(model, component(cfg, "model").loss, cfg, dist)
    shard = sum(g.shard.numel() * g.shard.element_size() for g in engine.components.stage.groups)
    reads = sum(len(spec.spans) for spec in engine.components.stage.piece_specs())   # ranges this rank reads
    with _Peak() as peak:   # anonymous memory: mapped file pages are page cache, mapped as the host chooses
        load_weights(engine, folder)    # sliced reads: this rank's ranges only
    grown = peak.result()["anon_bytes"]
    name = "model.layers.3.mlp.up_proj.weight"
    p = dict(model.named_parameters())[name]
    with framework.gathered([p]):
        value = p.detach().clone()
    engine.close()
    return full, layer, shard, grown, value, reads


@needs_weights
def test_pretrained_loading_peak_memory(pools, tmp_path):
    path = write_config("llama", tmp_path / "config", **BIG)
    plain, _ = build(hf_cfg(path, "model.context=64"), meta=False)
    with torch.no_grad():
        for p in plain.parameters():
            p.add_(0.5)   # differs from what the ranks initialise themselves
    folder = tmp_path / "pretrained"
    plain.save_pretrained(folder, max_shard_size="20MB")   # transformers' writer: sharded, with an index
    assert (folder / "model.safetensors.index.json").is_file()
    out = pools(WORLD).run(_load, path, folder, timeout=240)
    for rank, (full, layer, shard, grown, value, reads) in enumerate(out):
        # Safetensors maps the files: their pages are shared page cache, not copies, and how many of them
        # a read maps depends on the host; measured is the anonymous memory (heap and tensors) alone.
        limit = shard + layer + SLACK
        assert full > 2 * limit, "the model must be several times the limit"
        assert grown < limit, (f"rank {rank}: loading grew the peak anonymous RSS by {grown / 2**20:.1f} MiB > limit "
                               f"{limit / 2**20:.1f} MiB (shard {shard / 2**20:.1f}, layer {layer / 2**20:.1f}, "
                               f"{reads} ranges, model {full / 2**20:.1f})")
        assert torch.equal(value, dict(plain.named_parameters())["model.layers.3.mlp.up_proj.weight"])
