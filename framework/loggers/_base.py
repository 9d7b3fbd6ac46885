"""Logger protocol, the run record (metrics.jsonl, summary.json) and console output.

Only rank 0 logs. Every run directory gets metrics.jsonl and summary.json whatever logger is
chosen; loggers add a console view and/or an external service.
"""
from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from framework import files


@dataclass(frozen=True)
class RunInfo:
    run_dir: Path
    group: str | None     # W&B group: the multirun sweep, so its jobs appear together
    name: str | None      # W&B run name: the job's overrides or number


class Logger(Protocol):
    def start(self, config: dict, total_steps: int) -> None: ...
    def log(self, record: dict) -> None: ...
    def finish(self, summary: dict) -> None: ...
    def close(self) -> None: ...


class NullLogger:
    def start(self, config: dict, total_steps: int) -> None: ...
    def log(self, record: dict) -> None: ...
    def finish(self, summary: dict) -> None: ...
    def close(self) -> None: ...


class RunRecord:
    """Append-only metrics.jsonl plus an atomically written summary.json."""

    def __init__(self, run_dir: Path):
        files.make_dirs(run_dir)
        self.run_dir = run_dir
        self._metrics = files.open_append(run_dir / "metrics.jsonl")   # never through a planted link

    def log(self, record: dict) -> None:
        self._metrics.write(json.dumps(record) + "\n")

    def finish(self, summary: dict) -> None:
        files.write_atomic(self.run_dir / "summary.json", (json.dumps(summary, indent=2) + "\n").encode())

    def close(self) -> None:
        self._metrics.close()


def fmt_record(r: dict) -> str:
    if "val_loss" in r:
        return f"step {r['step']:>6} | val loss {r['val_loss']:.4f}"
    parts = [f"step {r['step']:>6}", f"loss {r['loss']:.4f}", f"lr {r['lr']:.2e}",
             f"{r['tokens_per_s']:,.0f} tok/s"]
    if r.get("skipped_steps"):
        parts.append(f"skipped {r['skipped_steps']}")
    if "eta_s" in r:
        parts.append(f"eta {_hms(r['eta_s'])}")
    return " | ".join(parts)


def _hms(s: float) -> str:
    if not math.isfinite(s):
        return "?"
    s = int(s)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


class Console:
    """A live progress bar on a terminal; plain log lines when stdout is not one
    (a redrawn bar in a log file becomes one unreadable line)."""

    def __init__(self, live: bool | None = None):
        self.live = sys.stdout.isatty() if live is None else live
        self._progress = None
        self._task = None
        self._t0 = time.perf_counter()

    def start(self, config: dict, total_steps: int) -> None:
        if self.live:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
            self._progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                      TextColumn("{task.fields[status]}"), TimeRemainingColumn())
            self._task = self._progress.add_task("train", total=total_steps, status="")
            self._progress.start()

    def log(self, record: dict) -> None:
        if self._progress is not None:
            if "loss" in record:
                status = f"loss {record['loss']:.4f} lr {record['lr']:.2e} {record['tokens_per_s']:,.0f} tok/s"
                self._progress.update(self._task, completed=record["step"], status=status)
            else:
                self._progress.console.print(fmt_record(record))
        else:
            print(fmt_record(record), flush=True)

    def finish(self, summary: dict) -> None:
        self.close()
        print(summary_line(summary), flush=True)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


def summary_line(s: dict) -> str:
    line = (f"done: {s['steps']} steps | train loss {s['train_loss']:.4f} | val loss {s['val_loss']:.4f} | "
            f"{s['tokens_per_s']:,.0f} tok/s")
    floor = s.get("data", {}).get("entropy_floor")
    if floor is not None:
        line += f" | entropy floor {floor:.4f} (val - floor = {s['val_loss'] - floor:+.4f} nats)"
    return line
