"""One-GPU benchmark: s/step, tokens/s and peak memory of our stages next to plain PyTorch, FSDP2
and (where installed; its rows are left out, saying so, where not) DeepSpeed, on the anchor config.

    python -m bench.gpu                       # every system below, on cuda:0
    python -m bench.gpu --systems plain,zero2-offload,zero2-offload-overlap --steps 10
    python -m bench.gpu --tiny                # smoke test: a small GPT, a few steps, CPU is fine (GPU-only
                                              # peers left out there, saying so)
    python -m bench.gpu --systems zero3-offload,zero3-nvme --nvme-dir /local/nvme   # NVMe rows

The anchor config: GPT d_model 2048, 24 layers, 16 heads, vocab 50304, context 1024 (``model=gpt-1b``,
1.417 B params), batch 16 x 1024 tokens, bf16, AdamW, clipping 1.0, world size 1. Every system runs
in its own subprocess, so peak memory is its own; each prints one JSON line and the parent prints
a markdown table with reference anchors beside it (another run on one H200 with another harness,
torch 2.11, DeepSpeed 0.19.8: not a side-by-side measurement).
Our rows also carry the estimator's device peak for the same config (``framework.memory.model``).
Per phase (milliseconds, median): forward, backward (for zero2 offload with overlap_step the
speculative host steps run during it), reduce (gradient partitions to the host), apply (clip,
optimizer step, copy back and gather). The GPU is synchronised at each phase boundary; the step
time comes from an unsynchronised run of the same steps first.
"""
from __future__ import annotations

import argparse
import importlib.util
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
    # (zero3 swaps parameters through buffers that must hold the largest tile: the embedding, 103 M)
    "zero3-nvme": ["+stage=zero3", "offload=nvme", "offload.sub_group_size=100000000",
                   "offload.param_buffer_size=200000000", "offload.pipeline_read=true", "offload.pipeline_write=true"],
}
# Peers (not our code): FSDP2 with and without CPU offload, DeepSpeed ZeRO-2 with CPU offload.
PEERS = ("fsdp2", "fsdp2-offload", "deepspeed-zero2-offload")
# Peers that cannot run without a GPU (left out there, saying so): FSDP2's CPUOffloadPolicy moves its
# parameters to and from the accelerator.
GPU_ONLY = {"fsdp2-offload": "FSDP2's CPUOffloadPolicy needs an accelerator"}
# Reference numbers from another run on one H200 with another harness (16 host cores, torch 2.11,
# DeepSpeed 0.19.8), not measured beside ours: s/step, peak GPU GiB.
ANCHORS = {"plain": (0.297, 54.8), "fsdp2": (0.283, 49.7), "fsdp2-offload": (0.818, 33.8),
           "deepspeed-zero2-offload": (0.934, 36.3), "zero2": (0.328, 51.9), "zero3": (0.356, 55.5),
           "zero2-offload": (0.934, 36.3), "zero3-offload": (1.021, 36.2)}
ANCHOR_NAMES = {"plain": "plain PyTorch", "fsdp2": "FSDP2", "fsdp2-offload": "FSDP2 + CPUOffloadPolicy",
                "deepspeed-zero2-offload": "DeepSpeed ZeRO-2 offload", "zero2": "DeepSpeed ZeRO-2",
                "zero3": "DeepSpeed ZeRO-3", "zero2-offload": "DeepSpeed ZeRO-2 offload",
                "zero3-offload": "DeepSpeed ZeRO-3 offload"}
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
    from framework.engine.build import component
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
        opt.zero_grad()   # (set_to_none, torch's default and the peers': no fp32 gradients through the next forward)
        return loss.item()

    return step, {"model": model}


def _world_one_group(device) -> None:
    """A one-rank process group for the peers that need one (FSDP2, DeepSpeed)."""
    import torch.distributed as tdist

    if not tdist.is_initialized():
        tdist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=tdist.HashStore(), rank=0,
                                 world_size=1, device_id=device if device.type == "cuda" else None)


def _fsdp2_step(cfg, device, offload: bool):
    """FSDP2 (torch's fully_shard), bf16 compute, fp32 master, per-Block units; with ``offload`` its
    CPUOffloadPolicy (parameters, gradients and the fused AdamW step on the host)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    from framework.engine.build import component
    from framework.models.gpt import gpt_loss

    _world_one_group(device)
    torch.manual_seed(0)
    with torch.device(device):
        model = component(cfg, "model").build(cfg.model)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    extra = {"offload_policy": CPUOffloadPolicy()} if offload else {}
    for m in model.modules():
        if type(m).__name__ == "Block":
            fully_shard(m, mp_policy=mp, **extra)
    fully_shard(model, mp_policy=mp, **extra)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.optimizer.weight_decay},
                             {"params": rest, "weight_decay": 0.0}], lr=cfg.optimizer.lr, fused=True)

    def step(batch):
        loss = gpt_loss(model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        opt.step()
        opt.zero_grad()
        return loss.item()

    return step, {}


def _deepspeed_step(cfg, device):
    """DeepSpeed ZeRO-2 with offload_optimizer=cpu (DeepSpeedCPUAdam), bf16; only where installed."""
    import deepspeed

    from framework.engine.build import component
    from framework.models.gpt import gpt_loss

    _world_one_group(device)
    torch.manual_seed(0)
    with torch.device(device):
        model = component(cfg, "model").build(cfg.model)
    ds = {"train_micro_batch_size_per_gpu": cfg.train.micro_batch, "gradient_accumulation_steps": 1,
          "gradient_clipping": cfg.train.grad_clip, "bf16": {"enabled": True},
          "optimizer": {"type": "AdamW", "params": {"lr": cfg.optimizer.lr, "weight_decay": cfg.optimizer.weight_decay}},
          "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)

    def step(batch):
        loss = gpt_loss(engine, batch)
        engine.backward(loss)
        engine.step()
        return loss.item()

    return step, {}


def _predicted_gib(cfg, device) -> float | None:
    """The estimator's device peak for ``cfg`` at world size 1 (GiB)."""
    from framework.memory.model import predict
    from framework.engine.build import component

    try:
        with torch.device("meta"):   # the model as the benchmark builds it (its own vocabulary)
            module = component(cfg, "model").build(cfg.model)
        return round(predict(cfg, world=1, module=module).device_peak(device.type == "cuda") / 2**30, 2)
    except Exception:  # noqa: BLE001 - a benchmark row without a prediction rather than none at all
        return None


def _ours_step(cfg, device):
    from framework import initialize
    from framework.engine.build import component
    from framework.models.gpt import gpt_loss

    torch.manual_seed(0)
    with torch.device("meta"):
        model = component(cfg, "model").build(cfg.model)
    phases: dict = {}
    engine = initialize(model, lambda m, b: gpt_loss(m, b), cfg)
    box = {"state": engine.state}

    def step(batch):
        box["state"], m = engine.train_step(box["state"], [batch] * cfg.train.grad_accum)   # (one, unless set)
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
    nvme = [f"offload.nvme_path={nvme_dir}"] if nvme_dir and "offload=nvme" in (SYSTEMS.get(name) or []) else []
    if tiny and "offload=nvme" in (SYSTEMS.get(name) or []):
        nvme.append("offload.sub_group_size=20000")
    cfg = compose([*(TINY if tiny else FULL), *COMMON, *(SYSTEMS.get(name) or []), *nvme])
    if name in PEERS:
        step, extra = (_deepspeed_step(cfg, device) if name.startswith("deepspeed") else
                       _fsdp2_step(cfg, device, offload=name.endswith("offload")))
    else:
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
           "first_loss": losses[0], "last_loss": losses[-1], "phases_ms": phases, "device": str(device),
           "predicted_gib": _predicted_gib(cfg, device) if name in SYSTEMS and SYSTEMS[name] is not None else None}
    engine = extra.get("engine")
    if engine is not None:
        update = engine.components.update
        out["speculated_kept"], out["rolled_back"] = getattr(update, "kept", None), getattr(update, "rolled_back", None)
        if hasattr(update, "swap_stats"):   # offload=nvme: bytes moved and seconds blocked on IO, whole run
            out["swap"] = update.swap_stats()
        engine.close()
    return out


def anchor(system: str) -> str:
    if system not in ANCHORS:
        return "-"
    t, gib = ANCHORS[system]
    return f"{ANCHOR_NAMES[system]} {t} s, {gib} GiB"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--systems", default=",".join([*SYSTEMS, *PEERS]))
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
    unknown = [s for s in names if s not in SYSTEMS and s not in PEERS]
    if unknown:
        ap.error(f"unknown system(s) {', '.join(unknown)}; choose from {', '.join([*SYSTEMS, *PEERS])}")
    if not torch.cuda.is_available() and (left := [s for s in names if s in GPU_ONLY]):
        print(f"no GPU: left out {', '.join(f'{s} ({GPU_ONLY[s]})' for s in left)}", flush=True)
        names = [s for s in names if s not in GPU_ONLY]
    # (found without importing it: the import alone takes seconds; a broken install still fails in its row)
    if (left := [s for s in names if s.startswith("deepspeed")]) and importlib.util.find_spec("deepspeed") is None:
        print(f"no DeepSpeed (not installed): left out {', '.join(left)}", flush=True)
        names = [s for s in names if s not in left]
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
    print("\n| system | s/step | vs plain | tokens/s | peak GPU GiB | estimated GiB | anchor (one H200) | phases (ms) |"
          "\n|---|---|---|---|---|---|---|---|")
    for r in rows:
        ratio = f"{r['s_per_step'] / base:.2f}x" if base else "-"
        phases = ", ".join(f"{k} {v}" for k, v in r["phases_ms"].items())
        print(f"| {r['system']} | {r['s_per_step']:.3f} | {ratio} | {r['tokens_per_s']:,} | {r['peak_gpu_gib']} | "
              f"{r.get('predicted_gib')} | {anchor(r['system'])} | {phases} |")


if __name__ == "__main__":
    main()
