"""Integrity of checkpoints: only state known good is committed, a damaged one is refused by name and
resume falls back, every failure ends in one line on every rank with the previous checkpoints intact.

Runs on 2 gloo ranks (the shared pool) with a checkpoint every step. Faults are injected through
seams, never by patching: DCP's storage writer (``Checkpointer.writer``) that changes the swap file
while DCP reads it or fails with ENOSPC, a loss function that turns NaN, a master value poisoned
before a save, files of a committed checkpoint rewritten (with matching checksums) afterwards.
"""
import contextlib
import errno
import functools
import io
import json
import os
import subprocess
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import framework
from framework.persist.checkpoint import Checkpointer
from framework.persist.stepfolders import file_entry
from framework.models.gpt import gpt_loss
from tests._helpers import build_gpt, tiny_config
from tests.dist.test_checkpoint import NVME, ROWS, _same_state

slow = pytest.mark.skipif(os.environ.get("FRAMEWORK_SLOW_TESTS") != "1", reason="set FRAMEWORK_SLOW_TESTS=1")
ZERO2 = ["+stage=zero2"]


class CorruptingWriter(dcp.FileSystemWriter):
    """Writes 1 MiB of random bytes into ``swap`` just before DCP reads the state it writes: the
    moment a swap file checked before the save changes under the checkpoint."""

    def __init__(self, *args, swap: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.swap = swap

    def write_data(self, plan, planner):
        _corrupt(self.swap)
        return super().write_data(plan, planner)


class FullDiskWriter(dcp.FileSystemWriter):
    """A disk that fills up while the shards are written."""

    def write_data(self, plan, planner):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path))


class FillingWriter(dcp.FileSystemWriter):
    """Fills the checkpoint's file system (a real ENOSPC from torch's writer) after the room check."""

    def write_data(self, plan, planner):
        _fill(Path(self.path).parent.parent)   # beside the checkpoint folder
        return super().write_data(plan, planner)


def _corrupt(path: str) -> None:
    with open(path, "r+b") as f:
        f.write(os.urandom(min(1 << 20, os.path.getsize(path))))


def _fill(folder: Path) -> None:
    with open(folder / "filler", "wb") as f:
        with contextlib.suppress(OSError):
            while True:
                f.write(b"\0" * (1 << 16))
                f.flush()


def _run(dist, over, root, *, steps=4, resume="off", seed=None, keep_last=2, fault_at=None, fault_rank=0,
         writer=None, corrupt=None, nan_loss=False, poison=False, extra=()):
    """Train to ``steps`` with a checkpoint every step. At step ``fault_at``, on rank ``fault_rank``:
    the save uses ``writer`` (a partial of a writer class), or the swap file ``corrupt`` is damaged
    before the save, or the loss is NaN (``nan_loss``), or a master value is NaN before the save
    (``poison``). Returns losses, the error (type: message) if the run stopped, what the rank
    printed, the first step and the final state_dict (None after an error)."""
    nvme = [f"offload.nvme_path={root}-nvme{dist.rank}"] if "offload=nvme" in over else []
    cfg = tiny_config("model.dropout=0.1", f"train.micro_batch={ROWS // dist.world}", f"train.steps={steps}",
                      f"checkpoint.dir={root}", "checkpoint.every=1", f"checkpoint.keep_last={keep_last}",
                      "checkpoint.timeout_s=60", f"checkpoint.resume={resume}", *over, *nvme, *extra)
    module, data = build_gpt(cfg, seed)
    mine = dist.rank == fault_rank
    step_no = [0]

    def loss_fn(m, micro):
        loss = gpt_loss(m, micro)
        return loss * float("nan") if nan_loss and mine and step_no[0] == fault_at else loss

    out, losses, error, first, final, saved = io.StringIO(), [], None, None, None, None
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out), \
            framework.initialize(module, loss_fn, cfg, dist) as engine:
        ckpt = Checkpointer(cfg, engine)
        try:
            state = ckpt.resume(engine.state)
            first = state.step
            while state.step < steps:
                batch = data.train_batch(state.data, micro_batch=cfg.train.micro_batch,
                                         grad_accum=cfg.train.grad_accum, rank=dist.rank, world=dist.world)
                step_no[0] = state.step + 1
                state, m = engine.train_step(state, batch)
                losses.append(m["loss"])
                fault = state.step == fault_at and mine
                if fault and poison:
                    with engine.mapped_state(state, write=True) as (mapped, _):
                        mapped.params[0].view(-1)[3] = float("nan")
                if fault and corrupt:
                    _corrupt(corrupt)
                ckpt.writer = writer if fault and writer is not None else dcp.FileSystemWriter
                ckpt.maybe_save(state, metrics=m)
                saved = saved or time.monotonic()
            ckpt.wait()
            final = engine.state_dict(state)
        except framework.FrameworkError as e:
            error = f"{type(e).__name__}: {e}"
        finally:
            ckpt.close()
    return {"losses": losses, "error": error, "out": out.getvalue(), "first": first, "state": final,
            "training_s": time.monotonic() - saved if saved else 0.0}   # from the first save on


def _steps(root: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in root.glob("step-*") if p.name.split("-")[1].isdigit())


@pytest.fixture(scope="module")
def reference(pools, tmp_path_factory, nvme_reference):
    """Uninterrupted 2-rank runs (zero2; zero2 with nvme), every step saved and kept (``keep_last=0``)."""
    root = tmp_path_factory.mktemp("reference-zero2") / "ckpt"
    return {"zero2": (root, pools(2).run(_run, ZERO2, str(root), steps=6, keep_last=0, seed=99, timeout=240)),
            "nvme": (nvme_reference["root"], nvme_reference["runs"])}


def _same_as_reference(ref, runs, step0):
    for rank in range(2):
        assert runs[rank]["error"] is None, runs[rank]
        assert runs[rank]["first"] == step0
        assert runs[rank]["losses"] == ref[rank]["losses"][step0:len(runs[rank]["losses"]) + step0], rank


# --- item 1: the swap file changed while the checkpoint reads it ----------------------------------

@pytest.mark.parametrize("when", ["while DCP reads it", pytest.param("before the save", marks=slow)])
def test_swap_corruption_mid_run_is_never_committed_and_resume_is_exact(pools, tmp_path, reference, when):
    """1 MiB of random bytes written into rank 0's swap file during the save of step 3 (after the
    extents were checked, while DCP reads them: the reported failure) or just before it: no
    checkpoint of step 3 is committed, both ranks stop naming the file, steps 1 and 2 are kept,
    and a resume continues from step 2 exactly as the uninterrupted run."""
    root = tmp_path / "ckpt"
    swap = f"{root}-nvme0/rank00000.optim.swap"
    fault = ({"writer": functools.partial(CorruptingWriter, swap=swap)} if when == "while DCP reads it"
             else {"corrupt": swap})
    runs = pools(2).run(_run, [*ZERO2, *NVME], str(root), fault_at=3, seed=99, timeout=240, **fault)
    assert "swap file" in runs[0]["error"] and "rank00000.optim.swap" in runs[0]["error"], runs[0]["error"]
    assert "checksum mismatch" in runs[0]["error"] and "rank 0" in runs[1]["error"], runs
    assert _steps(root) == [1, 2] and (root / "latest").read_text() == "step-2"
    again = pools(2).run(_run, [*ZERO2, *NVME], str(root), steps=6, resume="auto", seed=98, timeout=240)
    _same_as_reference(reference["nvme"][1], again, 2)
    _same_state([r["state"] for r in reference["nvme"][1]], [r["state"] for r in again], when)


# --- item 1: non-finite state is never saved -------------------------------------------------------

NONFINITE = {   # fault -> (run options, error expected, steps kept)
    "nan loss stops": ({"nan_loss": True, "fault_rank": 1},
                       "TrainingError: step 3: the loss is nan (non-finite from the micro batches of rank 1; rank 0 "
                       "finite) ", [1, 2]),
    "nan loss warns": ({"nan_loss": True, "extra": ["train.on_nonfinite=warn"]}, None, [2, 4]),
    "nan master stops": ({"poison": True}, "TrainingError: checkpoint: not saving step 3: the state holds "
                                           "non-finite values (NaN or inf) in rank 0: 'model.", [1, 2]),
}


@pytest.mark.parametrize("case", list(NONFINITE))
def test_non_finite_state_is_never_saved(pools, tmp_path, case):
    """fp32 (no loss scaling): a NaN loss on one rank at step 3 stops both ranks before the update, each
    naming the rank whose micro batches made it (or, train.on_nonfinite=warn, skips the step and its save);
    a NaN master value at the save of step 3 is refused on every rank. The checkpoints of steps 1 and 2 are kept."""
    options, expected, kept = NONFINITE[case]
    runs = pools(2).run(_run, ZERO2, str(tmp_path / "ckpt"), fault_at=3, timeout=240, **options)
    for r in runs:
        if expected is None:
            assert r["error"] is None and "not saving step 3" in r["out"] + runs[0]["out"], r
            assert "the loss is nan (non-finite from the micro batches of rank 0; rank 1 finite)" in runs[0]["out"]
        else:
            assert r["error"] is not None and r["error"].startswith(expected), r["error"]
    assert _steps(tmp_path / "ckpt") == kept


# --- item 2 and 4: every kind of damage is refused by name; resume falls back, on every rank ---------

class Foreign(torch.Tensor):
    """A tensor subclass: torch.load(weights_only=True) refuses to unpickle its class."""


def _rewrite(folder: Path, mutate) -> None:
    """Rewrite a checkpoint's DCP files with ``mutate(tensors)`` applied (one file), checksums updated."""
    md = dcp.FileSystemReader(str(folder)).read_metadata()
    tensors = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype) for k, v in md.state_dict_metadata.items()}
    dcp.load(tensors, checkpoint_id=str(folder), no_dist=True)
    mutate(tensors)
    for p in [*folder.glob("*.distcp"), folder / ".metadata"]:
        p.unlink()
    dcp.save(tensors, checkpoint_id=str(folder), no_dist=True)
    _rehash(folder)


def _rehash(folder: Path) -> None:
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["files"] = {p.name: file_entry(folder, p.name) for p in folder.iterdir() if p.name != "manifest.json"}
    manifest.pop("manifest_sha256")   # rewritten by hand: as a manifest of an older version, without its own checksum
    (folder / "manifest.json").write_text(json.dumps(manifest))


def _edit_train_state(folder: Path, edit) -> None:
    path = folder / "train_state.json"
    path.write_text(edit(path.read_text()))
    _rehash(folder)


def _foreign(tensors):
    key = next(k for k in tensors if k.startswith("model."))
    tensors[key] = torch.Tensor._make_subclass(Foreign, tensors[key])


def _nan(tensors):
    next(v for k, v in tensors.items() if k.startswith("optim.exp_avg.")).view(-1)[0] = float("nan")


DAMAGE = {   # step -> (damage, what every rank's fallback line says)
    6: (lambda f: _rewrite(f, _foreign), "torch refuses to unpickle it with weights_only=True"),
    5: (lambda f: _edit_train_state(f, lambda t: t[:-7]), "train_state.json is unreadable as the train state"),
    4: (lambda f: (f / "manifest.json").unlink(), None),
    3: (lambda f: _edit_train_state(f, lambda t: t.replace('"world": 2', '"world": 3')),
        "train_state.json says world size 3 but manifest.json says 2"),
    2: (lambda f: _rewrite(f, _nan), "non-finite values (NaN or inf) in 'optim.exp_avg."),
}


def test_resume_falls_back_past_every_kind_of_damage_on_every_rank(pools, tmp_path, reference):
    """Checkpoints 2..6 each damaged another way, with checksums that match the damage (a manifest
    rewritten too): a shard torch refuses to unpickle (DCP's CheckpointException), broken JSON in
    train_state.json, a deleted manifest, a world size that disagrees with the manifest,
    non-finite values. Each is refused with one line naming the file and the cause, on every rank,
    before training; resume=auto lands on step 1 and continues exactly as the uninterrupted run."""
    import shutil

    root = tmp_path / "ckpt"
    shutil.copytree(reference["zero2"][0], root)
    for step, (damage, _) in DAMAGE.items():
        damage(root / f"step-{step}")
    runs = pools(2).run(_run, ZERO2, str(root), steps=6, resume="auto", seed=98, keep_last=0, timeout=240)
    _same_as_reference(reference["zero2"][1], runs, 1)
    _same_state([r["state"] for r in reference["zero2"][1]], [r["state"] for r in runs], "fallback")
    for rank, r in enumerate(runs):
        lines = r["out"].splitlines()
        for step, (_, says) in DAMAGE.items():
            if says is not None:
                line = next((x for x in lines if x.startswith(f"rank {rank}: checkpoint {root / f'step-{step}'}: ")),
                            None)
                assert line is not None and says in line, (rank, step, r["out"])
    assert f"checkpoint: {root / 'step-4'}: no manifest.json (deleted, or an interrupted save): not a checkpoint; " \
        "ignored" in runs[0]["out"]
    assert f"resumed from {root / 'step-1'}" in runs[0]["out"]
    assert (root / "step-6" / "manifest.json").is_file()   # saved again over the damaged one


def test_an_error_after_a_refused_read_says_the_state_was_read_into(pools, tmp_path, reference):
    """resume=auto: step 2 is read and refused (non-finite values), the fallback to step 1 stops the run
    (a state format of a newer version: not damage, no fallback). The step-2 read already wrote into the
    state, so every rank's error says not to train from it."""
    import shutil

    root = tmp_path / "ckpt"
    shutil.copytree(reference["zero2"][0], root)
    for step in range(3, 7):
        shutil.rmtree(root / f"step-{step}")
    _rewrite(root / "step-2", _nan)
    _edit_train_state(root / "step-1", lambda t: t.replace('"state_format": 1', '"state_format": 99'))
    runs = pools(2).run(_run, ZERO2, str(root), steps=3, resume="auto", keep_last=0, timeout=240)
    for r in runs:
        assert r["error"].startswith(f"NewerVersion: checkpoint {root / 'step-1'} was saved by a newer version of "
                                     "the framework (state format 99, this one reads 1): resume it with that "
                                     "version"), r
        assert r["error"].endswith("; the state given to resume may be partly overwritten: do not train from it"), r


# --- item 4: a full disk during a save ---------------------------------------------------------------

def test_a_full_disk_during_a_save_names_the_folder_and_keeps_the_previous(pools, tmp_path):
    """ENOSPC while rank 1 writes its shard of step 3: every rank stops with one line naming the
    checkpoint folder, its free bytes and the bytes the checkpoint needs; steps 1 and 2 are
    intact and the unfinished folder is gone."""
    root = tmp_path / "ckpt"
    runs = pools(2).run(_run, ZERO2, str(root), fault_at=3, fault_rank=1, writer=FullDiskWriter, timeout=240)
    for r in runs:
        assert r["error"].startswith("CheckpointError: checkpoint: saving step-3 failed (writing the files): "
                                     f"rank 1: the file system of {root} is full ("), r["error"]
        assert "the checkpoint needs about" in r["error"] and "previous checkpoints are kept" in r["error"]
        assert "more rank" not in r["error"], r["error"]   # one cause, one number on every rank: said once
    assert _steps(root) == [1, 2] and not (root / "step-3.tmp").exists()


def _mount_tmpfs(where: Path, size: str) -> bool:
    where.mkdir()
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                          capture_output=True).returncode == 0


def test_a_real_full_disk_is_refused_before_or_during_the_write(pools, tmp_path):
    """On a small tmpfs (needs the right to mount, as CI's root has; skipped otherwise): a disk
    filled while torch writes the shards (its zip writer's "unexpected pos") ends in the same line
    as ENOSPC; a disk too small for the next checkpoint of both ranks is refused before anything
    is written, naming the bytes the ranks sharing it need. Step 1 survives both."""
    disk = tmp_path / "disk"
    if not _mount_tmpfs(disk, "2m"):
        pytest.skip("mounting a tmpfs needs root (CAP_SYS_ADMIN)")
    try:
        root = disk / "ckpt"
        runs = pools(2).run(_run, ZERO2, str(root), fault_at=2, writer=FillingWriter, timeout=240)
        for r in runs:
            assert r["error"] and f"the file system of {root} is full" in r["error"], r["error"]
        assert _steps(root) == [1] and not (root / "step-2.tmp").exists()
        (disk / "filler").unlink()
        with open(disk / "filler", "wb") as f:   # leave less than both ranks' shards need
            f.write(b"\0" * (os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize - (128 << 10)))
        runs = pools(2).run(_run, ZERO2, str(root), resume="auto", timeout=240)
        for r in runs:
            assert r["error"] and "not saving step 2: " in r["error"] and "the checkpoint files of ranks 0, 1, " \
                "sharing this file system, need" in r["error"], r["error"]
        assert _steps(root) == [1]
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


# --- item 5: the NVMe pre-flight sums the ranks that share a disk -----------------------------------

class _Extents:
    def __init__(self, nbytes):
        self.nbytes = nbytes

    def extents(self):
        return {"0.0": self.nbytes}


def _preflight(dist, folder, fraction):
    from framework.offload._swapfolder import agree_swap_room

    st = os.statvfs(folder)
    each = int(st.f_bavail * st.f_frsize * fraction) // 4096 * 4096
    try:
        agree_swap_room(dist, folder, {"optim": _Extents(each)}, check=lambda: None)
    except framework.ConfigError as e:
        return str(e)
    return None


def test_the_nvme_preflight_sums_the_ranks_sharing_a_disk(pools, tmp_path):
    """Each rank's swap file alone fits (60% of the free space), both together do not: every rank
    refuses with the same line naming the folder, the ranks and the bytes (no rank dies alone)."""
    errors = pools(2).run(_preflight, str(tmp_path), 0.6, timeout=60)
    assert errors[0] == errors[1] and errors[0].startswith(f"offload.nvme_path={tmp_path}: the swap files of ranks "
                                                           "0, 1, sharing this file system, need "), errors
    assert pools(2).run(_preflight, str(tmp_path), 0.1, timeout=60) == [None, None]


# --- item 7: a stalled rank is named -------------------------------------------------------------------

@slow   # (tests/unit/test_integrity_units.py names a stopped process without a timeout to wait for)
def test_a_stalled_rank_is_named_in_the_timeout(tmp_path):
    """Rank 1 stops itself (SIGSTOP) after step 3: rank 0's collective times out (3 s) and its
    message names rank 1, its pid and that it is stopped."""
    import multiprocessing
    import signal

    from tests.dist.test_checkpoint_faults import _worker

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "framework.engine.build", "framework.persist.checkpoint",
                                "tests.dist.test_checkpoint"])
    env = {"FRAMEWORK_FAULT": "step:3@1,stop"}
    procs = [ctx.Process(target=_worker, args=(r, 2, str(tmp_path / "store"), str(tmp_path / "ck"), env, 3.0,
                                              str(tmp_path))) for r in range(2)]
    for p in procs:
        p.start()
    try:
        procs[0].join(90)
        assert procs[0].exitcode == 1, procs[0].exitcode
        error = (tmp_path / "error-0").read_text()
        assert f"rank 1 stalled (pid {procs[1].pid} is stopped (SIGSTOP" in error, error
    finally:
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
            p.join()
