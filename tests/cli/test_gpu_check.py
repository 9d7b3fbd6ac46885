"""bench/gpu_check.sh --dry-run: the GPU check's code paths on the CPU checking accelerator, run as the
GPU image would run them (no Hydra, OmegaConf or W&B importable), end to end: every check reports,
none fails, one Markdown table and one JSON file come out."""
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_dry_run_without_hydra(tmp_path):
    """Also what a tool that returns few files and the end of the output gets: three files in OUT
    (everything in the bundle) and the verdict with its summary at the end of standard output. A
    --budget above the script's hard limit is clamped below it (to 455 s: room for every check here)."""
    import tarfile

    # (FRAMEWORK_OPS=0 in the caller's environment would make the kernels row a failure, as on a GPU machine)
    env = {**{k: v for k, v in os.environ.items() if k != "FRAMEWORK_OPS"}, "PYTHON": sys.executable,
           "PYTHONPATH": str(ROOT / "tests" / "without_hydra")}
    out, logs = tmp_path / "out", tmp_path / "logs"
    p = subprocess.run(["bash", "bench/gpu_check.sh", "--dry-run", "--out", str(out), "--logs", str(logs), "--budget",
                        "900"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "--budget 900 clamped to 455 s" in p.stdout, p.stdout
    assert sorted(os.listdir(out)) == ["gpu_check.json", "gpu_check.md", "gpu_check.tgz"]
    with tarfile.open(out / "gpu_check.tgz") as tar:
        names = set(tar.getnames())
    assert {"gpu_check.md", "gpu_check.json", "logs/equivalence_pytest.log", "logs/sync.log"} <= names, names
    tail = p.stdout[-12000:]
    assert len(p.stdout) < 6000 and "| equivalence |" in tail and "gpu_check: PASSED: 0 failed of" in tail, p.stdout
    tmp_path = out
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    rows = report["rows"]
    assert report["dry_run"] and report["failed"] == 0 and report["budget_s"] == 455
    assert {r["check"] for r in rows} == {"environment", "kernels", "equivalence", "memory", "sync", "timing"}
    assert not [r for r in rows if r["ok"] is False], [r for r in rows if r["ok"] is False]
    imports = {r["item"]: r["value"] for r in rows if r["item"].startswith("import ")}
    assert imports["import hydra"] == imports["import omegaconf"] == imports["import wandb"] == "not installed"
    compared = [r for r in rows if r["check"] == "equivalence" and "world" in r["item"]]
    assert {("world 1" in r["item"], "world 2" in r["item"]) for r in compared} == {(True, False), (False, True)}
    assert all(r["ok"] for r in compared)
    hf = [r for r in rows if r["check"] == "sync" and r["item"].startswith("model=hf")]
    # transformers' reads in the forward, counted (2 with today's transformers: not pinned, an upgrade may change it)
    assert len(hf) == 1 and int(hf[0]["value"].split()[0]) >= 1, hf
    timing = {r["item"]: r for r in rows if r["check"] == "timing"}
    assert timing["fsdp2"]["ok"], timing   # the peer's code path (ours runs in memory and sync)
    table = (tmp_path / "gpu_check.md").read_text()
    assert table.count("\n| ") >= len(rows) and "Not verifiable on one GPU" in table


FAKE_CHECK = """#!{python}
import json, os, subprocess, sys, time
from pathlib import Path
out = Path(sys.argv[sys.argv.index("--out") + 1])
# a grandchild that ignores SIGTERM (as a rank busy in a collective may): only SIGKILL ends it
kid = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                        "print('ready', flush=True); time.sleep(60)"], stdout=subprocess.PIPE)
kid.stdout.readline()
(out / "equivalence.jsonl").write_text(json.dumps(dict(case="zero2", precision="fp32", world=1, backend="nccl",
                                                       device="cuda", ok=True, max_rel_loss=0.0, max_abs_param=0.0))
                                       + "\\n")
(out / "pids").write_text(f"{{kid.pid}}")
(out / "deadline").write_text(os.environ.get("GPU_CHECK_DEADLINE", ""))
print("fake: comparing zero3 next", flush=True)
time.sleep(60)
"""


# the fake check's limit: room for two Python start-ups on a loaded machine before it is cut short
LIMIT_S = 6


def _group_alive(pgid: int) -> list[str]:
    """Processes of group ``pgid`` that are not zombies, from /proc."""
    alive = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            alive.append(stat.parent.name)
    return alive


def test_gpu_check_timeout_ends_the_check_and_all_it_started(tmp_path, monkeypatch):
    """A check past its limit goes with every process it started (pytest's ranks, say: here a
    grandchild that ignores SIGTERM), before the next check starts; the rows it recorded and its
    log's last line are reported."""
    from bench import gpu_check

    fake = tmp_path / "fake_python"
    fake.write_text(FAKE_CHECK.format(python=sys.executable))
    fake.chmod(0o755)
    monkeypatch.setattr(gpu_check.sys, "executable", str(fake))   # the driver's command for the child
    monkeypatch.setattr(gpu_check, "GRACE_S", 1)   # the grandchild waits for SIGKILL anyway
    launched = time.time()
    rows = gpu_check._run_child("equivalence", True, tmp_path, LIMIT_S)
    grandchild = int((tmp_path / "pids").read_text())
    pgid = None
    try:
        pgid = os.getpgid(grandchild)
    except ProcessLookupError:
        pass
    try:
        assert pgid is None or str(grandchild) not in _group_alive(pgid), "the check's grandchild is still running"
        assert pgid is None or pgid == os.getpgrp() or not _group_alive(pgid), _group_alive(pgid)
    finally:   # a killed grandchild may be reaped between the checks and here
        with contextlib.suppress(ProcessLookupError):
            if pgid is not None and pgid != os.getpgrp():   # the old driver's leftovers: not into later tests
                os.killpg(pgid, 9)
            elif pgid is not None:
                os.kill(grandchild, 9)
    assert [r["item"] for r in rows] == ["zero2 fp32, world 1 (nccl, cuda)", "check"], rows
    assert rows[0]["ok"] and rows[1]["ok"] is False and rows[1]["value"] == f"timed out after {LIMIT_S} s"
    assert rows[1]["note"] == "fake: comparing zero3 next", rows
    # the child's deadline is the driver's clock from before the launch, not its own after start-up
    assert launched + LIMIT_S <= float((tmp_path / "deadline").read_text()) <= time.time() + LIMIT_S


def test_gpu_check_stopped_while_ending_a_timed_out_check_still_kills_its_group(tmp_path, monkeypatch):
    """SIGTERM to the driver (gpu_check.sh's hard limit) while it ends a timed-out check's group, after
    that group's SIGTERM and before its SIGKILL: the stop goes on up, and the group still gets SIGKILL
    (here a grandchild that ignores SIGTERM)."""
    import signal

    import pytest

    from bench import gpu_check

    fake = tmp_path / "fake_python"
    fake.write_text(FAKE_CHECK.format(python=sys.executable))
    fake.chmod(0o755)
    monkeypatch.setattr(gpu_check.sys, "executable", str(fake))
    monkeypatch.setattr(gpu_check, "GRACE_S", 1)
    end_group, calls = gpu_check._end_group, []

    def stopped_inside(p, term):
        calls.append(term)
        if len(calls) > 1:
            return end_group(p, term)
        end = time.monotonic() + 60   # the fake check's grandchild has started
        while not (tmp_path / "pids").exists() and time.monotonic() < end and p.poll() is None:
            time.sleep(0.05)
        os.killpg(p.pid, signal.SIGTERM)
        raise gpu_check._Stopped   # what the driver's SIGTERM handler raises, here
    monkeypatch.setattr(gpu_check, "_end_group", stopped_inside)
    with pytest.raises(gpu_check._Stopped):
        gpu_check._run_child("equivalence", True, tmp_path, 0.5)
    grandchild = int((tmp_path / "pids").read_text())
    try:
        pgid = os.getpgid(grandchild)
    except ProcessLookupError:
        pgid = None
    try:
        assert pgid is None or str(grandchild) not in _group_alive(pgid), "the check's grandchild is still running"
    finally:
        with contextlib.suppress(ProcessLookupError):
            if pgid is not None and pgid != os.getpgrp():
                os.killpg(pgid, 9)
    assert calls == [True, True], calls


def test_gpu_check_timing_keeps_to_the_deadline_the_driver_set(monkeypatch, tmp_path):
    """The timing check starts no run that the driver's deadline (absolute, set before the check's
    process started) leaves too little time for."""
    from bench import _gpu_checks

    monkeypatch.setenv("GPU_CHECK_DEADLINE", repr(time.time() + 25))
    rows = _gpu_checks.check_timing(True, tmp_path)
    assert [r["value"] for r in rows] == ["skipped (time budget)"] * len(_gpu_checks.TIMING_DRY), rows


def test_gpu_check_timing_run_cut_short_by_the_budget_is_not_a_failure(monkeypatch, tmp_path):
    """A timing run stopped by the budget's end is not checked, not failed; on the GPU no 1.4 B run
    starts with under a minute left; a GPU run past its own limit (a hang) still fails."""
    from bench import _gpu_checks

    def run(cmd, timeout, **kw):
        seen.append(timeout)
        raise subprocess.TimeoutExpired(cmd, timeout)
    seen = []
    monkeypatch.setattr(_gpu_checks.subprocess, "run", run)
    monkeypatch.setattr(_gpu_checks, "TIMING_DRY", ("fsdp2",))
    monkeypatch.setenv("GPU_CHECK_DEADLINE", repr(time.time() + 40))
    rows = _gpu_checks.check_timing(True, tmp_path)
    assert len(seen) == 1 and [(r["ok"], r["value"].split(" (")[0]) for r in rows] == [(None, "stopped: time budget")], rows
    seen.clear()
    rows = _gpu_checks.check_timing(False, tmp_path)   # 30 s left: no GPU run starts
    assert not seen and {r["value"] for r in rows} == {"skipped (time budget)"}, rows
    monkeypatch.setattr(_gpu_checks, "TIMING", ("plain",))
    monkeypatch.setattr(_gpu_checks, "TIMING_RUN_CAP_S", 1)
    monkeypatch.setenv("GPU_CHECK_DEADLINE", repr(time.time() + 100))
    rows = _gpu_checks.check_timing(False, tmp_path)
    assert seen == [1] and rows[0]["ok"] is False and rows[0]["value"] == "timed out after 1 s (a run's limit)", rows


def test_a_check_log_planted_as_a_link_is_refused_not_followed(tmp_path):
    from bench.gpu_check import _new_log

    target = tmp_path / "elsewhere.txt"
    target.write_text("keep")
    (tmp_path / "sync.log").symlink_to(target)
    try:
        _new_log(tmp_path / "sync.log")
    except OSError:
        pass
    else:
        raise AssertionError("the link was followed")
    assert target.read_text() == "keep"
    with _new_log(tmp_path / "fresh.log") as f:
        f.write("x")
    assert (tmp_path / "fresh.log").read_text() == "x"


def _fake_pytest(junit_xml: str, seen: list):
    """subprocess.run for check_equivalence: records the command, writes ``junit_xml``, exits 1."""
    import types

    def run(cmd, **kw):
        seen.append(cmd)
        junit = next(a for a in cmd if a.startswith("--junitxml=")).split("=", 1)[1]
        Path(junit).write_text(junit_xml)
        return types.SimpleNamespace(returncode=1)
    return run


def test_gpu_check_reports_a_failed_gpu_test_whose_failure_element_is_bare(monkeypatch, tmp_path):
    """A <failure/> without children (falsy as an Element) is one failed row, not the whole
    equivalence check lost to an AttributeError."""
    from bench import _gpu_checks

    xml = ('<testsuites><testsuite><testcase classname="tests.gpu.test_zz" name="test_p"><failure/></testcase>'
           '<testcase classname="tests.gpu.test_zz" name="test_e"><error message="boom">tb</error></testcase>'
           '<testcase classname="tests.gpu.test_zz" name="test_ok"/></testsuite></testsuites>')
    seen = []
    monkeypatch.setattr(_gpu_checks.subprocess, "run", _fake_pytest(xml, seen))
    rows = {r["item"]: r for r in _gpu_checks.check_equivalence(True, tmp_path)}
    assert rows["pytest test_zz::test_p"]["ok"] is False and rows["pytest test_zz::test_p"]["value"] == "failed"
    assert rows["pytest test_zz::test_e"]["ok"] is False and rows["pytest test_zz::test_e"]["note"] == "boom"
    assert rows["pytest test_zz::test_ok"]["ok"] is True
    assert rows["pytest tests/gpu: exit status"]["ok"] is False


def test_gpu_check_runs_the_offload_test_before_the_comparison_matrix(monkeypatch, tmp_path):
    """pytest's time limit may cut the long matrix; the short CUDA offload test runs before it."""
    from bench import _gpu_checks

    seen = []
    monkeypatch.setattr(_gpu_checks.subprocess, "run", _fake_pytest("<testsuites/>", seen))
    _gpu_checks.check_equivalence(True, tmp_path)
    tests = [a for a in seen[0] if a.startswith("tests/")]
    assert tests[0] == "tests/gpu/test_offload_cuda.py" and "tests/gpu/test_matrix.py" in tests, tests


def test_gpu_check_kernels_row_gives_the_failed_builds_own_reason(monkeypatch, tmp_path):
    """Not what a status call that may not build says afterwards ("building is off")."""
    import warnings

    from bench import _gpu_checks
    from framework import ops
    from framework.ops import _loader

    def load(build=True, force=False):
        raise ops.BuildUnavailable("the build failed (c++: not found)" if build else
                                   "not built yet and building is off (FRAMEWORK_OPS_BUILD=0)")
    monkeypatch.delenv("FRAMEWORK_OPS", raising=False)
    monkeypatch.setattr(_loader, "load", load)
    _loader.status.cache_clear()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")   # the fallback's one warning
            rows = _gpu_checks.check_kernels(True, tmp_path)
    finally:
        _loader.status.cache_clear()
    kernels = rows[0]
    assert kernels["ok"] is False and kernels["value"].startswith("the build failed (c++: not found)"), kernels


STOP = """import sys
from bench import gpu_check
sys.executable = {fake!r}   # the driver's command for the child
gpu_check.GRACE_S = 1
sys.exit(gpu_check.main(["--dry-run", "--out", {out!r}, "--logs", {logs!r}, "--skip", "environment,kernels"]))
"""


def test_gpu_check_stopped_by_the_time_limit_still_writes_the_table(tmp_path):
    """SIGTERM (gpu_check.sh's hard limit) during a check: the check's group goes, and the table is
    written with the rows it recorded, its "stopped" row and the checks not run."""
    fake, out, logs = tmp_path / "fake_python", tmp_path / "out", tmp_path / "logs"
    fake.write_text(FAKE_CHECK.format(python=sys.executable))
    fake.chmod(0o755)
    driver = subprocess.Popen([sys.executable, "-c", STOP.format(fake=str(fake), out=str(out), logs=str(logs))],
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        end = time.monotonic() + 60
        while not (logs / "pids").exists() and time.monotonic() < end and driver.poll() is None:
            time.sleep(0.1)
        driver.terminate()
        output = driver.communicate(timeout=60)[0]
    finally:
        driver.kill()
        if (logs / "pids").exists():
            try:
                os.kill(int((logs / "pids").read_text()), 9)
            except ProcessLookupError:
                pass
    assert driver.returncode == 1, output
    rows = {(r["check"], r["item"]): r for r in json.loads((out / "gpu_check.json").read_text())["rows"]}
    assert rows[("equivalence", "zero2 fp32, world 1 (nccl, cuda)")]["ok"], rows
    assert rows[("equivalence", "check")]["value"] == "stopped by the time limit (SIGTERM)", rows
    assert all(rows[(c, "check")]["value"] == "not run (stopped by the time limit)" for c in ("memory", "sync", "timing"))
    assert "stopped by the time limit during equivalence" in output.splitlines()[-2], output


def test_gpu_check_that_checked_nothing_is_incomplete_not_passed(tmp_path):
    """Checks left out by the time budget: INCOMPLETE, exit 3 (not PASSED with nothing checked); the table
    and rows say so too."""
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(ROOT / "tests" / "without_hydra")}
    p = subprocess.run(["bash", "bench/gpu_check.sh", "--dry-run", "--out", str(tmp_path), "--budget", "2", "--skip",
                        "timing"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 3, p.stdout + p.stderr
    verdict = p.stdout.splitlines()[-2]
    assert verdict.startswith("gpu_check: INCOMPLETE: 0 failed of 0 checked rows"), p.stdout
    assert verdict.endswith("not checked: environment, kernels, equivalence, memory, sync not run (time budget or "
                            "limit)"), verdict
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["verdict"] == "INCOMPLETE" and report["failed"] == 0, report
    assert (tmp_path / "gpu_check.md").read_text().startswith("# GPU check (dry run on the CPU): INCOMPLETE")


def test_gpu_check_without_a_gpu_stops_after_the_environment_check(tmp_path):
    """A GPU run on a machine without one: one line says so, the environment check runs (no GPU is not
    checked there, not failed) and the run stops: INCOMPLETE, exit 3, in seconds (not the CPU's minutes of
    memory and timing runs, failing)."""
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(ROOT / "tests" / "without_hydra"),
           "CUDA_VISIBLE_DEVICES": ""}   # (no GPU, also where there is one)
    # (--budget: where the run went on, it would end within it)
    p = subprocess.run(["bash", "bench/gpu_check.sh", "--out", str(tmp_path), "--budget", "60", "--skip", "timing"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 3, p.stdout + p.stderr
    assert p.stdout.startswith("gpu_check: no GPU found (torch.cuda.is_available() is False): only the environment "
                               "check runs"), p.stdout
    verdict = p.stdout.splitlines()[-2]
    assert verdict.startswith("gpu_check: INCOMPLETE: 0 failed of ") and verdict.endswith("not checked: no GPU"), verdict
    rows = {(r["check"], r["item"]): r for r in json.loads((tmp_path / "gpu_check.json").read_text())["rows"]}
    assert rows[("environment", "CUDA")]["ok"] is None and rows[("environment", "GPUs")]["ok"] is None, rows
    assert [rows[(c, "check")]["value"] for c in ("kernels", "equivalence", "memory", "sync", "timing")] == \
        ["not run (no GPU)"] * 4 + ["skipped (--skip)"], rows


def test_gpu_check_with_a_python_without_torch_is_one_line(tmp_path):
    """PYTHON (or python3) without torch, as outside the environment: one line saying what to do, exit 2,
    nothing written."""
    bare = tmp_path / "python"
    bare.write_text(f'#!/bin/sh\nexec {sys.executable} -S "$@"\n')   # (-S: no site-packages, no torch)
    bare.chmod(0o755)
    p = subprocess.run(["bash", "bench/gpu_check.sh", "--out", str(tmp_path / "out")], cwd=ROOT,
                       env={**os.environ, "PYTHON": str(bare)}, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and p.stdout == "", p.stdout + p.stderr
    assert p.stderr.splitlines() == [f"gpu_check: {sys.executable} cannot import torch (No module named 'torch'); "
                                     "activate the environment (. .venv/bin/activate) or set PYTHON=.venv/bin/python"]
    assert not (tmp_path / "out").exists()


def test_make_gpu_check_uses_the_python_make_setup_built(tmp_path):
    """`make gpu-check` after `make setup` runs the check with the environment's Python (was: python3, outside
    it: "cannot import torch", exit 2), and python3 where no environment was built. (`make -n`: nothing runs.)"""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").touch()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "MAKEFLAGS", "MFLAGS")}

    def dry(folder):
        return subprocess.run(["make", "-n", "-s", "gpu-check", f"VENV={folder}", "ARGS=--dry-run"], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=30).stdout.strip()
    assert dry(venv) == f'PYTHON="${{PYTHON:-{venv}/bin/python}}" bash bench/gpu_check.sh --dry-run'
    assert dry(tmp_path / "none") == 'PYTHON="${PYTHON:-python3}" bash bench/gpu_check.sh --dry-run'


@pytest.mark.parametrize("budget", ["0", "-5", "nan", "soon"])
def test_gpu_check_refuses_a_budget_that_is_no_time(budget, tmp_path, capsys):
    """--budget 0 or below is a bad argument (exit 2, one line, nothing written), not a run that checks
    nothing and says INCOMPLETE (exit 3)."""
    from bench import gpu_check

    with pytest.raises(SystemExit) as e:
        gpu_check.main(["--dry-run", "--out", str(tmp_path / "out"), "--budget", budget])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "is not a number of seconds above 0" in err, err
    assert not (tmp_path / "out").exists()


def test_gpu_check_verdict_only_an_explicit_skip_is_neutral():
    from bench.gpu_check import ORDER, _verdict, row

    dry, gpu = {"dry_run": True, "gpus": 0}, {"dry_run": False, "gpus": 1}
    skipped = [row(c, "check", None, "skipped (--skip)") for c in ORDER]
    assert _verdict(dry, skipped) == ("PASSED", [])
    assert _verdict(gpu, skipped) == ("PASSED", [])
    assert _verdict({"dry_run": False, "gpus": 0}, skipped) == ("INCOMPLETE", ["no GPU"])
    # (the table written while the run goes on: the checks after it not reached yet)
    assert _verdict(gpu, skipped[:4]) == ("INCOMPLETE", ["sync, timing not reached"])
    stopped = [*skipped[:2], row("equivalence", "check", False, "stopped by the time limit (SIGTERM)"),
               *(row(c, "check", None, "not run (stopped by the time limit)") for c in ORDER[3:])]
    assert _verdict(gpu, stopped)[0] == "FAILED"
    # every timing run skipped or stopped by the budget: nothing was timed
    checked = [row(c, "check", True, "ok") for c in ORDER[:-1]]
    cut = [row("timing", "zero2", None, "skipped (time budget)"), row("timing", "zero3", None, "stopped: time budget")]
    assert _verdict(gpu, [*checked, *cut]) == ("INCOMPLETE", ["timing not run (time budget or limit)"])
    assert _verdict(gpu, [*checked, row("timing", "plain", True, "1.0 s/step"), *cut]) == ("PASSED", [])


def test_gpu_check_sync_watches_the_thread_that_runs_backward():
    """On CUDA the hooks run on autograd's device thread, not the caller's: the sync check is told that
    thread from inside the graph (a hook on the loss), once per backward, between its start and end."""
    import threading

    import torch

    from bench import _gpu_engine_checks
    from framework.config import compose

    told = []
    cfg = compose(["model=gpt-nano", "precision=bf16", "logger=none", "train.micro_batch=4",
                   *_gpu_engine_checks.SYNC["zero3"]])
    _gpu_engine_checks._engine_run(cfg, torch.device("cpu"), 2,
                                   around_backward=lambda now: told.append((now, threading.get_ident())))
    assert [now for now, _ in told] == ["backward", "autograd", "step"] * 2, told


def test_gpu_check_a_deepspeed_that_raises_on_import_is_one_row(monkeypatch, tmp_path):
    """A DeepSpeed install that raises something other than ImportError on import (its RuntimeError
    when CUDA_HOME is missing) gives one "import failed" row; the check's other rows stay."""
    from bench import _gpu_checks

    fake = tmp_path / "fake"
    (fake / "deepspeed").mkdir(parents=True)
    (fake / "deepspeed" / "__init__.py").write_text('raise RuntimeError("CUDA_HOME does not exist")\n')
    monkeypatch.syspath_prepend(str(fake))
    rows = _gpu_checks.check_environment(True, tmp_path)
    values = {r["item"]: r["value"] for r in rows}
    assert values["import deepspeed"] == "import failed: RuntimeError: CUDA_HOME does not exist", rows
    assert "import transformers" in values and "dist.backend=auto, 1 local rank" in values
    monkeypatch.setattr(_gpu_checks, "TIMING_DRY", ("deepspeed-zero2-offload",))
    rows = _gpu_checks.check_timing(True, tmp_path)
    assert [r["value"] for r in rows] == ["deepspeed: import failed: RuntimeError: CUDA_HOME does not exist"], rows
