"""GPU readiness in one command: everything the CPU suite cannot verify, run once, one table.

    bash bench/gpu_check.sh                       # on a GPU machine: at most 8 minutes, nothing installed
    bash bench/gpu_check.sh --dry-run             # the same code paths on the CPU checking accelerator
    bash bench/gpu_check.sh --out DIR --budget 480 --skip timing

Checks, in order (each in its own process and session with its own time limit, so one that fails
or hangs is reported, with what it recorded and its log's last lines, and stopped with every process
it started before the others run; a check that would not fit in what is left of the budget is
reported as skipped):

* environment: versions, GPUs, which optional packages exist, the backend ``dist.backend=auto``
  picks for one and for more local ranks than GPUs, the one-line error of an impossible request;
* kernels: the C++ host optimizer kernels built (or loaded), the host-step thread's device, pinned
  memory as CUDA's caching host allocator holds it (power-of-two rounding) next to what was asked;
* equivalence: ``pytest tests/gpu`` (every stage x offload target, fp32, bf16 and fp16, against a
  single-GPU reference: world 1 on NCCL, two ranks over gloo with CUDA tensors on one GPU, NCCL
  across GPUs where there are two or more), one row per compared run with its largest differences;
* memory: peak ``max_memory_allocated`` per stage against the estimator (gpt2-medium, bf16; within
  0.8-1.1 of its CUDA peak, which traces attention as the fused kernels hold it);
* sync: host syncs made during backward (by the main thread or autograd's device thread, where the
  hooks run on CUDA), counted by CUDA's sync debug mode
  (expected 0), and over a whole step (the deliberate ones: gradient norm, loss);
* timing: the anchor config (GPT 1.417 B, 16 x 1024 tokens, bf16) for plain PyTorch, FSDP2 (with
  and without CPU offload), DeepSpeed where installed, and our stages (``bench.gpu``).

Writes DIR/gpu_check.md (one Markdown table), DIR/gpu_check.json and DIR/gpu_check.tgz (both and every
check's log and records), rewritten after every check: three files (the checks' own files go to
``--logs``, default DIR/logs; the device tool returns at most 8 files, so give it a folder outside DIR).
Standard output ends with a short summary (failed rows in full, the rest as counts per check) and the
verdict: PASSED (exit 0), FAILED (a row failed; exit 1) or INCOMPLETE (nothing failed, but a check was
left out by the time budget or limit, or a run without --dry-run found no GPU: then it stops after the
environment check; exit 3; --skip is neutral; exit 2: bad arguments, or a Python that cannot import torch). Under gpu_check.sh the budget is clamped to its hard time limit less a margin; when that limit
stops the run, the table is still written, with the interrupted check's row (a failure: FAILED).
``--dry-run`` runs each check on the CPU (gloo, FRAMEWORK_ACCELERATOR=check, tiny sizes); the test
suite runs it without Hydra, OmegaConf and W&B, as the GPU image has none.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import platform
import signal
import subprocess
import sys
import tarfile
import threading
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ORDER = ("environment", "kernels", "equivalence", "memory", "sync", "timing")
# Seconds a check may take at most on one H200, and the least it needs to be worth starting.
CAP = {"environment": 60, "kernels": 120, "equivalence": 240, "memory": 120, "sync": 90, "timing": 300}
FLOOR = {"environment": 10, "kernels": 20, "equivalence": 60, "memory": 30, "sync": 20, "timing": 90}
# Most telling first (the budget may end the list): offload against the offload peers, then no offload.
TIMING = ("plain", "zero2-offload", "zero2-offload-overlap", "fsdp2-offload", "deepspeed-zero2-offload", "zero3",
          "fsdp2", "zero3-offload", "zero2")
TIMING_DRY = ("fsdp2", "deepspeed-zero2-offload")   # (ours runs in memory and sync; DeepSpeed: if installed)
# A timing run starts only with this many seconds left (GPU, dry run): a 1.4 B run cut short by the
# budget measures nothing. One GPU run past TIMING_RUN_CAP_S has hung (a failure); one stopped by the
# budget's end is not checked, not failed.
TIMING_MIN_S = {False: 60, True: 20}
TIMING_RUN_CAP_S = 240
MEMORY = {"ddp": [], "zero1": ["+stage=zero1"], "zero2": ["+stage=zero2"], "zero3": ["+stage=zero3"],
          "zero2+cpu": ["+stage=zero2", "offload=cpu"], "zero3+cpu params": ["+stage=zero3", "offload=cpu",
                                                                             "offload.params=cpu"]}
SYNC = {"zero2+cpu": ["+stage=zero2", "offload=cpu", "stage.overlap_comm=true"],
        "zero3+cpu params": ["+stage=zero3", "offload=cpu", "offload.params=cpu"], "zero3": ["+stage=zero3"],
        # owned gradients in the swap file, read back by the second micro batch's hooks
        "zero3+nvme accum": ["+stage=zero3", "offload=nvme", "train.grad_accum=2"]}
# What one GPU cannot show, whatever the results above say.
UNRUN_ONE_GPU = [
    "NCCL collectives between ranks (framework.comm.collectives.Nccl: reduce_scatter_tensor, all_gather_into_tensor, "
    "per-owner reduce) and their ordering on NCCL's stream: need two GPUs",
    "NCCL's watchdog abort of a rank whose peer died (the launcher's SIGABRT message): needs two GPUs",
    "the host-step thread's device on a multi-GPU node (without bind_thread its context lands on GPU 0): "
    "with one GPU every thread's device is GPU 0 anyway",
    "dist.backend=auto choosing NCCL for several local ranks: needs as many GPUs as ranks",
]


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


def _engine_run(cfg, device, steps: int, around_backward=None):
    """Our engine on ``cfg`` (built on the meta device, as bench.gpu does), ``steps`` steps of random
    batches; ``around_backward(phase)`` is told when backward starts and ends, and ("autograd") from the
    thread that runs the backward graph (on CUDA autograd's device thread, not the caller's). Returns the
    engine's final loss."""
    import torch

    from bench.gpu import _batch, _ours_step

    step, extra = _ours_step(cfg, device)
    engine = extra["engine"]
    try:
        if around_backward is not None:
            stage = engine.components.stage
            backward = stage.backward

            def told(loss, *, sync):
                around_backward("backward")
                if loss.requires_grad:   # (the hook runs where the graph runs: on that thread)
                    loss.register_hook(lambda _g: around_backward("autograd"))
                try:
                    return backward(loss, sync=sync)
                finally:
                    around_backward("step")
            stage.backward = told
        gen = torch.Generator().manual_seed(0)
        loss = None
        for _ in range(steps):
            loss = step(_batch(cfg, device, gen))
        return loss
    finally:
        engine.close()


def check_memory(dry: bool, out: Path) -> list[dict]:
    import gc

    import torch

    from bench.gpu import _predicted_gib
    from framework.config import compose

    device = _device(dry)
    model = ["model=gpt-nano", "train.micro_batch=2"] if dry else ["model=gpt2-medium", "train.micro_batch=8"]
    if device.type == "cuda":   # the caching allocator's statistics exist once CUDA is initialised
        torch.zeros(1, device=device)
    rows = []
    for name, overrides in MEMORY.items():
        if dry and name != "zero3+cpu params":   # the code path once: the CPU suite's time is short
            continue
        try:
            cfg = compose([*model, "precision=bf16", "optimizer=adamw", "logger=none", "train.steps=3", *overrides])
            predicted = _predicted_gib(cfg, device)
            if device.type == "cuda":
                gc.collect()
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
                base = torch.cuda.memory_allocated(device)
            _engine_run(cfg, device, 3)
            measured = (torch.cuda.max_memory_allocated(device) - base) / 2**30 if device.type == "cuda" else None
            if measured is None:
                rows.append(row("memory", name, None, "no device allocator on the CPU", f"estimated {predicted} GiB"))
                continue
            ratio = measured / predicted if predicted else float("nan")
            rows.append(row("memory", name, 0.8 <= ratio <= 1.1, f"{measured:.2f} GiB peak allocated",
                            f"estimated {predicted} GiB", f"measured / estimated = {ratio:.2f}"))
        except Exception as e:  # noqa: BLE001 - one stage's failure is its own row
            rows.append(row("memory", name, False, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"))
    return rows


def check_sync(dry: bool, out: Path) -> list[dict]:
    import torch

    from framework.config import compose

    device = _device(dry)
    rows = []
    for name, overrides in SYNC.items():
        if dry and name != "zero3+cpu params":
            continue
        cfg = compose(["model=gpt-nano", "precision=bf16", "logger=none", "train.micro_batch=4", *overrides])
        counts, phase, steps = {"backward": 0, "step": 0}, {"now": "step"}, {"n": 0}
        # The main thread, and the thread that runs backward's hooks: not the offload worker threads,
        # whose waits on events are their job.
        watched = {threading.main_thread().ident}

        def seen(message, category, filename, lineno, file=None, line=None):
            if threading.get_ident() in watched and steps["n"] > 0 and "synchroniz" in str(message).lower():
                counts[phase["now"]] += 1

        def told(now):
            if now == "autograd":
                watched.add(threading.get_ident())
                return
            phase["now"] = now
            if now == "step" and device.type == "cuda":   # debug mode from the second step on (after warm-up)
                steps["n"] += 1
                torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("always")
                warnings.showwarning = seen
                _engine_run(cfg, device, 3, around_backward=told)
        finally:
            if device.type == "cuda":
                torch.cuda.set_sync_debug_mode("default")
        if device.type != "cuda":
            rows.append(row("sync", f"{name}: host syncs in backward", True, "none (the check mode raised nothing)",
                            "0", "CUDA's sync debug mode needs a GPU; on the CPU the checking accelerator watches hooks"))
            continue
        rows.append(row("sync", f"{name}: syncs in backward (main and autograd threads), steps 2-3", counts["backward"] == 0,
                        counts["backward"], "0"))
        rows.append(row("sync", f"{name}: main-thread syncs outside backward, after the first", None, counts["step"],
                        "a few per step: gradient norm, loss, event waits"))
    rows.append(_hf_forward_syncs(device, out))
    return rows


def _hf_forward_syncs(device, out: Path) -> dict:
    """model=hf (a 2-layer GPT-2 config.json written to ``out``) under zero2, 3 steps: the host reads of a
    tensor's value inside the forward (``causal_lm_loss``), counted on every device, and on CUDA the syncs
    that CUDA's sync debug mode reports there, from the second step on (docs/hf.md: transformers' mask code)."""
    import torch
    from torch.overrides import TorchFunctionMode

    try:
        from framework import initialize
        from framework.config import compose
        from framework.engine.build import component
        from framework.models.hf import causal_lm_loss
    except ImportError as e:   # (transformers not installed)
        return row("sync", "model=hf: host syncs in the forward", None, f"skipped: {_first_line(e)}")
    path = out / "hf_gpt2" / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict(model_type="gpt2", n_layer=2, n_head=4, n_embd=64, vocab_size=128,
                                    n_positions=64, bos_token_id=0, eos_token_id=0)))
    cfg = compose(["model=hf", f"model.config={path}", "model.context=32", "data.vocab_size=128",
                   "precision=bf16", "logger=none", "train.micro_batch=4", "+stage=zero2"])
    counts, step = {"reads": 0, "syncs": 0}, {"n": 0}

    class Reads(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if step["n"] > 0 and getattr(func, "__name__", "") in ("__bool__", "item", "tolist", "__int__"):
                counts["reads"] += 1
            return func(*args, **(kwargs or {}))

    def seen(message, *_a, **_k):
        if step["n"] > 0 and "synchroniz" in str(message).lower():
            counts["syncs"] += 1

    with torch.device("meta"):
        model = component(cfg, "model").build(cfg.model, vocab_size=128)
    engine = initialize(model, causal_lm_loss, cfg)
    loss_fn = engine.components.loss_fn

    def counted(m, batch):
        cuda = device.type == "cuda" and step["n"] > 0
        with warnings.catch_warnings(), Reads():
            warnings.simplefilter("always")
            warnings.showwarning = seen
            if cuda:
                torch.cuda.set_sync_debug_mode("warn")
            try:
                return loss_fn(m, batch)
            finally:
                if cuda:
                    torch.cuda.set_sync_debug_mode("default")
    object.__setattr__(engine.components, "loss_fn", counted)
    try:
        gen, state = torch.Generator().manual_seed(0), engine.state
        for n in range(3):
            step["n"] = n
            x = torch.randint(0, 128, (4, 33), generator=gen).to(device)
            state, _ = engine.train_step(state, [(x[:, :-1], x[:, 1:])])
    finally:
        engine.close()
    syncs = f", {counts['syncs']} CUDA syncs" if device.type == "cuda" else " (CUDA syncs: needs a GPU)"
    return row("sync", "model=hf (GPT-2, zero2): host reads in the forward, steps 2-3", None,
               f"{counts['reads']} value reads{syncs}", "2 (one a forward): transformers' packed-sequence check "
               "(docs/hf.md)")


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


CHECKS = {"environment": check_environment, "kernels": check_kernels, "equivalence": check_equivalence,
          "memory": check_memory, "sync": check_sync, "timing": check_timing}


# --- the driver -------------------------------------------------------------------------------------

def _one(name: str, dry: bool, out: Path) -> None:
    """Run one check in this process; its rows go to OUT/NAME.json."""
    if dry:
        os.environ.setdefault("FRAMEWORK_ACCELERATOR", "check")
    try:
        rows = CHECKS[name](dry, out)
    except Exception as e:  # noqa: BLE001 - the check's own failure is a row too
        import traceback
        rows = [row(name, "check", False, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", "",
                    " / ".join(traceback.format_exc().strip().splitlines()[-3:]))]
    (out / f"{name}.json").write_text(json.dumps(rows))


GRACE_S = 3   # between SIGTERM and SIGKILL to a check's process group


def _end_group(p: subprocess.Popen, term: bool) -> None:
    """End every process of ``p``'s group (its session: ``p`` and what it started, pytest's ranks,
    bench.gpu's runs): SIGTERM (when ``term``), up to GRACE_S seconds for them to go, then SIGKILL,
    and again up to GRACE_S seconds until the kernel has taken them (the next check's memory)."""
    for sig in (signal.SIGTERM, signal.SIGKILL) if term else (signal.SIGKILL,):
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            break
        end, gone = time.monotonic() + GRACE_S, False
        while not gone and time.monotonic() < end:
            p.poll()   # reap the leader: a zombie still counts as a member of its group
            try:
                os.killpg(p.pid, 0)
                time.sleep(0.05)
            except ProcessLookupError:
                gone = True
        if gone:
            break
    p.wait()


def _run_child(name: str, dry: bool, out: Path, limit: float) -> list[dict]:
    """Check ``name`` in its own process and session, stopped with all it started after ``limit``
    seconds; its output goes to OUT/NAME.log as it comes."""
    (out / f"{name}.json").unlink(missing_ok=True)
    if name == "equivalence":
        (out / "equivalence.jsonl").unlink(missing_ok=True)
    env = {**os.environ, "GPU_CHECK_DEADLINE": repr(time.time() + limit)}
    cmd = [sys.executable, "-m", "bench.gpu_check", "--one", name, "--out", str(out), *(["--dry-run"] if dry else [])]
    log = out / f"{name}.log"
    with _new_log(log) as f:
        p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        ended = False
        try:
            try:
                p.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                _end_group(p, term=True)
                ended = True
                partial = _equivalence_rows(out / "equivalence.jsonl") if name == "equivalence" else []
                return [*partial, row(name, "check", False, f"timed out after {limit:.0f} s", "", _tail(log))]
            _end_group(p, term=False)   # what it left behind (a timed-out pytest's ranks)
            ended = True
        finally:
            # The driver itself stopped (SIGTERM from gpu_check.sh's timeout, Ctrl-C), also while it was
            # ending the group above: the group still goes, SIGKILL included.
            if not ended:
                _end_group(p, term=True)
    done = out / f"{name}.json"
    if done.exists():
        return json.loads(done.read_text())
    return [row(name, "check", False, f"exit {p.returncode}", "", _tail(log, 1))]


HARD_MARGIN_S = 25   # gpu_check.sh's hard limit less this is the most --budget: start-up, the last check's end


class _Stopped(BaseException):
    """SIGTERM (gpu_check.sh's hard time limit, or a person) while a check runs."""


EXIT = {"PASSED": 0, "FAILED": 1, "INCOMPLETE": 3}
NO_GPU = "not run (no GPU)"   # (the verdict's "no GPU" says why: not the time budget)


def _verdict(info: dict, rows: list[dict]) -> tuple[str, list[str]]:
    """FAILED where a row failed; else INCOMPLETE where the run did not check what it should (a check
    the time budget or the time limit left out or that was not reached yet, a GPU run without a GPU),
    else PASSED. A check left out by --skip was asked for: neutral. Also what was not checked."""
    seen = {r["check"] for r in rows}
    cut = [r["check"] for r in rows
           if r["item"] == "check" and r["ok"] is None and r["value"] not in ("skipped (--skip)", NO_GPU)]
    timing = [r for r in rows if r["check"] == "timing" and r["item"] != "check"]
    if timing and not any(r["ok"] for r in timing) and any("time budget" in r["value"] for r in timing):
        cut.append("timing")   # every system skipped or stopped by the budget: nothing was timed
    why = [f"{', '.join(cut)} not run (time budget or limit)"] if cut else []
    if [c for c in ORDER if c not in seen]:
        why.append(f"{', '.join(c for c in ORDER if c not in seen)} not reached")
    if not info["dry_run"] and not info.get("gpus"):
        why.append("no GPU")
    return ("FAILED" if any(r["ok"] is False for r in rows) else "INCOMPLETE" if why else "PASSED"), why


def _table(rows: list[dict]) -> str:
    mark = {True: "ok", False: "FAIL", None: "-"}
    lines = ["| check | item | ok | value | expected / anchor | note |", "|---|---|---|---|---|---|"]
    for r in rows:
        cells = [r["check"], r["item"], mark[r["ok"]], r["value"], r["expected"], r["note"]]
        lines.append("| " + " | ".join(str(c).replace("|", "/").replace("\n", " ") for c in cells) + " |")
    return "\n".join(lines)


def _summary(out: Path, info: dict, rows: list[dict], most: int = 30) -> str:
    """What standard output ends with (a tool may keep only its last few thousand characters): the
    failed rows, one line each, then one line per check with its counts, then the verdict."""
    fails = [r for r in rows if r["ok"] is False]
    lines = [f"Failed rows ({len(fails)}):"] if fails else []
    for r in fails[:most]:
        lines.append(f"FAIL {r['check']} / {r['item']}: {r['value']}"
                     + (f"; expected {r['expected']}" if r["expected"] else "") + (f"; {r['note']}" if r["note"] else ""))
        lines[-1] = lines[-1].replace("\n", " ")[:300]
    if len(fails) > most:
        lines.append(f"... and {len(fails) - most} more in gpu_check.md")
    lines += ["", "| check | ok | FAIL | not checked | s |", "|---|---|---|---|---|"]
    for name in ORDER:
        mine = [r for r in rows if r["check"] == name]
        if not mine:
            continue
        lone = mine[0]["value"] if len(mine) == 1 and mine[0]["ok"] is None else ""
        counts = [sum(r["ok"] is v for r in mine) for v in (True, False, None)]
        lines.append(f"| {name} | {counts[0]} | {counts[1]} | {counts[2]}{f' ({lone})' if lone else ''} | "
                     f"{info['per_check_s'].get(name, '-')} |")
    failed, checked = len(fails), sum(r["ok"] is not None for r in rows)
    verdict, why = _verdict(info, rows)
    lines += ["", f"gpu_check: {verdict}: {failed} failed of {checked} checked rows"
              f"{' (dry run)' if info['dry_run'] else ''}; {info['machine']}; {info['seconds']:.0f} s"
              f"{'; ' + info['stopped'] if info.get('stopped') else ''}{'; not checked: ' + '; '.join(why) if why else ''}",
              f"gpu_check: full table {out / 'gpu_check.md'}; rows {out / 'gpu_check.json'}; "
              f"with every log {out / 'gpu_check.tgz'}"]
    return "\n".join(lines)


def _bundle(out: Path, logs: Path) -> None:
    """OUT/gpu_check.tgz: the table, the rows and every check's files (under logs/), replaced whole."""
    tmp = out / ".gpu_check.tgz.tmp"
    if tmp.is_file() and not tmp.is_symlink():   # a stopped run's leftover
        tmp.unlink()
    # (made new: a link planted there is refused, never followed)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "wb") as f, tarfile.open(fileobj=f, mode="w:gz") as tar:
        for name in ("gpu_check.md", "gpu_check.json"):
            tar.add(out / name, arcname=name)
        for f in sorted(logs.iterdir()) if logs.is_dir() else []:
            if f.is_file() and not f.is_symlink():
                data = f.read_bytes()
                info = tarfile.TarInfo(f"logs/{f.name}")
                info.size, info.mtime = len(data), int(f.stat().st_mtime)
                tar.addfile(info, io.BytesIO(data))
    os.replace(tmp, out / "gpu_check.tgz")


def write(out: Path, info: dict, rows: list[dict], logs: Path | None = None) -> None:
    failed = sum(r["ok"] is False for r in rows)
    verdict, why = _verdict(info, rows)   # (while the run goes on: INCOMPLETE, the checks not reached yet)
    head = (f"# GPU check{' (dry run on the CPU)' if info['dry_run'] else ''}: {verdict}\n\n{info['machine']}; "
            f"{info['started']}; {info['seconds']:.0f} s; {failed} failed of {sum(r['ok'] is not None for r in rows)}"
            f" checked rows{'; not checked: ' + '; '.join(why) if why else ''}\n\n")
    unrun = "\n\nNot verifiable on one GPU:\n" + "\n".join(f"- {u}" for u in info["unrun"]) if info["unrun"] else ""
    (out / "gpu_check.md").write_text(head + _table(rows) + unrun + "\n")
    (out / "gpu_check.json").write_text(json.dumps({**info, "verdict": verdict, "not_checked": why, "failed": failed,
                                                      "rows": rows}, indent=1))
    if logs is not None:
        _bundle(out, logs)


def _seconds(text: str) -> float:
    """--budget: a number of seconds above 0 (argparse's type)."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0:   # (NaN too)
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds above 0 (e.g. --budget 450)")
    return value


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench/gpu_check.sh", description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="the same code paths on the CPU checking accelerator")
    ap.add_argument("--out", default="gpu_check_out", help="folder for gpu_check.md, .json and .tgz")
    ap.add_argument("--logs", help="folder for each check's log and records (default: OUT/logs; on a tool that "
                                   "returns few files from OUT, one outside it)")
    ap.add_argument("--budget", type=_seconds, default=450, help="seconds for all checks (the script stops starting "
                                                               "checks that would not fit)")
    ap.add_argument("--skip", default="", help=f"comma-separated checks to skip: {', '.join(ORDER)}")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    try:
        import torch
    except ImportError as e:
        print(f"gpu_check: {sys.executable} cannot import torch ({e}); activate the environment "
              f"(. .venv/bin/activate) or set PYTHON=.venv/bin/python", file=sys.stderr)
        return 2
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.one:
        _one(args.one, args.dry_run, out)
        return 0
    skip = {s for s in args.skip.split(",") if s}
    if skip - set(ORDER):
        ap.error(f"unknown check(s) {', '.join(sorted(skip - set(ORDER)))}; choose from {', '.join(ORDER)}")
    logs = Path(args.logs).resolve() if args.logs else out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    budget = args.budget
    hard = os.environ.get("GPU_CHECK_HARD_LIMIT_S")   # gpu_check.sh's timeout, which ends everything
    if hard and budget > float(hard) - HARD_MARGIN_S:
        budget = float(hard) - HARD_MARGIN_S
        print(f"gpu_check: --budget {args.budget:g} clamped to {budget:g} s (gpu_check.sh stops everything at "
              f"{float(hard):g} s; start-up and the last check's end need the rest)", flush=True)
    # gpu_check.sh's timeout signals this process's group, which the checks' sessions are not in:
    # SIGTERM ends the running check's group (_run_child), then the table is written with its row.
    state = {"running": False, "stopped": False}

    def stop(*_):
        state["stopped"] = True
        if state["running"]:
            state["running"] = False
            raise _Stopped
    signal.signal(signal.SIGTERM, stop)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    start = time.monotonic()
    machine = (f"{torch.cuda.get_device_name(0)} x{gpus}" if gpus else "no GPU") + \
        f"; {os.cpu_count()} host cores; torch {torch.__version__}; python {platform.python_version()}"
    info = {"dry_run": args.dry_run, "machine": machine, "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "seconds": 0.0, "budget_s": budget, "gpus": gpus, "unrun": UNRUN_ONE_GPU if gpus < 2 else [], "per_check_s": {}}
    no_gpu = not args.dry_run and not gpus
    if no_gpu:
        print("gpu_check: no GPU found (torch.cuda.is_available() is False): only the environment check runs; run it "
              "on a GPU machine, or with --dry-run for the same code paths on the CPU", flush=True)
    rows: list[dict] = []
    for name in ORDER:
        left = budget - (time.monotonic() - start)
        if state["stopped"]:
            rows.append(row(name, "check", None, "not run (stopped by the time limit)"))
        elif name in skip:
            rows.append(row(name, "check", None, "skipped (--skip)"))
        elif no_gpu and name != "environment":
            rows.append(row(name, "check", None, NO_GPU))
        elif left < (3 if args.dry_run else FLOOR[name]):
            rows.append(row(name, "check", None, f"skipped (time budget: {left:.0f} s left)"))
        else:
            t = time.monotonic()
            limit = left if args.dry_run else min(CAP[name], left)
            print(f"gpu_check: {name} (up to {limit:.0f} s)", flush=True)
            try:
                state["running"] = True
                rows += _run_child(name, args.dry_run, logs, limit)
            except _Stopped:
                signal.signal(signal.SIGTERM, signal.SIG_IGN)   # the table first; SIGKILL comes anyway
                partial = _equivalence_rows(logs / "equivalence.jsonl") if name == "equivalence" else []
                rows += [*partial, row(name, "check", False, "stopped by the time limit (SIGTERM)", "",
                                       _tail(logs / f"{name}.log"))]
                info["stopped"] = f"stopped by the time limit during {name}"
            finally:
                state["running"] = False
            info["per_check_s"][name] = round(time.monotonic() - t, 1)
        info["seconds"] = time.monotonic() - start
        write(out, info, rows, logs)
    print(_summary(out, info, rows), flush=True)
    return EXIT[_verdict(info, rows)[0]]


if __name__ == "__main__":
    sys.exit(main())
