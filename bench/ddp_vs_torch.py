"""Our ddp stage vs torch DistributedDataParallel: step time and peak RSS per rank.

    .venv/bin/python bench/ddp_vs_torch.py [--rounds 3] [--steps 20]

Same model (GPT, 6 layers, d 384, vocab 256, context 128: ~10.9 M params), same batch
(8 sequences per rank), fp32, AdamW (torch: fused=True, the fastest torch CPU AdamW),
gradient clipping at 1.0, 2 gloo ranks with one thread each. Median step time over
``--steps`` steps after 3 warm-up steps, the slower rank counts; systems alternate.
"""
from __future__ import annotations

import argparse
import statistics

import torch

OVERRIDES = ["model=gpt-mini", "model.context=128", "data.vocab_size=256", "train.micro_batch=8",
             "train.steps=1000", "logger=none"]


def ours(dist, steps: int) -> list[float]:
    from framework import compose, initialize
    from framework.build import component
    from framework.models.gpt import gpt_loss
    from bench._common import time_steps

    cfg = compose(OVERRIDES)
    torch.manual_seed(0)
    data = component(cfg, "data").build(cfg.data, seed=0, context=cfg.model.context)
    engine = initialize(component(cfg, "model").build(cfg.model, vocab_size=data.vocab_size), gpt_loss, cfg, dist)
    box = {"state": engine.state}

    def step():
        s = box["state"]
        batch = data.train_batch(s.data, micro_batch=8, grad_accum=1, rank=dist.rank, world=dist.world)
        box["state"], _ = engine.train_step(s, batch)

    return time_steps(step, 3, steps)


def torch_ddp(dist, steps: int) -> list[float]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from framework import compose
    from framework.build import component
    from framework.models.gpt import gpt_loss
    from bench._common import time_steps

    cfg = compose(OVERRIDES)
    torch.manual_seed(0)
    data = component(cfg, "data").build(cfg.data, seed=0, context=cfg.model.context)
    model = DDP(component(cfg, "model").build(cfg.model, vocab_size=data.vocab_size))
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    o = cfg.optimizer
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": o.weight_decay}, {"params": rest, "weight_decay": 0}],
                            lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, fused=True)
    box = {"pos": 0}

    def step():
        batch = data.train_batch(box["pos"], micro_batch=8, grad_accum=1, rank=dist.rank, world=dist.world)
        box["pos"] += 1
        loss = gpt_loss(model, batch.micro[0])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=False)
        # The same per-step global loss all-reduce that our train_step does for its metrics.
        torch.distributed.all_reduce(loss.detach())
        loss.item()

    return time_steps(step, 3, steps)


def main() -> None:
    from bench._common import machine, run_ranks

    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--world", type=int, default=2)
    args = ap.parse_args()
    systems = {"framework ddp": ours, "torch DDP": torch_ddp}
    results: dict[str, list] = {k: [] for k in systems}
    for r in range(args.rounds):
        for name, fn in (systems.items() if r % 2 == 0 else reversed(systems.items())):
            results[name].append(run_ranks(args.world, fn, args.steps))
            print(f"round {r} {name}: {results[name][-1][0]:.3f} s/step", flush=True)
    base = statistics.median(t for t, _ in results["torch DDP"])
    print(f"\n{machine()}; {args.world} gloo ranks, 1 thread each; median over {args.rounds} rounds of the "
          f"per-round median of {args.steps} steps\n")
    print("| system | s/step | vs torch DDP | peak RSS per rank (MiB) |\n|---|---|---|---|")
    for name, runs in results.items():
        t = statistics.median(x for x, _ in runs)
        rss = max(max(r) for _, r in runs) / 2**20
        print(f"| {name} | {t:.3f} | {t / base:.3f}x | {rss:.0f} |")


if __name__ == "__main__":
    main()
