"""Loggers (conf/logger): console, wandb, none. Rank 0 only."""
from framework.loggers._base import (NOT_IDENTITY, NullLogger, RunInfo, RunRecord, console_log, run_header,
                                     run_only)

__all__ = ["NOT_IDENTITY", "NullLogger", "RunInfo", "RunRecord", "console_log", "run_header", "run_only"]
