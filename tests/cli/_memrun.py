"""Measure a configuration's memory the way the OS sees it, in fresh processes (one per rank).

    python -m tests.cli._memrun '{"overrides": ["+stage=zero2", "model=gpt-mini"], "world": 2, "steps": 2}'

Each rank first trains one step of the same configuration with a tiny model (so modules, kernels
and thread pools are loaded; for ``model=hf model.config=...`` a config.json of the same model_type), with the
model's own loss, composes the config, builds the data and the model on the meta
device, asks glibc to return freed memory (``malloc_trim``) and reads its resident set (``/proc/self/statm``): the
baseline, and resets the kernel's peak resident set to it (``clear_refs``), so that a peak reached
earlier (imports, the warm-up) cannot hide the run's own. Then it builds the engine and trains ``steps``
steps, trims again and reads the resident set (``steady``: what the run keeps between steps), and the
peak resident set since the baseline (``VmHWM``).
Prints one JSON list (per rank) on the last line. Nothing here reads the framework's memory ledger.
"""
from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import sys
import tempfile

import torch
import torch.multiprocessing as mp


def _rss() -> int:
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _rank(rank: int, spec: dict, world: int, store: str, out_dir: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    from framework.engine.build import component, initialize
    from framework.config import compose
    from framework.comm.distributed import connect

    cfg = compose(spec["overrides"])
    dist = connect("gloo", 120, store_path=store) if world > 1 else connect("gloo", 120)
    torch.manual_seed(cfg.seed)
    data = component(cfg, "data").build(cfg.data, seed=cfg.seed, context=cfg.model.context)
    with torch.device("meta"):
        module = component(cfg, "model").build(cfg.model, vocab_size=data.vocab_size)
    batches = [data.train_batch(i, micro_batch=cfg.train.micro_batch, grad_accum=cfg.train.grad_accum,
                                rank=dist.rank, world=dist.world) for i in range(spec["steps"])]
    _warm_up(spec["overrides"], cfg, dist, out_dir)
    base = _reset_hwm()
    engine = initialize(module, component(cfg, "model").loss, cfg, dist)
    state = engine.state
    built = _rss()
    for b in batches:
        state, _ = engine.train_step(state, b)
    steady = _rss()
    peak = _hwm()
    result = {"base": base, "built": built, "steady": steady, "peak": peak}
    if spec.get("checkpoint"):
        result.update(_checkpoint(cfg, engine, state, spec["checkpoint"]))
    engine.close()
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
        json.dump(result, f)
    if world > 1:
        dist.barrier("memrun end")
        torch.distributed.destroy_process_group()


def _hwm() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def _reset_hwm() -> int:
    """Reset the kernel's peak resident set to the current one (``clear_refs`` 5); the new baseline."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _hwm()


def _checkpoint(cfg, engine, state, folder: str) -> dict:
    """Peak resident set over a checkpoint save, then over its load, then over ``save_weights`` and
    ``load_weights`` (safetensors, fp32) of the same state, each above the resident set just
    before it (``spec["checkpoint"]``: the folder to write them to)."""
    from framework.persist.checkpoint import Checkpointer

    cfg = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, dir=folder))   # (frozen)
    ckpt = Checkpointer(cfg, engine)
    try:
        base = _reset_hwm()
        ckpt.save(state)
        ckpt.wait()
        save_peak = _hwm() - base
        base = _reset_hwm()
        ckpt.cfg = dataclasses.replace(ckpt.cfg, resume="auto")   # (the checkpoint section; frozen)
        loaded = ckpt.resume(state)
        load_peak = _hwm() - base
    finally:
        ckpt.close()
    assert loaded.step == state.step
    from framework.persist.weights import load_weights, save_weights

    base = _reset_hwm()
    save_weights(engine, os.path.join(folder, "weights"))
    weights_save_peak = _hwm() - base
    base = _reset_hwm()
    load_weights(engine, os.path.join(folder, "weights"))
    weights_load_peak = _hwm() - base
    return {"save_peak": save_peak, "load_peak": load_peak, "weights_save_peak": weights_save_peak,
            "weights_load_peak": weights_load_peak}


def _warm_up(overrides: list[str], cfg, dist, folder: str) -> None:
    """One step of the same configuration with a tiny model, so that the baseline already holds
    everything a run loads once whatever the model size (modules, the C++ kernels, thread pools)."""
    from framework.engine.build import component, initialize
    from framework.config import compose

    cfg = compose([*overrides, *_tiny_model(cfg, folder, dist.rank), "train.micro_batch=1"])
    data = component(cfg, "data").build(cfg.data, seed=cfg.seed, context=cfg.model.context)
    with torch.device("meta"):
        module = component(cfg, "model").build(cfg.model, vocab_size=data.vocab_size)
    with initialize(module, component(cfg, "model").loss, cfg, dist) as engine:
        engine.train_step(engine.state, data.train_batch(0, micro_batch=1, grad_accum=cfg.train.grad_accum,
                                                         rank=dist.rank, world=dist.world))


# A Hugging Face config.json's size keys, shrunk for the warm-up (the same model_type, so the same code paths).
_HF_TINY = {"num_hidden_layers": 1, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2,
            "num_key_value_heads": 1, "head_dim": 16, "vocab_size": 128}


def _tiny_model(cfg, folder: str, rank: int) -> list[str]:
    """Overrides for a tiny model of ``cfg``'s kind: a GPT preset's size keys, or (``model=hf model.config=``) a
    config.json of the same model_type with ``_HF_TINY``'s sizes, written to ``folder``."""
    if cfg.choices["model"] != "hf":
        return ["model.n_layer=1", "model.d_model=32", "model.n_head=2"]
    if cfg.model.config is None:
        raise SystemExit("_memrun: model=hf is measured from model.config=path/to/config.json, not model.pretrained")
    src = cfg.model.config if cfg.model.config.endswith(".json") else os.path.join(cfg.model.config, "config.json")
    with open(src) as f:
        raw = json.load(f)
    tiny = {**raw, **{k: v for k, v in _HF_TINY.items() if k in raw}}
    if raw.get("layer_types"):
        tiny["layer_types"] = raw["layer_types"][:1]
    path = os.path.join(folder, f"tiny-{rank}.json")
    with open(path, "w") as f:
        json.dump(tiny, f)
    return [f"model.config={path}"]


def main() -> None:
    spec = json.loads(sys.argv[1])
    world = spec.get("world", 1)
    with tempfile.TemporaryDirectory(prefix="memrun-") as d:
        if world == 1:
            _rank(0, spec, 1, "", d)
        else:
            mp.start_processes(_rank, args=(spec, world, os.path.join(d, "store"), d), nprocs=world,
                               join=True, start_method="spawn")
        print(json.dumps([json.load(open(os.path.join(d, f"{r}.json"))) for r in range(world)]))


if __name__ == "__main__":
    main()
