"""wandb: Weights & Biases (offline unless configured otherwise) plus the console view.

The mode comes from ``logger.mode``, then the WANDB_MODE environment variable, then
"offline": a ``mode=`` argument in code would silently beat WANDB_MODE. wandb is imported
lazily (1-2.5 s) and only on rank 0.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

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
    def __init__(self, cfg: WandbConfig, run: RunInfo):
        self.cfg, self.run_info = cfg, run
        self.console = Console(cfg.live)
        self.run = None

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
        if self.run is not None:
            for k, v in summary.items():
                if isinstance(v, (int, float, str)):
                    self.run.summary[k] = v

    def close(self) -> None:
        self.console.close()
        if self.run is not None:
            self.run.finish()
            self.run = None


def build(cfg: WandbConfig, *, run: RunInfo) -> WandbLogger:
    if cfg.mode is not None and cfg.mode not in MODES:
        raise ConfigError(f"logger.mode={cfg.mode!r} is not one of {', '.join(MODES)}")
    return WandbLogger(cfg, run)


COMPONENT = Component(config=WandbConfig, build=build)
