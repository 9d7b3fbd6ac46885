"""Fault tests of checkpointing: kills during the save protocol, a rank lost mid-step, restarts.

Ranks here are real processes that die with ``os._exit`` (the FRAMEWORK_FAULT test hook of
tests/_fault_train.py, which tests.dist.test_checkpoint calls after each step and hands each save
as its ``on_point``; torchrun runs that script, which passes it to the loop as ``on_point``):
forked from a forkserver that has torch and framework imported, so a 2-rank launch costs a
fraction of a second instead of two interpreter starts. The relaunch
resumes in the shared 2-rank pool and is compared with an uninterrupted run there.

The torchrun cases (--max-restarts with a crash-once marker; two agents with --nnodes 2 that
resume as one node) start several interpreters each: they run with FRAMEWORK_SLOW_TESTS=1.
"""
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from tests.dist.test_checkpoint import K, N, _same_state, _train

ROOT = Path(__file__).resolve().parents[2]
slow = pytest.mark.skipif(os.environ.get("FRAMEWORK_SLOW_TESTS") != "1", reason="set FRAMEWORK_SLOW_TESTS=1")
OVER = ["+stage=zero2"]


def _worker(rank, world, store, root, env, timeout_s, out, over=OVER):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), GLOO_SOCKET_IFNAME="lo", **env)
    torch.set_num_threads(1)
    from framework.comm.distributed import connect, disconnect
    from framework.core.errors import FrameworkError
    try:
        dist = connect("gloo", timeout_s=timeout_s, store_path=store)
        _train(dist, over, root, resume="auto")
    except FrameworkError as e:
        Path(out, f"error-{rank}").write_text(str(e))
        os._exit(1)
    finally:
        disconnect()


def _launch(root, env, timeout_s=30.0, world=2, limit=60.0, ends=None):
    """Start ``world`` ranks and let each end by itself (within ``limit`` seconds); return their
    exit codes and the error message each rank that failed wrote. ``ends``: a dict to fill with
    the monotonic time each rank was first seen ended (to within 50 ms)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "framework.engine.build", "framework.persist.checkpoint",
                                "tests.dist.test_checkpoint"])
    tmp = tempfile.mkdtemp(prefix="ckpt-fault-")
    procs = [ctx.Process(target=_worker, args=(r, world, os.path.join(tmp, "store"), str(root), env, timeout_s, tmp))
             for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + limit
    ends = {} if ends is None else ends
    while len(ends) < world and time.monotonic() < deadline:
        for r, p in enumerate(procs):
            if r not in ends and not p.is_alive():
                ends[r] = time.monotonic()
        time.sleep(0.05)
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join()
    errors = {int(f.name.split("-")[1]): f.read_text() for f in Path(tmp).glob("error-*")}
    shutil.rmtree(tmp, ignore_errors=True)
    return [p.exitcode for p in procs], errors


def _stop_on_first_death(root, env, over=OVER):
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "framework.engine.build", "framework.persist.checkpoint",
                                "tests.dist.test_checkpoint"])
    tmp = tempfile.mkdtemp(prefix="ckpt-fault-")
    procs = [ctx.Process(target=_worker, args=(r, 2, os.path.join(tmp, "store"), str(root), env, 30.0, tmp, over))
             for r in range(2)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + 60
    while all(p.exitcode in (None, 0) for p in procs) and any(p.is_alive() for p in procs) \
            and time.monotonic() < deadline:
        time.sleep(0.02)
    for p in procs:  # the launcher's part: the survivors of a dead rank are stopped
        if p.is_alive():
            p.kill()
        p.join()
    shutil.rmtree(tmp, ignore_errors=True)
    return [p.exitcode for p in procs]


@pytest.fixture(scope="module")
def reference(pools, tmp_path_factory):
    """An uninterrupted run's final state dicts (every rank)."""
    root = tmp_path_factory.mktemp("reference")
    return [r[1] for r in pools(2).run(_train, OVER, str(root), timeout=240)]


# (where the kill happens during the save of step N, which step the relaunch resumes from)
POINTS = {
    f"save-{N}:after-shard@0": K,
    f"save-{N}:after-shard@1": K,
    f"save-{N}:before-manifest@0": K,
    f"save-{N}:before-rename@0": K,
    f"save-{N}:before-latest@0": N,    # renamed: committed (latest is repaired by the next save)
    f"save-{N}:pruning@0": N,   # committed; rotation (keep_last=1) renamed step-K to step-K.del, not yet deleted
}
PRUNE = f"save-{N}:pruning@0"


# One of each on-disk situation in the suite: a folder without a manifest, a complete folder not
# yet renamed, a renamed folder that latest does not name yet, an older one rotated to step-K.del and
# left there; the other two with the slow tests.
QUICK = {f"save-{N}:after-shard@1", f"save-{N}:before-rename@0", f"save-{N}:before-latest@0", PRUNE}


@pytest.mark.parametrize("point", [p if p in QUICK else pytest.param(p, marks=slow) for p in POINTS])
def test_a_kill_during_a_save_leaves_the_previous_checkpoint(pools, tmp_path, reference, point):
    codes = _stop_on_first_death(tmp_path, {"FRAMEWORK_FAULT": point},
                                 [*OVER, "checkpoint.keep_last=1"] if point == PRUNE else OVER)
    assert 17 in codes, codes
    kept = f"step-{N}" if point == PRUNE else f"step-{K}"
    assert (tmp_path / kept / "manifest.json").is_file() and (point != PRUNE or (tmp_path / f"step-{K}.del").is_dir())
    out = pools(2).run(_train, OVER, str(tmp_path), resume="auto", seed=99, timeout=240)
    assert out[0][2][0] == POINTS[point]
    _same_state(reference, [r[1] for r in out], point)


def test_a_rank_lost_mid_step_ends_the_others_naming_it(tmp_path):
    timeout_s, ends = 3.0, {}
    codes, errors = _launch(tmp_path, {"FRAMEWORK_FAULT": "step:3@1"}, timeout_s=timeout_s, ends=ends)
    assert codes == [1, 17], (codes, errors)
    # (its closed connections failed the collective at once: no wait up to the timeout is claimed)
    assert "rank 1 lost (process gone) during" in errors[0] and "after waiting" not in errors[0], errors
    # Timed from rank 1's death, not from the launch (process start-up under load varies by seconds):
    # rank 0 notices within its collective timeout, plus the time to write its error and exit.
    assert ends[0] - ends[1] < timeout_s + 10, ends


def test_a_crashed_run_restarts_from_its_checkpoint(pools, tmp_path, reference):
    """What torchrun --max-restarts=1 does, in one process pair: a crash-once marker kills rank 1
    after step 3; the same command again resumes from step 2 and ends equal to the reference."""
    env = {"FRAMEWORK_FAULT": f"step:3@1,once={tmp_path / 'crashed'}"}
    codes = _stop_on_first_death(tmp_path / "ckpt", env)
    assert 17 in codes and (tmp_path / "crashed").exists()
    codes, errors = _launch(tmp_path / "ckpt", env)
    assert codes == [0, 0], errors
    out = pools(2).run(_train, OVER, str(tmp_path / "ckpt"), resume="auto", seed=99, timeout=240)
    assert out[0][2][0] == N
    _same_state(reference, [r[2][2] for r in out], "restarted")


# --- torchrun ---------------------------------------------------------------------------------

CLI = ["model=gpt-nano", "model.n_layer=2", "model.n_head=2", "model.d_model=32", "model.context=16",
       "data.vocab_size=24", "train.steps=4", "train.micro_batch=4", "train.eval_every=0", "logger=none",
       "+stage=zero2", "checkpoint.every=2", "dist.timeout_s=20"]


def _torchrun(args, ckpt, run_dir, env=None, timeout=240):
    cmd = [sys.executable, "-m", "torch.distributed.run", *args, "-m", "tests._fault_train", *CLI,
           f"checkpoint.dir={ckpt}", f"hydra.run.dir={run_dir}"]
    # Restarts reuse torchrun's shared TCP store, whose keys from the failed attempt broke the new gloo mesh
    # (pytorch/pytorch#135712) unless TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: the framework keeps each attempt's apart.
    e = {k: v for k, v in os.environ.items() if k != "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"}
    e = {**e, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(cmd, cwd=ROOT, env=e, capture_output=True, text=True, timeout=timeout)


def _final(ckpt: Path) -> dict:
    import torch.distributed.checkpoint as dcp
    folder = ckpt / (ckpt / "latest").read_text()
    body = json.loads((folder / "train_state.json").read_text())
    t = {f"model.{n}": torch.empty(s) for n, s in body["parameters"].items()}
    dcp.load(t, checkpoint_id=str(folder), no_dist=True)
    return t


@slow
def test_torchrun_max_restarts_finishes_equal_to_an_uninterrupted_run(tmp_path):
    ref = _torchrun(["--standalone", "--nproc-per-node", "2"], tmp_path / "ref", tmp_path / "r0")
    assert ref.returncode == 0, ref.stderr[-2000:]
    env = {"FRAMEWORK_FAULT": f"step:3@1,once={tmp_path / 'crashed'}"}
    run = _torchrun(["--standalone", "--nproc-per-node", "2", "--max-restarts", "1"], tmp_path / "ck",
                    tmp_path / "r1", env)
    assert run.returncode == 0, run.stderr[-2000:]
    assert (tmp_path / "crashed").exists() and "resumed from" in run.stdout, run.stdout[-3000:]
    assert "rank 1 lost (process gone)" in run.stderr
    a, b = _final(tmp_path / "ref"), _final(tmp_path / "ck")
    assert all(torch.equal(a[k], b[k]) for k in a)


@slow
def test_two_torchrun_agents_then_one_node(tmp_path):
    """--nnodes 2 --nproc-per-node 1 on 127.0.0.1 trains to step 2 (train.steps=2 for that run),
    then one agent with 2 ranks resumes and finishes; equal to one uninterrupted 2-rank run."""
    port = 29500 + os.getpid() % 1000
    args = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "ckpt"]
    env = {"FRAMEWORK_FAULT": "step:3@0"}  # both agents stop after step 3, step 2 saved
    cmd_env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **env}
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *args, "--node-rank", str(n),
                               "-m", "tests._fault_train", *CLI, f"checkpoint.dir={tmp_path / 'ck'}",
                               f"hydra.run.dir={tmp_path / f'n{n}'}"], cwd=ROOT, env=cmd_env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for n in range(2)]
    for p in procs:
        p.communicate(timeout=240)
    assert (tmp_path / "ck" / f"step-{K}" / "manifest.json").is_file()
    one = _torchrun(["--standalone", "--nproc-per-node", "2"], tmp_path / "ck", tmp_path / "r1")
    assert one.returncode == 0, one.stderr[-2000:]
    assert f"resumed from {tmp_path / 'ck' / f'step-{K}'}" in one.stdout
    ref = _torchrun(["--standalone", "--nproc-per-node", "2"], tmp_path / "ref", tmp_path / "r0")
    assert ref.returncode == 0, ref.stderr[-2000:]
    a, b = _final(tmp_path / "ref"), _final(tmp_path / "ck")
    assert all(torch.equal(a[k], b[k]) for k in a)
