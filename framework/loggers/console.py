"""console: progress bar on a terminal, plain periodic lines otherwise (rank 0 only)."""
from dataclasses import dataclass

from framework.loggers._base import Console, RunInfo
from framework.core.registry import Component


@dataclass(kw_only=True)
class ConsoleConfig:
    live: bool | None = None   # None: a live bar only when stdout is a terminal


def build(cfg: ConsoleConfig, *, run: RunInfo) -> Console:
    return Console(cfg.live)


COMPONENT = Component(config=ConsoleConfig, build=build)
