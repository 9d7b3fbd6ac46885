"""console: progress bar on a terminal, plain periodic lines otherwise; none: no console output and
no service (metrics.jsonl and summary.json are still written). Rank 0 only."""
from dataclasses import dataclass

from framework.loggers._base import Console, NullLogger
from framework.core.registry import Component


@dataclass(kw_only=True)
class ConsoleConfig:
    live: bool | None = None   # None: a live bar only when stdout is a terminal


@dataclass(kw_only=True)
class NoLoggerConfig:
    pass


COMPONENTS = {"console": Component(config=ConsoleConfig, build=lambda cfg, *, run: Console(cfg.live)),
              "none": Component(config=NoLoggerConfig, build=lambda cfg, *, run: NullLogger())}
