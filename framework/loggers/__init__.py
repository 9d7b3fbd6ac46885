"""Loggers (conf/logger): console, wandb, none. Rank 0 only."""
from framework.loggers._base import NullLogger, RunInfo, RunRecord, console_log, run_header

__all__ = ["NullLogger", "RunInfo", "RunRecord", "console_log", "run_header"]
