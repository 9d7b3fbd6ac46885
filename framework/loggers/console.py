"""console: progress bar on a terminal, plain periodic lines otherwise (rank 0 only)."""
from dataclasses import dataclass

from framework.loggers._base import Console
from framework.core.registry import Component


@dataclass(kw_only=True)
class ConsoleConfig:
    live: bool | None = None   # None: a live bar only when stdout is a terminal


COMPONENT = Component(config=ConsoleConfig, build=lambda cfg, *, run: Console(cfg.live))
