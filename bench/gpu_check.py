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

This module is the driver (the runner, the table, the verdict); the checks themselves are in
bench/_gpu_checks.py (environment, kernels, equivalence, timing) and bench/_gpu_engine_checks.py
(memory, sync).
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
import time
from pathlib import Path

from bench._gpu_checks import (CAP, ROOT, _equivalence_rows, _new_log, _tail, check_environment, check_equivalence,
                               check_kernels, check_timing, row)
from bench._gpu_engine_checks import check_memory, check_sync

ORDER = ("environment", "kernels", "equivalence", "memory", "sync", "timing")
# The least a check needs on one H200 to be worth starting (seconds; CAP, the most, in bench._gpu_checks).
FLOOR = {"environment": 10, "kernels": 20, "equivalence": 60, "memory": 30, "sync": 20, "timing": 90}
# What one GPU cannot show, whatever the results above say.
UNRUN_ONE_GPU = [
    "NCCL collectives between ranks (framework.comm.collectives.Nccl: reduce_scatter_tensor, all_gather_into_tensor, "
    "per-owner reduce) and their ordering on NCCL's stream: need two GPUs",
    "NCCL's watchdog abort of a rank whose peer died (the launcher's SIGABRT message): needs two GPUs",
    "the host-step thread's device on a multi-GPU node (without bind_thread its context lands on GPU 0): "
    "with one GPU every thread's device is GPU 0 anyway",
    "dist.backend=auto choosing NCCL for several local ranks: needs as many GPUs as ranks",
]


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
