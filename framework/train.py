"""Train from the command line.

    python -m framework.train                                  # default job: gpt-nano on synthetic data
    python -m framework.train +stage=zero3 offload=cpu         # compose a stage and an offload target
    python -m framework.train dist.nproc=2 train.steps=100     # 2 local ranks (gloo on CPU)
    torchrun --nproc-per-node 2 -m framework.train             # ranks made by torchrun
    python -m framework.train -m optimizer=adamw,lion          # a Hydra multirun sweep

Flow: check (every job's composed config against the typed schemas, one line per error)
-> compose (Hydra) -> launch (1 process, spawned ranks or torchrun) -> build -> loop.
"""
from __future__ import annotations

import itertools
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from framework.config import compose, validate
from framework.errors import FrameworkError
from framework.launch import launch
from framework.loggers._base import RunInfo
from framework.paths import conf_dir
from framework.registry import GROUPS


def _jobs(argv: list[str]) -> list[list[str]] | None:
    """Each job's overrides (a multirun expands its sweeps); None for Hydra's info flags."""
    from hydra._internal.utils import get_args_parser
    from hydra.core.override_parser.overrides_parser import OverridesParser

    args = get_args_parser().parse_args(argv)
    if args.help or args.hydra_help or args.info or args.shell_completion or args.cfg:
        return None
    if not args.multirun:
        return [args.overrides]
    axes = [[f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()] if o.is_sweep_override()
            else [o.input_line] for o in OverridesParser.create().parse_overrides(args.overrides)]
    return [list(combo) for combo in itertools.product(*axes)]


@hydra.main(config_path=str(conf_dir()), config_name="train", version_base="1.3")
def _job(cfg: DictConfig) -> float:
    hc = HydraConfig.get()
    config = validate(cfg, {k: v for k, v in hc.runtime.choices.items() if k in GROUPS})
    multirun = hc.mode == RunMode.MULTIRUN
    run = RunInfo(Path(hc.runtime.output_dir),
                  group=f"{hc.job.name}-{Path(hc.sweep.dir).name}" if multirun else None,
                  name=(hc.job.override_dirname or f"job{hc.job.num}") if multirun else None)
    try:
        return launch(config, run)["val_loss"]
    except FrameworkError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(1)


def main() -> None:
    try:
        for overrides in _jobs(sys.argv[1:]) or []:
            compose(overrides)  # fail fast, before any run directory or process exists
    except FrameworkError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    _job()


if __name__ == "__main__":
    main()
