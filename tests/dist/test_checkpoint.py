"""Checkpoints through the DCP folder (framework.persist.checkpoint): bitwise resume, resharding, safety.

Exactness: run A trains N steps and saves at step K (checkpoint.every=K) without changing its
course; run B is a fresh engine (other initial values) that resumes from A's step-K folder and
trains to N. B's per-step losses and final master parameters and optimizer state must equal A's
bitwise (torch.equal / ==), on 2 gloo ranks, with dropout on (each rank's generator resumes).
Resharding: the gathered masters and Adam moments after a load under another world size or
stage are bitwise the saved ones, and the data position continues.
"""
import hashlib
import json
import os
import pickle
import re
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import framework
from framework.core.errors import ConfigError
from framework.persist.checkpoint import Checkpointer, CheckpointError
from framework.persist.export import get_fp32_state_dict_from_checkpoint
from framework.persist.rng import fresh_seed
from framework.models.gpt import gpt_loss
from framework.engine.state import capture_rng
from tests._fault_train import fault
from tests._helpers import OverflowAt, build_gpt, tiny_config
from tests.dist.test_layout import assemble

N, K = 4, 2
ZERO3_SHARDED = "stage.stage3_param_persistence_threshold=0"   # every unit sharded
ROWS = 8
NVME = ["offload=nvme", "offload.sub_group_size=1024", "offload.buffer_count=3"]   # many small tiles


def _cfg(world, overrides, root, extra=()):
    return tiny_config("model.dropout=0.1", f"train.micro_batch={ROWS // world}", f"train.steps={N}",
                       f"checkpoint.dir={root}", f"checkpoint.every={K}", "checkpoint.keep_last=0",
                       "checkpoint.timeout_s=60", *overrides, *extra)


def test_saving_does_not_change_the_run(pools, tmp_path):
    """A run that saves (asynchronously, offload on) trains exactly like one that never saves; it is
    also test_resume_is_bitwise's "zero2 bf16 offload async" case (resumed from its step K, bitwise)."""
    over = ["+stage=zero2", "offload=cpu", "precision=bf16"]
    saving = pools(2).run(_train, [*over, "checkpoint.async=true"], str(tmp_path / "a"), timeout=240)
    plain = pools(2).run(_train, [*over, "checkpoint.every=0"], str(tmp_path / "b"), timeout=240)
    assert [r[0] for r in saving] == [r[0] for r in plain]
    _same_state([r[1] for r in saving], [r[1] for r in plain], "saving vs plain")
    assert (tmp_path / "a" / f"step-{N}").is_dir() and not (tmp_path / "b").exists()
    _resumed_equals(pools, saving, EXACT_MORE["zero2 bf16 offload async"], tmp_path / "a", "zero2 bf16 offload async")


def _train(dist, overrides, root, *, resume="off", seed=None, steps=N, overflow_at=None, batch_from_config=False,
           pre=0):
    """Train to ``steps`` (saving every K), optionally resuming first (after ``pre`` steps of this engine's own, as
    a library loop may take); return losses, the assembled-ready state dict, step and data position of the first
    state."""
    cfg = _cfg(dist.world, overrides, root, [f"checkpoint.resume={resume}"])
    module, data = build_gpt(cfg, seed)
    loss = OverflowAt(dist.rank, overflow_at) if overflow_at is not None else gpt_loss
    with framework.initialize(module, loss, cfg, dist) as engine:
        torch.manual_seed(fresh_seed(cfg.seed, dist.rank))   # as the CLI's loop
        state = replace(engine.state, rng=capture_rng(dist.device))
        # the fault tests' kill points inside a save (FRAMEWORK_FAULT=save-<N>:<point>@<rank>)
        ckpt = Checkpointer(cfg, engine, on_point=lambda point: fault(point, dist.rank),
                            batch_from_config=batch_from_config, data=data.identity())
        try:
            for _ in range(pre):
                state, _ = engine.train_step(state, data.train_batch(state.data, micro_batch=cfg.train.micro_batch,
                                                                     grad_accum=1, rank=dist.rank, world=dist.world))
            state = ckpt.resume(state)
            first = (state.step, state.data, engine.state_dict(state))
            losses = []
            while state.step < steps:
                batch = data.train_batch(state.data, micro_batch=cfg.train.micro_batch,
                                         grad_accum=cfg.train.grad_accum, rank=dist.rank, world=dist.world)
                if overflow_at is not None:
                    loss.step = state.step
                state, m = engine.train_step(state, batch)
                losses.append(m["loss"])
                fault(f"step:{state.step}", dist.rank)  # as framework.cli.loop's on_point (fault tests)
                ckpt.maybe_save(state)
        finally:
            ckpt.close()
        return losses, engine.state_dict(state), first, state.precision.skipped_steps


def _local():
    from framework.comm.distributed import connect
    return connect("gloo")


def _on(pools, world, fn, *args, **kw):
    return [fn(_local(), *args, **kw)] if world == 1 else pools(world).run(fn, *args, timeout=240, **kw)


slow = pytest.mark.skipif(os.environ.get("FRAMEWORK_SLOW_TESTS") != "1", reason="set FRAMEWORK_SLOW_TESTS=1")

# Every stage with offload none, cpu and nvme, fp32 and bf16, gradient accumulation, an async save.
# The suite runs EXACT (each stage x offload x precision value at least once; zero3 + nvme is
# tests/dist/test_nvme.py::test_checkpointer_resume_of_an_nvme_run_is_bitwise, and the async save's
# case, zero2 bf16 offload async, is resumed by test_saving_does_not_change_the_run from the run it
# already made); FRAMEWORK_SLOW_TESTS=1 runs the full cross product.
EXACT = {
    "ddp fp32 accum2": ["train.grad_accum=2"],
    "zero1 bf16 offload accum2": ["+stage=zero1", "precision=bf16", "offload=cpu", "train.grad_accum=2"],
    "zero1 fp32": ["+stage=zero1"],
    "zero2 fp32 offload accum2": ["+stage=zero2", "offload=cpu", "train.grad_accum=2"],
    "zero3 fp32 accum2": ["+stage=zero3", ZERO3_SHARDED, "train.grad_accum=2"],
    "zero3 bf16 offload params": ["+stage=zero3", "precision=bf16", "offload=cpu", "offload.params=cpu"],
    "zero3 fp32 offload ratio": ["+stage=zero3", "offload=cpu", "offload.ratio=0.5"],
    "zero1 fp32 nvme accum2": ["+stage=zero1", *NVME, "train.grad_accum=2"],
    "zero2 bf16 nvme": ["+stage=zero2", "precision=bf16", *NVME],
}
EXACT_MORE = {
    "zero2 bf16 offload async": ["+stage=zero2", "precision=bf16", "offload=cpu", "checkpoint.async=true"],
    "ddp bf16": ["precision=bf16"],
    "zero1 fp32 offload": ["+stage=zero1", "offload=cpu"],
    "zero1 bf16": ["+stage=zero1", "precision=bf16"],
    "zero2 bf16": ["+stage=zero2", "precision=bf16"],
    "zero2 fp32": ["+stage=zero2", "stage.reduce_bucket_size=300", "stage.overlap_comm=true"],
    "zero3 bf16": ["+stage=zero3", "precision=bf16"],
    "zero1 bf16 nvme": ["+stage=zero1", "precision=bf16", *NVME],
    "zero2 fp32 nvme accum2": ["+stage=zero2", *NVME, "train.grad_accum=2"],
    "zero3 fp32 nvme params cpu": ["+stage=zero3", ZERO3_SHARDED, *NVME, "offload.params=cpu"],
}


def _same_state(a: list[dict], b: list[dict], what: str) -> None:
    sa, sb = assemble(a), assemble(b)
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), f"{what}: {key} differs"
    for x, y in zip(a, b):
        assert x["optimizer"]["scalars"] == y["optimizer"]["scalars"], what
        assert (x["step"], x["data"], x["precision"]) == (y["step"], y["data"], y["precision"]), what


@pytest.mark.parametrize("case", [*EXACT, *(pytest.param(c, marks=slow) for c in EXACT_MORE)])
def test_resume_is_bitwise(pools, tmp_path, case):
    over = {**EXACT, **EXACT_MORE}[case]
    a = pools(2).run(_train, over, str(tmp_path), timeout=240)
    _resumed_equals(pools, a, over, tmp_path, case)


def _resumed_equals(pools, a, over, root, case):
    """A fresh engine (other initial values) resumed from ``a``'s step K in ``root`` trains on to N exactly as ``a``."""
    assert (root / f"step-{K}" / "manifest.json").is_file()
    b = pools(2).run(_train, over, str(root / f"step-{K}"), resume=str(root / f"step-{K}"), seed=99, timeout=240)
    for rank in range(2):
        assert b[rank][2][:2] == (K, K)
        assert b[rank][0] == a[rank][0][K:], f"{case} rank {rank}: losses {b[rank][0]} vs {a[rank][0][K:]}"
    _same_state([r[1] for r in a], [r[1] for r in b], case)


@pytest.mark.parametrize("stage", ["+stage=zero2", "+stage=zero3", "+stage=zero3 nvme"])
def test_fp16_resume_after_a_skipped_step_is_bitwise(pools, tmp_path, stage):
    """fp16 with dynamic loss scaling, one rank's loss infinite at step 1 (skipped, scale halved)
    before the save at step 2: the scaler fields and the skipped count resume exactly."""
    over = [stage.split()[0], "precision=fp16", *(NVME if stage.endswith("nvme") else [])]
    a = pools(2).run(_train, over, str(tmp_path), overflow_at=1, timeout=240)
    b = pools(2).run(_train, over, str(tmp_path), resume=str(tmp_path / f"step-{K}"), seed=99, timeout=240)
    assert a[0][3] == 1 and b[0][3] == 1  # the skipped step is counted after the resume too
    assert b[0][2][2]["precision"]["skipped_steps"] == 1
    for rank in range(2):
        assert b[rank][0] == a[rank][0][K:]
    _same_state([r[1] for r in a], [r[1] for r in b], "fp16")


# (world, overrides) of the saving run -> of the loading run
RESHARD = {
    "zero2-w2 -> ddp-w1": ((2, ["+stage=zero2"]), (1, [])),
    "zero1-w1 -> zero3-w2": ((1, ["+stage=zero1"]), (2, ["+stage=zero3", ZERO3_SHARDED])),
    "zero3-w2-offload -> zero2-w4": ((2, ["+stage=zero3", "offload=cpu", ZERO3_SHARDED]), (4, ["+stage=zero2"])),
    "zero2-w2 -> zero3-w2": ((2, ["+stage=zero2", "stage.reduce_bucket_size=300"]), (2, ["+stage=zero3"])),
    "zero3-w2 -> ddp-w2": ((2, ["+stage=zero3"]), (2, [])),
    # saved from the mapped swap files of 2 ranks, read straight into the one rank's new swap file
    "zero2-w2-nvme -> zero3-w1-nvme": ((2, ["+stage=zero2", *NVME]), (1, ["+stage=zero3", ZERO3_SHARDED, *NVME])),
}


@pytest.mark.parametrize("case", list(RESHARD))
def test_resume_under_another_layout(pools, tmp_path, case):
    (wa, a_over), (wb, b_over) = RESHARD[case]
    a = _on(pools, wa, _train, a_over, str(tmp_path), steps=K)
    b = _on(pools, wb, _train, b_over, str(tmp_path), resume="auto", seed=99)
    saved, loaded = [r[1] for r in a], [r[2][2] for r in b]
    for r in b:
        assert r[2][:2] == (K, K)  # step and global data position continue
        assert len(r[0]) == N - K and all(torch.isfinite(torch.tensor(r[0])))
    _same_state(saved, loaded, case)


def _diverged_save(dist, root):
    """ddp: rank 1 alone changes its copy of a (replicated) parameter; the save's error, on each rank."""
    cfg = _cfg(dist.world, [], root, ["checkpoint.resume=off"])
    module, _ = build_gpt(cfg)
    with framework.initialize(module, gpt_loss, cfg, dist) as engine:
        ckpt = Checkpointer(cfg, engine)
        try:
            with engine.mapped_state(engine.state, write=True) as (mapped, _), torch.no_grad():
                if dist.rank == 1:
                    mapped.params[0].add_(1.0)
            with pytest.raises(CheckpointError) as got:
                ckpt.save(engine.state)
            return str(got.value)
        finally:
            ckpt.close()


def test_ranks_whose_replicated_copies_differ_are_not_saved(pools, tmp_path):
    """One rank's copy of each replicated parameter is written: copies that differ (bit for bit) are refused,
    naming the ranks and the parameter, not saved as a checkpoint that matches neither rank."""
    errors = pools(2).run(_diverged_save, str(tmp_path), timeout=120)
    assert errors[0] == errors[1], errors
    assert errors[0].startswith("checkpoint: not saving step 0: ranks 0 and 1 hold different values of model."), errors
    assert "change it on every rank alike; the previous checkpoints are kept" in errors[0], errors
    assert not list(tmp_path.glob("step-*")), list(tmp_path.iterdir())


def test_a_user_reads_the_folder_with_plain_dcp(pools, tmp_path):
    """The folder is plain DCP: dcp.load into full tensors on one process gives the masters and
    moments by name, with global shapes (contract D)."""
    import torch.distributed.checkpoint as dcp

    a = pools(2).run(_train, ["+stage=zero2"], str(tmp_path), steps=K, timeout=240)
    full = assemble([r[1] for r in a])
    folder = tmp_path / f"step-{K}"
    body = json.loads((folder / "train_state.json").read_text())
    targets = {}
    for name, shape in body["parameters"].items():
        targets[f"model.{name}"] = torch.empty(shape)
        targets[f"optim.exp_avg.{name}"] = torch.empty(shape)
        targets[f"optim.exp_avg_sq.{name}"] = torch.empty(shape)
    targets["optim.step"] = torch.zeros((), dtype=torch.int64)
    dcp.load(targets, checkpoint_id=str(folder), no_dist=True)
    for name in body["parameters"]:
        assert torch.equal(targets[f"model.{name}"].reshape(-1), full[name])
        assert torch.equal(targets[f"optim.exp_avg.{name}"].reshape(-1), full[f"{name}/0.mu"])
        assert torch.equal(targets[f"optim.exp_avg_sq.{name}"].reshape(-1), full[f"{name}/0.nu"])
    assert int(targets["optim.step"]) == K
    assert (tmp_path / "latest").read_text() == f"step-{K}"
    assert all((p.stat().st_mode & 0o077) == 0 for p in [folder, *folder.iterdir()])


def _damaged_load(dist, root, resume):
    try:
        _train(dist, ["+stage=zero2"], root, resume=resume, seed=99)
    except CheckpointError as e:
        return str(e)
    return None


def test_damaged_checkpoints_fail_clearly_or_fall_back(pools, tmp_path, capfd):
    pools(2).run(_train, ["+stage=zero2"], str(tmp_path), timeout=240)  # step-2, step-4
    newest = tmp_path / f"step-{N}"
    shard = newest / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-100])                         # truncated
    other = newest / "__0_0.distcp"
    data = bytearray(other.read_bytes())
    data[len(data) // 2] ^= 0x01                                          # one flipped bit
    other.write_bytes(bytes(data))
    errors = pools(2).run(_damaged_load, str(tmp_path), str(newest), timeout=120)
    for e in errors:  # every rank, the same message naming both files
        assert e is not None and "__1_0.distcp has" in e and "truncated" in e and "__0_0.distcp does not match" in e
    assert errors[0] == errors[1]
    # resume=auto falls back to step-2 and says so.
    out = pools(2).run(_train, ["+stage=zero2"], str(tmp_path), resume="auto", seed=99, timeout=240)
    assert out[0][2][:2] == (K, K)


def test_metadata_that_would_run_code_is_refused(tmp_path):
    """A crafted .metadata (a pickle that calls os.system) is refused by the allow-listed
    unpickler, even with a manifest whose checksums match it."""
    dist = _local()
    _train(dist, [], str(tmp_path), steps=K)
    folder = tmp_path / f"step-{K}"
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    (folder / ".metadata").write_bytes(pickle.dumps(Evil()))
    manifest = json.loads((folder / "manifest.json").read_text())
    from framework.persist.stepfolders import file_entry
    manifest["files"][".metadata"] = file_entry(folder, ".metadata")
    manifest.pop("manifest_sha256")   # (crafted: a manifest without its own checksum is read as an older version's)
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"refused to read the DCP metadata \(posix.system is not part"):
        _train(dist, [], str(tmp_path), resume=str(folder))
    assert not marker.exists()


def test_resume_off_says_checkpoints_exist_refuses_to_overwrite_them_and_incomplete_folders_are_ignored(tmp_path, capsys):
    dist = _local()
    _train(dist, ["scheduler.warmup_steps=1"], str(tmp_path), steps=K)   # (past its warm-up at K: the note below)
    (tmp_path / f"step-{N}.tmp").mkdir()                # an interrupted save
    (tmp_path / "step-9").mkdir()                      # a folder without a manifest
    _train(dist, ["checkpoint.every=0"], str(tmp_path), resume="off", steps=0)   # no saves: a note
    assert f"resume=off: starting from step 0 although {tmp_path} holds 1 checkpoint, newest step-{K}" \
        in capsys.readouterr().out
    with pytest.raises(ConfigError, match=f"holds 1 checkpoint, newest step-{K}, which this run's saves would"):
        _train(dist, [], str(tmp_path), resume="off", steps=0)   # saves: they would overwrite them
    # So is a resume from another folder's checkpoint, in the check before the ranks and in the loop's own.
    from framework.persist.checkpoint import preflight
    other = tmp_path / "other" / f"step-{K}"
    shutil.copytree(tmp_path / f"step-{K}", other)
    refused = fr"checkpoint.resume={re.escape(str(other))}: {re.escape(str(tmp_path))} holds 1 checkpoint, newest " \
              fr"step-{K}, which this run's saves"
    with pytest.raises(ConfigError, match=refused):
        preflight(_cfg(1, [], str(tmp_path), [f"checkpoint.resume={other}"]), None)
    with pytest.raises(ConfigError, match=refused):
        _train(dist, [], str(tmp_path), resume=str(other), steps=0)
    # no saves: nothing to lose
    _train(dist, ["checkpoint.every=0", "train.micro_batch=4"], str(tmp_path), resume=str(other), steps=0)
    out = capsys.readouterr().out   # (a loop of one's own: train.micro_batch is no batch of it, no global batch said)
    assert f"resumed from {other}" in out and "global batch" not in out, out
    # Every difference is listed, however many (a changed group, logger here, as one entry)
    more = ["logger=console", "model.dropout=0.2", "optimizer.beta1=0.8", "optimizer.beta2=0.98", "optimizer.eps=1e-7",
            "optimizer.weight_decay=0.2", "scheduler.warmup_steps=1", f"train.steps={N + 4}"]
    losses, _, first, _ = _train(dist, ["train.micro_batch=4", *more], str(tmp_path), resume="auto", steps=N,
                                 batch_from_config=True)
    assert first[:2] == (K, K) and len(losses) == N - K
    out = capsys.readouterr().out
    assert f"resumed from {tmp_path / f'step-{K}'} (step {K}" in out, out
    was = _cfg(1, [], str(tmp_path))   # (each with its saved value)
    assert (f"; config differs in logger none->console, model.dropout {was.model.dropout}->0.2, optimizer.beta1 "
            f"{was.optimizer.beta1}->0.8, optimizer.beta2 {was.optimizer.beta2}->0.98, optimizer.eps "
            f"{was.optimizer.eps}->1e-07, optimizer.weight_decay {was.optimizer.weight_decay}->0.2, train.micro_batch "
            f"{was.train.micro_batch}->4, train.steps {N}->{N + 4};") in out, out
    # the schedule's length follows train.steps (decay_steps null): the resumed update's lr moves, and that is said
    from framework.schedulers import warmup_cosine
    cfg = _cfg(1, more, str(tmp_path))
    lr, was = (warmup_cosine.build(cfg.scheduler, cfg.optimizer.lr, total)(K) for total in (N + 4, N))
    assert (f"; the lr schedule (scheduler=warmup_cosine) follows train.steps: it now spans {N + 4} steps, not {N}, "
            f"and the next update's lr is {lr:.2e} (over {N} steps: {was:.2e}); set scheduler.decay_steps={N} to keep "
            "the saved run's;") in out, out
    assert "; global batch 8 -> 4 rows (micro_batch x grad_accum x world); set train.micro_batch or train.grad_accum " \
           "to keep it" in out, out
    assert not (tmp_path / f"step-{N}.tmp").exists()   # removed by the next save
    assert (tmp_path / f"step-{N}" / "manifest.json").is_file()
    # No such note where the scheduler itself changed (this one's lr over the saved length is not the saved run's;
    # "config differs in" names it) or where no update follows (the checkpoint at or past the new train.steps)
    for over in (["scheduler.min_lr=0", f"train.steps={N + 8}"], [f"train.steps={N - 1}"]):
        _train(dist, [*more[:-1], *over], str(tmp_path), resume="auto", steps=0)
        out = capsys.readouterr().out
        assert f"resumed from {tmp_path / f'step-{N}'}" in out and "the lr schedule" not in out, out


def test_a_step_a_save_left_aside_in_its_commit_is_put_back_before_a_resume_looks(tmp_path, capsys, monkeypatch):
    """A save of a step already there killed inside its commit leaves step-N moved to step-N.old (and maybe a
    complete step-N.tmp): the resume restores step-N and goes on from it, not from a save interval earlier. A run
    that only reads the folder (another run's, whose commit may be under way) renames nothing: it reads step-N
    where it lies."""
    from framework.persist.checkpoint import preflight
    dist = _local()
    _train(dist, [], str(tmp_path), steps=N)
    final = tmp_path / f"step-{N}"
    final.rename(tmp_path / f"step-{N}.old")
    shutil.copytree(tmp_path / f"step-{N}.old", tmp_path / f"step-{N}.tmp")   # the new one, complete
    preflight(_cfg(1, [], str(tmp_path), ["checkpoint.resume=auto"]), None)   # the check before the ranks
    assert "restored it from step-4.tmp (complete" in capsys.readouterr().out and final.is_dir()
    shutil.rmtree(tmp_path / f"step-{N}.old")
    final.rename(tmp_path / f"step-{N}.old")   # moved aside, its successor not yet complete
    _, _, first, _ = _train(dist, [], str(tmp_path), resume=str(tmp_path), steps=N)   # the loop's own, a path
    assert first[:2] == (N, N)
    assert "restored it from step-4.old (the copy moved aside)" in capsys.readouterr().out
    final.rename(tmp_path / f"step-{N}.old")   # and so is the step folder itself, named as the resume
    for resume in (final, tmp_path):   # read by a run that saves nothing: as it lies
        _, _, first, _ = _train(dist, ["checkpoint.every=0"], str(tmp_path), resume=str(resume), steps=N)
        assert first[:2] == (N, N)
        assert f"resumed from {tmp_path / f'step-{N}.old'} (step {N}" in capsys.readouterr().out
        assert not final.exists() and (tmp_path / f"step-{N}.old").is_dir()
    # that run's commit puts step-N back between the reader's choice and its read: read there, no damage said
    from framework.persist import checkpoint
    chosen = checkpoint.choose

    def racing(*args, **kwargs):
        out = chosen(*args, **kwargs)
        (tmp_path / f"step-{N}.old").rename(final)
        return out

    monkeypatch.setattr(checkpoint, "choose", racing)
    for resume in (final, tmp_path):
        _, _, first, _ = _train(dist, ["checkpoint.every=0"], str(tmp_path), resume=str(resume), steps=N)
        out = capsys.readouterr().out
        assert first[:2] == (N, N) and f"resumed from {final} (step {N}" in out and "damaged" not in out, out
        final.rename(tmp_path / f"step-{N}.old")
    # only a step-N.tmp / step-N.old is read again from step-N: a copy named otherwise that is damaged is damage
    shutil.copytree(tmp_path / f"step-{N}.old", tmp_path / "mine")
    shutil.copytree(tmp_path / f"step-{N}.old", tmp_path / "mine.bak")
    (tmp_path / "mine.bak" / "train_state.json").write_text("{")
    with pytest.raises(CheckpointError, match="mine.bak/train_state.json"):
        _train(dist, ["checkpoint.every=0"], str(tmp_path), resume=str(tmp_path / "mine.bak"), steps=N)


def test_a_file_the_manifest_leaves_out_is_damage_not_read_unchecked(tmp_path):
    dist = _local()
    _train(dist, [], str(tmp_path), steps=K)
    folder = tmp_path / f"step-{K}"
    manifest = json.loads((folder / "manifest.json").read_text())
    del manifest["files"]["__0_0.distcp"]
    manifest.pop("manifest_sha256")   # (edited: a manifest without its own checksum is read as an older version's)
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=f"checkpoint {re.escape(str(folder))} is damaged: "
                                              f"{re.escape(str(folder / '__0_0.distcp'))} is not in "
                                              r"manifest.json \(a save lists every file it writes"):
        _train(dist, [], str(tmp_path / "b"), resume=str(folder), steps=K)


def test_another_steps_manifest_or_folder_in_a_step_folder_is_named(tmp_path, capsys):
    """step-4 holding step-2's manifest: the line says so first, naming both steps, before the files that then fail
    their check (not disk damage), and names the folder's resume (falling back to step-2) as the way out; step-2's
    whole folder copied into step-4 resumes what it holds (step 2), and the resume line says the folder's name and its
    contents disagree."""
    dist = _local()
    _train(dist, ["checkpoint.keep_last=0"], str(tmp_path), steps=N)   # step-2, step-4
    two, four = tmp_path / f"step-{K}", tmp_path / f"step-{N}"
    shutil.copy(two / "manifest.json", four / "manifest.json")
    with pytest.raises(CheckpointError) as e:
        _train(dist, [], str(tmp_path / "b"), resume=str(four), steps=N)
    assert str(e.value).startswith(f"checkpoint {four} is damaged: {four / 'manifest.json'} is step {K}'s, not step "
                                   f"{N}'s (copied from another step's folder?); {four / '.metadata'} does not "
                                   "match"), e.value
    assert str(e.value).endswith(f"; checkpoint.resume={tmp_path} falls back to the newest step there that "
                                 "verifies"), e.value
    shutil.rmtree(four)
    shutil.copytree(two, four)
    capsys.readouterr()
    assert _train(dist, [], str(tmp_path / "c"), resume=str(four), steps=N)[2][0] == K
    assert (f"resumed from {four} (step {K}, data position {K}; same layout); note: its name says step {N} but it "
            f"holds step {K}'s files (copied from another step's folder?)") in capsys.readouterr().out


def test_files_no_save_writes_are_ignored_not_damage(tmp_path, capsys):
    """An editor's swap file, .DS_Store or a user's notes in the newest step do not make resume skip it (and the
    re-save replace it); an unlisted file a save could have written still is damage."""
    dist = _local()
    _train(dist, ["checkpoint.keep_last=0"], str(tmp_path), steps=N)
    folder = tmp_path / f"step-{N}"
    for name in (".train_state.json.swp", ".DS_Store", "notes.txt"):
        (folder / name).write_bytes(b"not a checkpoint file")
    capsys.readouterr()
    _, _, first, _ = _train(dist, ["checkpoint.keep_last=0"], str(tmp_path), resume="auto", steps=N)
    assert first[0] == N
    assert (f"checkpoint: {folder} holds '.DS_Store', '.train_state.json.swp', 'notes.txt', which no save writes: "
            "ignored") in capsys.readouterr().err
    (folder / "__1_0.distcp").write_bytes(b"x")
    with pytest.raises(CheckpointError, match=f"{re.escape(str(folder / '__1_0.distcp'))} is not in manifest.json"):
        _train(dist, [], str(tmp_path / "b"), resume=str(folder), steps=N)


def test_a_failure_after_the_commit_rename_is_a_warning_and_export_takes_the_newest_step(tmp_path, capsys,
                                                                                         monkeypatch):
    """Renamed, step-N is committed (resume=auto uses it): a full disk writing ``latest`` then is a warning, not
    a failed save, and an export of the folder takes step-N, not the step ``latest`` still names."""
    from framework.persist import stepfolders
    from framework.persist.export import resolve

    def full(point, rank):
        if point == f"save-{N}:before-latest":
            raise OSError(28, "No space left on device")
    def busy(*args):
        raise OSError(16, "Device or resource busy")
    monkeypatch.setitem(globals(), "fault", full)
    monkeypatch.setattr(stepfolders, "prune", busy)   # a failed rotation after it keeps the first warning
    _train(_local(), [], str(tmp_path), steps=N)
    err = capsys.readouterr().err
    assert f"warning: checkpoint: {tmp_path / f'step-{N}'} committed; {tmp_path / 'latest'} not updated (No space " \
           "left on device)" in err
    line = next(x for x in err.splitlines() if f"step-{N} committed" in x)
    assert line.endswith("; deleting the older checkpoints failed (Device or resource busy)"), line
    assert (tmp_path / "latest").read_text() == f"step-{K}"
    assert resolve(tmp_path) == tmp_path / f"step-{N}"
    assert f"warning: export: {tmp_path} holds step-{N}, its newest committed checkpoint, but its latest names " \
           f"step-{K}; exporting step-{N}" in capsys.readouterr().err


def _apart(dist, root):
    """The pre-training check on the folder every rank shares, then on one folder per rank (as a node-local /tmp
    on each of two nodes), then a save into one folder per rank: every rank's errors."""
    from framework.persist.checkpoint import shared
    shared(dist, Path(root))   # one folder: passes, and leaves nothing there
    dist.all_gather_object(None, what="rank 0's removal of the check's file")   # (rank 0 removes it last)
    out = [sorted(p.name for p in Path(root).iterdir() if not p.name.startswith("node-"))]
    mine = Path(root) / f"node-{dist.rank}"
    mine.mkdir()
    for check in (lambda: shared(dist, mine), lambda: _train(dist, [], str(mine), steps=K)):
        try:
            check()
            out.append(None)
        except (ConfigError, CheckpointError) as e:
            out.append((type(e).__name__, str(e)))
    return out


def test_a_checkpoint_dir_not_every_rank_sees_is_refused_before_training_and_never_committed(pools, tmp_path):
    """A checkpoint.dir that is another folder on each node: refused on every rank before training (rank 0 writes a
    file there that rank 1 does not see), and a save into it (a library loop, or a folder that changed since) is
    refused at the commit, rank 0's folder lacking the files rank 1 wrote, instead of committed as verified."""
    for rank, (listing, check, save) in enumerate(pools(2).run(_apart, str(tmp_path), timeout=240)):
        assert listing == [] and check == ("ConfigError", f"checkpoint.dir {tmp_path / f'node-{rank}'} is not one "
                                           f"folder every rank sees (rank 1 on host {os.uname().nodename} does not "
                                           f"see the files rank 0 on host {os.uname().nodename} writes there): put it "
                                           "on a shared file system")
        tmp = tmp_path / "node-0" / f"step-{K}.tmp"
        assert save[0] == "CheckpointError" and save[1].startswith(
            f"checkpoint: saving step-{K} failed (commit): rank 0: {tmp} is not the folder every rank wrote (rank 0 "
            "does not see 'rng-1.json'")
        assert save[1].endswith("checkpoint.dir must be one folder every rank sees; put it on a shared file system; "
                                "the previous checkpoints are kept")
    assert not list((tmp_path / "node-0").iterdir())   # nothing committed, the unfinished folder removed


def test_a_listed_file_gone_before_the_commit_is_no_verified_checkpoint(tmp_path, monkeypatch):
    """A file the ranks wrote and hashed that the folder being committed no longer holds: the save is refused,
    nothing committed, the previous checkpoint kept."""
    def gone(point, rank):
        if point == f"save-{N}:before-manifest":
            (tmp_path / f"step-{N}.tmp" / "rng-0.json").unlink()
    monkeypatch.setitem(globals(), "fault", gone)
    with pytest.raises(CheckpointError, match=fr"saving step-{N} failed \(commit\): rank 0: .*step-{N}.tmp is not the "
                                              r"folder every rank wrote \(rank 0 does not see 'rng-0.json' there"):
        _train(_local(), [], str(tmp_path), steps=N)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", f"step-{K}"]


def test_every_checkpoint_damaged_keeps_them_and_names_the_way_out(tmp_path):
    """resume=auto with every folder damaged: one error, the folders kept, and the advice is one that
    works (another checkpoint.dir: resume=off is refused where the run would save among them)."""
    dist = _local()
    _train(dist, [], str(tmp_path), steps=K)
    for folder in tmp_path.glob("step-*"):
        (folder / "train_state.json").write_text("{")
    with pytest.raises(CheckpointError, match=r"every checkpoint in .* is damaged or not finite \(the folders are "
                                              r"kept; use another checkpoint.dir to start this run afresh\)"):
        _train(dist, [], str(tmp_path), resume="auto")
    assert sorted(p.name for p in tmp_path.glob("step-*")) == [f"step-{K}"]
    # a manifest there that does not parse (truncated) is damage too, not a folder without a commit to ignore
    manifest = tmp_path / f"step-{K}" / "manifest.json"
    manifest.write_bytes(manifest.read_bytes()[:-20])
    with pytest.raises(CheckpointError, match=fr"every checkpoint in .* is damaged .*{re.escape(str(manifest))} is "
                                              r"unreadable as the manifest"):
        _train(dist, [], str(tmp_path), resume="auto")
    assert sorted(p.name for p in tmp_path.glob("step-*")) == [f"step-{K}"]


def test_a_checkpoint_of_another_model_is_an_error_not_a_fallback(tmp_path, monkeypatch):
    dist = _local()
    _train(dist, [], str(tmp_path), steps=K)
    with pytest.raises(framework.FrameworkError, match=r"parameter 'wte.weight' has shape \(24, 32\) in the checkpoint "
                                                       r"but \(24, 36\) in this model; use another checkpoint.dir "
                                                       r"to start this run afresh$"):   # (nothing was read into the state)
        _train(dist, ["model.d_model=36"], str(tmp_path), resume="auto")
    # another vocabulary from the data: named, not only the embedding's shape
    with pytest.raises(ConfigError, match=r"has shape \(24, 32\) in the checkpoint but \(20, 32\) in this model "
                                          r"\(data.vocab_size 24->20: the data sets the model's vocabulary\); resume "
                                          r"with data.vocab_size=24, or use another checkpoint.dir to start this run "
                                          r"afresh$"):
        _train(dist, ["data.vocab_size=20"], str(tmp_path), resume="auto")
    # the data changed too, but another shape (or missing parameters) is not its doing: no advice that fails again
    for other, told in ((["model.n_layer=3"], r"does not fit this model: missing parameters 'blocks.2.attn.*"),
                        (["model.d_model=36"], r"has shape \(24, 32\) in the checkpoint but \(20, 36\) in this model")):
        with pytest.raises(ConfigError, match=told + r"; use another checkpoint.dir to start this run afresh$"):
            _train(dist, [*other, "data.vocab_size=20"], str(tmp_path), resume="auto")
    # another optimizer: named as the configs name it (not by its state's keys), in a loop of one's own too
    with pytest.raises(ConfigError, match=r"was saved with optimizer=adamw, this run uses optimizer=sgd; resume with "
                                          r"optimizer=adamw; use another checkpoint.dir to start this run afresh$"):
        _train(dist, ["optimizer=sgd"], str(tmp_path), resume="auto")
    # Named by a path (or found by latest, which searches the run folders wherever checkpoint.dir is), another
    # checkpoint.dir reads it again: the way out is resume=off, with another folder where this run saves among it.
    from framework.persist.checkpoint import preflight
    step = tmp_path / f"step-{K}"
    with pytest.raises(ConfigError, match=r"optimizer=sgd; resume with optimizer=adamw; set checkpoint.resume=off to "
                                          r"start this run afresh$"):
        _train(dist, ["optimizer=sgd"], str(tmp_path / "elsewhere"), resume=str(step))
    with pytest.raises(ConfigError, match=r"32 vs 36; saved vs this run\); set checkpoint.resume=off to start this run afresh$"):
        preflight(_cfg(1, ["model.d_model=36"], str(tmp_path / "elsewhere"), [f"checkpoint.resume={step}"]), None)
    monkeypatch.chdir(tmp_path)   # (latest looks in the run folders under the working directory too)
    with pytest.raises(ConfigError, match=r"^checkpoint.resume=latest: .*; set checkpoint.resume=off and another "
                                          r"checkpoint.dir to start this run afresh$"):
        preflight(_cfg(1, ["optimizer=sgd"], str(tmp_path), ["checkpoint.resume=latest"]), None)
    # a train state that names another model but fails its manifest check is damage, not another model: the
    # check before the ranks leaves it to them (which name it and fall back)
    state = tmp_path / f"step-{K}" / "train_state.json"
    other, edits = re.subn(r'"n_layer": (\d+)', lambda m: f'"n_layer": {int(m[1]) + 1}', state.read_text(), 1)
    assert edits == 1
    state.write_text(other)
    preflight(_cfg(1, [], str(tmp_path), ["checkpoint.resume=auto"]), None)
    # latest, resolved to that folder before the ranks, is still said as typed (``Checkpointer.resume``'s errors)
    resolved = preflight(_cfg(1, [], str(tmp_path), ["checkpoint.resume=latest"]), None)
    assert (resolved.checkpoint.resume, resolved.resume_given) == (str(tmp_path), "latest")


def test_a_new_initial_loss_scale_at_an_fp16_resume_is_said_to_give_way_to_the_saved_one(tmp_path, capsys):
    """Dynamic scaling goes on from the saved scale, as DeepSpeed's does: the changed key is listed with it."""
    dist = _local()
    _train(dist, ["precision=fp16"], str(tmp_path), steps=K)
    saved = json.loads((tmp_path / f"step-{K}" / "train_state.json").read_text())["precision"]["cur_scale"]
    capsys.readouterr()
    _train(dist, ["precision=fp16", "precision.initial_scale_power=8"], str(tmp_path), resume="auto", steps=2 * K)
    assert f"config differs in precision.initial_scale_power 16->8 (the saved scale {saved:g} carries on)" \
        in capsys.readouterr().out
    # as the note says: the next checkpoint holds the saved scale, not the new initial 2**8
    after = json.loads((tmp_path / f"step-{2 * K}" / "train_state.json").read_text())["precision"]["cur_scale"]
    assert saved != 2 ** 8 and after == saved, (saved, after)
    # saved with a static scale: the new initial scale is this run's start, listed as it is
    _train(dist, ["precision=fp16", "precision.loss_scale=128"], str(tmp_path / "static"), steps=K)
    capsys.readouterr()
    _train(dist, ["precision=fp16", "precision.initial_scale_power=8"], str(tmp_path / "static"), resume="auto",
           steps=K)
    out = capsys.readouterr().out
    assert "precision.initial_scale_power 16->8, precision.loss_scale 128" in out and "carries on" not in out, out


def test_sgd_momentum_turned_on_or_off_at_a_resume_goes_on_as_torch_optim_does(tmp_path, capsys):
    """optimizer.momentum 0 -> 0.9 at a resume: the checkpoint holds no momentum_buffer, which starts as torch.optim's
    SGD starts one a loaded state dict lacks (the next gradient, undampened: dampening shows a zero start), also in
    an engine that stepped with momentum before the resume (a library loop: its buffer and step count are not kept);
    0.9 -> 0: the saved buffer is not read. Against torch.optim.SGD in fp32, its state dict carried across the same
    changes."""
    over = ["optimizer=sgd", "optimizer.lr=0.5", "scheduler=constant", "train.grad_clip=0", "model.dropout=0"]
    on = ["optimizer.momentum=0.9", "optimizer.dampening=0.5"]
    dist = _local()
    ours = _train(dist, over, str(tmp_path), steps=K)[0]
    capsys.readouterr()
    ours += _train(dist, [*over, *on], str(tmp_path), resume="auto", steps=N, pre=3)[0]
    assert "holds no optimizer state momentum_buffer: it starts anew at this resume, as in torch.optim" in \
        capsys.readouterr().out
    losses, state, *_ = _train(dist, over, str(tmp_path), resume="auto", steps=N + K)
    ours += losses
    assert "holds optimizer state momentum_buffer that this optimizer keeps none of: not read" in capsys.readouterr().out
    model, data = build_gpt(_cfg(1, over, str(tmp_path)))
    opt, ref = torch.optim.SGD(model.parameters(), lr=0.5), []
    for step in range(N + K):
        if step in (K, N):   # (on its param_groups: its load_state_dict would restore the saved settings)
            opt.load_state_dict(opt.state_dict())
            opt.param_groups[0].update(momentum=0.9 if step == K else 0.0, dampening=0.5 if step == K else 0.0)
        loss = gpt_loss(model, data.train_batch(step, micro_batch=ROWS, grad_accum=1, rank=0, world=1).micro[0])
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref.append(loss.item())
    assert ours == pytest.approx(ref, rel=1e-6), (ours, ref)
    final = assemble([state])
    for name, p in model.named_parameters():
        torch.testing.assert_close(final[name].view(p.shape), p.detach(), rtol=1e-5, atol=1e-6)


def test_a_resume_refuses_data_whose_ids_changed_meaning_and_says_when_only_its_content_did(tmp_path, capsys,
                                                                                            monkeypatch):
    """A token file prepared anew at the same data.path: with another vocabulary (its ids stand for other
    characters, though the model's shapes fit) the resume is refused before anything is read; new text of the
    same vocabulary (fine-tuning) resumes with a note; a checkpoint that recorded no data resumes as before."""
    from framework.data import _base
    from framework.data.text import prepare_chars
    text, tokens, root = tmp_path / "t.txt", tmp_path / "t.bin", str(tmp_path / "ck")
    data = ["data=tokens", f"data.path={tokens}"]   # (TINY's data.vocab_size=24: any 20 characters fit)
    dist = _local()
    words = "".join("abcdefghijklmnopqrst"[i * 7 % 20] for i in range(400))
    text.write_text(words)
    prepare_chars(str(text), tokens)
    _train(dist, data, root, steps=K)
    with pytest.raises(ConfigError, match=r"\(saved with data=tokens, this run uses data=synthetic: the data sets the "
                                          r"model's vocabulary\); resume with data=tokens, or use another"):
        _train(dist, ["data.vocab_size=22"], root, resume="auto", steps=K)   # (22 rows: 24 would fit)
    # 24 rows fit: refused all the same, the saved data position counting batches of the token file
    with pytest.raises(ConfigError, match=rf"^checkpoint.resume=auto: {re.escape(root)}/step-{K} was saved with "
                                          r"data=tokens, this run uses data=synthetic \(its data position counts "
                                          r"batches of that data, not of this run's\); resume with data=tokens, or "
                                          r"use another checkpoint.dir to start this run afresh$"):
        _train(dist, [], root, resume="auto", steps=K)
    text.write_text(words + words[:40])   # more of the same characters
    prepare_chars(str(text), tokens)
    capsys.readouterr()
    _train(dist, data, root, resume="auto", steps=K)
    assert f"; the data in {tokens} changed since the save (800 -> 880 bytes, same vocabulary): training goes on " \
           "with its new rows" in capsys.readouterr().out
    text.write_text(words.replace("a", "u"))
    prepare_chars(str(text), tokens)
    with pytest.raises(ConfigError, match=rf"^checkpoint.resume=auto: {re.escape(root)}/step-{K} was saved with other "
                                          rf"data: the vocabulary of {re.escape(str(tokens))} changed \(20 -> 20 "
                                          r"characters, adds 'u' and drops 'a'\), so its token ids now stand for other "
                                          r"characters; restore the data file it was saved with to resume, or use "
                                          r"another checkpoint.dir to start this run afresh$"):
        _train(dist, data, root, resume="auto", steps=K)
    monkeypatch.setattr(_base.CropSource, "identity", lambda self: None)   # saved before checkpoints recorded it
    _train(dist, data, str(tmp_path / "old"), steps=K)
    monkeypatch.undo()
    capsys.readouterr()
    _train(dist, data, str(tmp_path / "old"), resume="auto", steps=K)
    assert "resumed from" in (out := capsys.readouterr().out) and "data" not in out.split("data position")[1], out


class _Norm(torch.nn.Module):
    """Persistent buffers that training changes (BatchNorm's running statistics and step count), a
    frozen layer (outside every stage's layout: whole on every rank, zero3 too) and a non-persistent buffer."""

    def __init__(self, freeze: bool):
        super().__init__()
        self.a = torch.nn.Linear(6, 8)
        self.norm = torch.nn.BatchNorm1d(8)
        self.f = torch.nn.Linear(8, 8)
        self.f.requires_grad_(not freeze)
        self.b = torch.nn.Linear(8, 1)
        self.register_buffer("scratch", torch.zeros(3), persistent=False)

    def forward(self, x):
        return self.b(torch.tanh(self.f(self.norm(self.a(x)))))


def _norm_loss(m, batch):
    x, y = batch
    return (m(x.to(m.b.weight.dtype)).float() - y).square().mean()


def _norm_train(dist, over, root, *, resume="off", seed=0, steps=N, freeze=True, model=_Norm, after=None):
    """Train ``_Norm`` to ``steps`` saving every K (a fresh module of ``seed``, resumed first); return
    the losses and the module's persistent buffers, frozen and (gathered) trained parameters. ``after(module,
    state)``: the state to go on with, after each step, before its save."""
    from framework.engine.step import Batch
    cfg = framework.compose(["logger=none", "optimizer=adamw", f"train.steps={N}", f"checkpoint.dir={root}",
                             f"checkpoint.every={K}", "checkpoint.keep_last=0", "checkpoint.timeout_s=60",
                             f"checkpoint.resume={resume}", *over])
    torch.manual_seed(seed)
    module = model(freeze)
    with framework.initialize(module, _norm_loss, cfg, dist) as engine:
        ckpt = Checkpointer(cfg, engine)
        try:
            state, losses = ckpt.resume(engine.state), []
            while state.step < steps:
                g = torch.Generator().manual_seed(1000 * state.step + dist.rank)
                x = torch.randn(4, 6, generator=g) * 3 + 1
                state, m = engine.train_step(state, Batch(((x, x.sum(1, keepdim=True).sin()),)))
                losses.append(m["loss"])
                if after is not None:
                    state = after(module, state)
                ckpt.maybe_save(state)
        finally:
            ckpt.close()
        values = {**(engine.consolidated_state_dict() or {}),   # the parameters: rank 0's
                  **{n: t.clone() for n, t in module.named_buffers() if n != "scratch"}}
    return losses, values


@pytest.mark.parametrize("world,over", [(1, []), (1, ["+stage=zero3"]), (2, ["+stage=zero2"])])
def test_resume_restores_buffers_and_frozen_parameters(pools, tmp_path, world, over):
    """Buffers changed by training (BatchNorm's) and frozen parameters are in the checkpoint: N steps
    straight equal K + save + resume into a fresh module (other initial values) + N - K, bitwise."""
    freeze = "+stage=zero3" not in over
    a = _on(pools, world, _norm_train, over, str(tmp_path), freeze=freeze)
    b = _on(pools, world, _norm_train, over, str(tmp_path / "b"), resume=str(tmp_path / f"step-{K}"), seed=99,
            freeze=freeze)
    assert [r[0][K:] for r in a] == [r[0] for r in b]
    # Each rank's BatchNorm counts its own batches (buffers take rank 0's values at build only); the
    # checkpoint holds rank 0's buffers (as DeepSpeed's does): rank 0's run is the uninterrupted one, bitwise.
    (_, va), (_, vb) = a[0], b[0]
    assert va.keys() == vb.keys() and "norm.running_var" in va and "scratch" not in va
    for k in va:
        assert torch.equal(va[k], vb[k]), f"{k} differs after the resume"
    exported = get_fp32_state_dict_from_checkpoint(tmp_path / f"step-{N}")   # buffers included
    assert exported.keys() == va.keys() and all(torch.equal(exported[k], va[k]) for k in va)


def _poison(what):
    """``_norm_train``'s ``after``: at step N, a NaN running variance or frozen weight, an infinite loss scale."""
    def after(module, state):
        if state.step != N:
            return state
        with torch.no_grad():
            if what == "buffer":
                module.norm.running_var.fill_(float("nan"))
            elif what == "frozen":
                module.f.weight[0, 0] = float("nan")
        return replace(state, precision=replace(state.precision, cur_scale=float("inf"))) if what == "scale" else state
    return after


def test_non_finite_buffers_frozen_parameters_and_loss_scales_are_neither_saved_nor_resumed(tmp_path, capsys,
                                                                                         monkeypatch):
    """A NaN in BatchNorm's running statistics (a NaN forward under train.on_nonfinite=warn) or a frozen
    weight, or a non-finite loss scale stops the save as a non-finite master does (warn: not saved); a checkpoint
    holding such buffers is damaged: resume=auto falls back to the one before it."""
    from framework.core.errors import TrainingError
    from framework.persist.checkpoint import _save
    dist = _local()
    for what, name in (("buffer", "'buffer.norm.running_var'"), ("frozen", "'frozen.f.weight'"),
                       ("scale", r"'precision.cur_scale \(inf\)'")):
        root = tmp_path / what
        with pytest.raises(TrainingError, match=f"not saving step {N}: the state holds non-finite values "
                                                 fr"\(NaN or inf\) in rank 0: {name}; stopping"):
            _norm_train(dist, [], str(root), after=_poison(what))
        assert sorted(p.name for p in root.glob("step-*")) == [f"step-{K}"]
    _norm_train(dist, ["train.on_nonfinite=warn"], str(tmp_path / "warn"), after=_poison("buffer"))
    assert sorted(p.name for p in (tmp_path / "warn").glob("step-*")) == [f"step-{K}"]
    assert f"warning: checkpoint: not saving step {N}: the state holds non-finite values (NaN or inf) in rank 0: " \
           "'buffer.norm.running_var' (train.on_nonfinite=warn)" in capsys.readouterr().err
    # saved by a save that did not check them: refused at the load, the older checkpoint resumed
    monkeypatch.setattr(_save, "nonfinite_items", lambda items, release=None, nan_only=False: [])
    _norm_train(dist, [], str(tmp_path / "old"), after=_poison("buffer"))
    monkeypatch.undo()
    capsys.readouterr()
    shutil.copytree(tmp_path / "old" / f"step-{N}", tmp_path / "nan" / f"step-{N}")
    losses, _ = _norm_train(dist, [], str(tmp_path / "old"), resume="auto", steps=N)
    assert len(losses) == N - K
    assert "non-finite values (NaN or inf) in 'buffer.norm.running_var' (rank 0's share): not a state to train " \
           f"from; falling back to the previous checkpoint, {tmp_path / 'old' / f'step-{K}'}" in capsys.readouterr().out
    # resumed into one engine: refused before anything is read (another optimizer), it goes on; refused after a
    # read began (the one folder asked for), it refuses to step, evaluate or save until a resume that reads whole
    def resume(folder, *over):
        cfg = framework.compose(["logger=none", "optimizer=adamw", "checkpoint.every=0", *over,
                                 f"checkpoint.resume={folder}"])
        ckpt = Checkpointer(cfg, engine)
        try:
            return ckpt.resume(engine.state)
        finally:
            ckpt.close()

    with framework.initialize(_Norm(True), _norm_loss, framework.compose(["logger=none", "optimizer=adamw"]),
                              dist) as engine:
        with pytest.raises(ConfigError, match="was saved with optimizer=adamw, this run uses optimizer=sgd"):
            resume(tmp_path / "old" / f"step-{K}", "optimizer=sgd")
        engine.state_dict(engine.state)
        with pytest.raises(CheckpointError, match="not a state to train from; the state given to resume may be "
                                                  "partly overwritten"):
            resume(tmp_path / "nan" / f"step-{N}")
        with pytest.raises(framework.FrameworkError, match="^checkpoint resume did not finish, which left the "
                                                           "weights partly loaded"):
            engine.state_dict(engine.state)
        engine.state_dict(resume(tmp_path / "old" / f"step-{K}"))


class _Masked(_Norm):
    """An additive causal mask: -inf by design, in a float buffer and in a frozen parameter."""
    def __init__(self, freeze: bool):
        super().__init__(freeze)
        self.register_buffer("mask", torch.full((4, 4), float("-inf")).triu(1))
        self.fmask = torch.nn.Parameter(torch.full((4, 4), float("-inf")).triu(1), requires_grad=False)


def test_a_buffer_or_frozen_parameter_infinite_by_design_is_saved_and_resumed(tmp_path):
    """Only a NaN marks a buffer or frozen parameter as diverged: an infinity in one can be by design (an
    additive mask)."""
    dist = _local()
    losses, values = _norm_train(dist, [], str(tmp_path), model=_Masked)
    assert sorted(p.name for p in tmp_path.glob("step-*")) == [f"step-{K}", f"step-{N}"]
    again, resumed = _norm_train(dist, [], str(tmp_path / "b"), resume=str(tmp_path / f"step-{K}"), seed=99,
                                 model=_Masked)
    assert again == losses[K:] and torch.equal(resumed["mask"], values["mask"])
    assert torch.equal(resumed["fmask"], values["fmask"])


class _ExtraBuffer(_Norm):
    def __init__(self, freeze: bool):
        super().__init__(freeze)
        self.register_buffer("extra", torch.ones(2))


class _WiderMean(_Norm):
    def __init__(self, freeze: bool):
        super().__init__(freeze)
        self.norm.register_buffer("running_mean", torch.zeros(9))


def test_buffers_of_another_shape_are_refused_and_older_checkpoints_keep_the_models(tmp_path, capsys, monkeypatch):
    from framework.persist.checkpoint import _save
    dist = _local()
    _norm_train(dist, [], str(tmp_path), steps=K)
    step = str(tmp_path / f"step-{K}")
    with pytest.raises(ConfigError, match=r"does not fit this model: missing 'buffer.extra'; set "
                                          r"checkpoint.resume=off to start this run afresh$"):
        _norm_train(dist, [], str(tmp_path / "b"), resume=step, model=_ExtraBuffer)
    with pytest.raises(ConfigError, match=r"'buffer.norm.running_mean' has shape \(8,\) in the checkpoint but "
                                          r"\(9,\) in this model; set checkpoint.resume=off"):
        _norm_train(dist, [], str(tmp_path / "b"), resume=step, model=_WiderMean)
    # parameters frozen when saved and trainable now (and the other way round): named as such, with the ways out
    with pytest.raises(ConfigError, match=r"parameters 'f.bias', 'f.weight' were frozen \(requires_grad=False\) "
                                          r"when saved but are trainable in this run; set their requires_grad as"):
        _norm_train(dist, [], str(tmp_path / "b"), resume=step, freeze=False)
    _norm_train(dist, [], str(tmp_path / "trainable"), steps=K, freeze=False)
    with pytest.raises(ConfigError, match=r"'f.bias', 'f.weight' were trainable when saved but are frozen in this "
                                          r"run; .* \(python -m framework.export .* framework.load_weights\(engine, DIR\); "
                                          r"set checkpoint.resume=off to start this run afresh\)$"):
        _norm_train(dist, [], str(tmp_path / "b"), resume=str(tmp_path / "trainable" / f"step-{K}"))
    # a checkpoint written before buffers and frozen parameters were saved: they keep the model's values
    monkeypatch.setattr(_save, "whole_tensors", lambda module: {})
    _norm_train(dist, [], str(tmp_path / "old"), steps=K)
    monkeypatch.undo()
    capsys.readouterr()
    _, fresh = _norm_train(dist, [], str(tmp_path / "c"), resume=str(tmp_path / "old" / f"step-{K}"), seed=99,
                           steps=K)
    torch.manual_seed(99)
    assert torch.equal(fresh["f.weight"], _Norm(True).f.weight) and fresh["norm.num_batches_tracked"] == 0
    assert "holds no buffers or frozen parameters (saved before checkpoints had them): 'buffer.norm.num_batches_" \
           in capsys.readouterr().out


def test_a_resume_at_another_world_size_says_the_global_batch():
    """The world size is no config difference a resume lists, but it changes the global batch: said."""
    from framework.persist.checkpoint._load import batch_change
    saved = tiny_config("train.micro_batch=4", "train.grad_accum=2").to_dict()
    assert batch_change(saved, 2, saved, 1) == ("global batch 16 -> 8 rows (micro_batch x grad_accum x world); set "
                                                "train.micro_batch or train.grad_accum to keep it")
    assert batch_change(saved, 2, tiny_config("train.micro_batch=8", "train.grad_accum=2").to_dict(), 1) is None
    assert batch_change(saved, 2, saved, 2) is None


def test_a_resume_lists_no_difference_in_where_files_lie():
    """offload.nvme_path defaults to the run folder, so it is another path at every relaunch into a
    new folder; like checkpoint.*, where files lie changes no number and is not listed as a difference."""
    from framework.persist.checkpoint._load import changed

    saved = tiny_config("+stage=zero2", "offload=nvme", "offload.nvme_path=/runs/a/nvme", "checkpoint.dir=/ck/a").to_dict()
    mine = tiny_config("+stage=zero2", "offload=nvme", "offload.nvme_path=/runs/b/nvme", "checkpoint.dir=/ck/b").to_dict()
    assert changed(saved, mine) == []
    assert changed(saved, {**mine, "seed": mine["seed"] + 1}) == ["seed"]
    # A group chosen anew is one entry, not its keys (which would crowd out the others)
    assert changed(saved, tiny_config("+stage=zero2", "offload=cpu", "optimizer.lr=5e-3").to_dict()) == \
        ["offload nvme->cpu", "optimizer.lr"]


def _hf_train(dist, path, root, *over, steps=K):
    """Train a tiny HF GPT-2 (its config.json at ``path``) to ``steps``, resuming from ``root`` first (auto)."""
    pytest.importorskip("transformers")   # (the optional hf extra)
    from framework.engine.build import component
    from tests._hf import build, hf_cfg
    cfg = hf_cfg(path, f"train.steps={steps}", f"checkpoint.dir={root}", f"checkpoint.every={K}",
                 "checkpoint.timeout_s=60", *over)
    model, data = build(cfg)
    with framework.initialize(model, component(cfg, "model").loss, cfg, dist) as engine:
        ckpt = Checkpointer(cfg, engine)
        try:
            state = ckpt.resume(engine.state)
            while state.step < steps:
                batch = data.train_batch(state.data, micro_batch=cfg.train.micro_batch, grad_accum=1, rank=0, world=1)
                state, _ = engine.train_step(state, batch)
                ckpt.maybe_save(state)
        finally:
            ckpt.close()
    return cfg


def test_an_hf_model_is_compared_by_its_config_not_the_files_path(tmp_path, capsys):
    """model=hf: the checkpoint records the model's resolved config. Another architecture whose shapes fit
    (more heads) behind the same config path is refused; the same model read from a copy of its config, with
    another model.context, resumes (both listed as differences)."""
    from framework.persist.checkpoint import preflight
    from tests._hf import write_config
    dist, root = _local(), tmp_path / "ck"
    path = write_config("gpt2", tmp_path / "m", n_head=2)
    _hf_train(dist, path, root)
    write_config("gpt2", tmp_path / "m", n_head=4)   # the same file, another model
    with pytest.raises(ConfigError, match=r"step-2 was saved by another model \(its config: n_head 2 vs 4; saved vs "
                                          r"this run\); use another checkpoint.dir"):
        _hf_train(dist, path, root, steps=N)
    copy = write_config("gpt2", tmp_path / "copy", n_head=2)
    again = ("model.context=8", f"train.steps={N}")
    preflight(framework.compose(
        ["model=hf", f"model.config={copy}", *again, f"checkpoint.dir={root}", "checkpoint.every=2",
         "data.vocab_size=64", "logger=none"]), None)   # before the ranks: not refused for the path either
    capsys.readouterr()
    _hf_train(dist, copy, root, *again, steps=N)
    out = capsys.readouterr().out
    assert f"resumed from {root / 'step-2'} (step 2" in out, out
    assert re.search(r"differs in model\.config \S+->\S+, model\.context \d+->8, train", out), out
    assert (root / f"step-{N}").is_dir()


def test_an_export_of_an_hf_checkpoint_loads_with_from_pretrained(tmp_path, capsys):
    """model=hf: the export writes config.json from the config the checkpoint records, as the model's own
    save_pretrained writes it (its class in architectures, for pipeline and AutoModel), so from_pretrained loads the
    folder as it is, with the logits of the model the checkpoint holds; the model's own config.json put there first
    is replaced by it (the dtype the export wrote), another model's is refused in one line naming what differs."""
    from_pretrained = pytest.importorskip("transformers").AutoModelForCausalLM.from_pretrained
    from framework.persist.export import export
    from tests._hf import build, write_config
    path = write_config("gpt2", tmp_path / "m")
    # logits compared exactly: both models' attention the same kernel (eager), whatever transformers' default
    cfg = _hf_train(_local(), path, tmp_path / "ck", "model.attn_implementation=eager")
    step = tmp_path / "ck" / f"step-{K}"
    model, _ = build(cfg, meta=False)   # the model the checkpoint holds, from the config file trained with
    model.load_state_dict(get_fp32_state_dict_from_checkpoint(step))
    model.save_pretrained(tmp_path / "own")   # (transformers' own: what the export's config.json should be)
    own = json.loads((tmp_path / "own" / "config.json").read_text())
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    first = tmp_path / "first"   # the model's config.json put there first (its dtype bfloat16): not refused
    first.mkdir()
    (first / "config.json").write_text(json.dumps({**json.loads(path.read_text()), "torch_dtype": "bfloat16"}))
    for out in (tmp_path / "out", first):
        assert out / "config.json" in export(step, out)
        loaded = from_pretrained(out, attn_implementation="eager")   # (as written: fp32, not rounded to the bfloat16)
        with torch.no_grad():
            assert loaded.dtype == torch.float32 and torch.equal(loaded(ids).logits, model(ids).logits)
        assert loaded.config.architectures == [type(model).__name__] == own["architectures"]
        assert json.loads((out / "config.json").read_text()) == own
    export(step, first, overwrite=True)   # an earlier export there (its class named) is of the same model
    other = write_config("gpt2", tmp_path / "other", n_layer=3).parent
    with pytest.raises(ConfigError, match=re.escape(f"export: {other / 'config.json'} describes another model than "
                                                    "the checkpoint's (n_layer 3 vs 2: its vs the checkpoint's); "
                                                    "remove it")):
        export(step, other)
    # Another head's config.json of the same dims is another model's too (its class is what differs); neither it
    # nor its weights are replaced, even with --overwrite
    for head in ("GPT2ForSequenceClassification", "GPT2ForTokenClassification"):
        cls = write_config("gpt2", tmp_path / head, architectures=[head]).parent
        for overwrite in (False, True):
            with pytest.raises(ConfigError, match=re.escape(f"export: {cls / 'config.json'} describes another model "
                                                            f"than the checkpoint's (architectures ['{head}'] vs "
                                                            "None: its vs the checkpoint's)")):
                export(step, cls, overwrite=overwrite)
        assert [p.name for p in cls.iterdir()] == ["config.json"]
    # Saved before checkpoints recorded the config, or a model type this transformers does not know: the weights,
    # and a line saying how to add the config.json.
    body = json.loads((step / "train_state.json").read_text())
    for i, config in enumerate((None, {**body["model_config"], "model_type": "no-such-model"})):
        data = json.dumps({**body, "model_config": config}).encode()
        (step / "train_state.json").write_bytes(data)
        manifest = json.loads((step / "manifest.json").read_text())
        manifest["files"]["train_state.json"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        manifest.pop("manifest_sha256", None)   # (read as an older version's manifest)
        (step / "manifest.json").write_text(json.dumps(manifest))
        capsys.readouterr()
        assert [p.name for p in export(step, tmp_path / f"hint{i}")] == ["model.safetensors"]
        assert (f"for from_pretrained, copy the model's config.json into {tmp_path / f'hint{i}'}\n"
                in capsys.readouterr().err)


def test_a_run_resumes_after_an_export_into_its_models_own_folder(tmp_path, capsys):
    """The export's config.json names the model's class (architectures), the one trained from may not: a resume
    with the same model.config is of the same model (AutoModelForCausalLM builds its class whatever it says)."""
    from framework.persist.export import export
    from tests._hf import write_config
    path = write_config("gpt2", tmp_path / "m")   # without architectures, as a hand-written one
    _hf_train(_local(), path, tmp_path / "ck")
    export(tmp_path / "ck" / f"step-{K}", path.parent)   # config.json replaced by the export's
    assert json.loads(path.read_text())["architectures"] == ["GPT2LMHeadModel"]
    capsys.readouterr()
    _hf_train(_local(), path, tmp_path / "ck", steps=N)
    assert f"resumed from {tmp_path / 'ck' / f'step-{K}'} (step {K}" in capsys.readouterr().out
    assert (tmp_path / "ck" / f"step-{N}").is_dir()


def test_an_hf_export_writes_its_config_json_through_no_link(tmp_path, capsys):
    """The config.json's temporary is created new, never through a link a colleague left (nothing outside the
    folder written); a linked config.json is refused before any weight is written; one of the same model replaced
    is said in one note line."""
    from framework.core.errors import FrameworkError, UnsafePathError
    from framework.persist.export import export
    from tests._hf import write_config
    path = write_config("gpt2", tmp_path / "m")
    _hf_train(_local(), path, tmp_path / "ck")
    step = tmp_path / "ck" / f"step-{K}"
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    out = tmp_path / "out"
    out.mkdir()
    (out / ".config.json.part").symlink_to(victim)
    capsys.readouterr()
    export(step, out)
    assert victim.read_text() == "precious" and not (out / "config.json").is_symlink()
    assert "replaced" not in capsys.readouterr().err
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "config.json").symlink_to(path)
    with pytest.raises(UnsafePathError, match=re.escape(f"{linked / 'config.json'} is a symbolic link")):
        export(step, linked)
    assert [p.name for p in linked.iterdir()] == ["config.json"]   # no weights published
    capsys.readouterr()
    export(step, out, overwrite=True)   # the same checkpoint again: the same bytes, nothing said
    assert "replaced" not in capsys.readouterr().err
    (out / "config.json").write_text(json.dumps({**json.loads(path.read_text()), "torch_dtype": "bfloat16"}))
    export(step, out, overwrite=True)
    assert capsys.readouterr().err.count(f"note: export: {out / 'config.json'} (of the same model) replaced") == 1
    # --to an existing file: that said (not a read of a config.json under it)
    afile = tmp_path / "afile"
    afile.write_text("hi")
    with pytest.raises(FrameworkError, match=re.escape(f"export: cannot write {afile} (exists and is not a folder)")):
        export(step, afile)


@pytest.mark.parametrize("saved_on, run_on", [("cpu", "cuda"), ("cuda", "cpu")])
def test_a_checkpoint_saved_on_another_kind_of_device_resumes_its_cpu_generator(tmp_path, capsys, monkeypatch,
                                                                              saved_on, run_on):
    """Same world size, other device: the generator states given to train_step have the shape this run's
    device needs (a CPU run saves no CUDA state; a CUDA run's is of no use on the CPU), the CPU's as saved,
    and one line says so. (No CUDA here: the CUDA generator state is a stand-in tensor.)"""
    from types import SimpleNamespace

    from framework.persist import rng as _rng
    from framework.persist.checkpoint import _load

    fake_cuda = torch.arange(16, dtype=torch.uint8)   # what torch.cuda.get_rng_state would give
    real = _rng.derive

    def derive(seed, step, rank, device):   # (the real one creates a CUDA generator for a CUDA device)
        states, host = real(seed, step, rank, torch.device("cpu"))
        return (states + (fake_cuda,) if device.type == "cuda" else states), host

    monkeypatch.setattr(_rng, "derive", derive)
    cpu = torch.Generator().manual_seed(3).get_state()
    (tmp_path / "rng-0.json").write_text(json.dumps(_rng.capture((cpu, fake_cuda + 1) if saved_on == "cuda" else (cpu,))))
    c = SimpleNamespace(dist=SimpleNamespace(rank=0, world=1, device=torch.device(run_on, 0)))
    states, host = _load._rng_of(c, tmp_path, {"world": 1, "step": 2}, seed=5)
    assert torch.equal(states[0], cpu) and "python" in host
    assert len(states) == (2 if run_on == "cuda" else 1) and (run_on == "cpu" or torch.equal(states[1], fake_cuda))
    out = capsys.readouterr().out
    assert out.count("was saved on another kind of device") == 1, out
    assert ("derived from (seed, step, rank)" if run_on == "cuda" else "dropped") in out, out


def test_a_step_folder_rotation_cannot_delete_is_said_at_every_save_that_fails_again(tmp_path, capsys, monkeypatch):
    """keep_last=1 with step-2's deletion refused (no permission): step-2.del stays; the save that left it says so,
    and each later save whose retry fails says it again, once, naming the folder and why."""
    import shutil

    rmtree = shutil.rmtree

    def refused(path, ignore_errors=False, onerror=None, **kw):
        if Path(path).name != f"step-{K}.del":
            return rmtree(path, ignore_errors=ignore_errors, onerror=onerror, **kw)
        e = PermissionError(13, "Permission denied", str(Path(path) / "__0_0.distcp"))
        if onerror is not None:
            onerror(os.unlink, e.filename, (type(e), e, None))
        elif not ignore_errors:
            raise e
    monkeypatch.setattr(shutil, "rmtree", refused)
    _train(_local(), ["checkpoint.keep_last=1"], str(tmp_path), steps=3 * K)
    err = capsys.readouterr().err.splitlines()
    stuck = tmp_path / f"step-{K}.del"
    assert stuck.is_dir() and sorted(p.name for p in tmp_path.glob("step-*")) == [stuck.name, f"step-{3 * K}"]
    first = [x for x in err if f"step-{2 * K} committed" in x]
    assert len(first) == 1 and f"could not delete all of {stuck}; the next save tries again" in first[0], err
    again = [x for x in err if f"step-{3 * K} committed" in x]
    assert len(again) == 1 and again[0].endswith(
        f"still could not delete {stuck} (Permission denied: {stuck / '__0_0.distcp'}): remove it by hand (the "
        "next save tries again)"), err
