"""One-GPU checks of issues 3-5: s/step, tokens/s and peak memory of our stages next to plain PyTorch.

    python -m bench.gpu                       # every system below, REFERENCE §6 config, on cuda:0
    python -m bench.gpu --systems plain,zero2-offload,zero2-offload-overlap --steps 10
    python -m bench.gpu --tiny                # smoke test: a small GPT, a few steps, CPU is fine
    python -m bench.gpu --systems zero3-offload,zero3-nvme --nvme-dir /local/nvme   # NVMe rows

The config is REFERENCE §6: GPT d_model 2048, 24 layers, 16 heads, vocab 50304, context 1024
(`model=gpt-1b`, 1.417 B params), batch 16 x 1024 tokens, bf16, AdamW, clipping 1.0, world size 1.
Every system runs in its own subprocess, so peak memory is its own; each prints one JSON line and
the parent prints a markdown table with the anchors of REFERENCE §6 beside it. Per phase
(milliseconds, median): forward, backward (for zero2 offload with overlap_step the speculative host
steps run during it), reduce (gradient partitions to the host), apply (clip, optimizer step, copy
back and gather). The GPU is synchronised at each phase boundary; the step time comes from an
unsynchronised run of the same steps first.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch

SYSTEMS = {  # name -> overrides of ours (None: plain PyTorch)
    "plain": None,
    "zero2": ["+stage=zero2"],
    "zero3": ["+stage=zero3"],
    "zero2-offload": ["+stage=zero2", "offload=cpu"],
    "zero2-offload-overlap": ["+stage=zero2", "offload=cpu", "offload.overlap_step=true",
                              "stage.overlap_comm=true", "stage.reduce_bucket_size=50000000"],
    "zero3-offload": ["+stage=zero3", "offload=cpu", "offload.params=cpu"],
    # NVMe (ZeRO-Infinity): swap files under --nvme-dir (default: a temporary folder), 100 M-element tiles
    "zero2-nvme": ["+stage=zero2", "offload=nvme", "offload.sub_group_size=100000000",
                   "offload.pipeline_read=true", "offload.pipeline_write=true"],
    "zero3-nvme": ["+stage=zero3", "offload=nvme", "offload.sub_group_size=100000000",
                   "offload.pipeline_read=true", "offload.pipeline_write=true"],
}
ANCHORS = {"plain": "plain PyTorch 0.297 s, 54.8 GiB; FSDP2 CPU offload 0.818 s; DeepSpeed ZeRO-2 offload 0.934 s"}
FULL = ["model=gpt-1b", "train.micro_batch=16"]
TINY = ["model=gpt-nano", "model.vocab_size=512", "model.context=64", "train.micro_batch=4"]
COMMON = ["precision=bf16", "optimizer=adamw", "train.grad_clip=1.0", "scheduler=constant", "logger=none"]


def _batch(cfg, device, gen):
    b, t, v = cfg.train.micro_batch, cfg.model.context, cfg.model.vocab_size
    x = torch.randint(0, v, (b, t + 1), generator=gen).to(device)
    return x[:, :-1], x[:, 1:]


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, phases: dict, key: str, device):
    def wrapper(*a, **k):
        _sync(device)
        t = time.perf_counter()
        out = fn(*a, **k)
        _sync(device)
        phases.setdefault(key, []).append(time.perf_counter() - t)
        return out

    return wrapper


def _plain_step(cfg, device):
    from framework.build import component
    from framework.models.gpt import gpt_loss

    torch.manual_seed(0)
    with torch.device(device):
        model = component(cfg, "model").build(cfg.model)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.optimizer.weight_decay},
                             {"params": rest, "weight_decay": 0.0}], lr=cfg.optimizer.lr, fused=device.type == "cuda")

    def step(batch):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = gpt_loss(model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=False)
        return loss.item()

    return step, {}


def _ours_step(cfg, device):
    from framework import initialize
    from framework.build import component
    from framework.models.gpt import gpt_loss

    torch.manual_seed(0)
    with torch.device("meta"):
        model = component(cfg, "model").build(cfg.model)
    phases: dict = {}
    engine = initialize(model, lambda m, b: gpt_loss(m, b), cfg)
    box = {"state": engine.state}

    def step(batch):
        box["state"], m = engine.train_step(box["state"], [batch])
        return m["loss"]

    def instrument():
        c = engine.components
        c.stage.backward = _timed(c.stage.backward, phases, "backward", device)
        c.stage.reduce_grads = _timed(c.stage.reduce_grads, phases, "reduce", device)
        c.update.apply = _timed(c.update.apply, phases, "apply", device)
        object.__setattr__(c, "loss_fn", _timed(c.loss_fn, phases, "forward", device))

    return step, {"instrument": instrument, "phases": phases, "engine": engine}


def run_one(name: str, tiny: bool, warmup: int, steps: int, nvme_dir: str | None = None) -> dict:
    from framework.config import compose

    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    nvme = [f"offload.nvme_path={nvme_dir}"] if nvme_dir and "offload=nvme" in (SYSTEMS[name] or []) else []
    if tiny and "offload=nvme" in (SYSTEMS[name] or []):
        nvme.append("offload.sub_group_size=20000")
    cfg = compose([*(TINY if tiny else FULL), *COMMON, *(SYSTEMS[name] or []), *nvme])
    build = _plain_step if SYSTEMS[name] is None else _ours_step
    step, extra = build(cfg, device)
    gen = torch.Generator().manual_seed(0)
    batches = [_batch(cfg, device, gen) for _ in range(4)]
    losses, times = [], []
    for i in range(warmup + steps):
        _sync(device)
        t = time.perf_counter()
        losses.append(step(batches[i % len(batches)]))
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t)
    phases = {}
    if "instrument" in extra:
        extra["instrument"]()
        for i in range(min(steps, 5)):
            step(batches[i % len(batches)])
        phases = {k: round(statistics.median(v) * 1e3, 1) for k, v in extra["phases"].items()}
    s = statistics.median(times)
    out = {"system": name, "s_per_step": round(s, 4),
           "tokens_per_s": round(cfg.train.micro_batch * cfg.model.context / s),
           "peak_gpu_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None,
           "first_loss": losses[0], "last_loss": losses[-1], "phases_ms": phases, "device": str(device)}
    engine = extra.get("engine")
    if engine is not None:
        update = engine.components.update
        out["speculated_kept"], out["rolled_back"] = getattr(update, "kept", None), getattr(update, "rolled_back", None)
        if hasattr(update, "swap_stats"):   # offload=nvme: bytes moved and seconds blocked on IO, whole run
            out["swap"] = update.swap_stats()
        engine.close()
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--nvme-dir", default=None, help="folder for the swap files of the *-nvme systems")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(run_one(args.one, args.tiny, args.warmup, args.steps, args.nvme_dir)), flush=True)
        return
    names = [s for s in args.systems.split(",") if s]
    unknown = [s for s in names if s not in SYSTEMS]
    if unknown:
        ap.error(f"unknown system(s) {', '.join(unknown)}; choose from {', '.join(SYSTEMS)}")
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    print(f"{gpu}; torch {torch.__version__}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", flush=True)
    rows = []
    for name in names:
        cmd = [sys.executable, "-m", "bench.gpu", "--one", name, "--steps", str(args.steps),
               "--warmup", str(args.warmup), *(["--tiny"] if args.tiny else []),
               *(["--nvme-dir", args.nvme_dir] if args.nvme_dir else [])]
        p = subprocess.run(cmd, capture_output=True, text=True)
        lines = [line for line in p.stdout.splitlines() if line.startswith("{")]
        if p.returncode != 0 or not lines:
            print(f"{name}: failed (exit {p.returncode}): {(p.stderr.strip().splitlines() or ['?'])[-1]}", flush=True)
            continue
        rows.append(json.loads(lines[-1]))
        print(lines[-1], flush=True)
    base = next((r["s_per_step"] for r in rows if r["system"] == "plain"), None)
    print("\n| system | s/step | vs plain | tokens/s | peak GPU GiB | phases (ms) |\n|---|---|---|---|---|---|")
    for r in rows:
        ratio = f"{r['s_per_step'] / base:.2f}x" if base else "-"
        phases = ", ".join(f"{k} {v}" for k, v in r["phases_ms"].items())
        print(f"| {r['system']} | {r['s_per_step']:.3f} | {ratio} | {r['tokens_per_s']:,} | {r['peak_gpu_gib']} | {phases} |")
    print(f"\nREFERENCE §6 anchors (one H200): {ANCHORS['plain']}")


if __name__ == "__main__":
    main()
