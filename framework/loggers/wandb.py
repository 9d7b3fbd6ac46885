"""wandb: Weights & Biases (offline unless configured otherwise) plus the console view.

The mode comes from ``logger.mode``, then the WANDB_MODE environment variable, then
"offline": a ``mode=`` argument in code would silently beat WANDB_MODE. wandb is imported
lazily (1-2.5 s) and only on rank 0.
"""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from framework.core.errors import ConfigError
from framework.loggers._base import Console, RunInfo
from framework.core.registry import Component

MODES = ("online", "offline", "disabled")


@dataclass(kw_only=True)
class WandbConfig:
    project: str = "framework"
    entity: str | None = None
    mode: str | None = None          # online | offline | disabled; None: $WANDB_MODE or offline
    tags: list[str] = field(default_factory=list)
    live: bool | None = None         # console bar, as in logger=console


class WandbLogger:
    def __init__(self, cfg: WandbConfig, *, run: RunInfo):
        self.cfg, self.run_info = cfg, run
        self.console = Console(cfg.live)
        self.run = None
        self.finished = False   # finish(summary) reached

    def start(self, config: dict, total_steps: int) -> None:
        import wandb

        mode = self.cfg.mode or os.environ.get("WANDB_MODE") or "offline"
        self.run = wandb.init(project=self.cfg.project, entity=self.cfg.entity, mode=mode,
                              group=self.run_info.group, name=self.run_info.name, tags=list(self.cfg.tags),
                              dir=str(self.run_info.run_dir), config=config, reinit="finish_previous")
        self.console.start(config, total_steps)

    def log(self, record: dict) -> None:
        self.console.log(record)
        if self.run is not None:
            self.run.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])

    def finish(self, summary: dict) -> None:
        self.console.finish(summary)
        self.finished = True
        if self.run is not None:
            self.run.summary.update({k: v for k, v in summary.items() if isinstance(v, (int, float, str))})

    def close(self) -> None:
        self.console.close()
        if self.run is not None:
            # A run that ended before its summary failed: W&B records it so (exit code 0 is "finished").
            self.run.finish(exit_code=None if self.finished else 1)
            self.run = None


FORBIDDEN = "/\\#?%:"   # W&B refuses these in a project name (after the run is set up)


def check(cfg: WandbConfig, stage: str, nodes: Mapping[str, Any]) -> WandbConfig:
    """When composing, before any run folder or rank: what W&B would refuse only once the run starts."""
    if cfg.mode is not None and cfg.mode not in MODES:
        raise ConfigError(f"logger.mode={cfg.mode!r} is not one of {', '.join(MODES)}")
    env = os.environ.get("WANDB_MODE")
    if cfg.mode is None and env and env not in MODES:
        raise ConfigError(f"the environment variable WANDB_MODE={env!r} is not one of {', '.join(MODES)}; "
                          "fix or unset it, or set logger.mode")
    bad = sorted(set(FORBIDDEN) & set(cfg.project))
    if bad:
        raise ConfigError(f"logger.project={cfg.project!r} has a character W&B refuses ({' '.join(bad)}); "
                          f"choose a name without any of {' '.join(FORBIDDEN)}")
    if importlib.util.find_spec("wandb") is None:
        raise ConfigError("logger=wandb needs wandb, which is not installed: pip install wandb, or logger=console")
    return cfg


COMPONENT = Component(config=WandbConfig, build=WandbLogger, check=check)
