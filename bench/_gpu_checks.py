"""The GPU check's checks that stand on their own (bench/gpu_check.py runs each in a child process:
``python -m bench.gpu_check --one NAME``): environment, kernels, equivalence and timing, and what
every check shares (``row``, the deadline the driver set, the device). The checks that drive our
engine (memory, sync) are in bench/_gpu_engine_checks.py. Each returns its rows; none exits.
"""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Seconds a check may take at most on one H200 (the driver's limit for it; FLOOR there: the least).
CAP = {"environment": 60, "kernels": 120, "equivalence": 240, "memory": 120, "sync": 90, "timing": 300}
# Most telling first (the budget may end the list): offload against the offload peers, then no offload.
TIMING = ("plain", "zero2-offload", "zero2-offload-overlap", "fsdp2-offload", "deepspeed-zero2-offload", "zero3",
          "fsdp2", "zero3-offload", "zero2")
TIMING_DRY = ("fsdp2", "deepspeed-zero2-offload")   # (ours runs in memory and sync; DeepSpeed: if installed)
# A timing run starts only with this many seconds left (GPU, dry run): a 1.4 B run cut short by the
# budget measures nothing. One GPU run past TIMING_RUN_CAP_S has hung (a failure); one stopped by the
# budget's end is not checked, not failed.
TIMING_MIN_S = {False: 60, True: 20}
TIMING_RUN_CAP_S = 240


def row(check: str, item: str, ok, value="", expected="", note="") -> dict:
    return {"check": check, "item": item, "ok": ok, "value": str(value), "expected": str(expected), "note": str(note)}


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:300]}"


def _tail(path: Path, n: int = 3, width: int = 300) -> str:
    """The last ``n`` non-empty lines of ``path``, as one line (a row's note)."""
    text = path.read_text(errors="replace") if path.exists() else ""
    return " / ".join(x.strip() for x in text.strip().splitlines()[-n:] if x.strip())[-width:]


def _new_log(path: Path):
    """``path`` opened for writing, truncated; a link there is refused, never followed (the driver stays
    light: no framework import)."""
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644), "w")


def _deadline(name: str) -> float:
    """When this check's process will be stopped (``time.time()``), as the driver set it before the
    launch: the clock starts before Python's start-up and the imports, not after them."""
    return float(os.environ.get("GPU_CHECK_DEADLINE", time.time() + CAP[name]))


def _device(dry: bool):
    import torch
    return torch.device("cpu") if dry or not torch.cuda.is_available() else torch.device("cuda", 0)


# --- the checks (each runs in a child process: ``--one NAME``) ------------------------------------

def check_environment(dry: bool, out: Path) -> list[dict]:
    import torch

    from framework.comm.distributed import backend_notice, gpu_count, resolve_backend
    from framework.core.errors import ConfigError

    rows = [row("environment", "python", True, platform.python_version()),
            row("environment", "torch", True, torch.__version__, "2.11 (GPU image) or 2.13"),
            row("environment", "CUDA", True if torch.cuda.is_available() or dry else None, torch.version.cuda or "none"),
            row("environment", "host cores", True, os.cpu_count())]
    gpus = gpu_count()
    names = [torch.cuda.get_device_name(i) for i in range(gpus)]
    rows.append(row("environment", "GPUs", True if gpus > 0 or dry else None, f"{gpus}: {', '.join(names) or '-'}"))
    for mod in ("hydra", "omegaconf", "wandb", "deepspeed", "transformers", "yaml", "ninja"):
        try:
            __import__(mod)
            have = "installed"
        except ImportError:
            have = "not installed"
        except Exception as e:  # e.g. DeepSpeed raising RuntimeError when it finds no CUDA_HOME
            have = f"import failed: {_first_line(e)}"
        rows.append(row("environment", f"import {mod}", None, have,
                        "not needed" if mod in ("hydra", "omegaconf", "wandb", "deepspeed") else "needed"))
    rows.append(row("environment", "dist.backend=auto, 1 local rank", True, resolve_backend("auto", 1),
                    "nccl" if gpus else "gloo"))
    more = max(2, gpus + 1)
    picked = resolve_backend("auto", more)
    rows.append(row("environment", f"dist.backend=auto, {more} local ranks", picked == "gloo", picked,
                    "gloo (more ranks than GPUs)", backend_notice("auto", more) or ""))
    try:
        resolve_backend("nccl", more)
        rows.append(row("environment", f"dist.backend=nccl, {more} local ranks", False, "accepted", "one-line error"))
    except ConfigError as e:
        rows.append(row("environment", f"dist.backend=nccl, {more} local ranks", "\n" not in str(e), str(e),
                        "one-line error"))
    return rows


def check_kernels(dry: bool, out: Path) -> list[dict]:
    import torch

    from framework import ops
    from framework.comm.accelerator import for_device

    rows = []
    t = time.perf_counter()
    ops.cpu_optim()
    rows.append(row("kernels", "C++ host optimizer kernels", ops.available(),
                    f"{'available' if ops.available() else ops.unavailable_reason()} in {time.perf_counter() - t:.1f} s",
                    "available (else the slower PyTorch fallback)"))
    device = _device(dry)
    acc = for_device(device)
    seen = {}

    def worker():
        acc.bind_thread()
        seen["device"] = torch.cuda.current_device() if device.type == "cuda" else "cpu"
    th = threading.Thread(target=worker)
    th.start()
    th.join()
    want = device.index if device.type == "cuda" else "cpu"
    rows.append(row("kernels", "a worker thread's device after bind_thread", seen.get("device") == want,
                    seen.get("device"), want))
    before = acc.pinned_stats()
    keep = [acc.empty_host(n, torch.uint8) for n in (3 << 20, 5 << 20, 9 << 20)]
    after = acc.pinned_stats()
    asked = sum(t.numel() for t in keep)
    grew = after["reserved"] - before["reserved"]
    rows.append(row("kernels", "pinned 3+5+9 MiB: bytes the host allocator reserves", None,
                    f"{grew / 2**20:.0f} MiB for {asked / 2**20:.0f} MiB asked",
                    "28 MiB (4 + 8 + 16: each rounded up to a power of two)",
                    "what torch's caching pinned allocator holds; the offload stores use arenas instead"))
    from framework.offload import HostStore   # the offload tiers' pinned buffers: one arena
    store = HostStore(acc, pin=True)
    store.reserve([(t.numel(), torch.uint8) for t in keep])
    sliced = [store.allocate(t.numel(), torch.uint8) for t in keep]
    landed = torch.empty(sliced[-1].numel(), dtype=torch.uint8, device=device)
    sliced[-1].fill_(7)
    acc.copy(landed, sliced[-1], non_blocking=True)   # needs page-locked memory on CUDA
    done = acc.event()
    done.record()
    done.synchronize()
    ok = store.pinned_bytes() - asked < 64 * len(keep) + 4096 and bool((landed == 7).all())
    rows.append(row("kernels", "pinned 3+5+9 MiB as one offload arena: bytes locked, async copy", ok,
                    f"{store.pinned_bytes() / 2**20:.2f} MiB for {asked / 2**20:.0f} MiB asked",
                    "17 MiB (one page-locked allocation), the copy lands"))
    ev = acc.event()
    ev.record()
    t = time.perf_counter()
    ev.synchronize()
    rows.append(row("kernels", "event synchronize (blocking events)", True, f"{(time.perf_counter() - t) * 1e6:.0f} us"))
    return rows


def check_equivalence(dry: bool, out: Path) -> list[dict]:
    import xml.etree.ElementTree as ET

    report, junit, log = out / "equivalence.jsonl", out / "equivalence.xml", out / "equivalence_pytest.log"
    report.unlink(missing_ok=True)
    junit.unlink(missing_ok=True)
    env = {**os.environ, "FRAMEWORK_GPU_REPORT": str(report)}
    if dry:
        env.update(FRAMEWORK_GPU_DRY="1", FRAMEWORK_ACCELERATOR="check")
    # pytest stops a little before the driver stops this process, so its verdict and the rows it
    # recorded are still reported; its output goes to the log as it comes (kept on a timeout).
    limit = max(1.0, _deadline("equivalence") - time.time() - 15)
    # The short offload test first: the long comparison matrix must not leave it to pytest's time limit.
    files = sorted((ROOT / "tests" / "gpu").glob("test_*.py"), key=lambda f: (f.name != "test_offload_cuda.py", f.name))
    # (-p no:hydra_pytest: Hydra's plugin, where Hydra is installed but must not be used)
    with _new_log(log) as f:
        try:
            code = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:hydra_pytest",
                                   *(str(x.relative_to(ROOT)) for x in files), f"--junitxml={junit}"],
                                  cwd=ROOT, env=env, stdout=f,
                                  stderr=subprocess.STDOUT, timeout=limit).returncode
        except subprocess.TimeoutExpired:   # its ranks, in this process group, go when the driver ends the group
            code = None
    rows = _equivalence_rows(report)
    if junit.exists():
        for case in ET.parse(junit).getroot().iter("testcase"):
            name = f"{case.get('classname', '').split('.')[-1]}::{case.get('name')}"
            failed = case.find("failure") is not None or case.find("error") is not None
            skipped = case.find("skipped")
            if failed or skipped is None:
                # (an Element without children is falsy: test against None, not truthiness)
                bad = case.find("failure") if case.find("failure") is not None else case.find("error")
                msg = (bad.get("message", "") or (bad.text or "").strip())[:300] if failed else ""
                rows.append(row("equivalence", f"pytest {name}", not failed, "failed" if failed else "passed", "", msg))
            else:
                rows.append(row("equivalence", f"pytest {name}", None, "skipped", "", skipped.get("message", "")[:200]))
    # pytest's own verdict, always: a crash after the comparisons (a process group's teardown, say)
    # leaves every row above ok and no junit file.
    ok = code in (0, 5)
    rows.append(row("equivalence", "pytest tests/gpu: exit status", ok,
                    f"timed out after {limit:.0f} s" if code is None else f"exit {code}", "0",
                    "" if ok else f"{_tail(log)}; junit file {'written' if junit.exists() else 'missing'}"))
    return rows


def _equivalence_rows(report: Path) -> list[dict]:
    """One row per compared run in ``report`` (FRAMEWORK_GPU_REPORT's JSON lines, written as each
    comparison ends, so a run cut short still has its first rows)."""
    rows = []
    for line in report.read_text().splitlines() if report.exists() else []:
        try:
            r = json.loads(line)
        except ValueError:   # the last line, cut off by a kill
            continue
        value = (f"loss rel {r['max_rel_loss']:.1e}, params abs {r['max_abs_param']:.1e}" if "max_rel_loss" in r
                 else r.get("error", ""))
        rows.append(row("equivalence", f"{r['case']} {r['precision']}, world {r['world']} "
                        f"({r['backend']}, {r['device']})", r["ok"], value,
                        "fp32 vs plain PyTorch: rel 2e-5 / abs 2e-5; bf16, fp16 vs our ddp: rel 2e-2 / abs 3e-2"))
    return rows


def check_timing(dry: bool, out: Path) -> list[dict]:
    from bench.gpu import ANCHORS, anchor

    rows = []
    deadline = _deadline("timing") - 10
    for system in TIMING_DRY if dry else TIMING:
        left = deadline - time.time()
        if left < TIMING_MIN_S[dry]:
            rows.append(row("timing", system, None, "skipped (time budget)"))
            continue
        if system.startswith("deepspeed"):
            try:
                __import__("deepspeed")
            except ImportError:
                rows.append(row("timing", system, None, "not installed", anchor(system)))
                continue
            except Exception as e:  # a broken install: this row says so, the others still run
                rows.append(row("timing", system, None, f"deepspeed: import failed: {_first_line(e)}",
                                anchor(system)))
                continue
        cmd = [sys.executable, "-m", "bench.gpu", "--one", system, "--steps", "1" if dry else "4",
               "--warmup", "0" if dry else "1", *(["--tiny"] if dry else [])]
        limit = left if dry else min(left, TIMING_RUN_CAP_S)
        try:
            p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=limit)
        except subprocess.TimeoutExpired:
            if limit < left:
                rows.append(row("timing", system, False, f"timed out after {limit:.0f} s (a run's limit)"))
            else:
                rows.append(row("timing", system, None, f"stopped: time budget (after {limit:.0f} s)"))
            continue
        lines = [x for x in p.stdout.splitlines() if x.startswith("{")]
        if p.returncode or not lines:
            tail = (p.stderr.strip().splitlines() or ["?"])[-1]
            rows.append(row("timing", system, False, f"exit {p.returncode}", anchor(system), tail[:300]))
            continue
        r = json.loads(lines[-1])
        mem = f", peak {r['peak_gpu_gib']} GiB" if r["peak_gpu_gib"] is not None else ""
        est = f", estimated {r['predicted_gib']} GiB" if r.get("predicted_gib") is not None else ""
        rows.append(row("timing", system, True, f"{r['s_per_step']:.3f} s/step, {r['tokens_per_s']:,} tokens/s{mem}{est}",
                        anchor(system) if system in ANCHORS else "-",
                        ", ".join(f"{k} {v} ms" for k, v in r["phases_ms"].items())))
    return rows
