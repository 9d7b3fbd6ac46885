"""A randomised fault campaign: training on 2 ranks (zero2, offload=nvme, a checkpoint every step,
keep_last=2) hit at a random moment by one of: kill -9 of both ranks, 1 MiB of random bytes into
a rank's swap file, random damage to a file of a committed checkpoint (bytes flipped, truncated or
deleted), the checkpoint disk filled (on a tmpfs; needs the right to mount, skipped otherwise).

After each trial nothing may be lost or silently wrong:
* every committed checkpoint either fails its manifest's checks (a load refuses it by name) or
  holds exactly the state of the uninterrupted run at its step;
* ``resume=auto`` starts from the newest checkpoint that passes them, and the run ends with the
  uninterrupted run's losses and final state, bitwise.

``make test`` runs a few trials; FRAMEWORK_SLOW_TESTS=1 runs 60. A trial's faults come from
``random.Random(trial)``, so a failing trial number reproduces.
"""
import contextlib
import json
import multiprocessing
import os
import random
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from framework.persist import stepfolders
from tests.dist.test_checkpoint import NVME
from tests.dist.test_integrity import _run

SLOW = os.environ.get("FRAMEWORK_SLOW_TESTS") == "1"
TRIALS = 60 if SLOW else 3
STEPS = 6
OVER = ["+stage=zero2", *NVME]


def _worker(rank, world, store, root, out, timeout_s):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    from framework.comm.distributed import connect
    from framework.core.errors import FrameworkError
    try:
        dist = connect("gloo", timeout_s=timeout_s, store_path=store)
        result = _run(dist, OVER, root, steps=STEPS, resume="auto", keep_last=2, seed=99)
    except FrameworkError as e:
        result = {"error": str(e)}
    path = os.path.join(out, f"result-{rank}.pt")
    torch.save({k: v for k, v in result.items() if k != "state"}, path + ".tmp")
    os.replace(path + ".tmp", path)   # a rank killed meanwhile leaves no half result
    os._exit(0 if result.get("error") is None else 1)


def _launch(root: Path, work: Path, fault=None, delay: float = 0.0, timeout_s: float = 20.0, limit: float = 120.0):
    """Both ranks as forkserver children (torch and framework already imported); ``fault(procs)``
    is applied ``delay`` seconds after the first checkpoint exists. Returns the exit codes and
    per-rank results."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "framework.engine.build", "framework.persist.checkpoint",
                                "tests.dist.test_integrity"])
    work.mkdir(parents=True, exist_ok=True)
    procs = [ctx.Process(target=_worker, args=(r, 2, str(work / "store"), str(root), str(work), timeout_s))
             for r in range(2)]
    try:   # whatever goes wrong here (the fault itself included), no rank outlives the trial
        for p in procs:
            p.start()
        deadline, at = time.monotonic() + limit, None
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
            if at is None and (root / "latest").exists():
                at = time.monotonic() + delay
            if fault is not None and at is not None and time.monotonic() >= at:
                fault(procs)
                fault = None
            time.sleep(0.005)
    finally:
        for p in procs:
            if p.pid is not None:
                if p.is_alive():
                    p.kill()
                p.join()
    results = [torch.load(work / f"result-{r}.pt") if (work / f"result-{r}.pt").exists() else None for r in range(2)]
    return [p.exitcode for p in procs], results


def _tensors(folder: Path) -> dict:
    md = dcp.FileSystemReader(str(folder)).read_metadata()
    out = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype) for k, v in md.state_dict_metadata.items()}
    dcp.load(out, checkpoint_id=str(folder), no_dist=True)
    return out


def _passes(folder: Path) -> bool:
    """Whether ``folder`` passes the manifest checks a load makes first (sizes, sha256)."""
    try:
        manifest = stepfolders.read_manifest(folder)
    except Exception:  # noqa: BLE001
        return False
    return all(stepfolders.check_file(folder, n, e) is None for n, e in manifest["files"].items())


@pytest.fixture(scope="module")
def disk(tmp_path_factory):
    """A 64 MiB tmpfs for the checkpoints (the disk a trial may fill), or None without the right to mount."""
    where = tmp_path_factory.mktemp("campaign-disk")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(where)],
                             capture_output=True).returncode == 0
    yield where if mounted else None
    if mounted:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


@pytest.fixture(scope="module")
def reference(nvme_reference):
    """The uninterrupted run (``nvme_reference``): per-step checkpoint tensors, losses, final state."""
    root = nvme_reference["root"]
    steps = {stepfolders.step_of(p): _tensors(p) for p in stepfolders.scan(root)[0]}
    return {"steps": steps, "losses": nvme_reference["runs"][0]["losses"], "final": steps[STEPS],
            "window": nvme_reference["runs"][0]["training_s"]}


FAULTS = ["kill", "swap", "checkpoint", "fill"]


def _fault(kind: str, rng: random.Random, root: Path):
    def apply(procs):
        if kind == "kill":   # the whole group at once, as a kill -9 of the job would
            for p in procs:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGKILL)
        elif kind == "swap":
            rank = rng.randrange(2)
            path = Path(f"{root}-nvme{rank}") / f"rank{rank:05d}.optim.swap"
            with contextlib.suppress(FileNotFoundError), open(path, "r+b") as f:   # gone at the run's end: no fault
                size = os.fstat(f.fileno()).st_size
                f.seek(rng.randrange(max(1, size - (1 << 20))) // 4096 * 4096)
                f.write(os.urandom(min(1 << 20, size)))
        elif kind == "checkpoint":
            # The run prunes old checkpoints (keep_last=2) meanwhile: a folder or file picked here may
            # be gone a moment later. Pick again from a fresh scan then; a damaged file is changed in
            # place, never written anew (that would put a file back into a folder being deleted).
            how = rng.choice(["flip", "truncate", "delete"])
            for _ in range(20):
                try:
                    folders = stepfolders.scan(root)[0]
                    if not folders:
                        return
                    files = sorted(p for p in rng.choice(folders).iterdir() if p.is_file())
                    if not files:
                        continue
                    victim = rng.choice(files)
                    if how == "delete":
                        victim.unlink()
                    elif how == "truncate":
                        os.truncate(victim, victim.stat().st_size // 2)
                    else:
                        with open(victim, "r+b") as f:
                            size = os.fstat(f.fileno()).st_size
                            if size:
                                f.seek(rng.randrange(size))
                                byte = f.read(1)[0] ^ (1 << rng.randrange(8))
                                f.seek(-1, os.SEEK_CUR)
                                f.write(bytes([byte]))
                    return
                except OSError:   # gone meanwhile (or the folder with it)
                    continue
        elif kind == "fill":
            with open(root.parent / "filler", "wb") as f:
                try:
                    while True:
                        f.write(b"\0" * (1 << 20))
                        f.flush()
                except OSError:
                    pass
    return apply


@pytest.fixture
def base(disk, tmp_path):
    """This trial's folder: on the campaign's tmpfs (emptied afterwards: the trials share it) or in tmp_path."""
    if disk is None:
        yield tmp_path
        return
    folder = disk / tmp_path.name
    folder.mkdir()
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.parametrize("trial", range(TRIALS))
def test_random_faults_never_lose_or_corrupt_state(pools, tmp_path, disk, base, reference, trial):
    rng = random.Random(trial)
    kinds = FAULTS if disk is not None else FAULTS[:-1]
    kind = kinds[trial % len(kinds)] if trial < len(kinds) else rng.choice(kinds)   # each kind early on
    root = base / "ckpt"
    delay = rng.uniform(0, reference["window"])
    codes, results = _launch(root, tmp_path / "work", fault=_fault(kind, rng, root), delay=delay)
    (base / "filler").unlink(missing_ok=True)
    what = f"trial {trial}: {kind} after {delay:.2f}s, exit codes {codes}"
    for r in results:   # a rank that stopped by itself said why (a kill leaves no result)
        if r is not None and r["error"] is not None:
            assert "\n" not in r["error"].strip(), (what, r["error"])

    # No committed checkpoint holds wrong state: it fails its checks, or it is the reference's.
    good = []
    for folder in stepfolders.scan(root)[0]:
        if _passes(folder):
            got, want = _tensors(folder), reference["steps"][stepfolders.step_of(folder)]
            assert got.keys() == want.keys(), what
            for key in got:
                assert torch.equal(got[key], want[key]), f"{what}: {folder.name} {key} differs from the reference"
            good.append(stepfolders.step_of(folder))

    # Nothing is lost: the resume starts from the newest good checkpoint and ends as the reference.
    again = pools(2).run(_run, OVER, str(root), steps=STEPS, resume="auto", keep_last=2, seed=99, timeout=240)
    start = max(good, default=0)
    print(f"{what}; checkpoints that pass their checks: {good}; "
          f"errors: {[r['error'][:90] if r and r['error'] else None for r in results]}")
    for r in again:
        assert r["error"] is None, (what, r["error"], r["out"])
        assert r["first"] == start, (what, r["first"], good, r["out"])
        assert r["losses"] == reference["losses"][start:], what
    final = _tensors(root / (root / "latest").read_text())
    assert final.keys() == reference["final"].keys()
    assert all(torch.equal(final[k], reference["final"][k]) for k in final), what
    assert json.loads((root / f"step-{STEPS}" / "manifest.json").read_text())["verified"] is True
