"""Flat ranges as rectangular DCP chunks (framework.persist.checkpoint._dcp.boxes), ownership of
replicated ranges (framework.persist.layout), the config keys, and the folder protocol's pure parts."""
import importlib.util
import itertools
import json
import math
import random

import pytest
import torch

from framework.persist.checkpoint._dcp import boxes
from framework.persist.checkpoint._save import optim_keys
from framework.persist.layout import Holding, Param, StateLayout, nonfinite_items
from framework.core.errors import ConfigError, FrameworkError
from tests._helpers import tiny_config


@pytest.mark.parametrize("shape", [(), (7,), (5, 7), (3, 4, 5), (2, 3, 1, 4)])
def test_boxes_tile_every_flat_range_in_order(shape):
    full = torch.arange(math.prod(shape)).reshape(shape)
    n = full.numel()
    ranges = [(lo, hi) for lo, hi in itertools.combinations(range(n + 1), 2)]
    random.Random(0).shuffle(ranges)
    for lo, hi in ranges[:300]:
        got = boxes(shape, lo, hi)
        assert len(got) <= max(1, 2 * len(shape) - 1)
        parts = []
        for offsets, sizes in got:
            idx = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
            box = full[idx]
            # contiguous in flat order: its elements are consecutive integers
            first = int(box.reshape(-1)[0])
            assert torch.equal(box.reshape(-1), torch.arange(first, first + box.numel()))
            parts.append(box.reshape(-1))
        assert torch.equal(torch.cat(parts) if parts else torch.empty(0, dtype=torch.long), full.reshape(-1)[lo:hi])


def test_share_writes_each_element_once_spreading_replicated_parameters():
    # "a": rank 0 holds [0, 6), rank 1 [4, 10); "b": both hold all of it (a replicated stage)
    a = Param("a", (2, 5), None, (Holding(0, 0, 6, 0, 0), Holding(1, 4, 10, 0, 0)))
    b = Param("b", (3,), None, (Holding(0, 0, 3, 1, 0), Holding(1, 0, 3, 1, 6)))
    shares = [[(p.name, h.rank, lo, hi) for p, h, lo, hi in StateLayout([a, b], rank=r, world=2).share()]
              for r in range(2)]
    assert shares == [[("a", 0, 0, 6)], [("a", 1, 6, 10), ("b", 1, 0, 3)]]   # "b" (index 1) from rank 1 on
    gap = StateLayout([Param("c", (8,), None, (Holding(0, 0, 3, 0, 0), Holding(1, 5, 8, 0, 0)))], world=2)
    with pytest.raises(FrameworkError, match=r"'c': elements \[3, 5\) are in no saved fragment of any rank"):
        gap.share()


def test_optimizer_keys_use_torch_names_and_stay_unique():
    assert optim_keys(["0.mu", "0.nu"], ["0.count"]) == {"0.mu": "exp_avg", "0.nu": "exp_avg_sq", "0.count": "step"}
    assert optim_keys(["0.mu", "2.mu"], []) == {"0.mu": "0.mu", "2.mu": "2.mu"}


def test_the_finiteness_check_takes_float8_and_flags_only_nan_where_asked(monkeypatch):
    """float8 tensors (no aminmax kernel) are checked a chunk at a time; ``nan_only`` (buffers and frozen
    parameters) passes an infinity: an additive mask."""
    from framework.persist import tensorfiles
    monkeypatch.setattr(tensorfiles, "_CHUNK", 3)   # several chunks, the last one short
    f8 = torch.zeros(10, dtype=torch.float8_e4m3fn)
    nan8 = f8.clone()
    nan8[7] = float("nan")
    mask = torch.full((4, 4), float("-inf")).triu(1)
    items = [("buffer.f8", f8), ("buffer.nan8", nan8), ("frozen.nan8", nan8), ("buffer.mask", mask),
             ("frozen.mask", mask), ("buffer.nan", torch.tensor([1.0, float("nan")]))]
    assert nonfinite_items(items, nan_only=True) == ["buffer.nan", "buffer.nan8", "frozen.nan8"]
    assert nonfinite_items(items) == ["buffer.mask", "buffer.nan", "buffer.nan8", "frozen.mask", "frozen.nan8"]


def test_checkpoint_config_keys():
    cfg = tiny_config("checkpoint.every=5", "checkpoint.async=true", "checkpoint.resume=off")
    assert (cfg.checkpoint.every, cfg.checkpoint.async_, cfg.checkpoint.resume) == (5, True, "off")
    assert cfg.to_dict()["checkpoint"]["async"] is True
    # every=0 saves nothing in the CLI's loop (refused there: test_user_errors), but one's own loop may call
    # ckpt.save(state), which async writes in the background
    assert tiny_config("checkpoint.async=true").checkpoint.async_ is True
    with pytest.raises(ConfigError, match="checkpoint.async=true has no effect with offload=nvme"):
        tiny_config("checkpoint.every=5", "checkpoint.async=true", "+stage=zero2", "offload=nvme")
    # the key as YAML spells it; OmegaConf types the config where it is installed, plainconf where not (GPU image)
    says = ("config: checkpoint.async: Value 'maybe' is not a valid bool" if importlib.util.find_spec("omegaconf")
            else "config: checkpoint.async takes true or false \\(also yes/no, on/off, 1/0\\), got 'maybe'$")
    with pytest.raises(ConfigError, match=says):
        tiny_config("checkpoint.every=5", "checkpoint.async=maybe")
    for key, message in (("dist.nproc=0", "dist.nproc must be >= 1, got 0"),
                         ("train.grad_clip=-1", "train.grad_clip must be >= 0, got -1"),
                         ("checkpoint.timeout_s=0", "checkpoint.timeout_s must be > 0, got 0"),
                         ("checkpoint.timeout_s=1e14",   # (timedelta would overflow, on every rank)
                          r"checkpoint.timeout_s must be at most 1e\+09 s \(about 31 years\), got 100000000000000$"),
                         ("dist.timeout_s=1e10", r"dist.timeout_s must be at most 1e\+09 s"),
                         ("dist.timeout_s=1.0000001e9", r"at most 1e\+09 s \(about 31 years\), got 1000000100$"),
                         ("dist.timeout_s=1000000000.5", r"got 1000000000.5$"),   # (not rounded to the bound)
                         ("ds_config_strict=true", "ds_config_strict=true does nothing without a DeepSpeed file")):
        with pytest.raises(ConfigError, match=message):   # the one key that is wrong, not a list of rules
            tiny_config(key)
    with pytest.raises(ConfigError, match=r"checkpoint.every must be >= 0, got -1"):
        tiny_config("checkpoint.every=-1")
    with pytest.raises(ConfigError, match="unknown key 'checkpoint.evry'"):
        tiny_config("checkpoint.evry=3")


def test_a_resume_value_that_is_no_checkpoint_suggests_the_closest_choice(tmp_path):
    from framework.persist.checkpoint import candidates
    with pytest.raises(ConfigError, match=r"checkpoint.resume=lastest: no checkpoint there \(did you mean 'latest'\?\)"):
        candidates("lastest", tmp_path)
    with pytest.raises(ConfigError, match=r"no checkpoint there \(expected a step-<N> folder.*; use "
                                          r"checkpoint.resume=auto or off$"):
        candidates(str(tmp_path / "nowhere"), tmp_path)   # a path: nothing to suggest
    # a step that is not there (mistyped, or rotated away), or a run folder: the checkpoints it meant are named
    from framework.persist import stepfolders
    root = tmp_path / "run" / "checkpoints"
    for n in (4, 8):
        (root / f"step-{n}").mkdir(parents=True)
        (root / f"step-{n}" / stepfolders.MANIFEST).write_text(json.dumps({"format": stepfolders.FORMAT, "files": {},
                                                                           "seq": n}))
    with pytest.raises(ConfigError, match=rf"; the checkpoints in {root} are step-8, step-4: set checkpoint.resume "
                                          rf"to one of them, or to {root} for the newest$"):
        candidates(str(root / "step-9"), tmp_path)
    with pytest.raises(ConfigError, match=rf"; it is a run folder: set checkpoint.resume={root} for its newest "
                                          r"checkpoint \(step-8\), or to one of its step folders$"):
        candidates(str(root.parent), tmp_path)


def test_resume_latest_in_a_library_loop_is_the_newest_checkpoint(tmp_path, monkeypatch):
    """``checkpoint.resume=latest`` where no CLI resolved it first (a loop of one's own around Checkpointer):
    the newest committed checkpoint, in checkpoint.dir or in a run folder under outputs/, not a path."""
    import json
    import os

    from framework.persist import stepfolders
    from framework.persist.checkpoint import candidates

    monkeypatch.chdir(tmp_path)
    assert candidates("latest", tmp_path / "ckpt") == ([], [
        f"resume=latest: no checkpoint in {tmp_path / 'ckpt'} or in the run folders under outputs/, multirun/; "
        "starting from step 0"])
    made = []
    for folder in (tmp_path / "ckpt" / "step-4", tmp_path / "outputs" / "a" / "checkpoints" / "step-2"):
        folder.mkdir(parents=True)
        (folder / stepfolders.MANIFEST).write_text(json.dumps({"format": stepfolders.FORMAT, "files": {}}))
        os.utime(folder / stepfolders.MANIFEST, (1e9 + len(made), 1e9 + len(made)))   # the run folder's is newer
        made.append(folder)
    assert candidates("latest", tmp_path / "ckpt") == ([made[1]], [])
    # a newer save of step 2 killed (or under way) inside its commit, step-2 moved aside: another run's folder is
    # read where it lies, renaming nothing; the run's own is put back first
    run = made[1].parent
    os.replace(made[1], run / "step-2.old")
    (run / "step-2.tmp").mkdir()
    os.utime(run / "step-2.old" / stepfolders.MANIFEST, (2e9, 2e9))
    assert candidates("latest", tmp_path / "ckpt") == ([run / "step-2.old"], [])
    assert sorted(os.listdir(run)) == ["step-2.old", "step-2.tmp"]
    assert candidates("latest", tmp_path / "ckpt", owned=run) == ([made[1]], []) and made[1].is_dir()


def test_a_sweeps_job_never_takes_on_another_jobs_checkpoint(tmp_path, monkeypatch, capsys):
    """A multirun job (``naming``: the keys of its overrides that say which job it is) never resumes the state of
    a job saved with other values of them, and reports it as its own: auto refuses another job's checkpoint in the
    job's folder (a sweep re-run with its values in another order), latest passes over one elsewhere (another
    sweep's); a single run resumes it (its load notes the difference), as a path given does."""
    import json
    import os

    from framework.persist import stepfolders
    from framework.persist.checkpoint import candidates, preflight
    from framework.persist.checkpoint._load import job_values, other_job

    monkeypatch.chdir(tmp_path)
    sweep = tmp_path / "multirun" / "k"
    old = []
    for i, lr in enumerate(("1e-3", "3e-4")):   # (job 1's the newer)
        step = sweep / str(i) / "checkpoints" / "step-4"
        step.mkdir(parents=True)
        state = json.dumps({"config": tiny_config(f"optimizer.lr={lr}", "checkpoint.every=2").to_dict()})
        (step / stepfolders.TRAIN_STATE).write_text(state)
        stepfolders.write_manifest(step, {stepfolders.TRAIN_STATE: stepfolders.file_entry(step, stepfolders.TRAIN_STATE)})
        os.utime(step / stepfolders.MANIFEST, (1e9 + i, 1e9 + i))
        old.append(step)
    lr = frozenset({"optimizer.lr"})

    def job(value: str, resume: str = "auto"):
        return tiny_config(f"optimizer.lr={value}", "checkpoint.every=2", f"checkpoint.resume={resume}")

    with pytest.raises(ConfigError, match=rf"^checkpoint.resume=auto: {sweep / '0' / 'checkpoints'} holds the "
                                          r"checkpoint of another job \(optimizer.lr=0.001; this job: optimizer.lr="
                                          r"0.0003\): a sweep's values in another order, or another sweep, saved "
                                          r"there; give this sweep another hydra.sweep.dir \(or checkpoint.dir\), or "
                                          r"delete that folder to start this job afresh$"):
        preflight(job("3e-4"), sweep / "0", naming=lr)
    with pytest.raises(ConfigError, match=r"^checkpoint.resume=latest: .* holds the checkpoint of another job"):
        preflight(job("3e-4", "latest"), sweep / "0", sweep_dir=sweep, naming=lr)
    assert preflight(job("1e-3"), sweep / "0", naming=lr).checkpoint.resume == "auto"   # its own
    # ... also relaunched with another swap folder, backend or recompute (how it runs, not which job it is)
    how = ("dist.backend=gloo", "model.activation_checkpointing=true")
    assert preflight(tiny_config("optimizer.lr=1e-3", "checkpoint.every=2", *how), sweep / "0",
                     naming=lr | {h.split("=")[0] for h in how}).checkpoint.resume == "auto"
    assert job_values(job("1e-3").to_dict(), {"offload.nvme_path", "dist.timeout_s"}) == {}
    assert preflight(job("3e-4"), sweep / "0").checkpoint.resume == "auto"   # a single run: resumed, as before
    assert preflight(job("3e-4", str(old[0])), sweep / "0", naming=lr).checkpoint.resume == str(old[0])
    # latest in another sweep: the newest checkpoint of this job's values, others passed over (said)
    other = tmp_path / "multirun" / "B"
    capsys.readouterr()
    assert preflight(job("1e-3", "latest"), other / "0", sweep_dir=other, naming=lr).checkpoint.resume \
        == str(old[0].parent)
    assert capsys.readouterr().out == (f"checkpoint: resume=latest: passed over 1 checkpoint saved with other values "
                                       f"of this job's overrides (newest {old[1]}: optimizer.lr=0.0003)\n")
    assert preflight(job("2e-4", "latest"), other / "1", sweep_dir=other, naming=lr).checkpoint.resume == "off"
    assert "passed over 2 checkpoints" in capsys.readouterr().out
    assert candidates("latest", tmp_path / "ck") == ([old[1]], [])   # (a library loop: no job to tell apart)
    # a group by its choice; checkpoint.resume (where latest led) is no job's name
    saved, mine = job("1e-3").to_dict(), job("1e-3", "latest").to_dict()
    mine["optimizer"]["name"] = "lion"
    assert other_job(saved, job_values(mine, {"optimizer", "optimizer.lr", "checkpoint.resume"})) == [
        ("optimizer=adamw", "optimizer=lion")]


def test_an_hf_checkpoint_without_its_recorded_config_is_compared_by_path():
    """Checkpoints saved before the HF model config was recorded: the config path is all there is to compare."""
    from functools import partial
    from framework.persist.checkpoint._load import same_run
    same_run = partial(same_run, way="set checkpoint.resume=off to start this run afresh")
    saved = {"model": {"name": "hf", "config": "/a/config.json", "context": 16}, "optimizer": {"name": "adamw"}}
    mine = {"model": {"name": "hf", "config": "/b/config.json", "context": 8}, "optimizer": {"name": "adamw"}}
    with pytest.raises(ConfigError, match=r"another model \(model.config '/a/config.json' vs '/b/config.json'; saved"):
        same_run("f", saved, mine, "auto")
    same_run("f", saved, mine, "auto", {"n_head": 2}, {"n_head": 2, "new_key": 1})   # recorded: the content counts
    # a dtype an older build recorded (the file's; models are built in fp32 now) is not part of what the model is
    same_run("f", saved, mine, "auto", {"n_head": 2, "dtype": "bfloat16", "text_config": {"dtype": "bfloat16", "a": 1}},
             {"n_head": 2, "text_config": {"a": 1}})
    with pytest.raises(ConfigError, match=r"another model \(its config: n_head 2 vs 4; saved vs this run\)"):
        same_run("f", saved, mine, "auto", {"n_head": 2}, {"n_head": 4})


def test_the_data_a_resume_says_changed_is_judged_by_checksum_else_by_size():
    """A checksum on both sides decides (text's is of its ids); without one, only a size that differs is said:
    a copied or touched token file changes no content."""
    from framework.persist.checkpoint._load import data_change
    tokens = {"source": "tokens", "path": "t.bin", "vocab": None, "bytes": 800}
    assert data_change(tokens, {**tokens}) is None
    assert data_change(tokens, {**tokens, "bytes": 880}) == ("800 -> 880 bytes", False)
    text = {"source": "text", "path": "t.txt", "vocab": "ab", "bytes": 100, "sha256": "1"}
    assert data_change(text, {**text, "bytes": 104}) is None   # (CRLF newlines: the same ids)
    assert data_change(text, {**text, "sha256": "2"}) == ("the same size", False)
    assert data_change(text, {**text, "vocab": "abc"}) == ("2 -> 3 characters, adds 'c'", True)


def test_the_resume_lists_each_changed_key_with_its_old_and_new_value():
    """``config differs in optimizer.lr 0.001->0.0005`` (a relaunch with resume=auto may not recall the old value);
    a group chosen anew by its choices, a long value cut to stay readable on the one line, the model check's keys
    bare."""
    from framework.persist.checkpoint._load import changed
    saved = {"optimizer": {"name": "adamw", "lr": 1e-3, "fused": False}, "data": {"name": "text", "path": "/a" * 40},
             "offload": {"name": "none"}, "seed": 0}
    mine = {"optimizer": {"name": "adamw", "lr": 5e-4, "fused": True}, "data": {"name": "text", "path": "/b"},
            "offload": {"name": "cpu"}, "seed": None}
    assert changed(saved, mine, values=True) == [
        f"data.path ...a{'/a' * 18}->/b", "offload none->cpu", "optimizer.fused false->true",
        "optimizer.lr 0.001->0.0005", "seed 0->null"]
    assert changed(saved, mine) == ["data.path", "offload none->cpu", "optimizer.fused", "optimizer.lr", "seed"]
    # cut at its start: long paths that differ in the file's name read apart
    old, new = (f"/work/shared/data/experiments/2026-12/corpus_v{i}.txt" for i in (1, 2))
    assert changed({"data": {"name": "text", "path": old}}, {"data": {"name": "text", "path": new}}, values=True) == [
        "data.path ...ata/experiments/2026-12/corpus_v1.txt->...ata/experiments/2026-12/corpus_v2.txt"]
