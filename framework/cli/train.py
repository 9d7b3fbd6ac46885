"""Train from the command line.

    python -m framework.train                                  # default job: gpt-nano on synthetic data
    python -m framework.train +stage=zero3 offload=cpu         # compose a stage and an offload target
    python -m framework.train dist.nproc=2 train.steps=100     # 2 local ranks (gloo on CPU)
    torchrun --nproc-per-node 2 -m framework.train             # ranks made by torchrun
    python -m framework.train -m optimizer=adamw,lion          # a Hydra multirun sweep
    python -m framework.train ds_config=ds.json train.steps=50 # a DeepSpeed config, then overrides
    python -m framework.train ds_config=ds.json --cfg job      # print the resolved config
    python -m framework.train --config-dir recipes/shakespeare_char_cpu --config-name config   # a recipe's config

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

from framework.config import app_composer, compose, compose_layers
from framework.core.errors import FrameworkError
from framework.cli.launch import launch
from framework.loggers import RunInfo
from framework.core.paths import conf_dir


def _jobs(argv: list[str]) -> tuple[list[list[str]] | None, dict]:
    """Each job's overrides (a multirun expands its sweeps; None for Hydra's info flags) and the
    primary config they apply to (``--config-dir``/``--config-name``, e.g. a recipe's)."""
    from hydra._internal.utils import get_args_parser
    from hydra.core.override_parser.overrides_parser import OverridesParser

    args = get_args_parser().parse_args(argv)
    primary = {"config_dir": args.config_dir, "config_name": args.config_name or "train"}
    if args.cfg == "job" and not args.multirun and any(o.split("=")[0].lstrip("+") == "ds_config"
                                                       for o in args.overrides):
        _print_resolved(args.overrides, args.resolve, primary)  # Hydra's own --cfg would not show the DeepSpeed layer
        sys.exit(0)
    if args.help or args.hydra_help or args.info or args.shell_completion or args.cfg:
        return None, primary
    if not args.multirun:
        return [args.overrides], primary
    axes = [[f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()] if o.is_sweep_override()
            else [o.input_line] for o in OverridesParser.create().parse_overrides(args.overrides)]
    return [list(combo) for combo in itertools.product(*axes)], primary


def _print_resolved(overrides: list[str], resolve: bool, primary: dict) -> None:
    """``--cfg job`` with a DeepSpeed config: the composed config with the file's values in it."""
    import functools

    from omegaconf import OmegaConf

    from framework.config import standalone_composer

    cfg, _ = compose_layers(list(overrides), composer=functools.partial(standalone_composer, **primary))
    node = OmegaConf.to_container(cfg, resolve=resolve)
    node.pop("hydra", None)
    print(OmegaConf.to_yaml(node), end="")


@hydra.main(config_path=str(conf_dir()), config_name="train", version_base="1.3")
def _job(cfg: DictConfig) -> float:
    hc = HydraConfig.get()
    # Composed again from this job's overrides: the DeepSpeed layer sits between the YAML and
    # them, and provenance needs to know which keys the command line set.
    config = compose(list(hc.overrides.task), composer=app_composer)
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
        jobs, primary = _jobs(sys.argv[1:])
        for overrides in jobs or []:
            compose(overrides, **primary)  # fail fast, before any run directory or process exists
    except FrameworkError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    _job()
