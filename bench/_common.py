"""Shared pieces of the side-by-side benchmarks: spawned gloo ranks, timing, peak RSS (VmHWM).

Each system runs in its own fresh set of rank processes so that peak RSS belongs to that
system alone; systems alternate over several rounds so that machine noise hits all alike.
"""
from __future__ import annotations

import os
import pickle
import platform
import shutil
import statistics
import subprocess
import tempfile
import time
from datetime import date

import torch
import torch.multiprocessing as mp


def peak_rss_bytes() -> int:
    """This process's own peak RSS: VmHWM, not ru_maxrss, which a spawned rank inherits from the
    parent's peak (Linux keeps it across exec)."""
    from framework.memory.probe import rss_peak

    return rss_peak()


def time_steps(step, warmup: int, steps: int) -> list[float]:
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return times


def _rank(rank: int, world: int, store: str, fn, args, out: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    from framework.comm.distributed import connect

    dist = connect("gloo", timeout_s=600, store_path=store)
    res = fn(dist, *args)
    times, info = (res["times"], res) if isinstance(res, dict) else (res, {})
    # A file, not a queue: the parent reads only after joining, and a result larger than a pipe's
    # buffer would block this rank's put (and the join) forever.
    with open(os.path.join(out, f"result-{rank}.pkl"), "wb") as f:
        pickle.dump((rank, statistics.median(times), peak_rss_bytes(),
                     {k: v for k, v in info.items() if k != "times"}), f)
    if torch.distributed.is_initialized():   # one rank alone makes no group
        torch.distributed.destroy_process_group()


def run_ranks_detail(world: int, fn, *args) -> tuple[float, list[int], list[dict]]:
    """Run ``fn(dist, *args)`` on ``world`` fresh gloo ranks; it returns its step times, or a dict
    with "times" and other picklable entries. Returns (max over ranks of the median step time, peak
    RSS per rank, each rank's other entries: an empty dict when ``fn`` returned only times)."""
    tmp = tempfile.mkdtemp(prefix="bench-")
    try:
        mp.start_processes(_rank, args=(world, os.path.join(tmp, "store"), fn, args, tmp), nprocs=world,
                           start_method="spawn")
        results = []
        for rank in range(world):
            with open(os.path.join(tmp, f"result-{rank}.pkl"), "rb") as f:
                results.append(pickle.load(f))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return max(r[1] for r in results), [r[2] for r in results], [r[3] for r in results]


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        model = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        cpu = next((line.split(":", 1)[1].strip() for line in model.splitlines() if "Model name" in line), cpu)
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}, {date.today().isoformat()}"
