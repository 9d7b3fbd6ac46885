"""console: progress bar on a terminal, plain periodic lines otherwise; none: no console output and
no service (metrics.jsonl and summary.json are still written). Rank 0 only."""
import math
import sys
from dataclasses import dataclass

from framework.loggers._base import NullLogger
from framework.core.registry import Component
from framework.core.utils import counted


def fmt_record(r: dict, scaled: bool = False) -> str:
    """A record's console line; ``scaled`` (fp16): with the loss scale the step used."""
    if "val_loss" in r:
        return f"step {r['step']:>6} | val loss {r['val_loss']:.4f}"
    return " | ".join([f"step {r['step']:>6}", f"loss {r['loss']:.4f}", f"lr {r['lr']:.2e}",
                       f"{r['tokens_per_s']:,.0f} tok/s",
                       *([f"scale {_scale(r['loss_scale'])}"] if scaled and "loss_scale" in r else []),
                       *([f"skipped {r['skipped_steps']}"] if r.get("skipped_steps") else []),
                       *([f"eta {_hms(r['eta_s'])}"] if "eta_s" in r else [])])


def _scale(s: float) -> str:
    return f"{s:.0f}" if s >= 1 and float(s).is_integer() else f"{s:g}"   # 1048576, not 1.04858e+06


def _hms(s: float) -> str:
    if not math.isfinite(s):
        return "?"
    s = int(s)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


class Console:
    """A live progress bar on a terminal; plain log lines otherwise."""

    def __init__(self, live: bool | None = None):
        self.live = sys.stdout.isatty() if live is None else live
        self._progress = self._task = None
        self.scaled = False   # fp16: the lines show the loss scale

    def start(self, config: dict, total_steps: int) -> None:
        self.scaled = (config.get("precision") or {}).get("name") == "fp16"
        if self.live:
            from rich.console import Console as RichConsole
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
            # The bar is drawn on the terminal only; train.log gets its records as plain lines.
            self._progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                      TextColumn("{task.fields[status]}"), TimeRemainingColumn(),
                                      console=RichConsole(file=getattr(sys.stdout, "terminal", sys.stdout)))
            self._task = self._progress.add_task("train", total=total_steps, status="")
            self._progress.start()

    def log(self, record: dict) -> None:
        if self._progress is not None:
            if "loss" in record:
                status = f"loss {record['loss']:.4f} lr {record['lr']:.2e} {record['tokens_per_s']:,.0f} tok/s"
                if self.scaled and "loss_scale" in record:
                    status += f" scale {_scale(record['loss_scale'])}"
                self._progress.update(self._task, completed=record["step"], status=status)
            else:
                self._progress.console.print(fmt_record(record, self.scaled))
            if hasattr(sys.stdout, "log_only"):   # train.log gets the records the bar shows
                sys.stdout.log_only(fmt_record(record, self.scaled) + "\n")
        else:
            print(fmt_record(record, self.scaled), flush=True)

    def finish(self, summary: dict) -> None:
        self.close()
        print(summary_line(summary), flush=True)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


def summary_line(s: dict) -> str:
    window = s.get("train_loss_steps")   # a kept summary.json need not have it (only its losses are required)
    loss = s["train_loss"]
    line = (f"done: {counted(s['steps'], 'step')} | "
            + (f"train loss {loss:.4f}" if loss is not None else "no step trained")
            + (f" (mean of last {counted(window, 'step')})" if window else "")
            + (f" | {skipped} of the {counted(s['steps'], 'step')} skipped, updating nothing"
               if (skipped := s.get("skipped_steps")) else "")
            + f" | val loss {_nan(s['val_loss']):.4f} | {_rate(s['tokens_per_s'])} tok/s")
    floor = s.get("data", {}).get("entropy_floor")
    if floor is not None and s["val_loss"] is not None:
        line += f" | entropy floor {floor:.4f} (val - floor = {s['val_loss'] - floor:+.4f} nats)"
    if exported := s.get("exported"):   # (the run folder is the first line's)
        line += f" | wrote {exported}/ ({s.get('exported_dtype', 'the working dtype')})"
    return line


def _rate(v) -> str:
    """Tokens/s; ``-`` where none was measured (no step trained: null)."""
    return "-" if v is None or not math.isfinite(v) else f"{v:,.0f}"


def _nan(v):
    """A kept summary.json's null (a non-finite value when written) as the NaN it was."""
    return math.nan if v is None else v


@dataclass(frozen=True, kw_only=True)
class ConsoleConfig:
    live: bool | None = None   # None: a live bar only when stdout is a terminal


@dataclass(frozen=True, kw_only=True)
class NoLoggerConfig:
    pass


COMPONENTS = {"console": Component(config=ConsoleConfig, build=lambda cfg, *, run: Console(cfg.live)),
              "none": Component(config=NoLoggerConfig, build=lambda cfg, *, run: NullLogger())}
