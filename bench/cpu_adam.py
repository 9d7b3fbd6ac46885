"""CPU AdamW step as a user calls it: our public optimizer step vs the peers' ``optimizer.step()``.

    .venv/bin/python -m bench.cpu_adam                              # ours + torch (fused, foreach)
    .venv/bin/python -m bench.cpu_adam --threads 1 --sizes 100e6 --systems ours,torch-fused
    PYTHONPATH=.bench-venv/ds-site .venv/bin/python -m bench.cpu_adam   # + DeepSpeedCPUAdam
    .bench-venv/bin/python -m bench.cpu_adam                        # same, from a full bench venv

DeepSpeed beside the main venv's torch (no second torch; its op JIT-builds on first use, ~3 min):
``DS_BUILD_OPS=0 .venv/bin/pip install --no-deps --target .bench-venv/ds-site deepspeed hjson
py-cpuinfo pydantic pydantic-core annotated-types typing-inspection typing-extensions psutil msgpack
einops tqdm ninja packaging`` (``.bench-venv`` is git-ignored). Without DeepSpeed its rows say why.

"ours" is ``framework.optimizers.step(tx, grads, state, params, lr)`` with ``tx`` the registered
adamw (``framework.optimizers.adamw.build``): the path the training step and the CPU-offload pipeline
take, Python dispatch included (``optimizers._transforms.optimizer``: the C++ kernel wherever it takes the
tensors, else torch's fused kernel, as under ``FRAMEWORK_OPS=0``, else the plain transforms). "ours+bf16" also
writes the bf16 copy of the params (``out16``), as offload does; "ours-kernel" (not in the default list) calls
the raw C++ kernel ``framework.ops.adam_step``, to show what dispatch costs; "ours-prefetch-off" / "ours-prefetch-on"
(not default either) are "ours" with the kernels' software prefetch forced off / to 1 KiB ahead
whatever this CPU's default (``python -m framework.ops`` shows it): the check to run on a new CPU
vendor before changing ``default_prefetch`` in csrc/cpu_optim/cpu_optim.cpp. Peers:
``torch.optim.AdamW(fused=True)``, ``torch.optim.AdamW(foreach=True)``, ``deepspeed.ops.adam.DeepSpeedCPUAdam(adamw_mode=True)``, each
timed by its ``step()`` with ``p.grad`` set.

Each thread count runs in its own worker process (OMP_NUM_THREADS and torch.set_num_threads set
before any work, so OpenMP-based peers get the same count). For each size and layout (one flat
tensor, or a list of 100 equal tensors) every system gets its own tensors, then all systems step
INTERLEAVED, one step each in turn (the order rotates every step), ``--warmup`` steps each and then
``--rounds`` x ``--steps`` timed steps each (more below 100 M). The machine may be shared: a
disturbance hits all systems alike, and the table reports the median step time with its spread
(25th-75th percentile), the median CPU time per step and thread (what time-slicing on a busy
machine does not inflate) and, per peer, the median over steps of the ratio peer/ours of
neighbouring steps, for both clocks. Interleaving also means no system finds its own data still in
the last-level cache from its previous step (at 10 M a system's 160 MB would fit), as in training,
where forward and backward run between two optimizer steps.

The memory-bandwidth ceiling comes from a large tensor copy (``dst.copy_(src)``, 400 MB, counted as
bytes read + written): an AdamW step reads p, g, m, v and writes p, m, v, 28 bytes per fp32 param.
A copy also reads every destination line before writing it (write-allocate), which an in-place
step does not, so the table also shows an in-place read+write stream (``x.mul_(1.0)``).
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
from framework.core.utils import plain_text  # noqa: E402

LR, BETAS, EPS, WD = 1e-3, (0.9, 0.999), 1e-8, 0.01
LIST_LEN = 100
COPY_ELEMS = 100_000_000
SYSTEMS = ("ours", "ours+bf16", "ours-kernel", "ours-prefetch-off", "ours-prefetch-on", "torch-fused", "torch-foreach",
           "deepspeed")
DEFAULT_SYSTEMS = ("ours", "ours+bf16", "torch-fused", "torch-foreach", "deepspeed")
LABELS = {"ours": "ours (framework.optimizers.step, adamw)", "ours+bf16": "ours + bf16 copy of params",
          "ours-kernel": "ours, raw C++ kernel (framework.ops.adam_step)",
          "ours-prefetch-off": "ours, software prefetch off", "ours-prefetch-on": "ours, prefetch 1 KiB ahead",
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
    if system == "ours-kernel":
        from framework import ops

        m = [torch.zeros_like(p) for p in params]
        v = [torch.zeros_like(p) for p in params]
        count = [0]

        def kernel_step() -> None:
            count[0] += 1
            ops.adam_step(params, grads, m, v, step=count[0], lr=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS,
                          weight_decay=WD, decoupled=True)

        return kernel_step
    if system.startswith("ours"):
        from framework.optimizers import adamw, step

        # Every group decayed, as the peers (one weight decay for all) do.
        tx = adamw.build(adamw.AdamWConfig(lr=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS, weight_decay=WD),
                         [True] * len(params))
        box = [tx.init(params)]
        out16 = [torch.empty_like(p, dtype=torch.bfloat16) for p in params] if system == "ours+bf16" else None

        def public_step() -> None:
            # grads are scratch for an optimizer step; the CPU kernels (ours, torch's fused) only read
            # them, so the same grads serve every step.
            box[0] = step(tx, grads, box[0], params, LR, out16=out16)

        if system not in ("ours-prefetch-off", "ours-prefetch-on"):
            return public_step
        from framework import ops

        def forced_step() -> None:
            ops.cpu_optim().set_prefetch(0 if system == "ours-prefetch-off" else 256)
            try:
                public_step()
            finally:
                ops.cpu_optim().set_prefetch(-1)

        return forced_step
    for p, g in zip(params, grads):
        p.grad = g
    if system == "deepspeed":
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        opt = DeepSpeedCPUAdam(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, adamw_mode=True)
    else:
        opt = torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                                **({"fused": True} if system == "torch-fused" else {"foreach": True}))
    return opt.step


def _interleaved(steps: dict, warmup: int, timed: int) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Step every system in turn (rotating the order each step); per-step wall-clock seconds and
    CPU seconds of this process (all its threads) per system."""
    names = list(steps)
    wall, cpu = {name: [] for name in names}, {name: [] for name in names}
    with torch.no_grad():
        for k in range(warmup + timed):
            shift = k % len(names)
            for name in names[shift:] + names[:shift]:
                c, t = time.process_time(), time.perf_counter()
                steps[name]()
                dt, dc = time.perf_counter() - t, time.process_time() - c
                if k >= warmup:
                    wall[name].append(dt)
                    cpu[name].append(dc)
    return wall, cpu


def _bandwidth_gbps(reps: int) -> tuple[list[float], list[float]]:
    """(copy, in-place) GB/s counting bytes read + written: ``dst.copy_(src)`` also pays a hidden
    read of each dst line before writing it (write-allocate); ``x.mul_(1.0)`` rewrites lines it
    has just read, as an in-place optimizer step does."""
    src = torch.empty(COPY_ELEMS).uniform_()
    dst = torch.empty_like(src).uniform_()
    nbytes = 2 * src.numel() * 4
    with torch.no_grad():
        copy = [nbytes / t / 1e9 for t in time_steps(lambda: dst.copy_(src), 2, reps)]
        inplace = [nbytes / t / 1e9 for t in time_steps(lambda: dst.mul_(1.0), 2, reps)]
    return copy, inplace


def _quantile(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[round(q * 100) - 1] if len(xs) > 1 else xs[0]


def worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    systems = [s for s in args.systems.split(",") if s]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        sys.exit(f"unknown system(s) {unknown}; choose from {', '.join(SYSTEMS)}")
    notes = []
    if "deepspeed" in systems:
        reason = _deepspeed_status()
        if reason is not None:
            systems.remove("deepspeed")
            notes.append(f"DeepSpeedCPUAdam skipped: {reason}")
        else:
            import deepspeed

            notes.append(f"DeepSpeed {deepspeed.__version__} (DeepSpeedCPUAdam, adamw_mode=True)")
    if not systems:
        sys.exit(f"no system left to time ({'; '.join(notes) or 'none asked'}); choose from {', '.join(SYSTEMS)}")
    if any(s.startswith("ours") for s in systems):
        from framework import ops

        ops.build()
        notes.append(f"ours: C++ kernels with ISA {ops.cpu_optim().isa()}, software prefetch "
                     f"{ops.cpu_optim().prefetch_distance()} floats ahead (0: off)")
    copy, inplace, times, cpu_times = [], [], {}, {}
    for n in args.sizes:
        bandwidth = _bandwidth_gbps(args.steps)
        copy.append(statistics.median(bandwidth[0]))
        inplace.append(statistics.median(bandwidth[1]))
        timed = args.rounds * (args.steps if n >= 1e8 else max(args.steps, min(5 * args.steps,
                                                                               int(args.steps * 1e8 / n))))
        for layout in ("flat", "list"):
            steps = {}
            for system in systems:
                params, grads = _tensors(n, layout)
                steps[system] = _make_step(system, params, grads)
                del params, grads
            wall, cpu = _interleaved(steps, args.warmup, timed)
            for system in steps:
                times[f"{system}|{layout}|{n}"] = wall[system]
                cpu_times[f"{system}|{layout}|{n}"] = cpu[system]
            del steps
            gc.collect()
    print(json.dumps({"threads": args.threads, "copy_gbps": statistics.median(copy),
                      "inplace_gbps": statistics.median(inplace),
                      "times_ms": {k: [round(x * 1e3, 3) for x in v] for k, v in times.items()},
                      "cpu_ms": {k: [round(x * 1e3, 3) for x in v] for k, v in cpu_times.items()},
                      "load": os.getloadavg()[0], "notes": notes}))


# --- driver ----------------------------------------------------------------------------------------

def _fmt_n(n: int) -> str:
    return f"{n / 1e6:g} M"


def _paired_ratio(peer: list[float], ours: list[float]) -> float:
    """Median over timed steps of peer/ours (steps k of both ran next to each other)."""
    return statistics.median(p / o for p, o in zip(peer, ours))


def table(results: list[dict], sizes: list[int]) -> tuple[str, list[str]]:
    cols = [(n, r) for n in sizes for r in results]
    head = "| | " + " | ".join(f"{_fmt_n(n)} params, {r['threads']} thr" for n, r in cols) + " |"
    lines = [head, "|" + "---|" * (len(cols) + 1)]
    lines.append("| copy bandwidth (GB/s) | " + " | ".join(f"{r['copy_gbps']:.1f}" for _, r in cols) + " |")
    lines.append("| in-place read+write bandwidth (GB/s) | "
                 + " | ".join(f"{r['inplace_gbps']:.1f}" for _, r in cols) + " |")
    checks = []
    for system in SYSTEMS:
        for layout in ("flat", "list"):
            key = f"{system}|{layout}"
            if not any(f"{key}|{n}" in r["times_ms"] for n, r in cols):
                continue
            cells = []
            for n, r in cols:
                ts = r["times_ms"].get(f"{key}|{n}")
                cs = r["cpu_ms"].get(f"{key}|{n}")
                ours, ours_cpu = r["times_ms"].get(f"ours|{layout}|{n}"), r["cpu_ms"].get(f"ours|{layout}|{n}")
                if ts is None:
                    cells.append("-")
                    continue
                cell = (f"{statistics.median(ts):.1f} [{_quantile(ts, 0.25):.1f}-{_quantile(ts, 0.75):.1f}]"
                        f" / cpu {statistics.median(cs) / r['threads']:.1f}")
                if system != "ours" and ours is not None:
                    cell += f"; {_paired_ratio(ts, ours):.2f}x / {_paired_ratio(cs, ours_cpu):.2f}x ours"
                cells.append(cell)
            where = "one flat tensor" if layout == "flat" else f"list of {LIST_LEN}"
            lines.append(f"| {LABELS[system]}, {where} | " + " | ".join(cells) + " |")
    for n, r in cols:
        for layout in ("flat", "list"):
            ours = r["times_ms"].get(f"ours|{layout}|{n}")
            peers = {p: r["times_ms"][f"{p}|{layout}|{n}"] for p in PEERS if f"{p}|{layout}|{n}" in r["times_ms"]}
            if ours is None or not peers:
                continue
            cpu = {p: r["cpu_ms"][f"{p}|{layout}|{n}"] for p in peers}
            ours_cpu = r["cpu_ms"][f"ours|{layout}|{n}"]
            best = min(peers, key=lambda p: statistics.median(cpu[p]))
            ratio, cpu_ratio = _paired_ratio(peers[best], ours), _paired_ratio(cpu[best], ours_cpu)
            checks.append(f"{_fmt_n(n)}, {r['threads']} thread(s), {layout}: ours {statistics.median(ours):.1f} ms "
                          f"(cpu {statistics.median(ours_cpu) / r['threads']:.1f}) vs fastest peer {LABELS[best]} "
                          f"{statistics.median(peers[best]):.1f} ms (cpu {statistics.median(cpu[best]) / r['threads']:.1f});"
                          f" paired peer/ours: wall {ratio:.3f}, cpu {cpu_ratio:.3f} "
                          f"[{'met' if min(ratio, cpu_ratio) >= 1.0 else 'MISSED'}]")
    return "\n".join(lines), checks


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=plain_text(__doc__.splitlines()[0]))
    parser.add_argument("--sizes", default="10e6,100e6", help="params per step, comma separated")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS),
                        help=f"comma separated, from {','.join(SYSTEMS)}")
    parser.add_argument("--rounds", type=int, default=2, help="timed steps = rounds x steps (per system)")
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
        text = ["# CPU AdamW step: framework.optimizers.step vs torch vs DeepSpeedCPUAdam", "",
                f"- command: `{command.strip()}`", f"- machine: {where}",
                f"- date: {datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
                f"- load average (1 min) at the end of each worker: "
                f"{', '.join(str(r['threads']) + ' thr ' + format(r['load'], '.1f') for r in results)} "
                f"on {os.cpu_count()} cores",
                f"- AdamW lr {LR}, betas {BETAS}, eps {EPS}, weight decay {WD}; fp32 params, grads and states; "
                f"systems stepped interleaved, {args.warmup} warm-up steps, then {args.rounds} x {args.steps} "
                "timed steps each at 100 M (more below); cells: median wall ms/step [25th-75th percentile] / "
                "median CPU ms per step and thread (process CPU time / threads: time the step was on a core, "
                "which a busy machine's time-slicing does not inflate); then the median over steps of this "
                "system's time / ours in the neighbouring step, wall / CPU", "", md, "",
                *[f"- {n}" for n in notes], "", "Targets (ours at least as fast as the fastest peer):", "",
                *[f"- {c}" for c in checks], ""]
        with open(args.out, "w") as handle:
            handle.write("\n".join(text))
        print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
