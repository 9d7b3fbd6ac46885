"""The run folder's records (metrics.jsonl, summary.json), its owner lock, and the W&B logger's
checks and exit code, on one process without training."""
import importlib.util
import json
import os
import re
import sys
import time

import pytest

from framework import ConfigError, compose
from framework.core.errors import FrameworkError
from framework.loggers import RunInfo, RunRecord
from tests._helpers import wandb_records

# wandb is in pyproject's dependencies but not on the GPU image; the tests of the framework's own line for a
# missing wandb run without it
needs_wandb = pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="needs wandb: pip install wandb")


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _started(record):
    record.start({}, 1)
    return record


def _earlier_run(folder, steps=(2, 4, 6)):
    folder.mkdir(exist_ok=True)
    lines = [json.dumps({"step": s, "loss": 1.0 / s}) for s in steps] + ['{"step": 6, "val_lo']   # cut short
    (folder / "metrics.jsonl").write_text("\n".join(lines))
    (folder / "summary.json").write_text(json.dumps({"steps": steps[-1], "train_loss": 0.5, "val_loss": 0.6,
                                                              "tokens_per_s": 100.0}))


def test_a_fresh_start_sets_the_earlier_runs_records_aside(tmp_path):
    _earlier_run(tmp_path)
    old = (tmp_path / "metrics.jsonl").read_text()
    record = _started(RunRecord(tmp_path, start=0))
    record.log({"step": 2, "loss": 9.0})
    record.close()
    assert _records(tmp_path / "metrics.jsonl") == [{"step": 2, "loss": 9.0}]   # this run's only
    assert (tmp_path / "metrics.jsonl.1").read_text() == old                    # nothing lost
    assert json.loads((tmp_path / "summary.json.1").read_text())["steps"] == 6
    assert not (tmp_path / "summary.json").exists()   # no summary of another run beside this run's records
    _earlier_run(tmp_path)
    _started(RunRecord(tmp_path, start=0)).close()   # the next free number
    assert (tmp_path / "metrics.jsonl.2").read_text() == old and (tmp_path / "summary.json.2").is_file()


def test_a_resume_drops_the_records_after_its_step(tmp_path):
    _earlier_run(tmp_path)
    old = (tmp_path / "metrics.jsonl").read_text()
    record = _started(RunRecord(tmp_path, start=4))
    record.log({"step": 6, "loss": 9.0})
    record.close()
    assert [r["step"] for r in _records(tmp_path / "metrics.jsonl")] == [2, 4, 6]   # step 6 once: this run's
    assert _records(tmp_path / "metrics.jsonl")[-1]["loss"] == 9.0
    assert (tmp_path / "metrics.jsonl.1").read_text() == old
    # The summary of step 6 went with the history it ends: a run interrupted now has none of another history.
    assert json.loads((tmp_path / "summary.json.1").read_text())["steps"] == 6
    assert not (tmp_path / "summary.json").exists()


def test_a_resume_with_nothing_after_its_step_leaves_the_records_alone(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 2, "loss": 1.0}\n')
    (tmp_path / "summary.json").write_text('{"steps": 2}')
    _started(RunRecord(tmp_path, start=2)).close()
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 2, "loss": 1.0}\n'
    assert (tmp_path / "summary.json").read_text() == '{"steps": 2}'   # of this history's step
    assert not (tmp_path / "metrics.jsonl.1").exists() and not (tmp_path / "summary.json.1").exists()


@pytest.mark.parametrize("start", [0, 4])
@pytest.mark.parametrize("name, damaged", [("metrics.jsonl", '{"step": null}\n'), ("metrics.jsonl", '{"step": "3"}\n'),
                                           ("metrics.jsonl", '{"step": true}\n'), ("summary.json", "[1]"),
                                           ("summary.json", '{"steps": "2"}'),
                                           ("summary.json", '{"steps": 4, "train_loss": "0.5"}')])
def test_a_damaged_record_is_set_aside_not_a_traceback(tmp_path, capsys, name, damaged, start):
    (tmp_path / "metrics.jsonl").write_text('{"step": 2, "loss": 1.0}\n')
    (tmp_path / "summary.json").write_text('{"steps": 2}')
    (tmp_path / name).write_text(damaged if name == "summary.json" else '{"step": 2, "loss": 1.0}\n' + damaged)
    record = _started(RunRecord(tmp_path, start=start))
    record.finish({"steps": 4, "steps_run": 0, "train_loss": None, "val_loss": 0.5})
    record.close()
    assert (tmp_path / f"{name}.1").read_text().endswith(damaged)   # nothing lost
    assert f"{name} " in capsys.readouterr().out and json.loads((tmp_path / "summary.json").read_text())["steps"] == 4


def test_a_run_that_trained_no_step_keeps_the_summary_of_that_step(tmp_path, capsys):
    """Re-running a finished run (resumed at train.steps) never replaces its summary with NaN."""
    _earlier_run(tmp_path, steps=(2,))
    before = (tmp_path / "summary.json").read_text()
    record = _started(RunRecord(tmp_path, start=2))
    record.finish({"steps": 2, "steps_run": 0, "train_loss": None, "val_loss": 0.6})
    record.close()
    assert (tmp_path / "summary.json").read_text() == before
    assert "summary.json of step 2 kept" in capsys.readouterr().out
    # one of that step whose numbers are missing is written over, not printed with a KeyError
    (tmp_path / "summary.json").write_text('{"steps": 2}')
    record = _started(RunRecord(tmp_path, start=2))
    record.finish({"steps": 2, "steps_run": 0, "train_loss": None, "val_loss": 0.6, "tokens_per_s": None})
    record.close()
    assert json.loads((tmp_path / "summary.json").read_text())["val_loss"] == 0.6
    # Another step's summary (or none): this one is written.
    record = _started(RunRecord(tmp_path, start=4))
    record.finish({"steps": 4, "steps_run": 0, "train_loss": None, "val_loss": 0.5})
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 4
    # That of another job (a resume that took on its state): this run's config, this one's numbers; one that
    # differs only in how long, how visibly or where it ran (the same job) is kept.
    config = {"optimizer": {"lr": 1e-3}, "train": {"steps": 4, "micro_batch": 2}, "checkpoint": {"resume": "auto"}}
    same = {**config, "train": {"steps": 2, "micro_batch": 2}, "checkpoint": {"resume": "/elsewhere"},
            "dist": {"backend": "gloo"}, "offload": {"nvme_path": "/swap/b"},   # how it ran; the vocabulary as built
            "model": {"vocab_size": 64, "activation_checkpointing": True}}
    config = {**config, "offload": {"nvme_path": "/swap/a"}, "model": {"vocab_size": 65}}
    for mine, kept in (({**config, "optimizer": {"lr": 5e-4}}, False), (same, True)):
        (tmp_path / "summary.json").write_text(json.dumps({"steps": 4, "train_loss": 0.5, "val_loss": 0.6,
                                                           "tokens_per_s": 100.0, "config": config}))
        record = _started(RunRecord(tmp_path, start=4))
        record.finish({"steps": 4, "steps_run": 0, "train_loss": None, "val_loss": 0.7, "config": mine})
        record.close()
        assert json.loads((tmp_path / "summary.json").read_text())["val_loss"] == (0.6 if kept else 0.7), mine


def test_an_error_that_ends_the_run_is_in_train_log(tmp_path):
    """Not only the framework's own errors: a bug or CUDA running out of memory is the line a run's log
    most needs (its type, message and traceback)."""
    from framework.loggers import console_log

    for i, error in enumerate((RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), ConfigError("bad key"))):
        with pytest.raises(type(error)), console_log(tmp_path / f"train{i}.log"):
            print("step 3 | loss 4.1647")
            raise error
        log = (tmp_path / f"train{i}.log").read_text()
        assert log.startswith("step 3 | loss 4.1647\n"), log
        said = "RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB" if i == 0 else "bad key"
        assert f"error: {said}\n" in log, log
    assert "Traceback" in (tmp_path / "train0.log").read_text()


def test_non_finite_values_are_written_as_null(tmp_path):
    """A diverged run's NaN val loss is null in summary.json (strict JSON readers refuse a bare NaN);
    a kept summary with a null val loss still makes its console line."""
    from framework.loggers.console import summary_line

    nan, inf = float("nan"), float("inf")
    record = _started(RunRecord(tmp_path))
    record.log({"step": 1, "loss": inf, "grad_norm": nan, "peaks": [1.0, -inf]})
    record.finish({"steps": 1, "steps_run": 1, "train_loss": None, "val_loss": nan, "tokens_per_s": 10.0,
                   "data": {"entropy_floor": 1.5}})
    record.close()

    def strict(text):
        return json.loads(text, parse_constant=lambda word: pytest.fail(f"{word} in {text}"))

    assert strict((tmp_path / "metrics.jsonl").read_text()) == {"step": 1, "loss": None, "grad_norm": None,
                                                                "peaks": [1.0, None]}
    summary = strict((tmp_path / "summary.json").read_text())
    assert summary["val_loss"] is None and summary["tokens_per_s"] == 10.0
    assert "| val loss nan |" in summary_line(summary)


def test_one_live_run_per_folder(tmp_path):
    from framework.cli.launch import own_run_folder

    fd = own_run_folder(RunInfo(tmp_path / "run", group=None, name=None))
    try:
        with pytest.raises(FrameworkError, match=r"run folder .*/run is in use by another run .*hydra\.run\.dir="):
            own_run_folder(RunInfo(tmp_path / "run", group=None, name=None))
        with pytest.raises(FrameworkError, match=r"hydra\.sweep\.dir="):   # a multirun job's folder
            own_run_folder(RunInfo(tmp_path / "run", group="train-x", name="seed=1"))
    finally:
        os.close(fd)
    os.close(own_run_folder(RunInfo(tmp_path / "run", group=None, name=None)))   # free again


def test_one_live_saving_run_per_checkpoint_folder(tmp_path):
    """Two runs saving into one checkpoint.dir would overwrite, rotate and delete each other's steps: the second is
    refused, naming the holder. The lock file is no step folder (scans, pruning and clean-up pass it over), and a
    checkpoint folder that is the run folder itself takes both locks."""
    from framework.cli.launch import CHECKPOINT_LOCK, own_checkpoint_dir, own_run_folder
    from framework.persist import stepfolders

    root = tmp_path / "ckpt"
    fd = own_checkpoint_dir(root)
    try:
        with pytest.raises(FrameworkError, match=rf"checkpoint\.dir {root} is in use by another run \(pid {os.getpid()} "
                                                 r"on host .+\): wait for it .* set checkpoint\.dir to another folder"):
            own_checkpoint_dir(root)
        stepfolders.remove_stale(root)
        assert stepfolders.scan(root) == ([], []) and (root / CHECKPOINT_LOCK).is_file()
    finally:
        os.close(fd)
    os.close(own_checkpoint_dir(root))   # free again
    run = own_run_folder(RunInfo(tmp_path / "run", group=None, name=None))
    try:
        os.close(own_checkpoint_dir(tmp_path / "run"))
    finally:
        os.close(run)
    (tmp_path / "other" / CHECKPOINT_LOCK).mkdir(parents=True)   # unopenable (another user's lock file alike)
    with pytest.raises(ConfigError, match=rf"cannot open {tmp_path / 'other' / CHECKPOINT_LOCK} to lock its folder "
                                          r"\(Is a directory\): remove it, or give this run another folder"):
        own_checkpoint_dir(tmp_path / "other")


def test_a_file_system_without_flock_runs_unlocked_with_a_note(tmp_path, monkeypatch, capsys):
    """Lustre without -o flock answers ENOSYS, NFS without lockd ENOLCK: the run goes on (a note says
    a second run is not detected there) instead of every run stopping on a traceback."""
    import errno
    import fcntl

    from framework.cli import launch

    def no_flock(fd, op):
        raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS))

    monkeypatch.setattr(fcntl, "flock", no_flock)
    os.close(launch.own_run_folder(RunInfo(tmp_path / "run", group=None, name=None)))
    err = capsys.readouterr().err
    assert err.startswith("note: ") and "cannot lock run.lock" in err and err.count("\n") == 1, err


def test_no_room_for_the_run_record_is_one_line(tmp_path):
    """A full disk (or a file size limit, a quota) under metrics.jsonl or summary.json ends the run with one
    line naming the file and the folder; closing the record (what the failed write left) adds no second error."""
    from tests._helpers import file_size_limit

    record = _started(RunRecord(tmp_path))
    with file_size_limit(1000), pytest.raises(FrameworkError) as e:
        try:
            for step in range(1, 100):
                record.log({"step": step, "loss": 1.0 / step, "lr": 1e-3, "tokens_per_s": 1234.5})
        finally:
            record.close()
    assert str(e.value).startswith(f"no room to write metrics.jsonl in {tmp_path} (File too large; "), e.value
    assert "free space" in str(e.value) and "\n" not in str(e.value)
    record = _started(RunRecord(tmp_path / "b"))
    with file_size_limit(100), pytest.raises(FrameworkError, match=f"^no room to write summary.json in {tmp_path / 'b'} "):
        record.finish({"steps": 1, "steps_run": 1, "train_loss": None, "val_loss": 1.0, "notes": "x" * 200})
    record.close()


def test_a_record_that_cannot_be_written_is_one_line_before_the_run_starts(tmp_path, capsys):
    """A folder (or a file it may not append to) in the place of train.log, metrics.jsonl or summary.json: one
    line naming it and the fix before the run starts, not a traceback (summary.json's after training). Past that
    check, opening metrics.jsonl says it in one line too, and train.log is a note (the console goes on)."""
    from framework.cli.launch import launch
    from framework.loggers import console_log
    from tests._helpers import tiny_config

    for name in ("train.log", "metrics.jsonl", "summary.json"):
        run = tmp_path / name.split(".")[0]
        (run / name).mkdir(parents=True)
        with pytest.raises(ConfigError) as e:
            launch(tiny_config("train.steps=1"), RunInfo(run, None, None))
        assert str(e.value) == f"cannot write {run / name} (a folder): fix its permissions, move it away if it is " \
                               "not a file, or give this run a folder of its own: hydra.run.dir=PATH"
        assert sorted(p.name for p in run.iterdir()) == sorted(["run.lock", name])   # nothing else written
    with pytest.raises(FrameworkError) as e:
        _started(RunRecord(tmp_path / "metrics"))
    assert str(e.value) == f"cannot write {tmp_path / 'metrics' / 'metrics.jsonl'} (Is a directory): fix its " \
                           "permissions, move it away if it is not a file, or choose another run folder"
    capsys.readouterr()
    with console_log(tmp_path / "train" / "train.log"):
        print("step 1")
    assert capsys.readouterr().out == f"step 1\n(train.log cannot be written: {tmp_path / 'train' / 'train.log'}: " \
                                      "Is a directory; the console goes on alone)\n"


def test_an_earlier_runs_records_it_may_not_append_to_are_no_reason_to_refuse(tmp_path, monkeypatch):
    """metrics.jsonl and summary.json of an earlier run are set aside (or replaced) by a rename, which the folder's
    permissions decide, not the file's: a read-only one is no reason to refuse the run; a train.log is appended."""
    from framework.core import files
    from framework.loggers._base import check_records

    for name in ("train.log", "metrics.jsonl", "summary.json"):
        (tmp_path / name).write_text("earlier run\n")
    opened = files.open_nofollow

    def read_only(path, flags, *args):   # (as root, which this suite may run as, a chmod 400 file stays writable)
        if flags & (os.O_WRONLY | os.O_RDWR):
            raise PermissionError(13, "Permission denied")
        return opened(path, flags, *args)
    monkeypatch.setattr(files, "open_nofollow", read_only)
    with pytest.raises(ConfigError, match=re.escape(f"cannot write {tmp_path / 'train.log'} (Permission denied)")):
        check_records(tmp_path, "hydra.run.dir")
    (tmp_path / "train.log").unlink()
    check_records(tmp_path, "hydra.run.dir")


def test_a_train_log_without_room_ends_nothing_and_the_console_goes_on(tmp_path):
    """train.log on a full disk is as a console that is gone: noted once (on the console), the run and its
    console go on, and the error that ends the run is the run's own, not a failed write of the log's.
    (In a child process: a file size limit in pytest's own process also fails pytest's writes to its
    capture and log files, which are past the limit already.)"""
    import subprocess
    from pathlib import Path

    script = f"""
import resource, signal
from pathlib import Path
from framework.core.errors import FrameworkError
from framework.loggers import console_log
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (200, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
try:
    with console_log(Path({str(tmp_path / "train.log")!r})):
        for step in range(20):
            print(f"step {{step}} | loss 4.1647")
        raise FrameworkError("the run's own error")
except FrameworkError as e:
    print(f"raised: {{e}}")
"""
    child = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                           env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    out = child.stdout.splitlines()
    assert child.returncode == 0 and out[-1] == "raised: the run's own error", (child.stdout, child.stderr)
    assert [line for line in out if line.startswith("step")] == [f"step {i} | loss 4.1647" for i in range(20)], out
    assert sum("(train.log cannot be written: [Errno 27] File too large; the console goes on alone)" == line
               for line in out) == 1, out
    assert (tmp_path / "train.log").read_text().startswith("step 0 | loss 4.1647\n")


def test_a_run_its_logger_refuses_leaves_the_folders_records_as_they_were(tmp_path):
    """W&B refusing to start the run (a ConfigError): the folder's earlier records are not set aside."""
    from framework.loggers import NullLogger

    class Refusing(NullLogger):
        def start(self, config, total_steps):
            raise ConfigError("logger=wandb: W&B refused to start the run")

    _earlier_run(tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    record = RunRecord(tmp_path, Refusing(), start=0)
    with pytest.raises(ConfigError):
        record.start({}, 1)
    record.close()
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


class _FakeRun:
    def __init__(self):
        self.summary, self.exit_code = {}, "not finished"

    def finish(self, exit_code=None):
        self.exit_code = exit_code


def test_a_failed_run_is_finished_in_wandb_with_exit_code_1():
    from framework.loggers.wandb import WandbConfig, WandbLogger

    for finished, code in ((False, 1), (True, None)):
        logger = WandbLogger(WandbConfig(live=False), run=RunInfo(None, None, None))
        logger.run = run = _FakeRun()
        if finished:
            logger.finish({"steps": 2, "train_loss": 1.0, "val_loss": 1.0, "tokens_per_s": 1.0})
        logger.close()
        assert run.exit_code == code


class _DyingRun(_FakeRun):
    """A W&B run whose service process died after ``lives`` records: every call to it fails as W&B's does."""

    def __init__(self, lives):
        super().__init__()
        self.lives, self.logged = lives, []

    def log(self, data, step=None, commit=None):
        if len(self.logged) == self.lives:
            raise ConnectionResetError("Connection lost")
        self.logged.append(step)

    def finish(self, exit_code=None):
        if len(self.logged) == self.lives:
            raise ConnectionResetError("Connection lost")
        super().finish(exit_code)


@needs_wandb
def test_wandb_failing_mid_run_is_one_note_and_the_run_goes_on(tmp_path, capsys):
    """W&B's service gone mid-run (a failing run.log, then run.finish): noted once, W&B dropped, and the run's
    records go on to the end; closing raises nothing either."""
    from framework.loggers.wandb import WandbConfig, WandbLogger

    # dies while logging; dies after the last record (6 steps, then finish's commit of the open row), so that
    # closing (run.finish) fails
    for lives in (3, 7):
        record = _started(RunRecord(tmp_path / str(lives)))
        record.logger = logger = WandbLogger(WandbConfig(live=False), run=RunInfo(tmp_path, None, None))
        logger.run = run = _DyingRun(lives)
        for step in range(1, 7):
            record.log({"step": step, "loss": 1.0, "lr": 1e-3, "tokens_per_s": 1.0})
        record.finish({"steps": 6, "steps_run": 6, "train_loss": 1.0, "val_loss": 1.0, "tokens_per_s": 1.0})
        record.close()
        assert [r["step"] for r in _records(tmp_path / str(lives) / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]
        assert run.logged == [*range(1, min(lives, 6) + 1), *[None][:lives - 6]] and logger.run is None
        assert bool(run.summary) == (lives == 7)
        err = capsys.readouterr().err
        assert err.count("note: W&B stopped (ConnectionResetError: Connection lost); this run logs no more to W&B, "
                         "metrics.jsonl goes on\n") == 1 and "Traceback" not in err, err


def test_the_wandb_pyproject_takes_starts_runs_as_the_logger_asks():
    """The logger passes wandb.init(reinit="finish_previous") (a sweep's jobs share a process): wandb before
    0.19.9 takes only a bool there and refuses every run, so pyproject asks for 0.19.9 or later."""
    import inspect
    import re
    import tomllib
    from pathlib import Path

    from framework.loggers.wandb import WandbLogger

    assert 'reinit="finish_previous"' in inspect.getsource(WandbLogger.start)
    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    pins = [d.replace(" ", "") for d in pyproject["project"]["dependencies"] if re.match(r"wandb\b", d)]
    assert len(pins) == 1 and (low := re.fullmatch(r"wandb>=([\d.]+)", pins[0])), pins
    assert tuple(map(int, low.group(1).split("."))) >= (0, 19, 9), pins


@pytest.mark.parametrize("overrides,env,says", [
    (["logger.project=a/b"], {}, "logger.project='a/b' has a character W&B refuses"),
    (["logger.project='a#b'"], {}, "logger.project='a#b' has a character W&B refuses"),
    ([], {"WANDB_MODE": "bogus"}, "WANDB_MODE='bogus' is not one of online, offline, shared, disabled, dryrun, run"),
    (["logger.mode=bogus"], {}, "logger.mode='bogus' is not one of online, offline, shared, disabled, dryrun, run"),
    (["logger.tags=[" + "t" * 70 + "]"], {}, "the tag 'tttt"),
    (["logger.tags=['']"], {}, "the tag '' is 0 characters long; W&B takes tags of 1 to 64 characters"),
    (["logger.project=" + "p" * 129], {}, "logger.project is 129 characters long; W&B takes at most 128"),
    pytest.param([], {"WANDB_MODE": "online"}, "WANDB_MODE=online logs to the W&B server, and no W&B API key is "
                 "configured: set WANDB_API_KEY", marks=needs_wandb),   # (the key look-ups are wandb's)
    pytest.param(["logger.mode=shared"], {}, "logger.mode=shared logs to the W&B server, and no W&B API key is "
                 "configured", marks=needs_wandb),
    pytest.param([], {"WANDB_MODE": "online", "WANDB_API_KEY": "short"}, "logger=wandb: WANDB_API_KEY invalid",
                 marks=needs_wandb),
    ([], {"no wandb": ""}, "logger=wandb needs wandb, which is not installed: pip install wandb, or logger=console"),
])
def test_wandb_settings_are_checked_when_composing(monkeypatch, tmp_path, overrides, env, says):
    _no_wandb_credentials(monkeypatch, tmp_path)
    for k, v in env.items():
        if k == "no wandb":
            monkeypatch.setitem(sys.modules, "wandb", None)   # import wandb fails
        else:
            monkeypatch.setenv(k, v)
    with pytest.raises(ConfigError) as e:
        compose(["logger=wandb", *overrides])
    assert says in str(e.value) and "\n" not in str(e.value)


@needs_wandb
def test_logger_mode_comes_before_wandb_mode(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "bogus")
    compose(["logger=wandb", "logger.mode=offline"])   # WANDB_MODE is not read


@needs_wandb
def test_wandb_keys_of_its_own_under_mode_disabled_are_noted(monkeypatch, tmp_path):
    """W&B's mode disabled records nothing: a project, entity or tags of its own are said to change nothing (from
    logger.mode or WANDB_MODE); the defaults, or another mode, say nothing."""
    _no_wandb_credentials(monkeypatch, tmp_path)
    says = ("note: logger.project and logger.tags change nothing with logger.mode=disabled (W&B records nothing); drop "
            "them, or use logger.mode=offline to keep a W&B run in the run folder")
    assert says in compose(["logger=wandb", "logger.mode=disabled", "logger.project=foo", "logger.tags=[a]"]).notices
    assert not [n for n in compose(["logger=wandb", "logger.mode=disabled"]).notices if "logger." in n]
    offline = compose(["logger=wandb", "logger.mode=offline", "logger.entity=e"]).notices
    assert not [n for n in offline if "logger." in n]
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert "note: logger.entity changes nothing with WANDB_MODE=disabled (W&B records nothing); drop it, or use " \
           "logger.mode=offline to keep a W&B run in the run folder" in \
        compose(["logger=wandb", "logger.entity=e"]).notices


def _no_wandb_credentials(monkeypatch, tmp_path):
    """No W&B key anywhere W&B looks (environment, .netrc, its settings files), and a server address
    that refuses at once: nothing here may reach the network."""
    for k in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_MODE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")


@needs_wandb
def test_every_mode_wandb_takes_is_accepted_and_a_configured_key_goes_online(monkeypatch, tmp_path):
    import typing

    from wandb.sdk.wandb_settings import Settings

    from framework.loggers.wandb import MODES

    assert set(MODES) == set(typing.get_args(Settings.model_fields["mode"].annotation))
    _no_wandb_credentials(monkeypatch, tmp_path)
    for m in ("offline", "dryrun", "disabled"):
        compose(["logger=wandb", f"logger.mode={m}", "logger.tags=[a," + "t" * 64 + "]", "logger.project=" + "p" * 128])
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    for m in ("online", "shared", "run"):
        compose(["logger=wandb", f"logger.mode={m}"])


@needs_wandb
def test_a_wandb_without_its_private_key_lookup_checks_the_environment_and_netrc(monkeypatch, tmp_path):
    """Older wandb (pyproject takes >=0.19.9) has no wandb.sdk.lib.wbauth: the check when composing falls back to
    WANDB_API_KEY and the .netrc entry for the server's host, never a traceback."""
    import wandb.sdk.lib

    _no_wandb_credentials(monkeypatch, tmp_path)
    monkeypatch.delattr(wandb.sdk.lib, "wbauth", raising=False)
    monkeypatch.setitem(sys.modules, "wandb.sdk.lib.wbauth", None)   # import fails, as where it does not exist
    with pytest.raises(ConfigError, match="no W&B API key is configured"):
        compose(["logger=wandb", "logger.mode=online"])
    (tmp_path / "no-netrc").write_text("machine api.wandb.ai login user password " + "k" * 40 + "\n")
    with pytest.raises(ConfigError, match="no W&B API key is configured"):   # another host's key
        compose(["logger=wandb", "logger.mode=online"])
    (tmp_path / "no-netrc").write_text("machine 127.0.0.1:9 login user password " + "k" * 40 + "\n")
    compose(["logger=wandb", "logger.mode=online"])
    (tmp_path / "no-netrc").unlink()
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    compose(["logger=wandb", "logger.mode=online"])


@needs_wandb
@pytest.mark.parametrize("cfg,says", [
    (dict(tags=["t" * 70]), "Tag 'tttt"),
    (dict(mode="online"), "No API key configured"),
])
def test_wandb_refusing_to_start_the_run_is_one_line(monkeypatch, tmp_path, cfg, says):
    """What the check when composing cannot see (a settings file, a server's refusal): one line, no traceback."""
    from framework.loggers.wandb import WandbConfig, WandbLogger

    _no_wandb_credentials(monkeypatch, tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")
    logger = WandbLogger(WandbConfig(live=False, **cfg), run=RunInfo(tmp_path / "run", None, None))
    with pytest.raises(ConfigError) as e:
        logger.start({}, 1)
    assert str(e.value).startswith("logger=wandb: W&B refused to start the run: ") and says in str(e.value)
    assert "\n" not in str(e.value) and "WANDB_API_KEY" in str(e.value)
    # Going offline is advice only for a run that was not offline already.
    assert ("or run with logger.mode=offline" in str(e.value)) == (cfg.get("mode") == "online"), e.value


def test_wandb_not_reaching_its_server_says_so_and_not_wandbs_own_advice(monkeypatch, tmp_path):
    """No network: the line says the server was not reached and offers logger.mode=offline, not W&B's advice to
    pass wandb.Settings(init_timeout=...) (no key of ours) nor the settings and key. Alone, W&B waits as long as
    it would; with other ranks waiting for it, half their dist.timeout_s for its whole start (its account look-up,
    whose retries its init_timeout does not count, included), and the line says so."""
    import time

    from framework.loggers.wandb import WandbConfig, WandbLogger
    from tests._helpers import fake_wandb

    for peers, bound in ((None, None), (40.0, 20.0), (600.0, None)):
        asked: dict = {}
        monkeypatch.setitem(sys.modules, "wandb", fake_wandb(asked))
        logger = WandbLogger(WandbConfig(live=False, mode="online"),
                             run=RunInfo(tmp_path / "run", None, None, peers_wait_s=peers))
        t0 = time.monotonic()
        with pytest.raises(ConfigError) as e:
            logger.start({}, 1)
        if bound:   # W&B gives up within the bound, counted from the start's beginning
            assert time.monotonic() - t0 + asked["gives_up_in"] <= bound + 0.5, asked
            assert asked["gives_up_in"] > bound - 5, asked
        within = f" within {bound:g}s (0.5 of dist.timeout_s, which the other ranks wait for it; raise " \
                 f"dist.timeout_s to wait longer)" if bound else ""
        assert str(e.value) == (f'logger=wandb: could not reach the W&B server{within}: Timed out while retrying: '
                                f'Post "https://api.wandb.ai/graphql": dial tcp: lookup api.wandb.ai: no such host; '
                                f'check the network (and WANDB_BASE_URL if set), or run with '
                                f'logger.mode=offline'), e.value
        assert (getattr(asked.get("settings"), "init_timeout", None) is None) == (bound is None), asked


@needs_wandb
def test_wandb_failing_on_its_files_names_them_not_the_settings(monkeypatch, tmp_path):
    """A file where W&B's folder belongs in the run folder: the error and the path, not the logger.* settings."""
    from framework.loggers.wandb import WandbConfig, WandbLogger

    _no_wandb_credentials(monkeypatch, tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = tmp_path / "run"
    run.mkdir()
    (run / "wandb").write_text("")
    with pytest.raises(ConfigError) as e:
        WandbLogger(WandbConfig(live=False), run=RunInfo(run, None, None)).start({}, 1)
    assert str(e.value).startswith(f"logger=wandb: W&B cannot write its files in {run / 'wandb'} (Not a directory: "
                                   f"{run / 'wandb'}/"), e.value
    assert str(e.value).endswith("); move away what is in the way there (a file where a folder belongs), fix its "
                                 "permissions or free space, or choose another run folder"), e.value
    assert "WANDB_API_KEY" not in str(e.value) and "\n" not in str(e.value)


@needs_wandb
def test_a_run_resumed_from_its_own_folder_continues_its_wandb_run(monkeypatch, tmp_path, capsys):
    """The W&B run id is kept in the run folder with the last step it logged: a resume from the folder's
    checkpoints (``resumed``) at or past that step continues that W&B run; one from an earlier checkpoint (a kill
    between two saves, or checkpoint.resume=<own step-N>) would log its steps again: a new W&B run, said in one
    line; any other start is a new W&B run (and its id the one kept). Each W&B run's history has each step once."""
    from dataclasses import replace

    from framework.loggers.wandb import RUN_ID, WandbConfig, WandbLogger

    _no_wandb_credentials(monkeypatch, tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    info = RunInfo(tmp_path / "run", None, None)
    info.run_dir.mkdir()
    ids, fsyncs, fsync = [], [], os.fsync
    # (resumed, the step it goes on from, the steps it logs): a chain 4, 12, a rollback to 9, a fresh start
    for resumed, start, steps in ((False, 0, (1, 2, 3, 4)), (True, 4, range(5, 13)), (True, 9, (10, 11, 12)),
                                  (False, 0, (1,))):
        logger = WandbLogger(WandbConfig(live=False), run=replace(info, resumed=resumed, start=start))
        logger.start({}, 12)
        ids.append(logger.run.id)
        # the step record is rewritten at each log, in the training loop: no fsync (milliseconds each)
        monkeypatch.setattr(os, "fsync", lambda fd: fsyncs.append(fd) or fsync(fd))
        for step in steps:
            logger.log({"step": step, "loss": 1.0, "lr": 1e-3, "tokens_per_s": 1.0})
        monkeypatch.setattr(os, "fsync", fsync)
        assert fsyncs == []
        logger.log({"step": steps[-1], "val_loss": 1.0})   # (an evaluation's record, at its step)
        logger.close()
        assert json.loads((info.run_dir / RUN_ID).read_text()) == {"id": ids[-1], "step": steps[-1]}
    assert ids[1] == ids[0] and len({ids[0], ids[2], ids[3]}) == 3, ids
    out = capsys.readouterr().out
    assert out.count("W&B:") == 1 and (f"W&B: this run goes on from step 9, behind step 12 that the W&B run {ids[0]} "
                                       f"logged: a new W&B run, {ids[2]}, logs it on ({ids[0]} keeps the steps it "
                                       f"logged)\n") in out, out
    expected = {ids[0]: list(range(1, 13)), ids[2]: [10, 11, 12], ids[3]: [1]}
    for _ in range(100):   # (W&B's service may write a run's last records a moment after its finish returned)
        history = {}
        for f in (info.run_dir / "wandb").glob("offline-run-*/run-*.wandb"):
            history.setdefault(f.stem.removeprefix("run-"), []).extend(_wandb_history_steps(f))
        if {k: sorted(v) for k, v in history.items()} == expected:
            break
        time.sleep(0.1)
    assert {k: sorted(v) for k, v in history.items()} == expected, history
    # A run id kept alone (no step): its last step is not known, and a resume continues it
    (info.run_dir / RUN_ID).write_text("abc123\n")
    assert WandbLogger(WandbConfig(), run=info)._kept() == ("abc123", None)


def _wandb_history_steps(path):
    """The steps of the history records in an offline W&B run's .wandb file, one per ``run.log`` call."""
    return [r.history.step.num for r in wandb_records(path) if r.WhichOneof("record_type") == "history"]


@needs_wandb
def test_an_offline_wandb_run_reaches_no_network(tmp_path):
    """Offline (the default, with no WANDB_MODE): nothing goes to the network, W&B's own usage telemetry included
    (it reads W&B's process-wide mode, not the run's). In a child process whose every name look-up or connection
    beyond this machine is refused and said on stderr (an audit hook cannot be taken out of pytest's process)."""
    import subprocess
    from pathlib import Path

    script = f"""
import os, socket, sys
from pathlib import Path

LOCAL = ("localhost", "127.0.0.1", "::1", None)

def refuse(event, args):
    host = args[0] if event == "socket.getaddrinfo" else (
        args[1][0] if event == "socket.connect" and args[0].family != socket.AF_UNIX else None)
    if host not in LOCAL:
        os.write(2, f"network: {{event}} {{host}}\\n".encode())
        raise OSError(f"no network here ({{host}})")

sys.addaudithook(refuse)
from framework.loggers import RunInfo
from framework.loggers.wandb import WandbConfig, WandbLogger

logger = WandbLogger(WandbConfig(live=False), run=RunInfo(Path({str(tmp_path)!r}), None, None))
logger.start({{}}, 2)
for step in (1, 2):
    logger.log({{"step": step, "loss": 1.0, "lr": 1e-3, "tokens_per_s": 1.0}})
logger.finish({{"steps": 2, "train_loss": 1.0, "val_loss": 1.0, "tokens_per_s": 1.0}})
logger.close()
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    child = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                           env={**env, "WANDB_SILENT": "true", "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"),
                                "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert child.returncode == 0 and "network:" not in child.stderr, child.stderr[-3000:]
    assert list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb")), child.stderr[-3000:]


def test_a_console_that_is_gone_ends_nothing_and_the_log_goes_on(tmp_path, monkeypatch):
    """``python -m framework.train ... | head -1``: the pipe's reader leaves after one line; the run and
    its train.log go on, and nothing printed later (the console's buffer flushed at exit) fails."""
    import os
    import sys

    from framework.loggers import console_log

    r, w = os.pipe()
    os.close(r)   # the reader is gone
    console = open(w, "w", buffering=1)
    monkeypatch.setattr(sys, "stdout", console)
    with console_log(tmp_path / "train.log"):
        for step in range(3):
            print(f"step {step} | loss 4.1647")
        sys.stdout.flush()
    monkeypatch.undo()
    print("after the run", file=console)
    console.close()
    log = (tmp_path / "train.log").read_text()
    assert [line for line in log.splitlines() if line.startswith("step")] == [f"step {i} | loss 4.1647" for i in range(3)]
    assert log.count("the console is gone") == 1, log


def test_a_console_closed_at_start_ends_nothing(tmp_path, monkeypatch):
    """``>&-`` in a program that did not reopen it (sys.stdout is None): the run's train.log goes on, noting once
    that the console is gone, as for a console that goes away during the run."""
    import sys

    from framework.loggers import console_log

    monkeypatch.setattr(sys, "stdout", None)
    with console_log(tmp_path / "train.log"):
        print("step 1 | loss 4.1647")
        print("step 2 | loss 4.1", flush=True)
    assert sys.stdout is None
    log = (tmp_path / "train.log").read_text()
    assert log.startswith("step 1 | loss 4.1647\n(the console is gone: closed at start;") and "step 2" in log, log


def test_the_done_line_says_how_many_steps_were_skipped():
    """A run whose steps were skipped (fp16 overflow at a static scale too high, or train.on_nonfinite=warn)
    says so in its last line: a train loss alone read as if every step had trained."""
    from framework.loggers.console import summary_line

    summary = {"steps": 6, "train_loss": 3.17, "train_loss_steps": 2, "val_loss": 3.2, "tokens_per_s": 10.0}
    assert "skipped" not in summary_line({**summary, "skipped_steps": 0})
    assert "done: 6 steps | train loss 3.1700 (mean of last 2 steps) | 6 of the 6 steps skipped, updating nothing | " \
           "val loss 3.2000" in summary_line({**summary, "skipped_steps": 6})
    one = {**summary, "steps": 1, "train_loss_steps": 1, "skipped_steps": 1}   # one step: no plural
    assert summary_line(one).startswith("done: 1 step | train loss 3.1700 (mean of last 1 step) | 1 of the 1 step ")


def test_the_first_lines_count_one_step_without_a_plural(tmp_path):
    from framework.loggers._base import run_header

    cfg = compose(["train.steps=1", "train.log_every=1", "checkpoint.every=1", "logger=none"])
    head = run_header(cfg, RunInfo(tmp_path, None, None), 1, None, "cpu", tmp_path / "ck")
    assert head[1].endswith("| 1 step") and "(every step) | summary" in head[2], head
    assert f"checkpoints {tmp_path / 'ck'} (every step, keep" in head[2], head
    assert "model_16bit" not in head[2], head


def test_the_first_and_last_lines_name_the_exported_weights_and_their_dtype(tmp_path):
    """stage3_gather_16bit_weights_on_model_save writes model_16bit/ at the end, in the working dtype (fp32
    under precision=fp32, whatever the key's name says): the lines that say where a run writes name it."""
    from framework.loggers._base import run_header
    from framework.loggers.console import summary_line

    cfg = compose(["+stage=zero3", "stage.stage3_gather_16bit_weights_on_model_save=true", "logger=none"])
    head = run_header(cfg, RunInfo(tmp_path, None, None), 1, None, "cpu", tmp_path / "ck")
    assert head[2].endswith(f" | weights {tmp_path / 'model_16bit'} at the end (fp32, the working dtype)"), head
    summary = {"steps": 2, "train_loss": 3.17, "val_loss": 3.2, "tokens_per_s": 10.0}
    assert summary_line({**summary, "exported": "model_16bit", "exported_dtype": "bf16"}).endswith(
        " tok/s | wrote model_16bit/ (bf16)")
    assert "wrote" not in summary_line(summary)


def test_a_logger_without_one_of_its_methods_is_one_line_before_training(tmp_path):
    """A logger of one's own lacking finish trained and saved every step, then ended in an AttributeError traceback:
    a class ``build`` is refused when the registry is read, any other logger at the run's start (every rank hears)."""
    from framework.core.registry import Component
    from framework.loggers import check_entry

    class FileLog:   # (no finish)
        def __init__(self, cfg, *, run): ...
        def start(self, config, total_steps): ...
        def log(self, record): ...
        def close(self): ...

    with pytest.raises(ConfigError) as e:
        check_entry("framework.loggers.filelog", "filelog", Component(config=object, build=FileLog))
    assert str(e.value) == ("logger 'filelog' (framework.loggers.filelog): its class FileLog has no finish method "
                            "(training calls start(config, total_steps), log(record), finish(summary) and close() on a "
                            "logger); subclass framework.loggers.NullLogger, which does nothing in each, and override "
                            "what it needs")
    record = RunRecord(tmp_path, FileLog(None, run=None))
    with pytest.raises(ConfigError, match=r"^the logger FileLog has no finish method \(training calls"):
        record.start({}, 2)
    record.close()

    class Unclosable:   # (what a function ``build`` returns: no class to refuse when the registry is read)
        def start(self, config, total_steps): ...
        def log(self, record): ...
        def finish(self, summary): ...

    record = RunRecord(tmp_path / "b", Unclosable())
    with pytest.raises(ConfigError, match=r"^the logger Unclosable has no close method \(training calls"):
        record.start({}, 2)
    record.close()   # (the run's close: the refusal stands alone, no AttributeError after it)


@pytest.mark.parametrize("precision,says", [("fp16", " | scale 65536 | skipped 2 | "), ("bf16", None)])
def test_the_console_line_shows_the_loss_scale_under_fp16(capsys, precision, says):
    """fp16: the line shows the scale the step used (a float the step returns: no extra host sync); others,
    whose scale is always 1, do not."""
    from framework.loggers.console import Console

    console = Console(live=False)
    console.start({"precision": {"name": precision}}, 4)
    for scale in (65536.0, 2.0 ** 20):
        console.log({"step": 2, "loss": 4.2, "lr": 1e-3, "tokens_per_s": 100.0, "loss_scale": scale,
                     "skipped_steps": 2, "eta_s": 5.0})
    console.close()
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and all(line.startswith("step      2 | loss 4.2000 | lr 1.00e-03") for line in lines), lines
    if says is None:
        assert not any("scale" in line for line in lines), lines
    else:
        assert says in lines[0] and " | scale 1048576 | " in lines[1], lines
