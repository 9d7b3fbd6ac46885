"""Loggers (conf/logger): console, wandb, none. Rank 0 only. ``check_entry``: a logger class ``build`` makes has
every method of ``NullLogger`` (a ``build`` that is not a class: its logger is checked at the run's start)."""
import inspect

from framework.loggers._base import (NOT_IDENTITY, RUN_ONLY, NullLogger, RunInfo, RunRecord, check_records,
                                     console_log, lacking, run_header)

__all__ = ["NOT_IDENTITY", "NullLogger", "RunInfo", "RunRecord", "check_records", "console_log", "run_header",
           "RUN_ONLY"]


def check_entry(module_name: str, name: str, component) -> None:
    if inspect.isclass(component.build):
        lacking(component.build, f"logger {name!r} ({module_name}): its class {component.build.__name__}")
