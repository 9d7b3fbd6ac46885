"""Loggers (conf/logger): console, wandb, none. Rank 0 only."""
from framework.loggers._base import (NOT_IDENTITY, RUN_ONLY, NullLogger, RunInfo, RunRecord, check_records,
                                     console_log, run_header)

__all__ = ["NOT_IDENTITY", "NullLogger", "RunInfo", "RunRecord", "check_records", "console_log", "run_header",
           "RUN_ONLY"]
