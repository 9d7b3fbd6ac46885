"""Measured host memory of offload=nvme against offload=cpu: peak RSS (the kernel's VmHWM) of one rank.

    .venv/bin/python -m bench.nvme_memory     # gpt2-small, zero2, 2 steps (about 2 min here)
    .venv/bin/python -m bench.nvme_memory --model gpt-mini --sub-group-size 1000000   # quicker (the test suite's)

gpt-mini (30 M parameters with this vocabulary) is only 3 tiles at the default ``sub_group_size``, all of
them resident at once in the default pool of 4: a smaller tile is what shows the saving (measured
0.30 GiB below offload=cpu with 1 M-element tiles, 0.11 GiB at the default).

Each configuration trains in a fresh process through the CLI (``python -m framework.train``; by default both at once) on
random token ids with the model's vocabulary (``data=tokens``, so gpt2-small keeps its 50304-token
embedding: 124 M parameters), micro batch 1, context 64, and reads ``peak_memory_per_rank`` from its
``summary.json``. offload=nvme swaps the fp32 master and the Adam moments (12 bytes per parameter)
through ``buffer_count`` tiles of ``sub_group_size`` elements; the gradients stay in host memory.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def start(model: str, offload: list[str], folder: Path, name: str, vocab: int, steps: int = 2):
    """Start one training process; ``finish`` collects it."""
    tokens = folder / "tokens.bin"
    if not tokens.exists():
        np.random.default_rng(0).integers(0, vocab, 200_000, dtype=np.uint16).tofile(tokens)
    run_dir = folder / f"run-{name}"
    cmd = [sys.executable, "-m", "framework.train", f"model={model}", "+stage=zero2", *offload, "data=tokens",
           f"data.path={tokens}", f"data.vocab_size={vocab}", "model.context=64", "train.micro_batch=1",
           f"train.steps={steps}", "train.eval_batches=1", "train.log_every=1", "logger=none",
           f"hydra.run.dir={run_dir}"]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return name, run_dir, proc


def finish(name: str, run_dir: Path, proc) -> dict:
    _, err = proc.communicate(timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{err[-3000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"name": name, "peak_rss_bytes": summary["peak_memory_per_rank"][0]["peak_rss_bytes"],
            "params": summary["params"], "train_loss": summary["train_loss"], "elapsed_s": summary["elapsed_s"],
            "run_dir_left": sorted(p.name for p in run_dir.iterdir())}


def compare(model: str = "gpt2-small", vocab: int = 50304, sub_group_size: int | None = None,
            folder: str | None = None, serial: bool = False) -> dict:
    if folder is not None:   # --dir: created when missing, as bench.nvme_io does
        os.makedirs(folder, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="nvme-memory-", dir=folder) as tmp:
        tmp = Path(tmp)
        # Both at once (each process's own peak RSS is what counts; on a quiet machine run them apart
        # with --serial for the timings)
        procs = [start(model, ["offload=cpu"], tmp, "cpu", vocab)]
        if serial:
            cpu = finish(*procs.pop())
        tile = [] if sub_group_size is None else [f"offload.sub_group_size={sub_group_size}"]  # None: the default
        procs.append(start(model, ["offload=nvme", *tile], tmp, "nvme", vocab))
        done = {name: finish(name, d, p) for name, d, p in procs}
        cpu = cpu if serial else done["cpu"]
        nvme = done["nvme"]
    return {"model": model, "params": cpu["params"], "cpu": cpu, "nvme": nvme,
            "drop_bytes": cpu["peak_rss_bytes"] - nvme["peak_rss_bytes"],
            "adam_state_bytes": 12 * cpu["params"]}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt2-small")
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--sub-group-size", type=int, default=None, help="default: offload=nvme's own default")
    ap.add_argument("--dir", default=None, help="where the swap files go (default: the system temp folder)")
    ap.add_argument("--serial", action="store_true", help="one run after the other (default: both at once)")
    args = ap.parse_args(argv)
    r = compare(args.model, args.vocab, args.sub_group_size, args.dir, args.serial)
    gib = 2 ** 30
    print(f"| {r['model']} ({r['params'] / 1e6:.1f} M params), zero2, 1 rank | peak RSS | train loss | s |")
    print("|---|---|---|---|")
    for k in ("cpu", "nvme"):
        print(f"| offload={k} | {r[k]['peak_rss_bytes'] / gib:.2f} GiB | {r[k]['train_loss']:.4f} | "
              f"{r[k]['elapsed_s']:.1f} |")
    print(f"nvme peaks {r['drop_bytes'] / gib:.2f} GiB below cpu (fp32 master + Adam moments: "
          f"{r['adam_state_bytes'] / gib:.2f} GiB)")
    return r


if __name__ == "__main__":
    main()
