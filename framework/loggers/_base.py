"""The logger interface (``NullLogger``), the run record (metrics.jsonl and summary.json, written whatever
logger is chosen) and the console's copy in train.log (``console_log``). Only rank 0 logs."""
from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

from framework.core import files
from framework.core.errors import ConfigError, FrameworkError, Interrupted, Terminated, say
from framework.core.room import FULL, free_note
from framework.core.utils import counted, under


# Keys that say how long, how visibly or where a job runs, not which job it is (a run's other keys do).
NOT_IDENTITY = ("checkpoint", "train.steps", "train.log_every", "train.eval_every", "train.eval_batches", "logger",
                "dist.nproc", "dist.timeout_s")
# Keys that say how a job computes, not what (a relaunch may give each job a new swap folder or another backend):
# a checkpoint or summary saved with other values of them is still the job's own. (They name its folder.)
RUN_ONLY = ("dist", "offload.nvme_path", "model.activation_checkpointing", "model.attn_implementation")


@dataclass(frozen=True)
class RunInfo:
    run_dir: Path
    group: str | None     # W&B group: the multirun sweep, so its jobs appear together
    name: str | None      # W&B run name: the job's overrides or number
    key: str | None = None   # a multirun job's checkpoint folder name (None: ``name``)
    resumed: bool = False    # resumed from a checkpoint in run_dir: its W&B run (id in run_dir) goes on
    start: int = 0           # the step a resumed run goes on from (its checkpoint's)
    sweep_dir: Path | None = None   # a multirun job's sweep folder: resume=latest passes over its other jobs'
    # the keys of a multirun job's overrides that say which job it is: it resumes no state saved with other values
    naming: frozenset[str] = frozenset()
    # how long the other ranks wait for rank 0's logger to start (dist.timeout_s); None: no other ranks
    peers_wait_s: float | None = None
    # the (device, inode) of the checkpoint folder's lock file the launcher holds: each save checks it is still there
    checkpoint_lock: tuple[int, int] | None = None

    @property
    def job(self) -> str | None:
        """A multirun job's name, which keys its folder under an explicit checkpoint.dir."""
        return (self.key if self.key is not None else self.name) if self.group else None


class NullLogger:
    """What every logger offers, doing nothing (``METHODS``): a logger of one's own subclasses it."""

    def start(self, config: dict, total_steps: int) -> None: ...
    def log(self, record: dict) -> None: ...
    def finish(self, summary: dict) -> None: ...
    def close(self) -> None: ...


METHODS = tuple(name for name in vars(NullLogger) if not name.startswith("_"))


def lacking(logger, what: str) -> None:
    """A ConfigError (one line) for a logger (an object, or the class ``build`` makes it of) without one of the
    ``METHODS``, which training calls, the last after the run's steps are trained and saved. ``what`` names it."""
    if missing := [m for m in METHODS if not callable(getattr(logger, m, None))]:
        raise ConfigError(f"{what} has no {' and no '.join(missing)} method (training calls start(config, "
                          f"total_steps), log(record), finish(summary) and close() on a logger); subclass "
                          f"framework.loggers.NullLogger, which does nothing in each, and override what it needs")


class RunRecord:
    """Rank 0's logger: metrics.jsonl plus an atomic summary.json, then the configured ``logger``.

    ``start``: the step this record goes on from (0: new; else the resumed checkpoint's). Later records
    would mix with this run's: once the logger started, the file is set aside as ``metrics.jsonl.N``
    (``summary.json`` too, a new record's or one of a later step), and so is a damaged one, nothing lost.
    No room to write ends the run with one line."""

    def __init__(self, run_dir: Path, logger: NullLogger | None = None, start: int = 0):
        files.make_dirs(run_dir)
        files.refuse_links(run_dir / "metrics.jsonl")   # (before anything starts; the open never follows one either)
        self.run_dir, self.logger, self._from = run_dir, logger if logger is not None else NullLogger(), start
        self._metrics = None
        self._full = False   # a write found no room: closing (flushing what it left) fails the same way

    def start(self, config: dict, total_steps: int) -> None:
        # (here, not at construction: every rank hears an error of the start's)
        lacking(self.logger, f"the logger {type(self.logger).__name__}")
        self.logger.start(config, total_steps)
        with self._room("metrics.jsonl"):
            _set_aside(self.run_dir, self._from)
            self._metrics = files.open_append(self.run_dir / "metrics.jsonl")   # never through a planted link

    def log(self, record: dict) -> None:
        with self._room("metrics.jsonl"):
            self._metrics.write(_json(record) + "\n")
        self.logger.log(record)

    def finish(self, summary: dict) -> None:
        kept = _summary(self.run_dir) if summary["steps_run"] == 0 else None
        if (kept is not None and kept.get("steps") == summary["steps"] and {"train_loss", "val_loss", "tokens_per_s"}
                <= set(kept) and _identity(kept.get("config")) == _identity(summary.get("config"))):
            # A re-run of the same job that trained nothing: the summary of the run that trained those steps is the
            # one to keep (not one of another job, whose state a resume with other values took on).
            print(f"summary.json of step {summary['steps']} kept (no step left to train; val loss of the loaded "
                  f"state {summary['val_loss']:.4f})", flush=True)
            summary = kept
        else:
            with self._room("summary.json"):
                files.write_atomic(self.run_dir / "summary.json", (_json(summary, indent=2) + "\n").encode())
        self.logger.finish(summary)

    def close(self) -> None:
        try:   # (a logger without close was refused by start in one line: that ends the run, not an AttributeError)
            if callable(close := getattr(self.logger, "close", None)):
                close()
        finally:
            if self._metrics is not None:
                metrics, self._metrics = self._metrics, None
                # (after a write found no room, that write's error ends the run, not a second one of its kind)
                with contextlib.suppress(OSError) if self._full else self._room("metrics.jsonl"):
                    metrics.close()

    @contextlib.contextmanager
    def _room(self, name: str):
        """An OSError writing ``name`` as one line: no room (the folder, the free space, the fix), or another (the
        file, the fix)."""
        try:
            yield
        except OSError as e:
            if e.errno not in FULL:
                path = e.filename if isinstance(e.filename, str) else self.run_dir / name   # (not an fd's number)
                raise FrameworkError(f"{_unwritable(path, e.strerror or str(e))}, or choose another run "
                                     "folder") from None
            self._full = True
            raise FrameworkError(f"no room to write {name} in {self.run_dir} ({e.strerror or e}"
                                 f"{free_note(self.run_dir, '; {} free')}): free space, "
                                 f"raise the file size limit (ulimit -f) or quota, or choose a run folder on a "
                                 f"larger disk") from None


def check_records(run_dir: Path, key: str) -> None:
    """One line, before a run starts, for a record in ``run_dir`` it could not write: something other than a file in
    the place of train.log, metrics.jsonl or summary.json, or a train.log it may not append to (an earlier run's
    metrics.jsonl and summary.json are replaced or set aside by a rename, which the folder's permissions decide; a
    resume that appends to metrics.jsonl says so in one line where it opens it). ``key``: the setting that gives
    the run another folder."""
    for name in ("train.log", "metrics.jsonl", "summary.json"):
        path = run_dir / name
        if files.is_link(path) or not os.path.lexists(path):   # (a link: refused where it is opened)
            continue
        problem = "a folder" if path.is_dir() else "not a file" if not path.is_file() else None
        if problem is None and name == "train.log":
            try:
                os.close(files.open_nofollow(path, os.O_WRONLY | os.O_APPEND))
            except OSError as e:
                problem = e.strerror or str(e)
        if problem:
            raise ConfigError(f"{_unwritable(path, problem)}, or give this run a folder of its own: {key}=PATH")


def _unwritable(path, problem: str) -> str:
    return f"cannot write {path} ({problem}): fix its permissions, move it away if it is not a file"


def _json(obj, **kw) -> str:
    """JSON that strict readers parse: a non-finite float is null, not Python's bare NaN/Infinity."""
    return json.dumps(_finite_or_none(obj), allow_nan=False, **kw)


def _finite_or_none(obj):
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite_or_none(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite_or_none(v) for v in obj]
    return obj


def _summary(run_dir: Path) -> dict | None:
    """summary.json; None when there is none or it is damaged (not an object, or a number the run's last line reads
    from a kept one is not a number or null: steps, the losses, tokens/s, the entropy floor)."""
    try:
        with os.fdopen(files.open_nofollow(run_dir / "summary.json", os.O_RDONLY)) as f:
            summary = json.load(f)
    except (OSError, ValueError):
        return None
    if not (isinstance(summary, dict) and _number(summary.get("steps")) and isinstance(summary.get("data", {}), dict)):
        return None
    read = [summary.get(k) for k in ("train_loss", "val_loss", "tokens_per_s")] + [
        summary.get("data", {}).get("entropy_floor")]
    return summary if all(v is None or _number(v) for v in read) else None


def _identity(config, prefix: str = ""):
    """A config (a summary's) without its ``NOT_IDENTITY`` and ``RUN_ONLY`` keys, and the vocabulary (a summary
    records the one the model was built with, an older one the composed value)."""
    if not isinstance(config, dict):
        return config
    return {k: _identity(v, f"{prefix}{k}.") for k, v in config.items()
            if not under(f"{prefix}{k}", (*NOT_IDENTITY, *RUN_ONLY, "model.vocab_size"))}


def _set_aside(run_dir: Path, start: int) -> None:
    """Keep in metrics.jsonl only the records of steps up to ``start`` (see ``RunRecord``)."""
    path = run_dir / "metrics.jsonl"
    try:
        with os.fdopen(files.open_nofollow(path, os.O_RDONLY)) as f:
            lines = f.read().splitlines(keepends=True)
    except FileNotFoundError:
        lines = []
    keep = [line for line in lines if line.endswith("\n") and _step(line) <= start]   # (a line cut short: aside)
    summary = run_dir / "summary.json"
    # A summary of a step past ``start`` ends another history (a resume from an earlier checkpoint): aside too,
    # as is a damaged one.
    steps = (_summary(run_dir) or {}).get("steps", math.inf) if start else None
    aside = [p for p in (path if len(keep) < len(lines) else None,
                         summary if start == 0 or steps > start else None)
             if p is not None and p.is_file()]
    if not aside:
        return
    n = next(n for n in itertools.count(1) if not any(p.with_name(f"{p.name}.{n}").exists() for p in (path, summary)))
    for p in aside:
        os.rename(p, p.with_name(f"{p.name}.{n}"))
    if path in aside:
        files.write_atomic(path, "".join(keep).encode())
    print(f"run folder: {' and '.join(p.name for p in aside)} of an earlier run set aside as "
          f"{' and '.join(f'{p.name}.{n}' for p in aside)} "
          f"({f'this run goes on from step {start}' if start else 'this run starts a new record'})", flush=True)


def _step(line: str) -> float:
    """A record's step; a damaged record's (no number there) is past every start."""
    try:
        step = json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return math.inf
    return step if _number(step) else math.inf


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


class _Sink:
    """A stream (train.log or the console) whose failing write ends it, not the run: the failure becomes a
    note, given once (``note``) for the other stream to carry."""

    def __init__(self, stream, says: str):
        self.stream, self.says = stream, says
        self.gone: bool | str = False   # once gone: the note, until given (True)

    def do(self, act, *args) -> None:
        if self.gone:
            return
        try:
            act(*args)
        except (OSError, ValueError) as e:
            self.gone = self.says.format(e)
            if isinstance(e, BrokenPipeError):
                # Its reader (``| head``) is gone for good: write to nowhere, so that nothing printed later
                # (the buffer flushed at exit included) fails with a traceback.
                with contextlib.suppress(AttributeError, OSError, ValueError), open(os.devnull, "wb") as nowhere:
                    os.dup2(nowhere.fileno(), self.stream.fileno())

    def write(self, text: str) -> None:
        self.do(self.stream.write, text)

    def flush(self) -> None:
        self.do(self.stream.flush)

    def close(self) -> None:
        self.do(self.stream.close)
        with contextlib.suppress(OSError, ValueError):   # gone: what a failed write left buffered is dropped
            self.stream.close()

    def note(self) -> str:
        """The note that the stream is gone, once ("" otherwise)."""
        if not isinstance(self.gone, str):
            return ""
        note, self.gone = self.gone, True
        return note


class _Tee:
    """A text stream writing to ``terminal`` (the console) and ``log`` (train.log); either one failing is noted
    once on the other, which goes on alone."""

    def __init__(self, terminal, log: _Sink):
        closed = terminal is None   # closed when Python started (``>&-``; the commands reopen it on os.devnull)
        self.terminal, self.log = open(os.devnull, "w") if closed else terminal, log
        self.console = _Sink(self.terminal, "(the console is gone: {}; this log goes on alone)\n")
        if closed:
            self.console.gone = self.console.says.format("closed at start")

    def write(self, text: str) -> int:
        self.console.write(text)
        self.log.write(text)
        if text.endswith("\n"):   # (notes on a line of their own)
            self.log.write(self.console.note())
            self.console.write(self.log.note())
        return len(text)

    def log_only(self, text: str) -> None:
        """A line for the log only: what a live bar shows, or what ``say`` wrote to the console itself."""
        self.log.write(text)

    def flush(self) -> None:
        self.console.flush()
        self.log.flush()

    def __getattr__(self, name):   # isatty, fileno, encoding, ... of the console stream
        return getattr(self.terminal, name)


@contextlib.contextmanager
def console_log(path: Path):
    """Within the block, stdout and stderr also go to ``path`` (appended: rank 0's train.log), and so does the
    error, Ctrl-C or SIGTERM that ends the run. A log that cannot be written ends nothing (a note says so)."""
    says = "(train.log cannot be written: {}; the console goes on alone)\n"
    try:
        log = _Sink(files.open_append(path), says)
    except OSError as e:   # (the CLI refused such a folder before: ``check_records``)
        log = _Sink(open(os.devnull, "w"), says)
        log.gone = says.format(f"{path}: {e.strerror or e}")
    out, err = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _Tee(out, log), _Tee(err, log)
    try:
        yield
    except FrameworkError as e:
        log.write(f"error: {e}\n")
        raise
    except Exception as e:   # a bug, CUDA out of memory, ...: its line and traceback, which the console gets too
        log.write(f"error: {type(e).__name__}: {e}\n{''.join(traceback.format_exception(e))}")
        raise
    except (Interrupted, Terminated) as e:   # Ctrl-C, SIGTERM: the line the console gets, and the log too
        log.write(f"{e}\n")
        raise
    finally:
        sys.stdout, sys.stderr = out, err
        log.close()
        if note := log.note():
            say(note.rstrip("\n"), err)


def run_header(cfg, run: RunInfo, world: int, backend: str | None, device, checkpoints: Path) -> list[str]:
    """The first lines of a run: where it writes, and what was composed."""
    c, t, ch = cfg.checkpoint, cfg.train, cfg.choices
    every = lambda n: "every step" if n == 1 else f"every {n} steps"   # noqa: E731
    saves = (f"{checkpoints} ({every(c.every)}, keep {c.keep_last or 'all'})" if c.every
             else "none saved (checkpoint.every=0)")
    return [f"run folder: {run.run_dir} (train.log: this console)",
            f"composed: stage {ch['stage']} | offload {ch['offload']} | precision {ch['precision']} | world {world} "
            f"({backend or 'single process'}, {device}) | model {ch['model']} | data {ch['data']} | "
            f"optimizer {ch['optimizer']} | scheduler {ch['scheduler']} | {counted(t.steps, 'step')}",
            f"writes: metrics {run.run_dir / 'metrics.jsonl'} ({every(t.log_every)}) | summary "
            f"{run.run_dir / 'summary.json'} | checkpoints {saves}; resume {c.resume}{_weights(cfg, run.run_dir)}"]


def _weights(cfg, run_dir: Path) -> str:
    """zero3's stage3_gather_16bit_weights_on_model_save exports the model at the end too: in the working dtype
    (the precision's: fp32 under precision=fp32, whatever DeepSpeed's name for it says)."""
    if not getattr(cfg.stage, "stage3_gather_16bit_weights_on_model_save", False):
        return ""
    return f" | weights {run_dir / 'model_16bit'} at the end ({cfg.choices['precision']}, the working dtype)"
