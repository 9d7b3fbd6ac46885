"""Sweep reports: a Markdown table and PNG plots from a Hydra multirun folder.

    python -m framework.report multirun/2026-12-01/10-00-00            # writes report.md + PNGs there
    python -m framework.report multirun/2026-12-01/10-00-00 --out docs/  # or somewhere else

Every job folder under the given one (any depth) with a ``summary.json`` or Hydra's overrides is a
row (one without a summary is running while a run holds its run.lock, else failed: the cause its train.log
ends with), and so is the given folder itself when it is one run's (Hydra's overrides, no job below);
``loss.png`` and ``throughput_memory.png`` plot the losses, tokens/s and measured peak memory.
Needs matplotlib (``pip install -e '.[report]'``).
"""
from __future__ import annotations

import argparse
import fcntl
import io
import json
import math
import os
import re
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from framework.cli import fail
from framework.cli.launch import PRINTED_ABOVE, RUN_LOCK, is_exit_line
from framework.config import override_key
from framework.config.dsconfig import COMMAND_LINE
from framework.config.schema import get_key
from framework.core.registry import GROUPS
from framework.core import files
from framework.core.errors import FrameworkError, first_line, say
from framework.core.units import MiB
from framework.core.utils import counted


@dataclass
class Job:
    """One finished (or failed) job of a sweep."""

    dir: Path
    overrides: list[str]
    summary: dict | None                     # None: the job did not finish
    records: list[dict] = field(default_factory=list)
    label: str = ""                          # the overrides that differ between the jobs

    def curve(self, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of ``key`` (e.g. ``loss``) over the records; a null (metrics.jsonl's NaN or inf) is NaN."""
        return ([r["step"] for r in self.records if key in r],
                [math.nan if r[key] is None else r[key] for r in self.records if key in r])

    def peak(self, key: str = "peak_rss_bytes") -> int | None:
        """The largest measured value of ``key`` over the job's ranks."""
        return max((r[key] for r in self._ranks() if key in r), default=None)

    def added(self) -> int | None:
        """The most any rank's resident set grew over what it held when the job started."""
        return max((max(0, r["peak_rss_bytes"] - r["rss_start_bytes"]) for r in self._ranks()
                    if "peak_rss_bytes" in r and "rss_start_bytes" in r), default=None)

    def _ranks(self) -> list[dict]:
        return (self.summary or {}).get("peak_memory_per_rank") or []


def load_jobs(root: Path, pattern: str | None = None) -> list[Job]:
    """Every job under ``root`` (``pattern``: the folders in it that glob names), labelled by its own overrides."""
    root = Path(root)
    if not root.is_dir():
        raise FrameworkError(f"report: {root} is not a folder; pass a Hydra multirun folder "
                             f"(e.g. multirun/<date>/<time>)")
    if pattern is not None:
        dirs = {d for d in root.glob(pattern) if (d / "summary.json").is_file()
                or (d / ".hydra" / "overrides.yaml").is_file()}
    else:
        dirs = {p.parent for p in root.rglob("summary.json")} | {
            p.parent.parent for p in root.rglob(".hydra/overrides.yaml") if p.parent.parent != root}
        if not dirs and (root / ".hydra" / "overrides.yaml").is_file():   # one run's folder, running or failed
            dirs = {root}
    jobs = []
    for d in sorted(dirs, key=lambda p: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", str(p))]):
        overrides = [str(o) for o in _parsed(d / ".hydra" / "overrides.yaml", yaml.safe_load) or []]
        summary = _parsed(d / "summary.json", _summary)
        if summary is not None and "config_sources" in summary:
            overrides = summary_overrides(summary, overrides)
        jobs.append(Job(d, overrides, summary, _parsed(d / "metrics.jsonl", _records) or []))
    if not jobs and pattern is not None:
        raise FrameworkError(f"report: no job folder named {pattern} in {root} (one with a summary.json or "
                             f".hydra/overrides.yaml); only those are read here: pass the folder that holds them")
    if not jobs:
        raise FrameworkError(f"report: no job under {root} (no summary.json or .hydra/overrides.yaml); "
                             f"pass the folder a multirun wrote (hydra.sweep.dir)")
    common = set(common_overrides(jobs))
    for j in jobs:
        j.label = " ".join(o for o in j.overrides if o not in common) or str(j.dir.relative_to(root))
    return jobs


def _spelled(value) -> str:
    """A config value as an override spells it."""
    return value if isinstance(value, str) else json.dumps(value) if isinstance(
        value, (bool, type(None), list, dict)) else repr(value)


def _same(text: str, value) -> bool:
    """Whether an override's value ``text`` spells the config's ``value`` (1e-3 and 0.001 alike)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            return float(text) == value
        except ValueError:
            return False
    try:
        return yaml.safe_load(text) == value or text == _spelled(value)
    except yaml.YAMLError:
        return text == _spelled(value)


def _config_value(cfg: dict, key: str):
    """A group's registry name (``stage``: ``zero3``) or a dotted key's value in a summary's config."""
    node = cfg.get(key)
    return node["name"] if isinstance(node, dict) and "name" in node else get_key(cfg, key)


def summary_overrides(summary: dict, hydra_overrides: list[str]) -> list[str]:
    """The overrides of the run that wrote ``summary`` (its command-line keys, with their values): Hydra rewrites
    .hydra/overrides.yaml when a later run starts in the folder, so those are used only where they agree."""
    cfg, sources = summary.get("config", {}), summary.get("config_sources", {})
    own = [key[:-len(".name")] if key.endswith(".name") and key[:-len(".name")] in GROUPS else key
           for key, source in sources.items() if source == COMMAND_LINE]
    said = {override_key(o): o.partition("=")[2] for o in hydra_overrides if "=" in o and not o.startswith("hydra")}
    # (checkpoint.resume=latest or auto is recorded as what it resolved to: not a disagreement)
    if set(own) <= said.keys() and all(_same(text, _config_value(cfg, k)) for k, text in said.items()
                                       if not k.startswith("checkpoint.")):
        return hydra_overrides
    typed = {"checkpoint.resume": summary.get("resume_given")}   # (latest, as the config records where it led)
    return [f"{k}={_spelled(typed.get(k) or _config_value(cfg, k))}" for k in own]


def _parsed(path: Path, parse):
    """``parse(text)`` of a job's file (None when it has none); a malformed one is a one-line error naming it."""
    if not path.is_file():
        return None
    try:
        return parse(path.read_text())
    except (ValueError, yaml.YAMLError) as e:
        raise FrameworkError(f"report: {path} is malformed ({first_line(e)}); fix or remove it") from None


def _records(text: str) -> list[dict]:
    """metrics.jsonl's records; a last line without its newline is a write cut short (a killed job), not a record."""
    records = []
    for n, line in enumerate(text.split("\n")[:-1], 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except ValueError as e:   # json counts lines within the one line it was given
            raise ValueError(f"line {n}: {str(e).split(': line ')[0]}") from None
        if not isinstance(records[-1], dict):
            raise ValueError(f"line {n} is not a JSON object")
        step = records[-1].get("step")
        if isinstance(step, bool) or not isinstance(step, int):   # every record is of a step (Job.curve)
            raise ValueError(f"line {n} has no integer 'step' (it has {step!r})")
    return records


def _summary(text: str) -> dict:
    """summary.json, checked for the shapes of the values the report reads (a ValueError names the first off)."""
    s = json.loads(text)
    if not isinstance(s, dict):
        raise ValueError(f"not a JSON object but {type(s).__name__}")
    for key in ("config", "config_sources", "data"):
        if not isinstance(s.get(key, {}), dict):
            raise ValueError(f"{key} is {s[key]!r}, not an object")
    ranks = s.get("peak_memory_per_rank") or []
    if not isinstance(ranks, list) or not all(isinstance(r, dict) for r in ranks):
        raise ValueError("peak_memory_per_rank is not a list of objects")
    numbers = [(key, s.get(key)) for key in ("steps", "train_loss", "val_loss", "tokens_per_s", "world", "params")]
    numbers += [("data.entropy_floor", s.get("data", {}).get("entropy_floor"))]
    numbers += [(f"peak_memory_per_rank: {key}", v) for r in ranks for key, v in r.items()]
    for key, v in numbers:
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
            raise ValueError(f"{key} is {v!r}, not a number")
    return s


def _fmt(v, spec: str) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def common_overrides(jobs: list[Job]) -> list[str]:
    """The overrides every job shares (stated once above the table)."""
    if len(jobs) < 2:
        return []
    shared = set.intersection(*(set(j.overrides) for j in jobs))
    return [o for o in jobs[0].overrides if o in shared]


def unfinished(folder: Path, width: int = 80) -> str:
    """Why a job folder has no summary.json: "running" while a run holds its run.lock, else "failed" with ``why``
    its train.log says (cut to ``width``); "failed or running" where the lock cannot be tried."""
    try:
        fd = files.open_nofollow(folder / RUN_LOCK, os.O_RDONLY)
    except (OSError, FrameworkError):   # none (a run refused before it owned the folder) or a link in its place
        fd = None
    if fd is not None:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)   # (released as it is closed)
        except BlockingIOError:
            return "running"
        except OSError:   # a file system without locks
            return "failed or running"
        finally:
            os.close(fd)
    try:
        error = why((folder / "train.log").read_text(errors="replace").splitlines())
    except OSError:
        error = None
    if error is None:
        return "failed"
    return f"failed: {error if len(error) <= width else error[:width - 3].rstrip() + '...'}"


def why(lines: list[str]) -> str | None:
    """The cause a train.log ends with (a relaunch appends: the last): its last own ``error:`` line, not the
    launcher's after it ("rank 1 of 2 exited with code 1"); a signal's "terminated (SIGTERM) at step N" or
    "interrupted at step N", unless the launcher's line after it names a rank's exit; else the launcher's alone."""
    exit_line = None
    for line in reversed(lines):
        error = line.removeprefix("error: ") if line.startswith("error: ") else None
        if error is not None and is_exit_line(error):
            exit_line = exit_line or error.replace(PRINTED_ABOVE, "")
        elif error is not None:
            return error
        elif line.startswith(("terminated (", "interrupted")):
            return exit_line or line
    return exit_line


def markdown_table(jobs: list[Job], root: Path) -> str:
    """One row per job (its own overrides; the shared ones go above the table); memory: the largest over its ranks."""
    device = ("peak_device_allocated_bytes", "peak_device_reserved_bytes")
    cuda = any(j.peak(device[0]) is not None for j in jobs)
    head = ["job", "overrides", "steps", "train loss (mean of last log_every steps)", "val loss", "tokens/s",
            "peak RSS/rank MiB", "added RSS/rank MiB", *(["peak allocated/rank MiB", "peak reserved/rank MiB"] * cuda)]
    common = set(common_overrides(jobs))
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for j in jobs:
        name = str(j.dir.relative_to(root))
        ov = " ".join(f"`{o}`" for o in j.overrides if o not in common) or "-"
        s = j.summary
        if s is None:
            cells = [name, ov, f"no summary.json ({unfinished(j.dir)})", *["-"] * (len(head) - 3)]
        else:
            mib = [j.peak(), j.added(), *(j.peak(k) for k in device if cuda)]
            # (a job resumed at its last step trained nothing: its numbers are those of the state it loaded)
            steps = f"{s.get('steps', '-')}{' (resumed, no step trained)' if s.get('steps_run') == 0 else ''}"
            cells = [name, ov, steps, _fmt(s.get("train_loss"), ".4f"),
                     _fmt(s.get("val_loss"), ".4f"), _fmt(s.get("tokens_per_s"), ",.0f"),
                     *(_fmt(None if v is None else v / MiB, ",.0f") for v in mib)]
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")   # (a | in an override: escaped)
    return "\n".join(rows) + "\n"


def require_matplotlib():
    """matplotlib's Figure class, or one line saying how to install it (checked before a recipe trains)."""
    try:
        from matplotlib.figure import Figure
        return Figure
    except ImportError:
        raise FrameworkError("report: plots need matplotlib; pip install -e '.[report]'") from None


def new_figure(figsize: tuple[float, float], cols: int = 1, **subplots):
    """(figure, its axes): a matplotlib Figure made without pyplot (files only; never a window, no global state)."""
    fig = require_matplotlib()(figsize=figsize, dpi=100)
    return fig, fig.subplots(1, cols, **subplots)


def save_png(fig, path: Path, grid: str = "both") -> Path:
    """Rendered in memory, then written atomically and never through a link planted at ``path``."""
    for ax in fig.axes:
        ax.grid(axis=grid, alpha=0.3)
    fig.set_layout_engine("constrained")
    png = io.BytesIO()
    fig.savefig(png, format="png")
    files.write_atomic(path, png.getvalue())
    return path


def plot_losses(jobs: list[Job], path: Path, *, title: str = "loss") -> Path:
    """Train loss per logged step (lines) and validation loss (markers), one colour per job."""
    fig, ax = new_figure((7, 4.2))
    for i, j in enumerate(x for x in jobs if x.records):
        color = f"C{i % 10}"
        steps, loss = j.curve("loss")
        ax.plot(steps, loss, color=color, lw=1.2, label=textwrap.fill(j.label, 60))
        vsteps, vloss = j.curve("val_loss")
        if vsteps:
            ax.plot(vsteps, vloss, color=color, ls="--", marker="o", ms=4, lw=0.8)
    floors = {(j.summary or {}).get("data", {}).get("entropy_floor") for j in jobs}
    if len(floors) == 1 and None not in floors:   # the synthetic chain's exact optimum
        ax.axhline(floors.pop(), color="k", ls=":", lw=1, label="entropy floor of the data")
    ax.set(xlabel="step", ylabel="loss (nats/token); dashed + markers: validation", title=title)
    ax.legend(fontsize=7)
    return save_png(fig, path)


def plot_throughput_memory(jobs: list[Job], path: Path) -> Path:
    """Tokens/s and peak memory per rank (largest rank) for each finished job."""
    done = [j for j in jobs if j.summary is not None]
    wrapped = [textwrap.fill(j.label, 40) for j in done]
    lines = sum(w.count("\n") + 1 for w in wrapped)
    fig, (a, b) = new_figure((10, max(2.8, 0.2 * lines + 0.3 * len(done) + 1.6)), 2, sharey=True)
    y = list(range(len(done)))
    a.barh(y, [j.summary.get("tokens_per_s") or 0 for j in done], color="C0")   # (null: not measured)
    a.set_xlabel("tokens/s")
    a.set_yticks(y, wrapped, fontsize=7)
    a.invert_yaxis()
    b.barh(y, [(j.peak() or 0) / MiB for j in done], color="C1", alpha=0.45, label="peak RSS")
    b.barh(y, [(j.added() or 0) / MiB for j in done], color="C1", label="added during the job")
    dev = [(j.peak("peak_device_allocated_bytes") or 0) / MiB for j in done]
    if any(dev):
        b.barh(y, dev, color="C2", height=0.3, label="peak device allocated")
    b.set_xlabel("MiB per rank (largest rank)")
    b.legend(fontsize=7)
    return save_png(fig, path, grid="x")


def matches(job, where: dict) -> bool:
    """``where``: {group: registry name} or {dotted config key: value} against the job's config."""
    cfg = (job.summary or {}).get("config", {})
    return all(_config_value(cfg, k) == v for k, v in (where or {}).items())


def write_report(root: Path, out: Path | None = None, *, title: str | None = None, pattern: str | None = None) -> dict:
    """Write report.md, loss.png and throughput_memory.png of ``load_jobs(root, pattern)``; return the paths and jobs."""
    root, out = Path(root), Path(out if out is not None else root)
    jobs = load_jobs(root, pattern)   # first: a wrong folder is refused before anything is made
    require_matplotlib()   # and a missing matplotlib
    try:
        files.make_dirs(out)
    except OSError as e:   # e.g. --out names a file
        raise FrameworkError(f"report: cannot make the output folder {out} ({e.strerror}); pass a folder "
                             "with --out") from None
    table = markdown_table(jobs, root)
    shared = " ".join(f"`{o}`" for o in common_overrides(jobs)) or "none"
    md = (f"# {title or 'Sweep report'}\n\n`{root}`: {counted(len(jobs), 'job')} "
          f"({sum(j.summary is None for j in jobs)} without a summary); overrides of every job: {shared}\n\n"
          f"{table}\n![loss](loss.png)\n\n![tokens/s and memory](throughput_memory.png)\n")
    try:
        loss_png = plot_losses(jobs, out / "loss.png", title=title or f"loss: {root.name}")
        tm_png = plot_throughput_memory(jobs, out / "throughput_memory.png")
        files.write_atomic(out / "report.md", md.encode())
    except OSError as e:   # e.g. a read-only run folder
        raise FrameworkError(f"report: cannot write in {out} ({e.strerror}); fix its permissions or pass a "
                             "writable folder with --out") from None
    return {"report": out / "report.md", "plots": [loss_png, tm_png], "jobs": jobs, "table": table}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m framework.report",
                                 description="Markdown table and PNG plots of a Hydra multirun folder")
    ap.add_argument("multirun_dir", type=Path, help="a Hydra multirun folder (hydra.sweep.dir: what a -m run wrote, "
                                                    "multirun/<date>/<time> by default), e.g. multirun/opt-lr")
    ap.add_argument("--out", type=Path, default=None, help="where to write (default: the multirun folder)")
    ap.add_argument("--title", default=None)
    args = ap.parse_args(argv)
    try:
        res = write_report(args.multirun_dir, args.out, title=args.title)
    except FrameworkError as e:
        sys.exit(fail(e, 2))   # (each refusal names the folder or --out given: a bad argument, as in the other tools)
    # (say: a reader that left, as ``| head`` does, ends nothing: the report is written)
    say(res["table"].rstrip("\n"), sys.stdout)
    say(f"wrote {res['report']} and {', '.join(str(p) for p in res['plots'])}", sys.stdout)
