"""Bandwidth probe for the planner: matmul, copies, host optimizer step, disk, the train step's fixed costs,
all-reduce, and a training process's own resident set; measured once per machine and disk, cached as
``<cache>/probe-<host>-<device>-t<threads>-fs<disk>.json`` (``python -m framework.plan --reprobe`` measures again)."""
from __future__ import annotations

import contextlib
import gc
import json
import os
import platform
import resource
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch

from framework.core.paths import cache_dir
from framework.core.units import MiB

VERSION = 5


def cache_path(device: torch.device, disk_dir: Path) -> Path:
    """The cache of ``device``'s probe with its disk test on ``disk_dir``'s file system."""
    name = device.type if device.type != "cuda" else torch.cuda.get_device_name(device).replace(" ", "_")
    fs = os.stat(disk_dir).st_dev
    return cache_dir() / f"probe-{socket.gethostname()}-{name}-t{torch.get_num_threads()}-fs{fs:x}.json"


def _best(fn, device: torch.device, reps: int = 3) -> float:
    """The fastest of ``reps`` calls of ``fn`` after a warm-up, each waited for on ``device``."""
    times = []
    for i in range(reps + 1):
        t = time.perf_counter()
        fn()
        _sync(device)
        if i:
            times.append(time.perf_counter() - t)
    return min(times)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(device: torch.device, disk_dir: Path, collectives: bool) -> dict:
    out: dict = {"version": VERSION, "device": str(device), "threads": torch.get_num_threads(),
                 "machine": platform.processor() or platform.machine()}
    n = 1024 if device.type == "cpu" else 8192
    a, b = torch.randn(2, n, n, device=device)
    out["matmul_flops"] = 2 * n ** 3 / _best(lambda: a @ b, device)
    src = torch.empty(32 * MiB // 4, device=device).normal_()
    dst = torch.empty_like(src)
    out["device_copy_bytes_s"] = 2 * src.numel() * 4 / _best(lambda: dst.copy_(src), device)   # read + write
    out["step_fixed_s"], out["micro_fixed_s"], out["micro_per_layer_s"] = _micro_overhead(device)
    if device.type == "cuda":
        host = torch.empty(src.numel(), device="cpu", pin_memory=True)
        out["h2d_bytes_s"] = host.numel() * 4 / _best(lambda: src.copy_(host, non_blocking=True), device)
        out["d2h_bytes_s"] = host.numel() * 4 / _best(lambda: host.copy_(src, non_blocking=True), device)
    else:   # the device is the host: a copy "to the host" is a memory copy
        out["h2d_bytes_s"] = out["d2h_bytes_s"] = out["device_copy_bytes_s"] / 2
    # The test tensors go before the resident set is read below (about 70 MiB of them on the CPU).
    a = b = src = dst = host = None
    gc.collect()
    out["host_optimizer_params_s"] = _host_optimizer()
    out["disk_write_bytes_s"], out["disk_read_bytes_s"] = _disk(disk_dir)
    out["allreduce_bytes_s"] = _collective() if collectives else None
    out["process_rss_bytes"] = rss_now()   # a process that has imported torch and the framework and trained
    # A run with activation checkpointing holds more: torch's checkpoint imports torch._dynamo (and sympy) on
    # its first call, about 65 MiB, which a process never frees (so measured last, as one checkpointed step).
    _tiny_gpt(device, 1, 1, checkpointing=True, reps=1)
    gc.collect()
    out["checkpointing_rss_bytes"] = max(0, rss_now() - out["process_rss_bytes"])
    return out


def rss_now() -> int:
    """This process's resident set size now (bytes); off Linux its peak, the best there is."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    except (OSError, IndexError, ValueError):
        return rss_peak()


def rss_peak() -> int:
    """This process's peak resident set size (bytes): VmHWM, which writing 5 to /proc/self/clear_refs
    resets; where /proc is missing getrusage's, which cannot be reset and keeps exited threads' marks."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) * 1024  # kB
    except (OSError, StopIteration, ValueError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024   # macOS counts bytes, others KiB


def _micro_overhead(device: torch.device) -> tuple[float, float, float]:
    """(per step, per micro step, per layer and micro step) seconds of train_step on a GPT that does almost
    no arithmetic: the fixed costs, fitted from 1 and 3 layers by 1 and 3 micro batches."""
    t = {(layers, accum): _tiny_gpt(device, layers, accum) for layers in (1, 3) for accum in (1, 3)}
    per_micro = {L: max(0.0, (t[L, 3] - t[L, 1]) / 2) for L in (1, 3)}
    per_layer = max(0.0, (per_micro[3] - per_micro[1]) / 2)
    fixed_micro = max(0.0, per_micro[1] - per_layer)
    return max(0.0, t[1, 1] - per_micro[1]), fixed_micro, per_layer


def _tiny_gpt(device: torch.device, layers: int, accum: int, checkpointing: bool = False, reps: int = 5) -> float:
    """The best of ``reps`` train_step seconds of a GPT that does almost no arithmetic."""
    from framework.engine.build import initialize
    from framework.config import compose
    from framework.comm.distributed import Dist
    from framework.models.gpt import build, gpt_loss

    cfg = compose([f"model.n_layer={layers}", "model.d_model=32", "model.n_head=2", "model.context=8",
                   f"model.activation_checkpointing={str(checkpointing).lower()}", "train.micro_batch=1",
                   f"train.grad_accum={accum}", "logger=none"])
    with torch.device("meta"):
        module = build(cfg.model, vocab_size=64)
    x = torch.zeros(1, 8, dtype=torch.long, device=device)
    with initialize(module, gpt_loss, cfg, Dist(0, 1, 0, device, None, 60.0)) as engine:
        box = [engine.state]

        def step():
            box[0], _ = engine.train_step(box[0], [(x, x)] * accum)
        return _best(step, device, reps=reps)


def _host_optimizer() -> float:
    """Our AdamW (the fused C++ kernel when built) on 4 M host parameters: parameters per second."""
    from framework.optimizers import step
    from framework.optimizers.adamw import AdamWConfig, build

    tx = build(AdamWConfig(), [True])
    params = [torch.zeros(4 * MiB, device="cpu")]
    grads = [torch.full_like(params[0], 1e-3)]
    box = [tx.init(params)]

    def run():
        box[0] = step(tx, [g.clone() for g in grads] if tx.fused is None else grads, box[0], params, 1e-3)
    return params[0].numel() / _best(run, torch.device("cpu"))


def _disk(folder: Path) -> tuple[float, float]:
    folder.mkdir(parents=True, exist_ok=True)
    data = os.urandom(32 * MiB)
    fd, name = tempfile.mkstemp(dir=folder, prefix=".framework-probe-")
    try:
        t = time.perf_counter()
        os.write(fd, data)
        os.fsync(fd)
        write = len(data) / (time.perf_counter() - t)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)   # read from the disk, not the page cache
        os.lseek(fd, 0, os.SEEK_SET)
        t = time.perf_counter()
        while os.read(fd, 8 * MiB):
            pass
        read = len(data) / (time.perf_counter() - t)
    finally:
        os.close(fd)
        os.unlink(name)
    return write, read


def _collective_rank(rank: int, store: str, q) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    import torch.distributed as td
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= 2   # the backend training would use
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    td.init_process_group("nccl" if cuda else "gloo", store=td.FileStore(store, 2), rank=rank, world_size=2)
    t = torch.ones(8 * MiB, device=device)
    td.all_reduce(t)
    _sync(device)
    td.barrier()
    start = time.perf_counter()
    for _ in range(3):
        td.all_reduce(t)
    _sync(device)
    if rank == 0:
        q.put(3 * t.numel() * 4 / (time.perf_counter() - start))
    td.destroy_process_group()


def _collective() -> float:
    """Algorithmic all-reduce bandwidth (bytes of the buffer per second) between 2 local ranks: NCCL
    on two GPUs when there are, else gloo."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory(prefix="framework-probe-") as d:
        mp.start_processes(_collective_rank, args=(os.path.join(d, "store"), q), nprocs=2, join=True,
                           start_method="spawn")
    return q.get()


def load(device: torch.device, disk_dir: Path, collectives: bool, reprobe: bool = False) -> dict:
    """The cached probe for this machine, device and ``disk_dir`` (the disk test writes there), measured
    now when missing or ``reprobe``."""

    path = cache_path(device, disk_dir)
    if not reprobe and path.exists():
        with contextlib.suppress(ValueError):   # an unreadable cache is measured again
            cached = json.loads(path.read_text())
            if cached.get("version") == VERSION and (not collectives or cached.get("allreduce_bytes_s")):
                return {**cached, "cache": str(path)}
    result = measure(device, disk_dir, collectives)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    return {**result, "cache": str(path), "measured_now": True}
