"""CPU AdamW step: our C++ kernel vs torch (foreach, fused) vs DeepSpeedCPUAdam, next to memory bandwidth.

    .venv/bin/python -m bench.cpu_adam                 # ours + torch
    .bench-venv/bin/python -m bench.cpu_adam           # + DeepSpeedCPUAdam (first run JIT-builds it, ~3 min)

Each thread count runs in its own worker process (OMP_NUM_THREADS and torch.set_num_threads set
before any work, so OpenMP-based peers get the same count). For each size and layout (one flat
tensor, or a list of 100 equal tensors) every system runs ``--rounds`` times, interleaved, each
time on freshly allocated tensors: ``--warmup`` steps, then timed steps; the table reports the
best round's median (the machine is shared: a round that another process disturbed runs slower,
never faster). The memory-bandwidth ceiling comes from a large tensor copy
(``dst.copy_(src)``, 400 MB, counted as bytes read + written): an AdamW step reads p, g, m, v and
writes p, m, v, 28 bytes per fp32 param, so the ceiling is copy GB/s / 28 params per second. A
copy also reads every destination line before writing it (write-allocate), which an in-place
step does not, so the table also shows an in-place read+write stream (``x.mul_(1.0)``): the
tighter ceiling for an optimizer step.
Results go to stdout and, with ``--out``, to a markdown file.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone

if __package__ in (None, ""):  # run as a file path: make ``bench`` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench._common import time_steps  # noqa: E402

LR, BETAS, EPS, WD = 1e-3, (0.9, 0.999), 1e-8, 0.01
BYTES_PER_PARAM = 28
LIST_LEN = 100
COPY_ELEMS = 100_000_000
SYSTEMS = ("ours", "ours+bf16", "torch-fused", "torch-foreach", "deepspeed")
LABELS = {"ours": "ours (framework.ops)", "ours+bf16": "ours + bf16 copy of params",
          "torch-fused": "torch AdamW fused=True", "torch-foreach": "torch AdamW foreach=True",
          "deepspeed": "DeepSpeedCPUAdam"}
PEERS = ("torch-fused", "torch-foreach", "deepspeed")


# --- worker: one thread count ------------------------------------------------------------------

def _tensors(n: int, layout: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    sizes = [n] if layout == "flat" else [n // LIST_LEN + (i < n % LIST_LEN) for i in range(LIST_LEN)]
    params = [torch.empty(k).uniform_(-0.05, 0.05) for k in sizes]
    grads = [torch.empty(k).uniform_(-1, 1) for k in sizes]
    return params, grads


def _deepspeed_status() -> str | None:
    """None when DeepSpeedCPUAdam can run here, else why not."""
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception as exc:  # noqa: BLE001 - any import failure means "skip"
        return f"`import deepspeed` failed in {sys.executable} ({type(exc).__name__}: {str(exc)[:120]})"
    try:
        DeepSpeedCPUAdam([torch.zeros(8, requires_grad=True)], lr=LR)  # builds its op on first use
    except Exception as exc:  # noqa: BLE001
        return f"DeepSpeed's CPU Adam op did not build ({type(exc).__name__}: {str(exc)[:160]})"
    return None


def _make_step(system: str, params: list[torch.Tensor], grads: list[torch.Tensor]):
    if system.startswith("ours"):
        from framework import ops

        m = [torch.zeros_like(p) for p in params]
        v = [torch.zeros_like(p) for p in params]
        out16 = [torch.empty_like(p, dtype=torch.bfloat16) for p in params] if system == "ours+bf16" else None
        count = [0]

        def step() -> None:
            count[0] += 1
            ops.adam_step(params, grads, m, v, step=count[0], lr=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS,
                          weight_decay=WD, decoupled=True, out16=out16)

        return step
    for p, g in zip(params, grads):
        p.grad = g
    if system == "deepspeed":
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        opt = DeepSpeedCPUAdam(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, adamw_mode=True)
    else:
        opt = torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                                **({"fused": True} if system == "torch-fused" else {"foreach": True}))
    return opt.step


def _time(step, warmup: int, steps: int) -> list[float]:
    with torch.no_grad():
        return time_steps(step, warmup, steps)


def _bandwidth_gbps(reps: int) -> tuple[list[float], list[float]]:
    """(copy, in-place) GB/s counting bytes read + written: ``dst.copy_(src)`` also pays a hidden
    read of each dst line before writing it (write-allocate); ``x.mul_(1.0)`` rewrites lines it
    has just read, as an in-place optimizer step does."""
    src = torch.empty(COPY_ELEMS).uniform_()
    dst = torch.empty_like(src).uniform_()
    nbytes = 2 * src.numel() * 4
    copy = [nbytes / t / 1e9 for t in _time(lambda: dst.copy_(src), 2, reps)]
    inplace = [nbytes / t / 1e9 for t in _time(lambda: dst.mul_(1.0), 2, reps)]
    return copy, inplace


def worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    systems = [s for s in args.systems.split(",") if s]
    notes = []
    if "deepspeed" in systems:
        reason = _deepspeed_status()
        if reason is not None:
            systems.remove("deepspeed")
            notes.append(f"DeepSpeedCPUAdam skipped: {reason}")
        else:
            import deepspeed

            notes.append(f"DeepSpeed {deepspeed.__version__} (DeepSpeedCPUAdam, adamw_mode=True)")
    if any(s.startswith("ours") for s in systems):
        from framework import ops

        ops.build()
        notes.append(f"ours: ISA {ops.cpu_optim().isa()}")
    copy, inplace, times = [], [], {}
    for n in args.sizes:
        steps = args.steps if n >= 1e8 else max(args.steps, min(5 * args.steps, int(args.steps * 1e8 / n)))
        for _ in range(args.rounds):
            bandwidth = _bandwidth_gbps(args.steps)
            copy.append(statistics.median(bandwidth[0]))
            inplace.append(statistics.median(bandwidth[1]))
            for layout in ("flat", "list"):
                for system in systems:
                    params, grads = _tensors(n, layout)
                    step = _make_step(system, params, grads)
                    times.setdefault(f"{system}|{layout}|{n}", []).append(
                        statistics.median(_time(step, args.warmup, steps)))
                    del step, params, grads
                    gc.collect()
    print(json.dumps({"threads": args.threads, "copy_gbps": max(copy), "inplace_gbps": max(inplace),
                      "ms": {k: min(v) * 1e3 for k, v in times.items()},
                      "rounds_ms": {k: [round(x * 1e3, 2) for x in v] for k, v in times.items()}, "notes": notes}))


# --- driver ----------------------------------------------------------------------------------------

def _fmt_n(n: int) -> str:
    return f"{n / 1e6:g} M"


def table(results: list[dict], sizes: list[int]) -> tuple[str, list[str]]:
    cols = [(n, r) for n in sizes for r in results]
    head = "| | " + " | ".join(f"{_fmt_n(n)} params, {r['threads']} thr" for n, r in cols) + " |"
    lines = [head, "|" + "---|" * (len(cols) + 1)]
    lines.append("| copy bandwidth (GB/s) | " + " | ".join(f"{r['copy_gbps']:.1f}" for _, r in cols) + " |")
    lines.append("| ceiling at 28 B/param (G params/s) | "
                 + " | ".join(f"{r['copy_gbps'] / BYTES_PER_PARAM:.3f}" for _, r in cols) + " |")
    lines.append("| in-place read+write bandwidth (GB/s) | "
                 + " | ".join(f"{r['inplace_gbps']:.1f}" for _, r in cols) + " |")
    checks = []
    for system in SYSTEMS:
        for layout in ("flat", "list"):
            key = f"{system}|{layout}"
            if not any(f"{key}|{n}" in r["ms"] for n, r in cols):
                continue
            cells = []
            for n, r in cols:
                ms = r["ms"].get(f"{key}|{n}")
                if ms is None:
                    cells.append("-")
                    continue
                rate = n / (ms / 1e3)
                frac = rate / (r["copy_gbps"] * 1e9 / BYTES_PER_PARAM)
                cells.append(f"{ms:.1f} ms, {rate / 1e9:.3f} G/s, {frac:.0%}")
            where = "one flat tensor" if layout == "flat" else f"list of {LIST_LEN}"
            lines.append(f"| {LABELS[system]}, {where} | " + " | ".join(cells) + " |")
    for n, r in cols:
        ceiling = r["copy_gbps"] * 1e9 / BYTES_PER_PARAM
        for layout in ("flat", "list"):
            ours = r["ms"].get(f"ours|{layout}|{n}")
            peers = {p: r["ms"][f"{p}|{layout}|{n}"] for p in PEERS if f"{p}|{layout}|{n}" in r["ms"]}
            if ours is None or not peers:
                continue
            best = min(peers, key=peers.get)
            frac = n / (ours / 1e3) / ceiling
            frac_inplace = n / (ours / 1e3) / (r["inplace_gbps"] * 1e9 / BYTES_PER_PARAM)
            checks.append(f"{_fmt_n(n)}, {r['threads']} thread(s), {layout}: ours {ours:.1f} ms vs fastest peer "
                          f"{LABELS[best]} {peers[best]:.1f} ms ({peers[best] / ours:.2f}x) "
                          f"[{'met' if ours <= peers[best] else 'MISSED'}]; {frac:.0%} of the copy ceiling "
                          f"[{'met' if frac >= 0.85 else 'MISSED'}] ({frac_inplace:.0%} of the in-place "
                          "read+write ceiling)")
    return "\n".join(lines), checks


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10e6,100e6", help="params per step, comma separated")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per round at 100 M (more when smaller)")
    parser.add_argument("--out", default=None, help="write the markdown report here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sizes = [int(float(s)) for s in args.sizes.split(",")]
    if args.worker:
        args.sizes, args.threads = sizes, int(args.threads)
        worker(args)
        return
    # ninja (for the builds) lives next to the interpreter in a venv.
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}
    results = []
    for threads in [int(t) for t in args.threads.split(",")]:
        cmd = [sys.executable, "-m", "bench.cpu_adam", "--worker", "--threads", str(threads), "--sizes", args.sizes,
               "--systems", args.systems, "--rounds", str(args.rounds), "--warmup", str(args.warmup),
               "--steps", str(args.steps)]
        print(f"# worker: {threads} thread(s)", file=sys.stderr, flush=True)
        out = subprocess.run(cmd, env={**env, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)},
                             stdout=subprocess.PIPE, text=True, cwd=os.path.dirname(os.path.dirname(
                                 os.path.abspath(__file__))))
        if out.returncode != 0:
            sys.exit(f"worker for {threads} thread(s) failed (exit {out.returncode})")
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    md, checks = table(results, sizes)
    notes = sorted({note for r in results for note in r["notes"]})
    print(md)
    print("\n".join(["", *notes, *checks]))
    if args.out:
        try:
            from bench._common import machine

            where = machine()
        except ImportError:
            where = f"{os.cpu_count()} cores, torch {torch.__version__}"
        command = f"{os.path.relpath(sys.executable)} -m bench.cpu_adam " + " ".join(argv or sys.argv[1:])
        text = [f"# CPU AdamW step: framework.ops vs torch vs DeepSpeedCPUAdam", "",
                f"- command: `{command.strip()}`", f"- machine: {where}",
                f"- date: {datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
                f"- AdamW lr {LR}, betas {BETAS}, eps {EPS}, weight decay {WD}; fp32 params, grads and states; "
                f"best of {args.rounds} rounds' median step time ({args.steps} timed steps at 100 M, more below) "
                f"after {args.warmup} warm-up steps; bandwidth: best round's median; "
                "cells: ms/step, params/s, fraction of the copy-bandwidth ceiling", "", md, "",
                *[f"- {n}" for n in notes], "", "Targets:", "", *[f"- {c}" for c in checks], ""]
        with open(args.out, "w") as handle:
            handle.write("\n".join(text))
        print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
