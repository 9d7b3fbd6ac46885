"""The command line as a user runs it: python -m framework.train ..."""
import contextlib
import importlib.util
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests._helpers import wandb_summaries

SHORT = ["train.steps=6", "train.log_every=2", "train.eval_every=3", "train.eval_batches=2",
         "model.n_layer=1", "model.d_model=32", "model.n_head=2", "model.context=16"]


ENV = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}
slow = pytest.mark.skipif(os.environ.get("FRAMEWORK_SLOW_TESTS") != "1", reason="set FRAMEWORK_SLOW_TESTS=1")


def cli(forkrun, tmp_path: Path, *args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    """``python -m framework.train ARGS`` in ``tmp_path`` (forked from a process that imported the
    framework once: tests/cli/_forkrun.py)."""
    return forkrun.run("framework.train", [*args, f"hydra.run.dir={tmp_path / 'run'}",
                                           f"hydra.sweep.dir={tmp_path / 'sweep'}"],
                       cwd=tmp_path, env=ENV, timeout=timeout)


def error_lines(p: subprocess.CompletedProcess) -> list[str]:
    # (a start-up note, such as SHORT's warm-up longer than the run, is not an error)
    return [line for line in p.stderr.splitlines() if line.strip() and not line.startswith("note: ")]


def test_default_job_shortened(forkrun, tmp_path):
    # (train.on_nonfinite: every schema key can be set on the command line, through Hydra's struct config)
    p = cli(forkrun, tmp_path, *SHORT, "train.on_nonfinite=warn")
    assert p.returncode == 0, p.stderr
    run = tmp_path / "run"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "loss" in r]
    assert [r["step"] for r in train] == [2, 4, 6]
    assert all({"step", "loss", "lr", "tokens_per_s"} <= r.keys() for r in train)
    assert [r["step"] for r in records if "val_loss" in r] == [3, 6]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["config"]["train"]["on_nonfinite"] == "warn"
    # the model as built: the data's vocabulary (the synthetic data's 64 ids), not the YAML's 65
    assert summary["config"]["model"]["vocab_size"] == summary["data"]["vocab_size"] == 64
    # the parameter count of a plain module (zero3's, whose parameters are empty between uses: below)
    assert summary["params"] == 64 * 32 + 16 * 32 + (12 * 32 * 32 + 2 * 32) + 32, summary["params"]
    assert summary["peak_memory_per_rank"][0]["peak_rss_bytes"] > 50 * 2**20
    mem = {k: v["device"] + v["host"] for k, v in summary["memory_per_rank"][0]["items"].items()}
    assert {"params", "grads", "optimizer_state"} <= mem.keys()
    assert mem["optimizer_state"] == 2 * mem["params"]  # AdamW m and v in fp32
    assert "entropy floor" in p.stdout and "val loss" in p.stdout
    # The summary's train loss is a mean over the last log_every steps (metrics.jsonl logs single
    # steps' losses): the console line and summary.json say over how many.
    assert summary["train_loss_steps"] == 2 and "(mean of last 2 steps)" in p.stdout, p.stdout


def test_the_val_loss_does_not_depend_on_the_micro_batch_split(forkrun, tmp_path):
    """micro_batch 4 and micro_batch 2 with grad_accum 2 train alike: their val loss (on held-out global
    batches of 4 rows, evaluated in micro batches) is the same too."""
    val = []
    for name, split in (("one", ["train.micro_batch=4"]), ("two", ["train.micro_batch=2", "train.grad_accum=2"])):
        # plain SGD, unclipped: Adam's normalisation and clipping would hide a summed (not averaged) accumulation
        p = forkrun.run("framework.train", [*SHORT, "train.steps=2", *split, "optimizer=sgd", "optimizer.lr=0.5",
                                            "scheduler=constant", "train.grad_clip=0",
                                            f"hydra.run.dir={tmp_path / name}"], cwd=tmp_path, env=ENV)
        assert p.returncode == 0, p.stderr
        val.append(json.loads((tmp_path / name / "summary.json").read_text())["val_loss"])
    assert val[0] == pytest.approx(val[1], rel=1e-5), val


@pytest.mark.parametrize("args,needle", [
    (["train.stpes=10"], "did you mean 'train.steps'"),
    (["optimizer.betas1=0.9"], "did you mean 'optimizer.beta1'"),
    (["train.steps=ten"], "train.steps"),
    (["+stage=zero4"], "unknown stage 'zero4' (did you mean 'zero1', 'zero2' or 'zero3'?)"),
    (["model=gpt-nono"], "unknown model 'gpt-nono' (did you mean 'gpt-nano'?)"),
    (["logger=wandb", "logger.project=my/proj"], "logger.project='my/proj' has a character W&B refuses"),
    (["-m", "optimizer.lr=interval(0.1,0.2)"], "needs a sweeper that samples"),
    (["-m", "optimizer.lr=interval(0.1,0.2)", "hydra/sweeper=basic"],
     "and hydra/sweeper=basic enumerates values, it does not sample them"),
    # a sweep of no job: refused (Hydra would run none and exit 0)
    (["-m", "optimizer=glob(adm*)"], "glob() selects none of the optimizer names (adagrad, adam, adamw, lion, sgd)"),
    (["-m", "optimizer.lr=range(1,1)"], "optimizer.lr=range(1,1): the sweep has no value (range(start, stop[, step])"),
    (["-m", "optimizer.lr=range(0,1,0)"], "optimizer.lr=range(0,1,0): a range's step must not be 0"),
    (["-m", "train.steps=range(1.5,3,0)"], "train.steps=range(1.5,3,0): a range's step must not be 0"),
    # every job is composed before the first runs: one bad value of a swept list refuses the sweep, and says so
    (["-m", "+stage=ddp", "offload=none,cpu"], "sweep job 1 (offload=cpu): config: offload=cpu is not supported "
                                               "with stage=ddp; valid: "),
    (["-m", "optimizer.lr=1e-3,abc"], "sweep job 1 (optimizer.lr=abc): config: optimizer.lr takes a number (such "
                                      "as 3e-4), got 'abc'; no job of the sweep ran"),
    # a hydra.* typo: the closest of Hydra's keys (its own advice, +KEY, adds a key nothing reads)
    (["hydra.run.dri=X"], "unknown key 'hydra.run.dri' of Hydra's config (did you mean 'hydra.run.dir'?)"),
    (["+hydra.job.chdri=true", "train.steps=1"], "unknown key 'hydra.job.chdri' of Hydra's config (did you mean "
                                                 "'hydra.job.chdir'?)"),
])
def test_bad_override_one_line(forkrun, tmp_path, args, needle):
    p = cli(forkrun, tmp_path, *args)
    assert p.returncode != 0
    lines = error_lines(p)
    assert len(lines) == 1 and needle in lines[0], p.stderr
    assert not (tmp_path / "run").exists()  # nothing was started


def test_missing_data_file(forkrun, tmp_path):
    p = cli(forkrun, tmp_path, *SHORT, "data=text", "data.path=no/such/file.txt")
    assert p.returncode != 0
    lines = error_lines(p)
    assert len(lines) == 1 and "no/such/file.txt" in lines[0], p.stderr
    assert not (tmp_path / "run").exists()   # the run folder made for the refused run is gone again


def test_help_shows_how_to_compose_a_job(forkrun, tmp_path):
    # stage has no default: Hydra's generic "group=option" would send a user to stage=zero3, which fails
    p = cli(forkrun, tmp_path, "--help")
    assert p.returncode == 0, p.stderr
    assert all(s in p.stdout for s in ("+stage=zero3", "dist.nproc=2", "--cfg job", " -m ", "stage: ddp, zero1")), p.stdout
    assert "group=option" not in p.stdout and not (tmp_path / "run").exists()
    # its examples run as written from the checkout: a DeepSpeed config it names exists (no placeholder)
    repo = Path(__file__).resolve().parents[2]
    assert all((repo / f).is_file() for f in re.findall(r"ds_config=(\S+)", p.stdout)) and "ds_config=" in p.stdout
    # every command's help is terminal text: its docstring's reST literal marks are not printed
    assert "``" not in p.stdout
    for module in ("estimate", "plan", "recipe", "export", "report", "ops"):
        p = forkrun.run(f"framework.{module}", ["--help"], cwd=tmp_path, timeout=60)
        assert p.returncode == 0 and "python -m framework." in p.stdout and "``" not in p.stdout, (module, p.stdout)
        assert module != "report" or "a Hydra multirun folder (hydra.sweep.dir" in p.stdout, p.stdout


@pytest.mark.parametrize("env", [{"WORLD_SIZE": "2x"}, {"LOCAL_WORLD_SIZE": "x"},
                                 {"SLURM_NTASKS": "two", "SLURM_STEP_ID": "0"}])
def test_a_malformed_launcher_variable_is_one_line_and_no_folder(forkrun, tmp_path, env):
    p = forkrun.run("framework.train", [*SHORT, f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path,
                    env={**ENV, **env})
    (name, value), = list(env.items())[:1]
    assert p.returncode != 0 and error_lines(p) == [f"error: {name}={value!r} is not an integer; unset it or "
                                                    f"launch with {'srun' if 'SLURM' in name else 'torchrun'}"], p.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("env", [{"RANK": "1"}, {"WORLD_SIZE": "2"}, {"SLURM_NTASKS": "2", "SLURM_STEP_ID": "0"}])
def test_a_launch_environment_that_cannot_work_is_a_usage_error_before_any_folder(monkeypatch, capsys, tmp_path, env):
    """A rank outside its world, a leftover WORLD_SIZE, srun tasks nothing made one group: all refused before Hydra
    starts, with one line and the same status as a malformed variable (2: a wrapper does not retry a usage error
    as a failed run), and no folder (a sweep's multirun.yaml neither)."""
    from framework.cli import train

    for key in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_NTASKS", "SLURM_STEP_ID",
                "SLURM_STEP_NUM_TASKS", "SUBMITIT_EXECUTOR", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_PROCID",
                "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(sys, "argv", ["framework.train", "-m", "train.steps=1,2", f"hydra.sweep.dir={tmp_path / 's'}"])
    with pytest.raises(SystemExit) as got:
        train.main()
    (name, value), = list(env.items())[:1]
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert got.value.code == 2 and len(err) == 1 and err[0].startswith(f"error: {name}={value}"), err
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("var, value", [("FRAMEWORK_OPS", "disable"), ("FRAMEWORK_OPS_ISA", "avx3")])
def test_a_bad_kernel_switch_is_a_usage_error_before_any_folder(monkeypatch, capsys, tmp_path, var, value):
    """A mistyped FRAMEWORK_OPS turned the kernels off and the run went on: refused as other bad input is."""
    from framework.cli import train

    monkeypatch.setenv(var, value)
    monkeypatch.setattr(sys, "argv", ["framework.train", f"hydra.run.dir={tmp_path / 'run'}"])
    with pytest.raises(SystemExit) as got:
        train.main()
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert got.value.code == 2 and len(err) == 1 and err[0].startswith(f"error: {var}={value!r} is not one of"), err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("var, value", [("FRAMEWORK_OPS_ISA", "avx3"), ("FRAMEWORK_OPS_PREFETCH", "lots"),
                                        ("FRAMEWORK_OPS_VERBOSE", "loud")])
def test_the_kernels_off_their_unused_variables_are_not_refused(monkeypatch, capsys, var, value):
    """A user who turned the kernels off to get past a problem is not stopped again by a value nothing reads."""
    from framework.cli import train

    monkeypatch.setenv("FRAMEWORK_OPS", "0")
    monkeypatch.setenv(var, value)
    monkeypatch.setattr(sys, "argv", ["framework.train", "--help"])
    with pytest.raises(SystemExit) as got:
        train.main()
    assert got.value.code in (0, None) and "error:" not in capsys.readouterr().err


def test_the_summary_says_which_path_the_host_optimizer_step_took(monkeypatch, tmp_path):
    """The kernels and their fallback differ in the last bits: a run's summary.json says which ran."""
    from framework import compose
    from framework.cli.launch import launch
    from framework.loggers import RunInfo
    from framework.ops import _loader

    monkeypatch.delenv("FRAMEWORK_OPS", raising=False)
    monkeypatch.setenv("FRAMEWORK_OPS_CACHE", str(tmp_path / "cache"))   # empty, and never built into
    monkeypatch.setenv("FRAMEWORK_OPS_BUILD", "0")
    _loader.status.cache_clear()
    try:
        summary = launch(compose([*SHORT, "train.steps=1"]), RunInfo(tmp_path / "run", None, None))
    finally:
        _loader.status.cache_clear()
    saved = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert saved["cpu_optimizer_kernels"] == summary["cpu_optimizer_kernels"]
    assert saved["cpu_optimizer_kernels"].startswith("fallback (not built yet and building is off"), saved


def test_a_refused_run_removes_the_folders_made_for_it(forkrun, tmp_path):
    """Refused after Hydra made its (timestamped) run folder: the folders made for it are removed,
    those that were there before are kept."""
    for outputs in (False, True):
        # (checkpoint.every: the checkpoint folder and its lock the pre-flight made go too)
        p = forkrun.run("framework.train", [*SHORT, "model.vocab_size=99", "checkpoint.every=2"], cwd=tmp_path, env=ENV)
        assert p.returncode == 1 and "model.vocab_size=99 differs" in error_lines(p)[-1], p.stderr
        assert [q.name for q in tmp_path.iterdir()] == (["outputs"] if outputs else [])
        # The header named the folder and the files the run writes there: the folder removed is said too.
        folder = p.stdout.splitlines()[0].removeprefix("run folder: ").removesuffix(" (train.log: this console)")
        assert f"note: run folder {folder} removed (the run was refused before training: none of its files were " \
               f"written)" in p.stderr.splitlines(), (p.stdout, p.stderr)
        (tmp_path / "outputs").mkdir(exist_ok=True)   # (kept: there before)
    (tmp_path / "outputs" / "mine").mkdir()   # an empty folder of the user's, named as the run folder: kept
    p = forkrun.run("framework.train", [*SHORT, "model.vocab_size=99", "hydra.run.dir=outputs/mine"], cwd=tmp_path,
                    env=ENV)
    assert p.returncode == 1 and [q.name for q in (tmp_path / "outputs").iterdir()] == ["mine"]
    assert "removed" not in p.stderr, p.stderr


def test_a_refusal_every_rank_raises_is_marked_so():
    """Marked every-rank, the launcher says it once as its last line, not as a rank's exit (that path, end to end:
    test_a_damaged_step_resumed_by_path_is_one_line_naming_the_newest_other_step)."""
    from framework import ConfigError, compose
    from framework.config import check_model_vocab

    with pytest.raises(ConfigError, match=r"^model.vocab_size=99 differs from the 65 token ids") as e:
        check_model_vocab(compose([*SHORT, "model.vocab_size=99"]), 65)
    assert getattr(e.value, "every_rank", False) is True


def test_a_refused_run_never_removes_a_folder_another_run_holds(tmp_path, monkeypatch):
    """Two runs started into the same new folder both found it empty: the refused one removes it only
    under its lock (a live run holding it keeps it), and one that never held it only if it is empty.
    Another rank of a torchrun sweep (whose Hydra may make the folder again after rank 0 removed it) removes
    an empty one too, after an error every rank raised alike (not one rank 0 may still be writing into)."""
    from framework.cli._hydra import remove_made as _remove_made
    from framework.cli.launch import own_checkpoint_dir, own_run_folder
    from framework.loggers import RunInfo

    run = tmp_path / "outputs" / "run"
    fd = own_run_folder(RunInfo(run, None, None))   # the other run took the lock first
    try:
        for owned in (True, False):
            _remove_made([run, run.parent], ".hydra", owned)
            assert (run / "run.lock").is_file(), owned
    finally:
        os.close(fd)
    _remove_made([run, run.parent], ".hydra", True)   # nobody holds it: the refused run's own, removed
    assert not (tmp_path / "outputs").exists()
    # checkpoint.every > 0: the pre-flight's checkpoints/.lock is the job's too, removed under that lock
    os.close(own_run_folder(RunInfo(run, None, None)))
    fd = own_checkpoint_dir(run / "checkpoints")   # another run saving there (its checkpoint.dir)
    try:
        _remove_made([run, run.parent], ".hydra", True)
        assert (run / "checkpoints" / ".lock").is_file()
    finally:
        os.close(fd)
    (run / "checkpoints" / "step-2").mkdir()   # a save: kept
    _remove_made([run, run.parent], ".hydra", True)
    assert (run / "checkpoints" / "step-2").is_dir()
    (run / "checkpoints" / "step-2").rmdir()
    # ... also one committed as the lock is taken: the folder is listed under it
    from framework.cli import _hydra
    take = _hydra._lock

    def saved_first(held, path):
        if path.parent.name == "checkpoints":
            (path.parent / "step-4").mkdir()
        return take(held, path)

    monkeypatch.setattr(_hydra, "_lock", saved_first)
    _remove_made([run, run.parent], ".hydra", True)
    assert (run / "checkpoints" / "step-4").is_dir()
    monkeypatch.undo()
    (run / "checkpoints" / "step-4").rmdir()
    _remove_made([run, run.parent], ".hydra", True)
    assert not (tmp_path / "outputs").exists()
    run.mkdir(parents=True)
    _remove_made([run, run.parent], ".hydra", False)   # never held, still empty: removed
    assert not (tmp_path / "outputs").exists()
    run.mkdir(parents=True)
    monkeypatch.setenv("RANK", "1")
    _remove_made([run, run.parent], ".hydra", False)
    assert run.is_dir()
    _remove_made([run, run.parent], ".hydra", False, alike=True)
    assert not (tmp_path / "outputs").exists()
    # A task of Hydra's submitit launcher, refused before launch set RANK: its own rank, not rank 0
    if importlib.util.find_spec("submitit") is None:
        return
    run.mkdir(parents=True)
    monkeypatch.delenv("RANK")
    for key, value in {"SUBMITIT_EXECUTOR": "local", "SUBMITIT_LOCAL_NTASKS": "2", "SUBMITIT_LOCAL_LOCALID": "1",
                       "SUBMITIT_LOCAL_GLOBALID": "1", "SUBMITIT_LOCAL_NODEID": "0",
                       "SUBMITIT_LOCAL_JOB_NUM_NODES": "1", "SUBMITIT_LOCAL_JOB_ID": "4242",
                       "MASTER_PORT": "29611"}.items():
        monkeypatch.setenv(key, value)
    _remove_made([run, run.parent], ".hydra", False)
    assert run.is_dir()


def test_a_jobs_checkpoint_folder_is_named_by_what_says_which_job_it_is():
    from framework.cli.train import job_key
    assert job_key(["train.steps=4", "checkpoint.every=2", "optimizer=adamw"]) == "optimizer=adamw"
    assert job_key(["train.steps=2", "optimizer=lion"], frozenset({"train.steps"})) == "optimizer=lion,train.steps=2"
    # nothing left: a folder of its own, not checkpoint.dir itself (where a plain run saves)
    assert job_key(["train.steps=4", "checkpoint.dir=ck"]) == "job"
    # what the command line fixes (a key any other job's overrides hold is swept, by it or by a sweeper)
    from framework.cli.train import _jobs
    assert _jobs(["-m", "train.steps=2,3", "seed=1", "optimizer=glob(lion)", "optimizer.lr=interval(0,1)",
                  "hydra/sweeper=x"])[3] == {"seed", "optimizer"}


def test_a_sweep_of_a_config_files_sweeper_params_gives_each_job_its_checkpoint_folder(forkrun, tmp_path):
    """Jobs swept by the config's hydra.sweeper.params (not the command line) that differ only in a key
    that says how long a job runs are distinct jobs under an explicit checkpoint.dir: none resumes another's."""
    (tmp_path / "sw.yaml").write_text("defaults: [train, _self_]\nhydra:\n  sweeper:\n    params:\n"
                                      "      train.steps: 2,3\n")
    p = cli(forkrun, tmp_path, "-m", "--config-dir", str(tmp_path), "--config-name", "sw",
            *[o for o in SHORT if not o.startswith("train.steps=")], "checkpoint.every=1",
            f"checkpoint.dir={tmp_path / 'ck'}")
    assert p.returncode == 0, p.stderr
    assert "resumed" not in p.stdout, p.stdout
    names = sorted(q.name for q in (tmp_path / "ck").iterdir())   # (the model.* overrides, then train.steps)
    assert [n.rsplit(",", 1)[-1] for n in names] == ["train.steps=2", "train.steps=3"], names


def test_the_summarys_train_loss_leaves_out_a_skipped_non_finite_step():
    from framework.cli.loop import train_loss
    assert train_loss([4.0, 3.0, float("nan"), 2.0], 2) == {"train_loss": 2.5, "train_loss_steps": 2}
    assert train_loss([1.0, 2.0, 3.0], 5) == {"train_loss": 2.0, "train_loss_steps": 3}
    assert train_loss([float("inf")], 2) == train_loss([], 2) == {"train_loss": None, "train_loss_steps": 0}


def test_a_resumed_runs_train_loss_is_that_of_the_run_uninterrupted(tmp_path):
    """The summary's train loss (the mean of the last log_every steps) of a run killed after a save and resumed
    fewer than log_every steps before its end counts the steps before the checkpoint too (it records them)."""
    from framework import compose
    from framework.cli.launch import launch
    from framework.loggers import RunInfo

    cfg = compose([*(o for o in SHORT if not o.startswith("train.log_every")), "train.log_every=4", "checkpoint.every=2"])
    whole = launch(cfg, RunInfo(tmp_path / "whole", None, None))

    def cut(point: str) -> None:
        if point == "step:5":   # (step 4 saved)
            raise RuntimeError("killed")
    with pytest.raises(RuntimeError, match="killed"):
        launch(cfg, RunInfo(tmp_path / "cut", None, None), on_point=cut)
    resumed = launch(cfg, RunInfo(tmp_path / "cut", None, None))
    assert resumed["steps_run"] == 2 and resumed["val_loss"] == whole["val_loss"]
    assert (resumed["train_loss"], resumed["train_loss_steps"]) == (whole["train_loss"], 4)


def test_pythons_and_numpys_generators_come_from_the_seed_and_a_resume_restores_them(tmp_path):
    """Python's and numpy's global generators are seeded from ``seed`` as torch's is (not left as the process, or
    a sweep's earlier job, had them); a resumed run goes on from the saved ones: the uninterrupted run's."""
    import random

    import numpy as np

    from framework import compose
    from framework.cli.launch import launch
    from framework.loggers import RunInfo

    cfg = compose([*SHORT, "checkpoint.every=2"])

    def host(run: str, step: int) -> dict:
        saved = json.loads((tmp_path / run / "checkpoints" / f"step-{step}" / "rng-0.json").read_text())
        return {k: saved[k] for k in ("python", "numpy")}

    def draw(point: str) -> None:   # a plugin drawing from both each step: a resume must go on from its draws
        if point.startswith("step:"):
            random.random(), np.random.random()
    for run, draws in (("a", 1), ("b", 3)):   # another state left behind before each run
        random.random(), np.random.random(draws)
        launch(cfg, RunInfo(tmp_path / run, None, None), on_point=draw)
    assert host("a", 4) == host("b", 4) and host("a", 6) == host("b", 6)

    def cut(point: str) -> None:
        draw(point)
        if point == "step:5":   # (step 4 saved)
            raise RuntimeError("killed")
    with pytest.raises(RuntimeError, match="killed"):
        launch(cfg, RunInfo(tmp_path / "cut", None, None), on_point=cut)
    random.seed(7), np.random.seed(7)   # (set aside by the resume)
    launch(cfg, RunInfo(tmp_path / "cut", None, None), on_point=draw)
    assert host("cut", 6) == host("a", 6)


def test_a_jobs_peak_rss_is_never_below_its_start_or_now(monkeypatch):
    """The kernel's high-water mark lags the RSS (per-thread counters folded in lazily): the peak is at least both."""
    from framework.cli import loop
    from framework.memory.probe import rss_now

    monkeypatch.setattr(loop, "rss_peak", lambda: 1)   # a high-water mark read before the kernel caught up
    start = rss_now()
    peak = loop.peak_memory(torch_cpu(), start + 4096)
    assert peak["rss_start_bytes"] == start + 4096 and peak["peak_rss_bytes"] >= start + 4096
    assert loop.peak_memory(torch_cpu(), 0)["peak_rss_bytes"] >= start // 2   # (now's: the process is alive)


def torch_cpu():
    import torch
    return torch.device("cpu")


def test_a_submitit_requeue_while_training_is_a_line_in_train_log(tmp_path, monkeypatch):
    """Submitit's pre-emption handler requeues the job and exits (144 on its local executor) from inside the loop:
    train.log says where it stopped and why, with the exit status kept (about 2 s)."""
    from framework import compose
    from framework.cli.launch import launch
    from framework.loggers import RunInfo

    def requeued(point: str) -> None:
        if point == "step:3":
            sys.exit(144)
    monkeypatch.setenv("SUBMITIT_EXECUTOR", "local")
    with pytest.raises(SystemExit) as got:
        launch(compose([*SHORT, "checkpoint.every=2", "train.eval_every=0"]), RunInfo(tmp_path / "run", None, None),
               on_point=requeued)
    assert got.value.code == 144 and (tmp_path / "run" / "train.log").read_text().splitlines()[-1] == (
        "stopped at step 3: requeued by the submitit launcher (its pre-emption/time-limit signal, exit 144); the "
        "job resumes from its last periodic save")
    # Before the first periodic save it starts again; another exit (not submitit's -1 or 144) is no requeue
    from framework.cli.loop import exit_why
    assert exit_why(-1, 500, False).endswith("the job starts again at step 0 (no periodic save yet: "
                                             "checkpoint.every=500)")
    assert exit_why(-1, 500, True).endswith("(its pre-emption/time-limit signal, exit -1); the job resumes from its "
                                            "last periodic save")
    assert exit_why(3, 500, True) == "exit 3 raised while training"


def test_too_many_open_files_in_a_run_is_its_error_line(tmp_path):
    """EMFILE anywhere in the loop (a swap manifest, Hydra's record, a checkpoint file) is the run's one error line,
    in train.log too, naming the limit: not a traceback of an OSError."""
    import errno

    from framework import compose
    from framework.cli.launch import launch
    from framework.core.errors import FrameworkError
    from framework.loggers import RunInfo

    def emfile(point: str) -> None:
        if point == "step:1":
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE), str(tmp_path / "x"))
    with pytest.raises(FrameworkError, match=r"^too many open files \(opening .*/x\): this process may have \d+ "
                                             r"open \(ulimit -n\); .*ulimit -n \d+"):
        launch(compose([*SHORT, "checkpoint.every=0"]), RunInfo(tmp_path / "run", None, None), on_point=emfile)
    assert (tmp_path / "run" / "train.log").read_text().splitlines()[-1].startswith("error: too many open files")


def _strict_json(text: str):
    """json.loads refusing the bare NaN/Infinity that Python writes and strict readers reject."""
    def refuse(word):
        raise AssertionError(f"{word} in {text[:300]}")
    return json.loads(text, parse_constant=refuse)


def test_an_fp16_run_with_skipped_steps_writes_strict_json(tmp_path):
    """An overflowing fp16 step (loss scale 2^40) has a non-finite grad norm: metrics.jsonl has null
    there, and the report and the recipe checks read it as the NaN it was."""
    from framework import compose
    from framework.cli import recipe, report
    from framework.cli.launch import launch
    from framework.loggers import RunInfo

    cfg = compose([*(o for o in SHORT if not o.startswith(("train.log_every", "train.steps"))), "train.log_every=1",
                   "train.steps=3", "precision=fp16", "precision.initial_scale_power=40"])
    launch(cfg, RunInfo(tmp_path / "run", None, None))
    records = [_strict_json(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["skipped_steps"] == 1 and records[0]["grad_norm"] is None, records[0]
    _strict_json((tmp_path / "run" / "summary.json").read_text())
    job = report.load_jobs(tmp_path)[0]
    steps, norms = job.curve("grad_norm")
    assert steps == [1, 2, 3]
    assert all(n != n for n in norms)   # every step overflowed: NaN, as before it was written as null
    losses = job.curve("loss")[1]
    assert len(set(losses)) == 3, losses   # unchanged weights: each skipped step still took the next batch
    res = recipe.evaluate([job], {"checks": [{"metric": "min:grad_norm", "max": 1e30},
                                             {"metric": "min:loss", "max": 1e30}]})
    assert [r["passed"] for r in res] == [False, True], res   # (no finite grad norm to bound)
    assert report.markdown_table([job], tmp_path).count("\n") == 3


# An SGD step at lr 3e38 with weight decay 1000 (each finite in fp32) makes the masters inf: non-finite state at
# the end of a run (its loss was finite).
DIVERGED = ["+stage=zero3", "stage.stage3_gather_16bit_weights_on_model_save=true", "train.steps=1",
            "optimizer=sgd", "optimizer.lr=3e38", "optimizer.weight_decay=1000", "scheduler=constant",
            "train.grad_clip=0",
            *(o for o in SHORT if o.startswith("model."))]


@pytest.mark.parametrize("extra,says", [
    # stop: the end-of-run export is refused as a due checkpoint is, one line, exit 1, no export folder
    ([], "error: not exporting model_16bit at step 1: the state holds non-finite values (NaN or inf) in rank 0: "
         "'model."),
    (["checkpoint.every=1"], "error: checkpoint: not saving step 1: the state holds non-finite values (NaN or inf) "
                             "in rank 0: 'model."),
    # warn: exported, with a warning naming the tensors; the step's checkpoint is not saved, said once
    (["train.on_nonfinite=warn", "checkpoint.every=1"], "warning: save_pretrained: NaN or inf values in '"),
])
def test_a_diverged_final_state_is_exported_only_under_warn(forkrun, tmp_path, extra, says):
    p = cli(forkrun, tmp_path, *DIVERGED, f"checkpoint.dir={tmp_path / 'ck'}", *extra)
    warn = "train.on_nonfinite=warn" in extra
    assert p.returncode == (0 if warn else 1), p.stderr
    assert says in (p.stderr if warn else error_lines(p)[-1]), p.stderr
    assert (tmp_path / "run" / "model_16bit").exists() == warn
    # Nothing else said: the checkpoint's 16-bit copy, removed with the step, warned of NaN before its refusal
    assert len(error_lines(p)) == 1 or warn and [line.split(":")[1] for line in error_lines(p)] == [
        " checkpoint", " save_pretrained"], p.stderr
    assert not [f for f in (tmp_path / "ck").glob("*") if f.name != ".lock"]   # no step folder, no staged copy


def test_multirun_two_optimizers(forkrun, tmp_path):
    from framework.cli.train import job_key
    from framework.persist.checkpoint import checkpoint_root

    saves = [f"checkpoint.dir={tmp_path / 'ck'}", "checkpoint.every=6"]
    p = cli(forkrun, tmp_path, "-m", "optimizer=adamw,lion", *SHORT, *saves)
    assert p.returncode == 0, p.stderr
    summaries = [json.loads((tmp_path / "sweep" / str(i) / "summary.json").read_text()) for i in (0, 1)]
    assert [s["config"]["optimizer"]["name"] for s in summaries] == ["adamw", "lion"]
    # Hydra's records of the sweep and of each job, as Hydra writes them (the job writes its own).
    for record in (tmp_path / "sweep" / "multirun.yaml", tmp_path / "sweep" / "1" / ".hydra" / "hydra.yaml"):
        assert "output_subdir: .hydra" in record.read_text() and "output_subdir=null" not in record.read_text()
    assert "optimizer=lion" in (tmp_path / "sweep" / "1" / ".hydra" / "overrides.yaml").read_text()
    assert len({(tmp_path / "sweep" / str(i) / ".hydra" / "config.yaml").read_text() for i in (0, 1)}) == 2
    # No state leaks between jobs: the lion job starts from the same initial loss as a fresh run.
    first = [json.loads((tmp_path / "sweep" / str(i) / "metrics.jsonl").read_text().splitlines()[0])
             for i in (0, 1)]
    assert all(r["step"] == 2 for r in first)

    # A relaunch (another sweep folder) with more steps is the same jobs: each resumes its own
    # checkpoints; a job folder named by all the job's overrides (train.steps included) for this same
    # command line is used.
    longer = [o for o in SHORT if not o.startswith("train.steps=")] + ["train.steps=8"]
    ckpt = type("C", (), {"checkpoint": type("D", (), {"dir": str(tmp_path / "ck")})})
    folder = {o: checkpoint_root(ckpt, None, job_key([*SHORT, *saves, f"optimizer={o}"], frozenset({"optimizer"})))
              for o in ("adamw", "lion")}
    older = checkpoint_root(ckpt, None, ",".join(sorted([*longer, *saves, "optimizer=lion"])))
    folder["lion"].rename(older)
    again = forkrun.run("framework.train", ["-m", "optimizer=adamw,lion", *longer, *saves,
                                            f"hydra.sweep.dir={tmp_path / 'again'}"], cwd=tmp_path, env=ENV)
    assert again.returncode == 0, again.stderr
    assert f"resumed from {folder['adamw'] / 'step-6'} (step 6" in again.stdout, again.stdout
    assert f"checkpoint: using {older} (this job's folder named by all its overrides, those that do not name a job " \
           f"included); move it to {folder['lion']} " in again.stdout, again.stdout
    assert f"resumed from {older / 'step-6'} (step 6" in again.stdout, again.stdout


def test_resume_latest_in_a_sweep_never_takes_another_jobs_checkpoint(forkrun, tmp_path):
    """checkpoint.resume=latest in a multirun: job 1 does not resume job 0's checkpoint (the newest one, just
    written, under multirun/) and report its numbers; a relaunch into the same sweep folder resumes each
    job's own."""
    base = [o for o in SHORT if not o.startswith("train.steps=")]
    sweep = tmp_path / "multirun" / "s"
    for steps in (2, 3):
        p = forkrun.run("framework.train", ["-m", "optimizer.lr=1e-3,3e-4", *base, f"train.steps={steps}",
                                            "checkpoint.every=2", "checkpoint.resume=latest", "hydra.sweep.dir=multirun/s"],
                        cwd=tmp_path, env=ENV)
        assert p.returncode == 0, p.stderr
        resumed = [line for line in p.stdout.splitlines() if "resumed from" in line]
        if steps == 2:
            assert not resumed, p.stdout
        else:
            assert [str(sweep / str(i) / "checkpoints" / "step-2") in line for i, line in enumerate(resumed)] == [True] * 2, resumed
    summaries = [json.loads((sweep / str(i) / "summary.json").read_text()) for i in (0, 1)]
    assert [s["config"]["optimizer"]["lr"] for s in summaries] == [1e-3, 3e-4]
    assert [s["resume_given"] for s in summaries] == ["latest"] * 2   # (the config has where it led)
    # The sweep again with its values in another order: job 0 (3e-4) would take on job 0's (1e-3) state and
    # report its numbers as its own: each job refused before it trains, nothing changed.
    def files():   # (but the locks' holders, and multirun.yaml: the record of the last sweep started there)
        return {p: p.read_bytes() for p in sweep.rglob("*") if p.name not in ("run.lock", ".lock", "multirun.yaml")
                and p.is_file()}
    before = files()
    p = forkrun.run("framework.train", ["-m", "optimizer.lr=3e-4,1e-3", *base, "train.steps=3", "checkpoint.every=2",
                                        "hydra.sweep.dir=multirun/s"], cwd=tmp_path, env=ENV)
    assert p.returncode == 1 and "resumed" not in p.stdout, p.stdout
    assert [line.split(" holds ")[1].split(")")[0] for line in error_lines(p)[:2]] == [
        "the checkpoint of another job (optimizer.lr=0.001; this job: optimizer.lr=0.0003",
        "the checkpoint of another job (optimizer.lr=0.0003; this job: optimizer.lr=0.001"], p.stderr
    assert files() == before


def test_a_failing_job_does_not_end_the_sweep(forkrun, tmp_path):
    (tmp_path / "t.txt").write_text("some text to train on, " * 20)
    p = cli(forkrun, tmp_path, "-m", "data=text", "data.path=missing.txt,t.txt", *SHORT)
    assert p.returncode == 1
    assert (tmp_path / "sweep" / "1" / "summary.json").is_file()   # the job after the failed one ran
    assert not (tmp_path / "sweep" / "0").exists()   # the refused job's folder is gone again
    lines = error_lines(p)
    assert len(lines) == 2 and "missing.txt" in lines[0], p.stderr
    # named by its swept override, not by the folder it no longer has
    assert lines[1] == "error: 1 job of the sweep failed (its error is above): job 0 (data.path=missing.txt, " \
                       "no folder)", lines


def test_a_job_failing_on_another_exception_does_not_end_the_sweep(forkrun, tmp_path):
    """A RuntimeError (a bug, the allocator's) in job 0 of a sweep: its traceback and one line right away,
    job 1 runs, and the sweep's count of failed jobs at the end (Hydra ended with the traceback instead)."""
    base = [o for o in SHORT if not o.startswith("train.steps=")]
    p = forkrun.run("tests._fault_train", ["-m", "train.steps=2,3", *base, f"hydra.sweep.dir={tmp_path / 'sweep'}"],
                    cwd=tmp_path, env={**ENV, "FRAMEWORK_FAULT": f"step:1@0,raise,once={tmp_path / 'fired'}"})
    assert p.returncode == 1, p.stderr
    assert (tmp_path / "sweep" / "1" / "summary.json").is_file()   # the job after the failed one ran
    job0 = f"job 0 ({tmp_path / 'sweep' / '0'})"
    lines = [line for line in error_lines(p) if line.startswith("error: ")]
    assert lines == [f"error: {job0} failed: RuntimeError: FRAMEWORK_FAULT: rank 0 raises at step:1",
                     f"error: 1 job of the sweep failed (its error is above): {job0}"], p.stderr
    assert p.stderr.index("Traceback") < p.stderr.index(lines[0])
    assert "Traceback" in (tmp_path / "sweep" / "0" / "train.log").read_text()   # kept with the job's run


def test_a_rank_of_an_external_launchers_group_ends_the_sweep_on_an_unexpected_error_or_a_broken_group(monkeypatch):
    """Under torchrun (WORLD_SIZE > 1: each rank runs the sweep in its own process) a rank's RuntimeError
    ends that rank instead of taking it alone to the next job, whose collectives would wait for its
    peers still in the failed job's; so does a DistributedError (a peer gone, a collective timed out: the
    group is unusable), and a FrameworkError not every rank raised alike (rank 0's full disk under
    metrics.jsonl). A single process (dist.nproc's launcher too) goes on, as after a ConfigError."""
    from framework import ConfigError, DistributedError
    from framework.cli import train
    from framework.core.errors import on_every_rank

    errors = [RuntimeError("bug"), on_every_rank(DistributedError("rank 0/2: all_reduce failed")), ConfigError("bad"),
              on_every_rank(ConfigError("run folder in use"))]
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert all(train._sweep_goes_on(e) for e in errors)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert all(train._sweep_goes_on(e) for e in errors)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert [train._sweep_goes_on(e) for e in errors] == [False, False, False, True]


def test_the_ranks_of_a_torchrun_sweep_end_it_with_rank_0s_count_alone(monkeypatch, capsys):
    """Each rank of a torchrun sweep prints its line for a failed job, but the count at the end is rank 0's
    alone (the ranks went on together, after the same failures): the others exit 1 without a word."""
    from framework.cli import train

    monkeypatch.setattr(sys, "argv", ["framework.train", "-m", "train.steps=2"])
    monkeypatch.setattr(train, "_app", lambda configs, on_point, failed, *a: lambda: failed.append("job 0 (x)"))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")   # (a launch that can work: none is refused before the sweep)
    monkeypatch.setenv("MASTER_PORT", "29500")
    for rank in ("0", "1"):
        monkeypatch.setenv("RANK", rank)
        with pytest.raises(SystemExit) as got:
            train.main()
        assert got.value.code == 1
        assert capsys.readouterr().err.splitlines() == ["error: 1 job of the sweep failed (its error is above): "
                                                        "job 0 (x)"] * (rank == "0")


def test_a_job_without_room_for_its_records_fails_on_one_line_and_the_sweep_goes_on(tmp_path):
    """A full disk under metrics.jsonl (here an 8 KiB file size limit, RLIMIT_FSIZE, which job 0's record
    outgrows and job 1's does not; Hydra's multirun.yaml, ~5 KiB with the help template, fits): one line for job 0, then job 1, then the sweep's count of failed jobs.
    (A fresh process, not forkrun: the limit would hold for the fork server's output files too.)"""
    import resource

    root = Path(__file__).resolve().parents[2]

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (8 * 1024, 8 * 1024))

    sweep = tmp_path / "sweep"
    p = subprocess.run([sys.executable, "-m", "framework.train", "-m", "train.steps=60,2", "train.log_every=1",
                        "train.eval_every=0", "train.eval_batches=1", *SHORT[4:], "hydra.output_subdir=null",
                        f"hydra.sweep.dir={sweep}"], cwd=tmp_path, env={**os.environ, **ENV, "PYTHONPATH": str(root)},
                       capture_output=True, text=True, timeout=240, preexec_fn=limit)
    lines = error_lines(p)
    assert p.returncode == 1 and len(lines) == 2, p.stderr[-3000:]
    assert lines[0].startswith(f"error: no room to write metrics.jsonl in {sweep / '0'} (File too large; "), lines
    assert "raise the file size limit" in lines[0], lines
    assert lines[1] == f"error: 1 job of the sweep failed (its error is above): job 0 ({sweep / '0'})", lines
    assert (sweep / "1" / "summary.json").is_file()   # the job after the failed one ran


def test_two_jobs_of_a_sweep_never_share_a_run_folder(forkrun, tmp_path):
    p = cli(forkrun, tmp_path, "-m", "train.steps=2,3", *[o for o in SHORT if not o.startswith("train.steps=")],
            "checkpoint.every=1", "hydra.sweep.subdir=same")
    assert p.returncode == 1
    lines = error_lines(p)
    assert len(lines) == 2 and lines[0].startswith(f"error: run folder {tmp_path / 'sweep' / 'same'}: job 1 of this "
                                                   "sweep would share it with job 0") and "hydra.sweep.subdir" in lines[0]
    assert "resumed" not in p.stdout, p.stdout
    assert json.loads((tmp_path / "sweep" / "same" / "summary.json").read_text())["steps"] == 2   # job 0's, kept


def test_two_jobs_of_a_sweep_sharing_a_checkpoint_folder_are_refused_before_any_runs(forkrun, tmp_path):
    """Under checkpoint.dir a value given twice (spelled two ways) names one job folder: the later job would resume
    the earlier's checkpoint and train nothing."""
    p = cli(forkrun, tmp_path, "-m", "optimizer.lr=1e-3,3e-4,0.001", *SHORT, "checkpoint.every=2",
            f"checkpoint.dir={tmp_path / 'ck'}")
    assert p.returncode == 2 and error_lines(p) == [
        "error: sweep jobs 0 and 2 are the same job (optimizer.lr=0.001): they would share the checkpoint folder "
        f"{tmp_path / 'ck'}/model.context=16,model.d_model=32,model.n_head=2,model.n_layer=1,optimizer.lr=0.001, and "
        "job 2 would resume job 0's checkpoint and train nothing; drop the repeated value, or set checkpoint.every=0 "
        "(no saves); no job of the sweep ran"], p.stderr
    assert not (tmp_path / "sweep").exists() and not (tmp_path / "ck").exists()
    # Without checkpoint.dir each job saves in its own run folder: both train
    p = cli(forkrun, tmp_path, "-m", "optimizer.lr=1e-3,0.001", *SHORT, "train.steps=2", "checkpoint.every=2")
    assert p.returncode == 0 and "resumed" not in p.stdout, p.stderr


def test_repeated_sweep_jobs_under_checkpoint_dir_are_refused_only_where_they_would_save_there(tmp_path):
    """A job repeated (a nondeterminism check) that saves nothing shares nothing written: it runs; one that saves
    under resume=off is refused in words that say so (its saves would overwrite the earlier job's)."""
    import framework
    from framework.cli.train import check_shared_checkpoints

    def jobs(*over):
        return [(["seed=1", *over], framework.compose(["seed=1", f"checkpoint.dir={tmp_path}", *over]))
                for _ in range(2)]
    check_shared_checkpoints(jobs("checkpoint.every=0"), frozenset())
    check_shared_checkpoints(jobs("checkpoint.every=0", "checkpoint.resume=off"), frozenset())
    with pytest.raises(framework.ConfigError, match=r"job 1's saves would overwrite job 0's checkpoints \(so "
                                                    r"checkpoint\.resume=off refuses them\); drop the repeated"):
        check_shared_checkpoints(jobs("checkpoint.every=2", "checkpoint.resume=off"), frozenset())
    with pytest.raises(framework.ConfigError, match="job 1 would resume job 0's checkpoint and train nothing"):
        check_shared_checkpoints(jobs("checkpoint.every=2"), frozenset())


@pytest.mark.parametrize("argv,end", [
    (["a=1", "--run"], 1), (["-m", "a=1", "b=2"], 3), (["a=1", "-cn", "train"], 1), (["-cn", "a=1", "a=1"], 3),
    (["--config-dir", "d", "a=1", "--multirun", "--config-name=x"], 3), (["-m"], 1), ([], 0)])
def test_the_added_overrides_follow_the_users_where_hydra_reads_them(argv, end):
    """Hydra's parser takes the overrides as one run of words: the CLI's own go at its end, a flag may follow."""
    from hydra._internal.utils import get_args_parser

    from framework.cli.train import with_added

    added = ["hydra.output_subdir=null", "hydra/hydra_logging=disabled"]
    assert with_added(argv, added) == [*argv[:end], *added, *argv[end:]]
    given = get_args_parser().parse_args(argv).overrides
    assert get_args_parser().parse_args(with_added(argv, added)).overrides == [*given, *added]


def test_glob_sweeps_the_names_of_a_group(forkrun, tmp_path):
    from framework.cli.train import _jobs

    assert _jobs(["-m", "optimizer=glob(ada*)", "seed=1"])[0] == [["optimizer=adagrad", "seed=1"],
                                                                 ["optimizer=adam", "seed=1"],
                                                                 ["optimizer=adamw", "seed=1"]]
    # (-m last, as Hydra takes it: the overrides the CLI adds go right after the user's, not after the flag)
    p = forkrun.run("framework.train", ["optimizer=glob([lion,sgd],exclude=sgd)", *SHORT,
                                        f"hydra.sweep.dir={tmp_path / 'sweep'}", "-m"], cwd=tmp_path, env=ENV)
    assert p.returncode == 0, p.stderr
    assert json.loads((tmp_path / "sweep" / "0" / "summary.json").read_text())["config"]["optimizer"]["name"] == "lion"
    assert not (tmp_path / "sweep" / "1").exists()


def test_rerunning_a_finished_run_keeps_its_summary(forkrun, tmp_path):
    args = ["checkpoint.every=2", "train.steps=2", f"hydra.run.dir={tmp_path / 'done'}"]
    first = forkrun.run("framework.train", [*SHORT, *args], cwd=tmp_path, env=ENV)
    assert first.returncode == 0, first.stderr
    summary, metrics = ((tmp_path / "done" / name).read_text() for name in ("summary.json", "metrics.jsonl"))
    again = forkrun.run("framework.train", [*SHORT, *args], cwd=tmp_path, env=ENV)
    assert again.returncode == 0, again.stderr
    assert "loss nan" not in again.stdout and "summary.json of step 2 kept" in again.stdout, again.stdout
    assert (tmp_path / "done" / "summary.json").read_text() == summary
    assert (tmp_path / "done" / "metrics.jsonl").read_text() == metrics


def test_a_second_run_into_a_live_runs_folder_is_refused(forkrun, tmp_path):
    from framework.cli.launch import own_run_folder
    from framework.loggers import RunInfo

    run = tmp_path / "run"
    fd = own_run_folder(RunInfo(run, None, None))   # a live run holds it, with its record of its config
    (run / ".hydra").mkdir()
    record = {name: f"the live run's {name}\n" for name in ("config.yaml", "hydra.yaml", "overrides.yaml")}
    for name, text in record.items():
        (run / ".hydra" / name).write_text(text)
    try:
        p = cli(forkrun, tmp_path, *SHORT)
    finally:
        os.close(fd)
    assert p.returncode == 1 and "loss" not in p.stdout
    lines = error_lines(p)
    assert len(lines) == 1 and f"run folder {run} is in use by another run" in lines[0], p.stderr
    # The refused run wrote nothing there: the live run's record of its config is as it was.
    assert {q.name for q in run.iterdir()} == {".hydra", "run.lock"}
    assert {q.name: q.read_text() for q in (run / ".hydra").iterdir()} == record


def test_a_second_run_saving_into_a_live_runs_checkpoint_dir_is_refused(forkrun, tmp_path):
    """Before it trains, and before it reads or writes anything there (the live run's step folders untouched)."""
    from framework.cli.launch import own_checkpoint_dir

    ckpt = tmp_path / "shared"
    fd = own_checkpoint_dir(ckpt)   # a live run saving there
    (ckpt / "step-4.tmp").mkdir()   # its save being written
    try:
        p = cli(forkrun, tmp_path, *SHORT, "checkpoint.every=1", f"checkpoint.dir={ckpt}")
    finally:
        os.close(fd)
    assert p.returncode == 1 and "loss" not in p.stdout
    lines = error_lines(p)
    assert len(lines) == 1 and f"checkpoint.dir {ckpt} is in use by another run (pid {os.getpid()}" in lines[0], \
        p.stderr
    assert {q.name for q in ckpt.iterdir()} == {".lock", "step-4.tmp"}


def test_a_run_refused_in_training_keeps_an_earlier_runs_record(forkrun, tmp_path):
    """Refused by a check of the training loop (after it took the run folder) in an earlier run's
    folder: that run's record of its config (.hydra/) is as it was."""
    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    record = {name: f"the earlier run's {name}\n" for name in ("config.yaml", "hydra.yaml", "overrides.yaml")}
    for name, text in record.items():
        (run / ".hydra" / name).write_text(text)
    p = cli(forkrun, tmp_path, *SHORT, "model.vocab_size=99")
    assert p.returncode == 1 and "model.vocab_size=99 differs" in error_lines(p)[-1], p.stderr
    assert {q.name: q.read_text() for q in (run / ".hydra").iterdir()} == record


# FRAMEWORK_SLOW_TESTS only: test_zero_stages_from_the_command_line launches 2 local ranks the same way and
# checks the same (Hydra's record written by rank 0, world 2, both ranks' memory); ddp at 2 local ranks from
# the command line is also test_recipes.py's memory_scaling twin (a sweep's job; the README test's
# `python -m framework.train +stage=ddp dist.nproc=2` is that one, tests/cli/test_readme.py COVERED).
@slow
def test_two_local_ranks(forkrun, tmp_path):
    p = cli(forkrun, tmp_path, *SHORT, "dist.nproc=2")
    assert p.returncode == 0, p.stderr
    # Hydra's record, written by rank 0 (a spawned process) once the run's checks passed
    assert "dist.nproc=2" in (tmp_path / "run" / ".hydra" / "overrides.yaml").read_text()
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["world"] == 2 and len(summary["memory_per_rank"]) == 2


def test_torchrun_multirun_reuses_group(forkrun, tmp_path):
    """Each rank names the sweep folder itself (here by its RANK, as ${now} may differ): rank 0's is the
    sweep's, and another rank's is removed (its jobs' folders, and the multirun.yaml Hydra wrote there).
    Hydra's own lines ("Launching 2 jobs locally", "#0 : ...") are rank 0's alone. Job 0 diverges (lr 1e9): the
    non-finite stop, decided on the all-reduced norm, is every rank's alike, so the ranks go on to job 1 together
    and rank 0 counts job 0 at the end. (torchrun is its script's ``torch.distributed.run``, forked from the fork
    server; the ranks it starts are fresh processes.)"""
    p = forkrun.run("torch.distributed.run", ["--standalone", "--nproc-per-node", "2", "-m", "framework.train", "-m",
                                              "optimizer=adamw", "optimizer.lr=1e9,1e-3", *SHORT,
                                              f"hydra.sweep.dir={tmp_path}/${{oc.env:RANK}}/sweep"],
                    cwd=tmp_path, env=ENV, timeout=240)
    assert p.returncode == 1, p.stderr[-3000:]
    assert not (tmp_path / "0" / "sweep" / "0" / "summary.json").exists()
    assert json.loads((tmp_path / "0" / "sweep" / "1" / "summary.json").read_text())["world"] == 2
    assert not (tmp_path / "1" / "sweep").exists()
    said = p.stdout + p.stderr
    assert said.count("Launching 2 jobs locally") == 1 and said.count("#1 : optimizer=adamw optimizer.lr=0.001") == 1, (
        said[-3000:])
    assert said.count("the global gradient norm nan") == 2 and said.count(
        f"error: 1 job of the sweep failed (its error is above): job 0 ({tmp_path}/0/sweep/0)") == 1, said[-3000:]
    record = (tmp_path / "0" / "sweep" / "multirun.yaml").read_text()
    assert "hydra_logging=disabled" not in record and "hydra/hydra_logging: default" in record, record


def test_torchrun_one_ranks_unexpected_error_ends_the_sweep(tmp_path):
    """Rank 1 alone raises a RuntimeError in job 0 of a sweep under torchrun: it exits with its line, and rank 0,
    whose collective fails on the lost peer, exits with its own, instead of either going on to job 1 alone (Hydra
    catches a re-raised error and goes on; a job's DistributedError was counted and the sweep went on) to fail
    it too, or wait in its collectives until dist.timeout_s (the unit test of the decision cannot see Hydra's
    side). The ranks are started as torchrun starts them but without its monitor, which stops rank 0 when it
    sees rank 1's exit before rank 0 sees the broken group: rank 0 always meets it here. Rank 1 starts late: the
    sweep's record is still rank 0's."""
    base = [o for o in SHORT if not o.startswith("train.steps=")]
    env = {**os.environ, "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "OMP_NUM_THREADS": "1",
           "GLOO_SOCKET_IFNAME": "lo", "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
           "FRAMEWORK_FAULT": "step:1@1,raise"}
    for attempt in range(2):
        # A free port now may be taken by another process before rank 0 listens on it: once, take another.
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            env["MASTER_PORT"] = str(s.getsockname()[1])
        sweep, procs = tmp_path / str(attempt) / "sweep", []
        for r in range(2):
            procs.append(subprocess.Popen([sys.executable, "-m", "tests._fault_train", "-m", "train.steps=2,3", *base,
                                           "dist.timeout_s=30", f"hydra.sweep.dir={sweep}"],
                                          env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, cwd=tmp_path,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
            # Rank 1 starts late: its sweeper's raw multirun.yaml lands after any record rank 0 wrote before the
            # ranks connected (rank 0's Hydra wrote its own, then up to 2 s for a rewrite).
            for _ in range(600 if r == 0 else 0):
                if (sweep / "multirun.yaml").is_file():
                    for _ in range(20):
                        if "output_subdir=null" not in (sweep / "multirun.yaml").read_text():
                            break
                        time.sleep(0.1)
                    break
                time.sleep(0.1)
        try:
            errs = [p.communicate(timeout=240)[1] for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.communicate()
        if attempt == 0 and procs[0].returncode != 0 and "address already in use" in errs[0].lower():
            continue
        break
    assert [p.returncode for p in procs] == [1, 1], errs
    assert "failed: RuntimeError: FRAMEWORK_FAULT: rank 1 raises at step:1" in errs[1], errs[1][-3000:]
    ended = [line for line in errs[0].splitlines() if line.startswith("error: ")]   # its collective's line alone
    assert len(ended) == 1 and ended[0].startswith("error: rank 0/2: "), errs[0][-3000:]
    assert not any("of the sweep failed" in e for e in errs), errs   # no rank got to the sweep's end
    # train.log (rank 0's console) holds rank 1's own error too, with its traceback, as the spawning launcher writes it
    log = (sweep / "0" / "train.log").read_text()
    line = "error: rank 1 of 2 failed: RuntimeError: FRAMEWORK_FAULT: rank 1 raises at step:1\n"
    assert line in log and log.index("Traceback (most recent call last):") < log.index(line), log[-3000:]
    # The sweep's record is rank 0's, written once the ranks connected: not rank 1's raw one, written later
    record = (sweep / "multirun.yaml").read_text()
    assert "output_subdir=null" not in record and "output_subdir: .hydra" in record, record


def test_wandb_offline_multirun_groups_runs(forkrun, tmp_path):
    sweep = tmp_path / "multirun" / "2026-12-01" / "10-00-00"   # as the default sweep folder: date/time
    p = forkrun.run("framework.train", ["-m", "logger=wandb", "optimizer=adamw,lion", *SHORT,
                                        f"hydra.sweep.dir={sweep}"], cwd=tmp_path, env=ENV, timeout=240)
    assert p.returncode == 0, p.stderr
    for i in (0, 1):
        runs = list((sweep / str(i) / "wandb").glob("offline-run-*/run-*.wandb"))
        assert len(runs) == 1
        blob = runs[0].read_bytes()
        # the group: job name + sweep folder (its date too: another day's sweep is another group), shared by both jobs
        assert b"train-multirun_2026-12-01_10-00-00" in blob


def test_failing_rank_exits_nonzero_with_message(forkrun, tmp_path):
    p = cli(forkrun, tmp_path, *SHORT, "dist.nproc=2", "data=text", "data.path=missing.txt")
    assert p.returncode != 0
    assert "missing.txt" in p.stderr and "exited with code 1" in p.stderr


def test_a_damaged_step_resumed_by_path_is_one_line_with_a_way_out_past_every_damaged_step(forkrun, tmp_path):
    """Every rank refuses the damaged step alike: the launcher says it once (not once a rank and once more), with
    a way out that falls back past every damaged step there (a resume by path does not fall back; naming the
    newest other step would name step-6, damaged too)."""
    saved = cli(forkrun, tmp_path, *SHORT, "checkpoint.every=2", "checkpoint.keep_last=3")
    assert saved.returncode == 0, saved.stderr
    steps = tmp_path / "run" / "checkpoints"
    for step in ("step-4", "step-6"):
        (steps / step / "__0_0.distcp").unlink()
    (tmp_path / "b").mkdir()
    p = cli(forkrun, tmp_path / "b", *SHORT, "dist.nproc=2", f"checkpoint.resume={steps / 'step-4'}")
    assert p.returncode == 1, p.stderr
    way = f"checkpoint.resume={steps}"
    line = (f"checkpoint {steps / 'step-4'} is damaged: {steps / 'step-4' / '__0_0.distcp'} is missing; "
            f"{way} falls back to the newest step there that verifies")
    assert p.stderr.count("is damaged") == 1 and f"error: {line}\n" in p.stderr, p.stderr
    (tmp_path / "c").mkdir()
    # The way out, as said, where the cwd also holds a newer run of the same model (latest would resume it): step 2
    other = forkrun.run("framework.train", [*SHORT, "checkpoint.every=2", "optimizer.lr=1e-4",
                                            f"hydra.run.dir={tmp_path / 'c' / 'outputs' / 'other'}"],
                        cwd=tmp_path / "c", env=ENV)
    assert other.returncode == 0, other.stderr
    p = cli(forkrun, tmp_path / "c", *SHORT, *shlex.split(way))
    assert p.returncode == 0 and f"resumed from {steps / 'step-2'} (step 2" in p.stdout, p.stderr[-3000:]


# zero1 and zero2 at 2 local ranks from the command line are the README test's (docs/stages.md, README.md; its
# `+stage=zero3 dist.nproc=2` is this test's zero3, tests/cli/test_readme.py COVERED); their
# launch, records and parameter count (a plain module's: the first test here) are the same code as zero3's here,
# whose count is the one that differs (its parameters are empty between uses).
@pytest.mark.parametrize("stage", ["zero3"])
def test_zero_stages_from_the_command_line(forkrun, tmp_path, stage):
    extra = ["stage.stage3_gather_16bit_weights_on_model_save=true"] if stage == "zero3" else []
    p = cli(forkrun, tmp_path, *SHORT, f"+stage={stage}", "dist.nproc=2", *extra)
    assert p.returncode == 0, p.stderr
    # Hydra's record, written by rank 0 (a spawned process) once the run's checks passed
    assert "dist.nproc=2" in (tmp_path / "run" / ".hydra" / "overrides.yaml").read_text()
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["config"]["stage"]["name"] == stage and summary["world"] == 2
    assert len(summary["memory_per_rank"]) == 2
    # Logical sizes under every stage (zero3's placeholders are empty between uses), and the
    # measured peak next to the ledger on each rank.
    vocab = summary["data"]["vocab_size"]
    assert summary["params"] == vocab * 32 + 16 * 32 + (12 * 32 * 32 + 2 * 32) + 32, summary["params"]
    peaks = summary["peak_memory_per_rank"]
    assert len(peaks) == 2 and all(p["peak_rss_bytes"] > 50 * 2**20 for p in peaks)
    if stage == "zero3":
        from safetensors.torch import load_file

        from framework import compose
        from framework.engine.build import component
        assert summary["exported"] == "model_16bit"   # consolidated safetensors, each rank writing its ranges
        weights = load_file(tmp_path / "run" / "model_16bit" / "model.safetensors")
        cfg = compose([o for o in SHORT if o.startswith("model.")])
        plain = component(cfg, "model").build(cfg.model, vocab_size=summary["data"]["vocab_size"])
        plain.load_state_dict(weights)


def _run(forkrun, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return forkrun.run("framework.train", [*SHORT, *args], cwd=cwd, env=ENV)


def test_run_folder_header_log_and_own_checkpoints(forkrun, tmp_path):
    """A run says where it writes, its train.log holds rank 0's console, its checkpoints live in
    its own folder: a rerun there resumes them, another run never does, unless pointed at them
    (``latest``, a path); a checkpoint of another model is refused on one line before any rank."""
    first = _run(forkrun, tmp_path, "checkpoint.every=2", "train.steps=4", "hydra.run.dir=outputs/a", "logger=wandb")
    assert first.returncode == 0, first.stderr
    run = tmp_path / "outputs" / "a"
    head = first.stdout.splitlines()[:3]
    assert head[0] == f"run folder: {run} (train.log: this console)", head
    assert "stage ddp | offload none | precision fp32 | world 1" in head[1], head
    assert f"metrics {run / 'metrics.jsonl'}" in head[2] and f"summary {run / 'summary.json'}" in head[2], head
    assert f"checkpoints {run / 'checkpoints'} (every 2 steps" in head[2], head
    log = (run / "train.log").read_text()
    assert log.startswith(first.stdout.splitlines()[0]) and "done: 4 steps" in log, log
    assert (run / "checkpoints" / "step-4" / "manifest.json").is_file()
    assert not (tmp_path / "checkpoints").exists()
    # W&B's summary has the run's tokens/s, not the last log window's that committing the step-4 row writes there
    [wb] = (run / "wandb").glob("offline-run-*/run-*.wandb")
    rates = [s["tokens_per_s"] for s in wandb_summaries(wb) if "tokens_per_s" in s]
    summary = json.loads((run / "summary.json").read_text())
    assert rates[-1] == summary["tokens_per_s"], rates
    # tokens/s over the training time, as the log windows' are: the evaluations' and the saves' seconds left out
    c = summary["config"]
    tokens = c["train"]["micro_batch"] * c["train"]["grad_accum"] * c["model"]["context"] * summary["steps_run"]
    assert summary["eval_s"] > 0 and summary["save_s"] > 0, summary
    assert summary["tokens_per_s"] == pytest.approx(
        tokens / (summary["elapsed_s"] - summary["eval_s"] - summary["save_s"]), rel=1e-9), summary

    other = _run(forkrun, tmp_path, "checkpoint.every=2", "train.steps=6", "hydra.run.dir=outputs/b")
    assert other.returncode == 0 and "resumed" not in other.stdout, other.stdout
    run_id = json.loads((run / "wandb-run-id").read_text())["id"]
    again = _run(forkrun, tmp_path, "checkpoint.every=2", "train.steps=6", "hydra.run.dir=outputs/a", "logger=wandb")
    assert f"resumed from {run / 'checkpoints' / 'step-4'}" in again.stdout, again.stdout
    # the resume goes on with the folder's W&B run (offline: a second record of the same run id)
    assert [p.name.endswith(f"-{run_id}") for p in (run / "wandb").glob("offline-run-*")] == [True, True]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["steps_run"] == 2   # tokens/s counts these two only

    newest = _run(forkrun, tmp_path, "checkpoint.resume=latest", "train.steps=7", "hydra.run.dir=outputs/c")
    assert f"resumed from {run / 'checkpoints' / 'step-6'}" in newest.stdout, newest.stdout
    # Into a folder with another run's records (b's, steps 2-6), from a's checkpoint: a new record there,
    # b's metrics.jsonl and summary.json set aside whole (not b's steps up to 4 followed by a's history).
    elsewhere = _run(forkrun, tmp_path, f"checkpoint.resume={run / 'checkpoints' / 'step-4'}", "train.steps=5",
                     "hydra.run.dir=outputs/b")
    assert f"resumed from {run / 'checkpoints' / 'step-4'}" in elsewhere.stdout, elsewhere.stdout
    b = tmp_path / "outputs" / "b"
    assert [json.loads(line)["step"] for line in (b / "metrics.jsonl").read_text().splitlines()] == [5, 5]
    assert json.loads((b / "summary.json.1").read_text())["steps"] == 6
    assert [json.loads(line)["step"] for line in (b / "metrics.jsonl.1").read_text().splitlines()] == [2, 3, 4, 6, 6]
    # Checkpoints on another disk (checkpoint.dir): a rerun resumes them and goes on with the same record.
    for steps in (2, 4):
        far = _run(forkrun, tmp_path, "checkpoint.every=2", f"train.steps={steps}", f"checkpoint.dir={tmp_path / 'ck'}",
                   "hydra.run.dir=outputs/f")
        assert far.returncode == 0, far.stderr
    f = tmp_path / "outputs" / "f"
    assert f"resumed from {tmp_path / 'ck'}" in far.stdout and not (f / "metrics.jsonl.1").exists(), far.stdout
    assert [json.loads(line)["step"] for line in (f / "metrics.jsonl").read_text().splitlines()][-1] == 4
    wrong = _run(forkrun, tmp_path, "checkpoint.resume=latest", "model.n_layer=2", "dist.nproc=2",
                 "hydra.run.dir=outputs/d")
    assert wrong.returncode != 0
    lines = error_lines(wrong)
    assert len(lines) == 1 and "was saved by another model (model.n_layer 1 vs 2" in lines[0], wrong.stderr
    assert "rank" not in wrong.stderr   # refused before any rank started

    # The same refusal for the folder a resume falls back to: the newest one's train state is damaged
    # (so the check before the ranks cannot read its config) and the older one has another n_head,
    # whose shapes fit this model.
    shutil.copytree(run / "checkpoints", tmp_path / "copy")
    (tmp_path / "copy" / "step-6" / "train_state.json").write_text("{")
    fallback = _run(forkrun, tmp_path, f"checkpoint.resume={tmp_path / 'copy'}", "model.n_head=4",
                    "train.steps=7", "hydra.run.dir=outputs/e")
    assert fallback.returncode != 0, fallback.stdout
    lines = error_lines(fallback)
    assert len(lines) == 1 and "step-4 was saved by another model (model.n_head 2 vs 4" in lines[0], fallback.stderr

    # Starting afresh where this run's saves would overwrite another run's checkpoints: refused.
    recorded = (run / ".hydra" / "overrides.yaml").read_text()
    afresh = _run(forkrun, tmp_path, "checkpoint.every=2", "checkpoint.resume=off", "hydra.run.dir=outputs/a")
    assert afresh.returncode != 0
    lines = error_lines(afresh)
    assert len(lines) == 1 and "holds 2 checkpoints, newest step-6, which this run's saves would" in lines[0], lines
    assert (run / ".hydra" / "overrides.yaml").read_text() == recorded   # the refused run's is not recorded
    # Rewound to step-4 and saved step-5: resume=auto continues that newest commit, not the
    # abandoned step-6 beside it.
    rewound = _run(forkrun, tmp_path, "checkpoint.every=2", f"checkpoint.resume={run / 'checkpoints' / 'step-4'}",
                   "train.steps=5", "hydra.run.dir=outputs/a")
    assert rewound.returncode == 0, rewound.stderr
    assert "rotates out" not in rewound.stdout, rewound.stdout   # (step-6 lies past train.steps=5: left alone)
    later = _run(forkrun, tmp_path, "checkpoint.every=2", "train.steps=7", "hydra.run.dir=outputs/a")
    assert f"resumed from {run / 'checkpoints' / 'step-5'}" in later.stdout, later.stdout
    # ... and says at the start that it replaces the later step-6 (rolling back is allowed, not silent)
    assert (f"checkpoint: resuming step-5 in {run / 'checkpoints'}, which holds the later step-6: this run saves over "
            f"or rotates out that step as it goes; set checkpoint.dir to another folder to keep it") in later.stdout

    # resume=latest whose newest checkpoint is damaged falls back to the one before it, as auto does: a train
    # state that reads as another model's but fails its manifest check is damage, not another model.
    state = run / "checkpoints" / "step-7" / "train_state.json"
    other, edits = re.subn(r'"n_layer": (\d+)', lambda m: f'"n_layer": {int(m[1]) + 1}', state.read_text(), 1)
    assert edits == 1
    state.write_text(other)
    damaged = _run(forkrun, tmp_path, "checkpoint.resume=latest", "train.steps=7", "hydra.run.dir=outputs/f")
    assert damaged.returncode == 0, damaged.stderr
    assert f"falling back to the previous checkpoint, {run / 'checkpoints' / 'step-6'}" in damaged.stdout, damaged.stdout
    assert f"resumed from {run / 'checkpoints' / 'step-6'} (step 6" in damaged.stdout, damaged.stdout

    # A checkpoint already past train.steps: said, and no NaN train loss for the steps nobody ran.
    past = _run(forkrun, tmp_path, f"checkpoint.resume={run / 'checkpoints' / 'step-6'}", "train.steps=4",
                "hydra.run.dir=outputs/g")
    assert past.returncode == 0, past.stderr
    # (the way to start afresh: not another checkpoint.dir, which would read the path named again)
    assert ("checkpoint: the checkpoint's step 6 is already past train.steps=4: nothing is trained; set train.steps "
            "above 6 to train on from it, or set checkpoint.resume=off to start this run afresh") in past.stdout
    assert "done: 6 steps | no step trained | val loss" in past.stdout and "loss nan" not in past.stdout, past.stdout
    assert " | - tok/s | " in past.stdout, past.stdout   # none measured, not 0
    past_summary = json.loads((tmp_path / "outputs" / "g" / "summary.json").read_text())
    assert past_summary["train_loss"] is None and past_summary["tokens_per_s"] is None, past_summary


def test_an_unwritable_checkpoint_folder_is_refused_before_training(forkrun, tmp_path):
    """Found before step 1 (one line), not at the first save after hours of training."""
    (tmp_path / "afile").write_text("x")
    p = _run(forkrun, tmp_path, "checkpoint.every=2", f"checkpoint.dir={tmp_path / 'afile'}", "hydra.run.dir=run")
    assert p.returncode != 0 and "loss" not in p.stdout, p.stdout   # no step ran
    lines = error_lines(p)
    assert len(lines) == 1 and f"checkpoint folder {tmp_path / 'afile'} is not writable" in lines[0], p.stderr


@pytest.mark.parametrize("sig,nproc,group", [("SIGTERM", 2, False), ("SIGTERM", 1, False), ("SIGINT", 1, True),
                                             ("SIGINT", 2, True), ("SIGINT", 2, False)])
def test_a_signalled_run_removes_its_swap_files(forkrun, tmp_path, sig, nproc, group):
    """SIGTERM to the launcher alone (kill, a Slurm time limit), Ctrl-C (SIGINT to the terminal's
    process group) and SIGINT to the launcher alone once it stepped: every rank unwinds and removes its
    swap files; each is one line per process (in train.log too) naming the signal sent, no traceback.
    (The command forked from the suite's fork server, in its own process group, with SIGINT as a terminal's.)"""
    import re
    import signal
    import time

    run = tmp_path / "run"
    p = forkrun.start("framework.train", [*SHORT[4:], "train.steps=100000", "train.log_every=1", "train.eval_every=0",
                                          "+stage=zero2", "offload=nvme", f"dist.nproc={nproc}", f"hydra.run.dir={run}"],
                      cwd=tmp_path, env={**ENV, "PYTHONFAULTHANDLER": "1"}, out=tmp_path / "out", err=tmp_path / "err",
                      timeout=300)
    try:
        deadline = time.monotonic() + 180
        while not ((run / "metrics.jsonl").exists() and (run / "metrics.jsonl").read_text()):
            assert p.poll() is None and time.monotonic() < deadline, (tmp_path / "err").read_text()
            time.sleep(0.2)
        assert list((run / "nvme").glob("rank*.swap"))
        (os.killpg if group else os.kill)(p.pid, getattr(signal, sig))
        deadline = time.monotonic() + 90   # it ends in seconds; a hang ends with every process's stacks in stderr
        while p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        if p.poll() is None:   # every process stopped, then each in turn (none reacts to another's end) prints
            os.killpg(p.pid, signal.SIGSTOP)   # its threads' stacks (faulthandler) and ends: SIGABRT
            for pid in _group(p.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGABRT)
                    os.kill(pid, signal.SIGCONT)
                time.sleep(1)
        rc = p.wait()
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    stderr = (tmp_path / "err").read_text()
    assert rc == (130 if sig == "SIGINT" else 143), stderr
    assert not (run / "nvme").exists() or list((run / "nvme").iterdir()) == []
    assert "Traceback" not in stderr, stderr
    said, last = ("interrupted", "interrupted") if sig == "SIGINT" else (r"terminated \(SIGTERM\)", "terminated (SIGTERM)")
    lines = [line for line in stderr.splitlines() if line.startswith(("interrupted", "terminated", "rank"))]
    want = [rf"{said} at step \d+"] if nproc == 1 else [rf"rank [01]: {said} at step \d+"] * 2 + [re.escape(last)]
    assert len(lines) == len(want), stderr
    assert all(any(re.fullmatch(w, line) for line in lines) for w in want), stderr
    log = (run / "train.log").read_text()
    assert re.search(rf"^{said} at step \d+$", log, re.M), log
    assert re.search(r"^nvme: rank 0 swaps \d+ bytes", log, re.M), log   # (rank 0's lines written whole)


def _group(pgid: int) -> list[int]:
    """The processes of process group ``pgid``, newest first (Linux)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[2]) == pgid:
                pids.append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):   # (a process that ended meanwhile)
            pass
    return sorted(pids, reverse=True)


def test_a_ranks_line_goes_out_in_one_write(tmp_path, monkeypatch):
    """Ranks share the launcher's stderr: a line and its newline in one write, so two ranks stopped together
    never print "rank 1: ...rank 0: ..." on one line (print wrote them apart; CI saw it)."""
    from framework.core.errors import say

    writes = []
    with open(tmp_path / "err", "w") as err:
        monkeypatch.setattr(sys, "stderr", err)
        monkeypatch.setattr(os, "write", lambda fd, data: writes.append((fd, data)) or len(data))
        say("rank 1: interrupted at step 1")
        assert writes == [(err.fileno(), b"rank 1: interrupted at step 1\n")]
    writes.clear()
    with open(tmp_path / "out", "w") as out:   # a rank's progress line on stdout (nvme, checkpoint fallback)
        monkeypatch.setattr(sys, "stdout", out)
        say("nvme: rank 1 swaps 4096 bytes", sys.stdout)
        assert writes == [(out.fileno(), b"nvme: rank 1 swaps 4096 bytes\n")]
    writes.clear()
    # rank 0's console is also its train.log: the line goes there too, still one write on the console
    from framework.loggers import console_log
    with open(tmp_path / "out", "w") as out:
        monkeypatch.setattr(sys, "stdout", out)
        with console_log(tmp_path / "train.log"):
            say("nvme: rank 0 swaps 4096 bytes", sys.stdout)
            assert writes == [(out.fileno(), b"nvme: rank 0 swaps 4096 bytes\n")]
    assert (tmp_path / "train.log").read_text() == "nvme: rank 0 swaps 4096 bytes\n"
    writes.clear()
    with open(tmp_path / "latin", "w", encoding="latin-1") as err:   # in the stream's encoding, as print's
        monkeypatch.setattr(sys, "stderr", err)
        say("error: report: /tmp/caf\u00e9 is not a folder")
        assert writes == [(err.fileno(), "error: report: /tmp/caf\u00e9 is not a folder\n".encode("latin-1"))]


def test_a_line_for_a_console_that_is_gone_raises_nothing(tmp_path, monkeypatch, capsys):
    """stderr closed (``2>&-``: sys.stderr is None): the line goes to stdout, as print's did; a reader
    that went away (a closed pipe): the line is dropped, no traceback in place of the run's own exit."""
    from framework.core.errors import say

    monkeypatch.setattr(sys, "stderr", None)
    say("error: checkpoint folder x is not writable")
    assert capsys.readouterr().out == "error: checkpoint folder x is not writable\n"
    r, w = os.pipe()
    os.close(r)
    with open(w, "w") as gone:
        monkeypatch.setattr(sys, "stderr", gone)
        say("rank 1: interrupted at step 1")
        gone.write("x")   # (pending, so that the flush before the line fails too)
        say("rank 1: interrupted at step 1")
        with contextlib.suppress(BrokenPipeError):
            gone.close()


def test_the_commands_reopen_a_stream_closed_at_start(tmp_path):
    """``>&- 2>&-``: Python's sys.stdout and sys.stderr are None, on which the run's first print failed; the
    commands give them os.devnull at descriptors 1 and 2, so that no file opened later takes those."""
    code = ("import os, sys\nfrom framework.cli import open_closed_streams\nopen_closed_streams()\n"
            "print('x', flush=True)\nsys.stderr.write('y')\nsys.stderr.flush()\n"
            f"with open({str(tmp_path / 'f')!r}, 'w') as f:\n    assert f.fileno() > 2, f.fileno()\n"
            "assert all(os.path.samefile(f'/proc/self/fd/{fd}', os.devnull) for fd in (1, 2))")
    child = subprocess.run(["sh", "-c", 'exec "$0" -c "$1" >&- 2>&-', sys.executable, code], timeout=60,
                           env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert child.returncode == 0


def _sweep_with_a_bar_in_an_override(root: Path) -> None:
    for i in (0, 1):
        (root / str(i) / ".hydra").mkdir(parents=True)
        (root / str(i) / ".hydra" / "overrides.yaml").write_text(f"- optimizer.lr=0.00{i + 1}\n- data.path=/d/a|b{i}.txt\n")
        (root / str(i) / "summary.json").write_text(json.dumps({"steps": 6, "train_loss": 4.1, "val_loss": 4.2,
                                                                "steps_run": 6 - 6 * i}))
        (root / str(i) / "metrics.jsonl").write_text('{"step": 2, "loss": 4.1}\n{"step": 6, "val_loss": 4.2}\n')


def test_a_bar_in_an_override_keeps_the_reports_columns(tmp_path):
    """``data.path=/d/a|b.txt``: the | is escaped in its cell (as GitHub's tables take it), not a column's end."""
    import re

    from framework.cli import report

    _sweep_with_a_bar_in_an_override(tmp_path)
    rows = report.markdown_table(report.load_jobs(tmp_path), tmp_path).splitlines()
    assert len({len(re.split(r"(?<!\\)\|", row)) for row in rows}) == 1, rows
    assert "`data.path=/d/a\\|b0.txt`" in rows[2], rows
    # a job resumed at its last step trained nothing: its numbers are those of the state it loaded
    assert [" 6 (resumed, no step trained) " in row for row in rows[2:]] == [False, True], rows


def test_a_report_whose_reader_left_ends_quietly(tmp_path, monkeypatch):
    """``python -m framework.report DIR | head``: the reader gone, the report is written all the same and
    nothing fails, at exit either (nothing left pending for the stream's last flush)."""
    from framework.cli import report

    _sweep_with_a_bar_in_an_override(tmp_path)
    r, w = os.pipe()
    os.close(r)   # the reader is gone
    with open(w, "w") as gone:
        monkeypatch.setattr(sys, "stdout", gone)
        report.main([str(tmp_path)])
        monkeypatch.undo()
        gone.close()
    assert (tmp_path / "report.md").is_file() and (tmp_path / "loss.png").is_file()


@pytest.mark.parametrize("fault", ["step:2@1", "step:2@1,raise", "step:2@0,raise", "step:2@0,fail"])
def test_a_spawned_rank_that_died_is_named_and_train_log_keeps_what_ended_the_run(forkrun, tmp_path, fault):
    """A rank gone without a word (os._exit, as a kill or a crash in native code): the launcher's line
    does not point at an error above that is not there, and torch's own line about stopping the
    others is not printed. A rank's bug: its traceback, then the launcher's line. Either way train.log
    (rank 0's console, which ended with the stop the launcher sent it) ends with what the console showed;
    rank 0's own bug is there once (its console wrote it). A rank's error slow to exit (W&B's teardown) is
    named, not the peer that exited first on losing it."""
    p = forkrun.run("tests._fault_train", [*SHORT, "dist.nproc=2", "train.steps=20", f"hydra.run.dir={tmp_path / 'run'}"],
                    cwd=tmp_path, env={**ENV, "FRAMEWORK_FAULT": fault})
    assert p.returncode == 1, p.stderr
    assert "Terminating process" not in p.stderr, p.stderr
    log = (tmp_path / "run" / "train.log").read_text()
    if fault in ("step:2@1", "step:2@0,fail"):
        rank, code = ("1", 17) if fault == "step:2@1" else ("0", 1)
        # (the peer ends by itself on losing the rank, or is stopped if that takes it past the launcher's grace)
        found = re.search(rf"error: rank {rank} of 2 exited with code {code} \(anything it printed is above\); the "
                          r"other ranks (were stopped|ended by themselves)\n", p.stderr)
        assert found and "Traceback" not in p.stderr, p.stderr
        line = found.group(0)[:-1]
        assert code == 17 or "error: rank 0: FRAMEWORK_FAULT: rank 0 fails at step:2\n" in p.stderr, p.stderr
        assert log.endswith(f"\n{line}\n"), log[-2000:]   # (after rank 0's own end: its stop, or its peer lost)
        return
    rank = fault[fault.index("@") + 1]
    line = f"error: rank {rank} of 2 failed: RuntimeError: FRAMEWORK_FAULT: rank {rank} raises at step:2"
    trace = p.stderr[p.stderr.rindex("Traceback (most recent call last):"):p.stderr.index(line)]
    assert 'in fault\n    raise RuntimeError(f"FRAMEWORK_FAULT: ' in trace, p.stderr[-3000:]
    assert log.endswith(f"{trace}{line}\n" if rank == "1" else f"\n{line}\n"), log[-3000:]
    assert log.count("Traceback (most recent call last):") == 1, log[-6000:]


def test_a_checkpoint_folder_removed_during_a_run_is_locked_again_or_refused(tmp_path, capsys):
    """``rm -rf`` of the checkpoint folder mid-run: the next save takes its lock again (said once), so that a second
    run into it is refused; where a second run got in first and holds it, the save is refused, never mixed in."""
    from framework import compose
    from framework.cli.launch import launch, own_checkpoint_dir
    from framework.core.errors import CheckpointError, FrameworkError
    from framework.loggers import RunInfo

    ckpt = tmp_path / "ckpt"
    cfg = compose([*SHORT, "checkpoint.every=2", f"checkpoint.dir={ckpt}"])
    second = []

    def removed(point: str) -> None:
        if point == "step:3":   # (step 2 saved)
            shutil.rmtree(ckpt)
        if point == "step:5":   # (step 4 saved, into the folder made again): a second run is refused
            with pytest.raises(FrameworkError, match=f"checkpoint.dir {ckpt} is in use by another run"):
                os.close(own_checkpoint_dir(ckpt))
            second.append(point)
    capsys.readouterr()
    launch(cfg, RunInfo(tmp_path / "a", None, None), on_point=removed)
    err = capsys.readouterr().err
    assert second == ["step:5"] and sorted(p.name for p in ckpt.glob("step-*")) == ["step-4", "step-6"]
    assert err.count(f"warning: checkpoint: checkpoint.dir {ckpt} lost this run's .lock (the folder removed during "
                     "the run?): locked it again, so that no other run saves there") == 1, err

    shutil.rmtree(ckpt)   # (a run that starts afresh)
    held = []

    def taken(point: str) -> None:
        if point == "step:3":   # removed, and a second run saves there now
            shutil.rmtree(ckpt)
            held.append(own_checkpoint_dir(ckpt))
    try:
        with pytest.raises(CheckpointError, match=rf"not saving step 4: rank 0: checkpoint.dir {re.escape(str(ckpt))} "
                                                  rf"lost this run's \.lock .* and another run \(pid {os.getpid()} .*\)"
                                                  " saves there now") as got:
            launch(cfg, RunInfo(tmp_path / "b", None, None), on_point=taken)
    finally:
        for fd in held:
            os.close(fd)
    # (this run's checkpoints went with the folder; those there are the other run's: none said to be kept)
    assert str(got.value).endswith("with checkpoint.dir set to a folder of its own"), got.value
    assert not list(ckpt.glob("step-*"))
