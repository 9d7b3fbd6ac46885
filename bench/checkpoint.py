"""Checkpoint save/load time and bytes: ours (sync and async) next to torch.save of the same
state and DeepSpeed's save_checkpoint / load_checkpoint, in one invocation.

Run (DeepSpeed from the bench site folder; see bench/cpu_adam.py's docstring for its install)::

    PYTHONPATH=.bench-venv/ds-site .venv/bin/python -m bench.checkpoint [--model gpt2-small] [--world 2]

Set-up: GPT-2 small (124.4 M parameters; vocab 50304 tied, context 1024 positions), fp32, AdamW,
ZeRO-2 on 2 gloo ranks (ours: ``+stage=zero2``; DeepSpeed: ``zero_optimization.stage=2`` with
``torch.optim.AdamW`` as client optimizer), 2 optimizer steps on random tokens (micro batch 1,
64 tokens) so the Adam moments exist, then per rank:

* ours sync: ``Checkpointer.save`` with ``checkpoint.async=false`` (DCP files, train state,
  checksums, manifest, commit), then a load of it into the engine (``Checkpointer.resume``:
  checksum verification, DCP read, re-slicing); torch.distributed.checkpoint's one-time import, which
  the package does on its first save, is done before, untimed;
* ours async: the time ``save`` blocks the training loop (the host copy of the state), the
  time from the call until the commit landed (while training went on), and the training time lost:
  ``--steps`` train steps run while the save is in flight against the same number without a save;
* torch.save: each rank ``torch.save`` of ``engine.state_dict(state)`` (the same fragments,
  one file per rank), fsynced, and its ``torch.load(weights_only=True)``;
* DeepSpeed: ``engine.save_checkpoint(dir)`` and ``engine.load_checkpoint(dir)``.

Times are wall seconds, the slower rank counts; bytes are the files on disk (all ranks).
Files go to ``--dir`` (default: a temp folder under /tmp, removed after).
"""
from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

MICRO, TOKENS = 1, 64


def _bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def _sync_all(world):
    if world > 1:
        torch.distributed.barrier()


def _batch(dist, vocab, pos):
    g = torch.Generator().manual_seed(pos * 100 + dist.rank)
    x = torch.randint(0, vocab, (MICRO, TOKENS + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def _model(name):
    from framework import compose
    from framework.engine.build import component

    cfg = compose([f"model={name}", "train.micro_batch=1", "train.steps=100", "logger=none", "+stage=zero2",
                   "optimizer=adamw", "scheduler=constant", "checkpoint.every=1"])
    torch.manual_seed(0)
    return cfg, component(cfg, "model").build(cfg.model, vocab_size=cfg.model.vocab_size)


def ours(dist, name, root, steps):
    from dataclasses import replace

    from framework import Batch, initialize
    from framework.persist.checkpoint import Checkpointer, glue
    from framework.models.gpt import gpt_loss

    cfg, model = _model(name)
    vocab = cfg.model.vocab_size
    out = {}
    with initialize(model, gpt_loss, cfg, dist) as engine:
        state = engine.state

        def step(s, pos):
            s, _ = engine.train_step(s, Batch((_batch(dist, vocab, pos),)))
            return s

        for pos in range(2):
            state = step(state, pos)
        # The package imports torch.distributed.checkpoint on its first save (most of a second, once per
        # process): done here, untimed, as the peers' save times include no such import.
        glue()
        for mode in ("sync", "async"):
            ck_cfg = replace(cfg, checkpoint=replace(cfg.checkpoint, dir=str(Path(root) / mode), async_=mode == "async",
                                                     keep_last=0, resume=str(Path(root) / mode)))
            ckpt = Checkpointer(ck_cfg, engine)
            try:
                _sync_all(dist.world)
                if mode == "async":  # baseline: steps without a save in flight
                    t = time.perf_counter()
                    for i in range(steps):
                        state = step(state, 10 + i)
                    out["steps_alone"] = time.perf_counter() - t
                _sync_all(dist.world)
                t = time.perf_counter()
                ckpt.save(state)
                out[f"{mode}_blocked"] = time.perf_counter() - t
                if mode == "async":
                    # the pool's one thread runs this after the save's files are written and committed: the
                    # commit's own time, not the end of the steps timed meanwhile
                    landed = ckpt.pool.submit(time.perf_counter)
                    t2 = time.perf_counter()
                    for i in range(steps):
                        state = step(state, 20 + i)
                    out["steps_with_save"] = time.perf_counter() - t2
                ckpt.wait()
                out[f"{mode}_total"] = (landed.result() if mode == "async" else time.perf_counter()) - t
                _sync_all(dist.world)
                if mode == "sync":
                    t = time.perf_counter()
                    state = ckpt.resume(state)
                    out["load"] = time.perf_counter() - t
            finally:
                ckpt.close()
        _sync_all(dist.world)
        # torch.save of the same per-rank state dict (fragments keyed by name).
        path = Path(root) / "torch" / f"rank{dist.rank}.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        _sync_all(dist.world)
        t = time.perf_counter()
        sd = engine.state_dict(state)
        with open(path, "wb") as f:
            torch.save(sd, f)
            f.flush()
            os.fsync(f.fileno())
        out["torch_save"] = time.perf_counter() - t
        del sd
        _sync_all(dist.world)
        t = time.perf_counter()
        torch.load(path, weights_only=True)
        out["torch_load"] = time.perf_counter() - t
    _sync_all(dist.world)
    if dist.rank == 0:
        out["bytes_ours"] = _bytes(Path(root) / "sync")
        out["bytes_torch"] = _bytes(Path(root) / "torch")
    return {"times": [0.0], **out}


def deepspeed(dist, name, root, steps):
    from bench.stages import _import_deepspeed
    from framework.models.gpt import gpt_loss

    ds = _import_deepspeed()
    cfg, model = _model(name)
    vocab = cfg.model.vocab_size
    opt = torch.optim.AdamW([{"params": [p for p in model.parameters() if p.ndim >= 2], "weight_decay": 0.1},
                             {"params": [p for p in model.parameters() if p.ndim < 2], "weight_decay": 0.0}],
                            lr=1e-4)
    ds_cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
              "zero_allow_untested_optimizer": True, "zero_optimization": {"stage": 2},
              "steps_per_print": 10 ** 9}
    engine, *_ = ds.initialize(model=model, optimizer=opt, config=ds_cfg)
    for pos in range(2):
        loss = gpt_loss(engine, _batch(dist, vocab, pos))
        engine.backward(loss)
        engine.step()
    out = {}
    d = Path(root) / "deepspeed"
    _sync_all(dist.world)
    t = time.perf_counter()
    engine.save_checkpoint(str(d), tag="step-2")
    _sync_all(dist.world)
    out["ds_save"] = time.perf_counter() - t
    t = time.perf_counter()
    engine.load_checkpoint(str(d), tag="step-2")
    _sync_all(dist.world)
    out["ds_load"] = time.perf_counter() - t
    if dist.rank == 0:
        out["bytes_ds"] = _bytes(d)
    return {"times": [0.0], **out}


def main(argv=None) -> None:
    from bench._common import machine, run_ranks_detail

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gpt2-small")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3, help="train steps timed with and without an async save")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--no-deepspeed", action="store_true")
    args = ap.parse_args(argv)
    root = Path(args.dir or tempfile.mkdtemp(prefix="bench-ckpt-"))
    load_before = os.getloadavg()
    try:
        _, _, mine = run_ranks_detail(args.world, ours, args.model, str(root), args.steps)
        theirs = None
        if not args.no_deepspeed:
            try:
                _, _, theirs = run_ranks_detail(args.world, deepspeed, args.model, str(root), args.steps)
            except Exception as e:  # report ours even if DeepSpeed cannot run here
                print(f"note: DeepSpeed failed: {type(e).__name__}: {str(e).strip().splitlines()[-1:]}")
        slow = lambda rs, k: max(r[k] for r in rs)  # noqa: E731
        gib = lambda b: b / 2 ** 30  # noqa: E731
        print(f"machine: {machine()}; model {args.model}, {args.world} gloo ranks, zero2, fp32 + AdamW; "
              f"load average before {load_before[0]:.1f}, after {os.getloadavg()[0]:.1f}")
        print("| system | save (s) | load (s) | bytes on disk (GiB) |")
        print("|---|---|---|---|")
        print(f"| ours, sync (DCP + checksums + commit) | {slow(mine, 'sync_total'):.2f} | {slow(mine, 'load'):.2f} "
              f"| {gib(mine[0]['bytes_ours']):.3f} |")
        print(f"| ours, async: loop blocked / until commit | {slow(mine, 'async_blocked'):.2f} / "
              f"{slow(mine, 'async_total'):.2f} | - | same |")
        print(f"| torch.save of engine.state_dict (per rank, fsync) | {slow(mine, 'torch_save'):.2f} | "
              f"{slow(mine, 'torch_load'):.2f} | {gib(mine[0]['bytes_torch']):.3f} |")
        if theirs:
            print(f"| DeepSpeed save_checkpoint / load_checkpoint | {slow(theirs, 'ds_save'):.2f} | "
                  f"{slow(theirs, 'ds_load'):.2f} | {gib(theirs[0]['bytes_ds']):.3f} |")
        alone, busy = slow(mine, "steps_alone"), slow(mine, "steps_with_save")
        print(f"training time lost to the async save: {args.steps} steps took {busy:.2f}s with the save in flight "
              f"vs {alone:.2f}s without (+{busy - alone:.2f}s; the save blocked the loop "
              f"{slow(mine, 'async_blocked'):.2f}s before that)")
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
