"""none: no console output and no service (metrics.jsonl and summary.json are still written)."""
from dataclasses import dataclass

from framework.loggers._base import NullLogger
from framework.core.registry import Component


@dataclass(kw_only=True)
class NoLoggerConfig:
    pass


COMPONENT = Component(config=NoLoggerConfig, build=lambda cfg, *, run: NullLogger())
