"""Where a step's time goes: phase timings per rank for our stages and for torch DDP.

    .bench-venv/bin/python -m bench.phases [--systems ddp,zero1,zero2,torch-ddp] [--steps 20] [--kernel torch]

Same model, batch, optimizer and ranks as ``bench.stages``, and the same optimizer kernel: by default
torch's fused AdamW for every system (ours with ``FRAMEWORK_OPS=0``), ``--kernel ours`` our C++ CPU
kernel for our stages. Our stage's methods are wrapped
from outside (nothing in framework/ changes): forward = the loss function, backward =
``stage.backward`` (autograd plus whatever communication it launches and waits for),
reduce = ``stage.reduce_grads``, norm = ``stage.grad_sq_norm`` (an all-reduce and the sync
point), publish = ``stage.publish`` (the parameter gather), rest = the remainder of
``train_step`` (clipping, optimizer, zeroing, loss all-reduce). torch DDP (built as in
``bench.stages``: ``gradient_as_bucket_view=True``): forward, backward (with DDP's overlapped
all-reduce), clip, optimizer step, zero_grad + loss all-reduce.
Medians over ``--steps`` steps after 3 warm-up, per rank, in milliseconds.
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch

from bench.stages import (ADAMW, CLIP, MICRO, OURS, OVERRIDES, WARMUP, _adamw_groups, _busy_seconds, _global_loss,
                          _wrap_ddp, kernel_option, use_kernel)

SYSTEMS = [*OURS, "torch-ddp"]


def _timed(fn, phases, key):
    def wrapper(*a, **k):
        t = time.perf_counter()
        out = fn(*a, **k)
        phases[key] += time.perf_counter() - t
        return out

    return wrapper


def run_phases(dist, name: str, steps: int) -> dict:
    from framework import compose, initialize
    from framework.engine.build import component
    from framework.models.gpt import gpt_loss

    cfg = compose(OVERRIDES + OURS.get(name, []))
    data = component(cfg, "data").build(cfg.data, seed=0, context=cfg.model.context)
    torch.manual_seed(0)
    model = component(cfg, "model").build(cfg.model, vocab_size=data.vocab_size)
    phases: dict[str, float] = defaultdict(float)
    if name in OURS:
        engine = initialize(model, _timed(gpt_loss, phases, "forward"), cfg, dist)
        stage = engine.components.stage
        for m, key in (("backward", "backward"), ("reduce_grads", "reduce"), ("grad_sq_norm", "norm"),
                       ("publish", "publish")):
            setattr(stage, m, _timed(getattr(stage, m), phases, key))
        box = {"state": engine.state}

        def step(pos):
            batch = data.train_batch(box["state"].data, micro_batch=MICRO, grad_accum=1, rank=dist.rank,
                                     world=dist.world)
            t = time.perf_counter()
            box["state"], _ = engine.train_step(box["state"], batch)
            phases["rest"] += time.perf_counter() - t - sum(v for k, v in phases.items() if k != "rest")
    else:  # torch-ddp
        model = _wrap_ddp(model)
        opt = torch.optim.AdamW(_adamw_groups(model.parameters()), **ADAMW, fused=True)

        def step(pos):
            batch = data.train_batch(pos, micro_batch=MICRO, grad_accum=1, rank=dist.rank, world=dist.world)
            t0 = time.perf_counter()
            loss = gpt_loss(model, batch.micro[0])
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            t3 = time.perf_counter()
            opt.step()
            t4 = time.perf_counter()
            opt.zero_grad(set_to_none=False)
            _global_loss(loss, dist.world)
            t5 = time.perf_counter()
            for k, v in zip(("forward", "backward", "clip", "optimizer", "rest"), (t1 - t0, t2 - t1, t3 - t2,
                                                                                   t4 - t3, t5 - t4)):
                phases[k] += v

    per_step = defaultdict(list)
    for pos in range(WARMUP + steps):
        phases.clear()
        t = time.perf_counter()
        step(pos)
        total = time.perf_counter() - t
        if pos >= WARMUP:
            for k, v in phases.items():
                per_step[k].append(v)
            per_step["total"].append(total)
    return {"times": per_step["total"], "phases": {k: statistics.median(v) for k, v in per_step.items()}}


def main(argv: list[str] | None = None) -> None:
    from bench._common import machine, run_ranks_detail

    ap = argparse.ArgumentParser()
    ap.add_argument("--systems", default="ddp,zero1,zero1-overlap,zero2,zero2-overlap,torch-ddp",
                    help=f"comma-separated, from: {', '.join(SYSTEMS)}")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--world", type=int, default=2)
    kernel_option(ap)
    args = ap.parse_args(argv)
    names = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in names if s not in SYSTEMS]
    if unknown or not names:
        ap.error(f"unknown system(s) {', '.join(unknown) or '(none given)'}; choose from {', '.join(SYSTEMS)}")
    use_kernel(ap, args.kernel)
    kernel = "torch fused AdamW (same as torch-ddp)" if args.kernel == "torch" else "our C++ CPU kernel"
    print(f"{machine()}; {args.world} gloo ranks; our optimizer kernel: {kernel}; median ms per step and phase, "
          f"each rank\n")
    for name in names:
        b0, o0, w0 = *_busy_seconds(), time.perf_counter()
        _, _, infos = run_ranks_detail(args.world, run_phases, name, args.steps)
        b1, o1, w1 = *_busy_seconds(), time.perf_counter()
        print(f"{name:14s} (other processes used {max(0.0, (b1 - b0) - (o1 - o0)) / (w1 - w0):.2f} cores)")
        for rank, info in enumerate(infos):
            cells = "  ".join(f"{k} {v * 1e3:6.1f}" for k, v in info["phases"].items())
            print(f"{name:14s} rank {rank}: {cells}", flush=True)


if __name__ == "__main__":
    main()
