"""End to end: zero3 + offload=nvme next to offload=cpu, offload=none and DeepSpeed ZeRO-3 with NVMe
offload, on gpt-mini and 2 gloo ranks, in the same run, with the share of step time waiting on IO and
the disk floor.

    .venv/bin/python -m bench.nvme_e2e [--steps 5] [--dir ./.bench-nvme]
    PYTHONPATH=$PWD/.bench-venv/ds-site .venv/bin/python -m bench.nvme_e2e   # with DeepSpeed

Model and data as ``bench.stages`` (gpt-mini, context 128, vocab 256, micro batch 8 per rank, AdamW,
fp32, clipping at 1.0). Ours: ``+stage=zero3`` with ``offload=none``, ``offload=cpu`` (master and Adam
state in host memory) and ``offload=nvme`` (master, Adam state and parameter shards in swap files under
``--dir``; ``sub_group_size`` 1 M elements, 4 buffers, pipeline_read and pipeline_write on, and once
with both off). Median step time of ``--steps`` steps after 2 warm-up steps, the slower rank counts.
"IO wait" is the time the ranks spent blocked on swap IO (``DiskStore.wait_s``) over the step time.
The disk floor is (bytes read per step / read bandwidth + bytes written per step / write bandwidth),
summed over the ranks (they share the disk), with the bandwidths our engine measures on the same folder in
the same run (``bench.nvme_io``, 256 MiB, 1 MiB blocks, queue depth 8). Target: nvme within 1.3x of
max(floor, offload=cpu step time); the ratio column says met or MISSED.

DeepSpeed ZeRO-3 with ``offload_optimizer`` and ``offload_param`` on nvme needs its ``async_io`` op
(libaio) and its CPU Adam op; where they cannot be built the row says why.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import tempfile
import time

import torch

from bench.stages import (ADAMW, CLIP, MICRO, OVERRIDES, _adamw_groups, _import_deepspeed,
                          deepspeed_step)

WARMUP = 2
TARGET = 1.3   # nvme's step time over max(disk floor, offload=cpu's)
NVME = ["offload=nvme", "offload.sub_group_size=1000000", "offload.buffer_count=4"]
SYSTEMS = {
    "zero3 offload=none": ["+stage=zero3"],
    "zero3 offload=cpu": ["+stage=zero3", "offload=cpu"],
    "zero3 offload=nvme": ["+stage=zero3", *NVME, "offload.pipeline_read=true", "offload.pipeline_write=true"],
    "zero3 offload=nvme (no pipeline)": ["+stage=zero3", *NVME],
}
DS = "DeepSpeed ZeRO-3 nvme"
DS_PLAIN = "DeepSpeed ZeRO-3 nvme (no pipeline)"   # its pipelined swapper can assert (see BENCHMARKS)
DEEPSPEED = (DS, DS_PLAIN)


def _rank(dist, name: str, steps: int, folder: str) -> dict:
    from framework import compose, initialize
    from framework.engine.build import component
    from framework.models.gpt import gpt_loss

    ds = name in DEEPSPEED
    over = OVERRIDES + (SYSTEMS[name] if not ds else [])
    if "offload=nvme" in over:
        over = over + [f"offload.nvme_path={folder}/{re.sub(r'[^A-Za-z0-9]+', '_', name)}"]
    cfg = compose(over)
    data = component(cfg, "data").build(cfg.data, seed=0, context=cfg.model.context)
    torch.manual_seed(0)
    model = component(cfg, "model").build(cfg.model, vocab_size=data.vocab_size)
    stats = lambda: {}   # noqa: E731
    if ds:
        step = _deepspeed_nvme(dist, model, data, f"{folder}/ds", pipeline=name == DS)
    else:
        engine = initialize(model, gpt_loss, cfg, dist)
        box = {"state": engine.state}
        update = engine.components.update
        stats = getattr(update, "swap_stats", stats)

        def step(pos: int) -> float:
            s = box["state"]
            batch = data.train_batch(s.data, micro_batch=MICRO, grad_accum=1, rank=dist.rank, world=dist.world)
            box["state"], m = engine.train_step(s, batch)
            return m["loss"]
    losses, times = [], []
    for pos in range(WARMUP):
        losses.append(step(pos))
    before = stats()
    for pos in range(WARMUP, WARMUP + steps):
        t = time.perf_counter()
        losses.append(step(pos))
        times.append(time.perf_counter() - t)
    after = stats()
    delta = {k: (after[k] - before[k]) / steps for k in after if k != "file"}
    if not ds:
        engine.close()
    return {"times": times, "losses": losses, "swap": delta}


def _deepspeed_nvme(dist, model, data, folder: str, pipeline: bool):
    deepspeed = _import_deepspeed()
    os.makedirs(folder, exist_ok=True)
    nvme = {"device": "nvme", "nvme_path": folder, "pin_memory": False}
    ds_cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1,
              "gradient_clipping": CLIP,
              "optimizer": {"type": "AdamW", "params": {"lr": ADAMW["lr"], "betas": list(ADAMW["betas"]),
                                                        "eps": ADAMW["eps"], "weight_decay": 0.1}},
              "zero_optimization": {"stage": 3, "sub_group_size": 1_000_000,
                                    "offload_optimizer": {**nvme, "buffer_count": 4, "pipeline_read": pipeline,
                                                          "pipeline_write": pipeline},
                                    "offload_param": {**nvme, "buffer_count": 5, "buffer_size": 100_000_000}},
              "aio": {"block_size": 1048576, "queue_depth": 8, "intra_op_parallelism": 1,
                      "single_submit": False, "overlap_events": True},
              "fp16": {"enabled": False}, "bf16": {"enabled": False}, "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=_adamw_groups(model.parameters()),
                                      config=ds_cfg)
    return deepspeed_step(engine, data, dist)


def _ds_available() -> str | None:
    """None when DeepSpeed's NVMe path can run here, else why not (one line)."""
    try:
        _import_deepspeed()
        from deepspeed.ops.op_builder import AsyncIOBuilder
    except Exception as e:   # noqa: BLE001 - any failure is the row's note
        return f"`import deepspeed` failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    try:
        ok = AsyncIOBuilder().is_compatible(verbose=False)
    except Exception as e:   # noqa: BLE001
        return f"AsyncIOBuilder().is_compatible() raised {type(e).__name__}: {e}"
    if not ok:
        return ("its async_io op cannot be built here (AsyncIOBuilder().is_compatible() is False: libaio's "
                "headers, libaio-dev, are not installed; only the runtime libaio.so.1 is)")
    return None


def disk_bandwidth(folder: str) -> tuple[float, float]:
    """(read, write) bytes/s of our engine on ``folder``: 256 MiB, 1 MiB blocks, queue depth 8."""
    from bench.nvme_io import main as io_main

    rows = io_main(["--dir", folder, "--size", "256MiB", "--tensor-size", "16MiB", "--block-sizes", "1MiB",
                    "--queue-depths", "8", "--rounds", "1", "--no-fio"])
    best = max((r for r in rows if r["system"].startswith("ours")), key=lambda r: r["read"] + r["write"])
    return best["read"] * 1e9, best["write"] * 1e9


def main(argv: list[str] | None = None) -> list[dict]:
    from bench._common import machine, run_ranks_detail

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--dir", default=".bench-nvme", help="folder for the swap files (same disk as the repo)")
    ap.add_argument("--systems", default=",".join([*SYSTEMS, *DEEPSPEED]),
                    help=f"comma-separated, from: {', '.join([*SYSTEMS, *DEEPSPEED])}")
    args = ap.parse_args(argv)
    names = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in names if s not in SYSTEMS and s not in DEEPSPEED]
    if unknown or not names:   # before the disk measurement, not a traceback in a table cell after it
        ap.error(f"unknown system(s) {', '.join(map(repr, unknown)) or '(none given)'}; choose from "
                 f"{', '.join(map(repr, [*SYSTEMS, *DEEPSPEED]))}")
    os.makedirs(args.dir, exist_ok=True)
    folder = tempfile.mkdtemp(prefix="nvme-e2e-", dir=args.dir)
    rows = []
    try:
        read_bw, write_bw = disk_bandwidth(folder)
        print(f"machine: {machine()}; disk (ours, O_DIRECT): read {read_bw / 1e9:.2f} GB/s, "
              f"write {write_bw / 1e9:.2f} GB/s", flush=True)
        for name in names:
            if name in DEEPSPEED and (why := _ds_available()) is not None:
                rows.append({"system": name, "note": why})
                print(f"{name}: skipped: {why}", flush=True)
                continue
            try:
                t, rss, info = run_ranks_detail(args.world, _rank, name, args.steps, folder)
            except Exception as e:   # noqa: BLE001 - one failing system must not lose the others
                rows.append({"system": name, "note": f"failed: {type(e).__name__}: {str(e).strip()[-300:]}"})
                print(f"{name}: FAILED {e}", flush=True)
                continue
            swap = [i["swap"] for i in info]
            read = sum(s.get("read", 0) for s in swap)
            written = sum(s.get("written", 0) for s in swap)
            wait = max((s.get("wait_s", 0.0) for s in swap), default=0.0)
            floor = read / read_bw + written / write_bw
            rows.append({"system": name, "s_per_step": t, "peak_rss": max(rss), "io_wait_share": wait / t,
                         "bytes_per_step": read + written, "floor_s": floor, "losses": info[0]["losses"]})
            print(rows[-1], flush=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    cpu = next((r["s_per_step"] for r in rows if r["system"] == "zero3 offload=cpu" and "s_per_step" in r), None)
    # (no peak RSS column: bench.nvme_memory measures memory, in fresh processes)
    print(f"\n| gpt-mini, {args.world} ranks, zero3 | s/step | IO wait | bytes/step (all ranks) | disk floor s | "
          f"vs max(floor, cpu) | loss at step {WARMUP + args.steps} |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if "s_per_step" not in r:
            print(f"| {r['system']} | - | - | - | - | - | {r['note']} |")
            continue
        ref = max(r["floor_s"], cpu or 0.0)
        x = r["s_per_step"] / ref if r["bytes_per_step"] and ref else None
        ratio = "-" if x is None else f"{x:.2f}x ({'met' if x <= TARGET else 'MISSED'})"
        print(f"| {r['system']} | {r['s_per_step']:.3f} | {100 * r['io_wait_share']:.0f}% | "
              f"{r['bytes_per_step'] / 1e6:.0f} MB | {r['floor_s']:.3f} | {ratio} | {r['losses'][-1]:.4f} |")
    return rows


if __name__ == "__main__":
    main()
