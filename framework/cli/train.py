"""Train from the command line: ``python -m framework.train --help`` prints the usage and examples (their one
copy: conf/train.yaml's ``hydra.help.template``).

Every job's config is composed and checked once, before any run folder or process exists. Hydra's record
of the job (.hydra/) is written once the run's checks passed, and a job refused before it trained removes
the folders made for it: a refused run leaves the file system as it found it.
"""
from __future__ import annotations

import argparse
import functools
import itertools
import math
import os
import re
import sys
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Callable, Mapping

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.types import ValueType
from hydra.errors import HydraException
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import InterpolationKeyError, InterpolationResolutionError, OmegaConfBaseException

from framework.cli import fail
from framework.cli._hydra import (OVERRIDE_DIRNAME_EXCLUDE, QUIET, Passed, first_rank, made_for, record_job,
                                  record_sweep, remove_made)
from framework.cli._signals import terminated_line
from framework.cli.launch import check_saves, launch
from framework import ops
from framework.comm.distributed import check_env, env_int
from framework.config import (GROUPS, Config, app_composer, compose, compose_layers, parse_overrides,
                              override_key, search_order, standalone_composer)
from framework.config.dsconfig import DS_FILE
from framework.core import files
from framework.core.errors import ConfigError, DistributedError, FrameworkError, first_line, say
from framework.core.paths import conf_dir
from framework.core.room import nearest_existing
from framework.core.utils import counted, under
from framework.loggers import NOT_IDENTITY, RunInfo
from framework.persist.checkpoint import checkpoint_root

# Hydra's own command-line flags: read here only to know which jobs a command line describes.
SWITCHES = (("--help", "-h"), ("--hydra-help",), ("--version",), ("--resolve",), ("--run", "-r"),
            ("--multirun", "-m"), ("--shell-completion", "-sc"))
VALUED = (("--cfg", "-c"), ("--package", "-p"), ("--config-path", "-cp"), ("--config-name", "-cn"),
          ("--config-dir", "-cd"), ("--experimental-rerun",))
VALUED_NAMES = frozenset(name for names in VALUED for name in names)


def _jobs(argv: list[str]) -> tuple[list[list[str]] | None, dict, str, frozenset[str]]:
    """Each job's overrides (sweeps expanded as Hydra's basic sweeper does; None for info flags and a line Hydra
    refuses), the primary config, the key of the folder Hydra makes, and the keys the command line fixes."""
    args, unknown = _parser().parse_known_args(argv)
    _check_one_run(argv, args.overrides)
    if args.config_path is not None:   # Hydra's would replace conf/ (every group) and be read from framework/cli/
        raise ConfigError(f"--config-path {args.config_path}: not supported (Hydra would replace the framework's "
                          f"conf/ with it, read relative to framework/cli/); use --config-dir {args.config_path} "
                          "(with --config-name NAME for a file other than train.yaml)")
    primary = {"config_dir": args.config_dir, "config_name": args.config_name or "train"}
    folder = "hydra.sweep.dir" if args.multirun else "hydra.run.dir"
    if not (unknown or args.help or args.hydra_help or args.version):   # (Hydra serves those first)
        _one_command(args)
    if args.resolve and args.cfg is None and not (unknown or args.help or args.version):   # Hydra: a traceback
        raise ConfigError("--resolve: only with --cfg job|hydra|all (or --help); add --cfg job to print the resolved "
                          "config")
    if args.cfg == "job" and not args.multirun and not unknown:   # Hydra's --cfg lacks a DeepSpeed config's layer
        _print_resolved(args.overrides, args.resolve, primary, args.package)
        sys.exit(0)
    if unknown or args.help or args.hydra_help or args.version or args.info or args.shell_completion or args.cfg:
        return None, primary, folder, frozenset()
    if not args.multirun:
        return [args.overrides], primary, folder, frozenset(o.key_or_group for o in parse_overrides(args.overrides)
                                                                  if not o.is_hydra_override())
    axes, fixed = {}, {}   # by key: a later override of the same key replaces the earlier one
    for o in parse_overrides(args.overrides):
        key = o.get_key_element()
        axes[key] = ([f"{key}={v}" for v in _sweep(o, primary, args.overrides)] if o.is_sweep_override()
                     else [f"{key}={o.get_value_element_as_str()}"])
        if not o.is_hydra_override():
            fixed[o.key_or_group] = len(axes[key]) == 1
    return ([list(combo) for combo in itertools.product(*axes.values())], primary, folder,
            frozenset(k for k, one in fixed.items() if one))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("overrides", nargs="*")
    for names in SWITCHES:
        parser.add_argument(*names, action="store_true")
    for names in VALUED:
        parser.add_argument(*names)
    parser.add_argument("--info", "-i", nargs="?", const="all")
    return parser


def _check_one_run(argv: list[str], first: list[str]) -> None:
    """One line for a flag between overrides (``a=1 -m b=2``), where Hydra's usage would blame a valid override."""
    every, _ = _parser().parse_known_intermixed_args(argv)
    if len(every.overrides) > len(first):
        later = every.overrides[len(first)]
        end = next(i + len(first) for i in range(len(argv))
                   if argv[i:i + len(first)] == first and (i == 0 or argv[i - 1] not in VALUED_NAMES))
        flags = " ".join(argv[end:argv.index(later, end)])
        raise ConfigError(f"{flags} between the overrides {first[-1]} and {later}: Hydra reads the overrides as one "
                          f"run of words; put {flags} before or after all of them")


def _one_command(args: argparse.Namespace) -> None:
    """One line where Hydra would refuse its commands together with a traceback (``--cfg job`` is printed here)."""
    given = [name for name, on in (("--run", args.run and args.cfg != "job"), ("-m", args.multirun),
                                   (f"--cfg {args.cfg}", args.cfg),
                                   (f"--info {args.info}".removesuffix(" all"), args.info is not None),
                                   ("--shell-completion", args.shell_completion)) if on]
    if len(given) > 1:
        fix = (f"drop -m to print one job's {'config' if args.cfg else 'info'} (give each swept key one of its "
               "values)" if args.multirun and (args.cfg or args.info is not None) else "keep one")
        raise ConfigError(f"{' with '.join(given)}: Hydra takes one of --run, -m, --cfg, --info and "
                          f"--shell-completion at a time; {fix}")


def with_added(argv: list[str], added: list[str]) -> list[str]:
    """``argv`` with ``added`` overrides right after the user's overrides (one run of words; a flag may follow)."""
    args, _ = _parser().parse_known_args(argv)
    n = len(args.overrides)
    ends = [i + n for i in range(len(argv) - n + 1)   # (a flag's value is none of them: -cn a=1 a=1)
            if n and argv[i:i + n] == args.overrides and (i == 0 or argv[i - 1] not in VALUED_NAMES)]
    end = ends[-1] if ends else len(argv)
    return [*argv[:end], *added, *argv[end:]]


def _sweep(o, primary: dict, overrides: list[str]) -> list[str]:
    """A sweep override's values as Hydra's basic sweeper enumerates them (``glob``'s from conf/ and --config-dir)."""
    if o.value_type == ValueType.INTERVAL_SWEEP:
        sweepers = [x.partition("=")[2] for x in overrides if override_key(x) == "hydra/sweeper"]
        if any(name != "basic" for name in sweepers):
            return []   # that sweeper samples; its jobs are composed in the job (Hydra's basic one enumerates)
        chosen = "hydra/sweeper=basic enumerates values, it does not sample them" if sweepers else "none is chosen"
        raise ConfigError(f"config: {o.input_line}: interval() needs a sweeper that samples values (Hydra's "
                          f"Optuna or Ax sweeper plugin, hydra/sweeper=...), and {chosen}; list the values "
                          "(a,b,c) or use range(...)")
    if o.value_type != ValueType.GLOB_CHOICE_SWEEP:
        try:
            values = list(o.sweep_string_iterator())
        except (ValueError, HydraException) as e:   # range(a,b,0): Python's ValueError, Hydra's for floats
            if o.value_type != ValueType.RANGE_SWEEP:
                raise
            raise ConfigError(f"config: {o.input_line}: a range's step must not be 0; give another step (below 0 "
                              "counts down) or leave it out for 1") from e
        if not values:   # (Hydra's sweeper would run no job and exit 0)
            why = " (range(start, stop[, step]) stops before stop)" if o.value_type == ValueType.RANGE_SWEEP else ""
            raise ConfigError(f"config: {o.input_line}: the sweep has no value{why}; give it at least one")
        return values
    group = o.key_or_group
    folders = [conf_dir(), *([Path(primary["config_dir"])] if primary["config_dir"] else [])]
    names = sorted({p.stem for d in folders for p in (d / group).glob("*.yaml")})
    if not names:
        raise ConfigError(f"config: {o.input_line}: glob() selects names of a config group, and {group} is none")
    if not (values := o.value().filter(names)):
        raise ConfigError(f"config: {o.input_line}: glob() selects none of the {group} names "
                          f"({', '.join(names)}); give a pattern that matches one")
    return values


def _key(overrides: list[str]) -> tuple[str, ...]:
    """A job's overrides as Hydra hands them to it (``hydra.*`` ones apart), spelled one way."""
    return tuple(o.input_line if o.is_sweep_override() else f"{o.get_key_element()}={o.get_value_element_as_str()}"
                 for o in parse_overrides(list(overrides)) if not o.is_hydra_override())


def check_folder(cfg: DictConfig, key: str) -> Path | None:
    """One line for a run folder ``key`` Hydra cannot make or write in (a traceback), else its nearest existing one."""
    try:
        folder = Path(str(OmegaConf.select(cfg, key)))
    except OmegaConfBaseException as e:   # an interpolation only a running Hydra resolves: Hydra's to check
        check_missing_key(cfg, key, e)
        return None
    base = nearest_existing(folder, key)
    if not base.is_dir():
        raise ConfigError(f"{key}={folder}: {base} is not a folder; set {key} to a folder")
    try:
        files.probe_writable(base)
    except OSError:
        raise ConfigError(f"{key}={folder}: {base} is not writable; fix its permissions or set {key} "
                          "to a writable folder") from None
    return base


def check_missing_key(cfg: DictConfig, key: str, error: Exception | None = None) -> None:
    """One line for a folder key interpolating a missing key or an unset environment variable (Hydra: a traceback),
    naming ``${hydra:runtime.choices.GROUP}`` for a group's choice."""
    try:
        if error is None:
            OmegaConf.select(cfg, key)
            return
    except OmegaConfBaseException as e:
        error = e
    unset = (re.search(r"Environment variable '([^']+)' not found", str(error))   # ${oc.env:VAR}, VAR unset
             if isinstance(error, InterpolationResolutionError) else None)
    found = re.match(r"Interpolation key '([^']+)' not found", str(error))
    if not unset and (not isinstance(error, InterpolationKeyError) or not found or found[1].split(".")[0] == "hydra"):
        return   # (Hydra's own keys are filled in by a running Hydra)
    parent, _, last = key.rpartition(".")
    raw = OmegaConf.to_container(OmegaConf.select(cfg, parent), resolve=False)[last]
    if unset:
        raise ConfigError(f"{key}={raw}: the environment variable {unset[1]} is not set; set it, or give "
                          f"it a default: ${{oc.env:{unset[1]},DEFAULT}}")
    missing, group = found[1], found[1].split(".")[0]
    hint = (f"; for the chosen {group} write ${{hydra:runtime.choices.{group}}}"
            if group in GROUPS and missing in (group, f"{group}.name") else "")
    raise ConfigError(f"{key}={raw}: the config has no key {missing}{hint}")


def check_no_chdir(cfg: DictConfig) -> None:
    """hydra.job.chdir=true is refused: relative paths are the launch directory's; the job names its run folder."""
    try:
        chdir = OmegaConf.select(cfg, "hydra.job.chdir")
    except OmegaConfBaseException:
        return
    if chdir:
        raise ConfigError("hydra.job.chdir=true: the job stays in the launch directory, against which relative paths "
                          "(data, checkpoint.dir, checkpoint.resume, outputs/) are resolved, and writes into its run "
                          "folder (hydra.run.dir / hydra.sweep.dir) all the same; drop hydra.job.chdir")


def check_groups_chosen(overrides: list[str], cfg: DictConfig, config: Config, passed: Mapping[str, str]) -> None:
    """Hydra's run composes the command line again with the group choices all DeepSpeed files share (``passed``),
    where ``stage.KEY=V`` without a chosen stage fails with unhelpful advice: one line naming the fix instead."""
    parsed = parse_overrides(overrides)
    given = {o.key_or_group for o in parsed if o.key_or_group in GROUPS}
    for o in parsed:
        group = o.key_or_group.split(".")[0]
        # Another group has a default in Hydra's config, where the key may well be (optimizer.lr): Hydra's to judge.
        if (group != "stage" or group == o.key_or_group or group in given or group in passed
                or o.is_add() or o.is_force_add() or o.is_delete()):
            continue
        if config.sources.get(f"{group}.name") == DS_FILE:
            raise ConfigError(f"config: {o.input_line} sets a key of the {group} group, which the DeepSpeed files of "
                              f"the sweep's jobs choose differently; set it as ++{o.input_line}")
        if "stage" not in cfg.hydra.runtime.choices:
            raise ConfigError(f"config: {o.input_line} sets a key of the stage, which the command line does not "
                              f"choose; choose it first: +stage={config.choices['stage']} {o.input_line}")


def _print_resolved(overrides: list[str], resolve: bool, primary: dict, package: str | None) -> None:
    """``--cfg job [--package KEY]``: the composed config (or KEY) with a DeepSpeed config's values, after a comment
    naming the chosen groups (``# stage=zero2 offload=cpu ...``) unless a KEY."""
    cfg, config = compose_layers(list(overrides), composer=functools.partial(standalone_composer, **primary))
    if config.notices:   # as a run prints them (stderr: stdout stays the YAML a script may read)
        print("\n".join(config.notices), file=sys.stderr, flush=True)
    node = OmegaConf.to_container(cfg)
    node.pop("hydra", None)   # Hydra's section (--cfg hydra): only a running Hydra resolves it (hydra.job.num)
    if resolve:
        try:
            node = OmegaConf.to_container(OmegaConf.create(node), resolve=True)
        except OmegaConfBaseException as e:
            raise ConfigError(f"--resolve: {str(e).splitlines()[0]}") from None
    if package:
        absent = object()   # a key whose value is null (checkpoint.dir) is there
        node = OmegaConf.select(OmegaConf.create(node), package, default=absent)
        if node is absent:
            raise ConfigError(f"--package {package}: the config has no such key")
        node = OmegaConf.to_container(node) if OmegaConf.is_config(node) else node
    order = ("stage", "offload", "precision", *(g for g in GROUPS if g not in ("stage", "offload", "precision")))
    # (a section or a value asked for alone is printed alone: a script may read it)
    top = "" if package else "# " + " ".join(f"{g}={config.choices[g]}" for g in order) + "\n"
    print(top + (OmegaConf.to_yaml(node) if isinstance(node, (dict, list)) else f"{'null' if node is None else node}\n"),
          end="")


def _naming(overrides: list[str], swept: frozenset[str]) -> list:
    """The overrides that name a sweep's job: all but unswept ``NOT_IDENTITY`` ones (a relaunch with more
    train.steps resumes the job)."""
    return [o for o in parse_overrides(overrides) if o.key_or_group in swept or not under(o.key_or_group, NOT_IDENTITY)]


def job_key(overrides: list[str], swept: frozenset[str] = frozenset()) -> str:
    """A sweep job's name under checkpoint.dir: its sorted overrides but unswept ``NOT_IDENTITY`` ones, or ``job``."""
    return ",".join(sorted(o.input_line for o in _naming(overrides, swept))) or "job"


def _job_checkpoints(config: Config, overrides: list[str], swept: frozenset[str],
                     older: str | None = None) -> tuple[str, Path]:
    """A sweep job's name under checkpoint.dir (``job_key``) and its checkpoint folder; ``older``'s (all its
    overrides, Hydra's ``override_dirname``) where only that folder exists."""
    key = job_key(overrides, swept)
    new = checkpoint_root(config, None, key)
    if older is None or config.checkpoint.dir is None or older == key or new.exists():
        return key, new
    if not (old := checkpoint_root(config, None, older)).is_dir():
        return key, new
    print(f"checkpoint: using {old} (this job's folder named by all its overrides, those that do not name a job "
          f"included); move it to {new} to resume it under the job's current name", flush=True)
    return older, old


def sweep_group(job_name: str, sweep_dir: str) -> str:
    """The W&B group of a sweep's runs: the job's name and the sweep folder (relative, else its last two parts)."""
    folder = os.path.abspath(sweep_dir)
    rel = os.path.relpath(folder, os.getcwd())
    parts = Path(rel).parts if not rel.startswith("..") else Path(folder).parts[-2:]
    return f"{job_name}-{'_'.join(parts)}"


def _app(configs: dict[tuple[str, ...], Config], on_point: Callable[[str], None] | None, failed: list[str],
         fixed: frozenset[str], subdir: str | None, base: Path | None, passed: Passed, home: str) -> Callable[[], None]:
    """The Hydra app running each job with its composed config (``base``, ``fixed``: as ``check_folder``, ``_jobs``;
    ``home``: as ``search_order``); a failed job of a basic sweep is added to ``failed`` and the sweep goes on."""
    folders: dict[Path, int] = {}   # each run folder's job number

    @hydra.main(config_path=home, config_name="train", version_base="1.3")
    def job(task: DictConfig) -> float:
        hc = HydraConfig.get()
        overrides = passed.given(list(hc.overrides.task))
        # (a job another sweeper made up: composed here, from its overrides)
        config = configs.get(_key(overrides)) or compose(overrides, composer=app_composer)
        multirun = hc.mode == RunMode.MULTIRUN
        # Keys the command line does not fix are swept (there or by the sweeper): they tell the jobs apart.
        swept = frozenset(o.key_or_group for o in parse_overrides(overrides)) - fixed
        run = RunInfo(Path(hc.runtime.output_dir), **(dict(
            group=sweep_group(hc.job.name, hc.sweep.dir), name=hc.job.override_dirname or f"job{hc.job.num}",
            key=_job_checkpoints(config, overrides, swept, hc.job.override_dirname)[0], sweep_dir=Path(hc.sweep.dir),
            naming=frozenset(o.key_or_group for o in _naming(overrides, swept))) if multirun else dict(group=None, name=None)))
        made, owned = made_for(run.run_dir, base), []
        # (no torchrun peers' sweepers to race: written before launch, for a job refused before owning too)
        early = multirun and first_rank() and env_int("WORLD_SIZE", 1) <= 1

        def own(folder: Path) -> None:
            """The folder's owner rewrites the sweep's record: by then (after the run-directory agreement) every
            torchrun rank's sweeper wrote its raw multirun.yaml, so no late rank's write lands after ours."""
            owned.append(folder)
            if multirun and not early:
                record_sweep(Path(hc.sweep.dir), subdir, passed)

        try:
            if early:
                record_sweep(Path(hc.sweep.dir), subdir, passed)
            # A job given an earlier job's run folder is refused: it would take that job's records for its own.
            if multirun and (earlier := folders.setdefault(run.run_dir.resolve(), hc.job.num)) != hc.job.num:
                raise ConfigError(f"run folder {run.run_dir}: job {hc.job.num} of this sweep would share it with job "
                                  f"{earlier} (resuming or setting aside that job's run); make hydra.sweep.subdir name "
                                  "one folder per job, e.g. its default ${hydra.job.num} (and, with override_dirname, "
                                  "exclude no swept key)")
            val = launch(config, run, on_point, own, record_job(task, hc, subdir, passed, config.ds_config)
                         )["val_loss"]
            return math.nan if val is None else val   # (summary.json, read back from ranks, has NaN as null)
        except Exception as e:
            basic_sweep = multirun and hc.runtime.choices.get("hydra/launcher") == "basic"
            if isinstance(e, FrameworkError):
                # Rank 0's header (train.log, looked at before the removal: &) named this folder and its files: gone.
                if (run.run_dir / "train.log").is_file() & remove_made(made, subdir, bool(owned), e.every_rank):
                    say(f"note: run folder {run.run_dir} removed (the run was refused before training: none of "
                        f"its files were written)")
                say(f"error: {e}")   # (under torchrun every rank prints its line)
                if not basic_sweep:
                    sys.exit(1)   # (another launcher reports the job's exit)
            else:   # a bug, the allocator's RuntimeError, ...: Hydra's to report, but in a sweep
                if not multirun:
                    raise
                # its traceback and one line now: a basic sweep goes on and counts it (Hydra would go on silently);
                # another launcher keeps it in the job's result, which Hydra's submitit one reads for task 0 alone
                traceback.print_exception(e)
                say(f"error: job {hc.job.num} ({run.run_dir}) failed: {type(e).__name__}: {first_line(e)}")
                if not basic_sweep:
                    raise
            if not _sweep_goes_on(e):
                sys.exit(1)   # (a re-raised error Hydra would catch, and go on with the next job)
            mine = " ".join(o for o, p in zip(overrides, parse_overrides(overrides)) if p.key_or_group in swept)
            gone = f"{mine}, no folder" if mine else "no folder"   # (refused before it trained: named by what it swept)
            failed.append(f"job {hc.job.num} ({run.run_dir if run.run_dir.is_dir() else gone})")
            return math.nan
        except KeyboardInterrupt as e:   # Ctrl-C: the run cleaned up as it unwound
            say(str(e) or "interrupted")
            sys.exit(130)
        except SystemExit as e:   # SIGTERM: as Ctrl-C, with its exit status
            if (line := terminated_line(e)) is not None:
                say(line)
            raise
    return job


def _sweep_goes_on(e: Exception) -> bool:
    """Whether this process may go on with a sweep's next job after ``e``: always alone; as a rank of an external
    group (torchrun's or submitit's tasks) only after a FrameworkError raised alike on every rank (else peers still
    in the failed job would pair their collectives with the next job's), not a DistributedError (the group is
    unusable)."""
    return env_int("WORLD_SIZE", 1) <= 1 or (isinstance(e, FrameworkError) and e.every_rank
                                             and not isinstance(e, DistributedError))


def _refused(e: FrameworkError, n: int, overrides: list[str], fixed: frozenset[str], count: int) -> FrameworkError:
    """``e`` of job ``n`` of ``count`` (composed before any runs): named by its swept overrides; no job ran."""
    mine = " ".join(o.input_line for o in parse_overrides(overrides) if o.key_or_group not in fixed
                    and not o.is_hydra_override())
    return e if count < 2 else ConfigError(f"sweep job {n}{f' ({mine})' if mine else ''}: {e}; no job of the sweep ran")


def check_shared_checkpoints(jobs: list[tuple[list[str], Config]], fixed: frozenset[str]) -> None:
    """Two jobs of a sweep named alike under checkpoint.dir (a value given twice, or spelled two ways: 1e-3 and
    0.001) would share one checkpoint folder: the later would resume the earlier's checkpoint and train nothing (or,
    not resuming, be refused by the earlier's steps there). Jobs that save nothing share nothing written (a job
    repeated as a nondeterminism check): they run."""
    seen: dict[Path, int] = {}
    for n, (overrides, config) in enumerate(jobs if len(jobs) > 1 else ()):
        if config.checkpoint.dir is None or not config.checkpoint.every:   # (their run folders', or no saves)
            continue
        task = [o for o in parse_overrides(overrides) if not o.is_hydra_override()]
        swept = frozenset(o.key_or_group for o in task) - fixed
        root = _job_checkpoints(config, [o.input_line for o in task], swept)[1]
        if (first := seen.setdefault(root, n)) != n:
            mine = " ".join(o.input_line for o in task if o.key_or_group in swept)
            then = (f"job {n} would resume job {first}'s checkpoint and train nothing"
                    if config.checkpoint.resume in ("auto", "latest") else
                    f"job {n}'s saves would overwrite job {first}'s checkpoints (so checkpoint.resume="
                    f"{config.checkpoint.resume} refuses them)")
            raise ConfigError(f"sweep jobs {first} and {n} are the same job{f' ({mine})' if mine else ''}: they would "
                              f"share the checkpoint folder {root}, and {then}; drop the repeated value, or set "
                              "checkpoint.every=0 (no saves); no job of the sweep ran")


def _sweep_world(overrides: list[str], folder: str, composer) -> int | None:
    """The ranks (nodes x tasks_per_node) of each job of a sweep on Hydra's submitit launcher, over which a
    DeepSpeed file's batch is divided; None for another launcher or one task."""
    if folder != "hydra.sweep.dir":
        return None
    try:   # (the launcher's choice is in the tree alone: it never depends on the DeepSpeed file)
        launcher = OmegaConf.select(composer(list(overrides))[0], "hydra.launcher")
    except FrameworkError:
        return None   # compose_layers says what is wrong, in its own words
    if launcher is None or not str(launcher.get("_target_", "")).endswith(
            ("submitit_launcher.SlurmLauncher", "submitit_launcher.LocalLauncher")):
        return None
    world = int(launcher.get("nodes", 1)) * int(launcher.get("tasks_per_node", 1))
    return world if world > 1 else None


def main(on_point: Callable[[str], None] | None = None) -> None:
    """``on_point``: called at the loop's points on every rank (``loop.train``; fault tests)."""
    try:
        check_env()   # a launch environment that cannot work: a usage error, before any run or sweep folder
        try:   # (a library user gets the fallback warning instead: the kernels unavailable, the step runs)
            ops.check_environment(when_off=False)   # (the kernels off: their other variables are unused)
        except ops.BuildUnavailable as e:
            raise ConfigError(str(e)) from None
        jobs, primary, folder, fixed = _jobs(sys.argv[1:])
        configs, subdir, base, composed, chosen, exclude = {}, None, None, [], None, []
        composer = functools.partial(standalone_composer, **primary)
        # (read only by a job with a DeepSpeed file: a sweep without one composes no extra config for it)
        world = functools.cache(lambda: _sweep_world(jobs[0], folder, composer))
        for n, overrides in enumerate(jobs or []):   # fail fast, before any run directory or process exists
            try:
                cfg, config = compose_layers(overrides, world=world, composer=composer)
            except FrameworkError as e:
                raise _refused(e, n, overrides, fixed, len(jobs)) from None
            configs[_key(overrides)] = config
            composed.append((overrides, cfg, config))
            # The file's group choices go to Hydra's run too: those all the jobs share.
            mine = {g: config.choices[g] for g in GROUPS if config.sources.get(f"{g}.name") == DS_FILE}
            chosen = mine if chosen is None else {g: n for g, n in chosen.items() if mine.get(g) == n}
            exclude = OmegaConf.to_container(OmegaConf.select(cfg, OVERRIDE_DIRNAME_EXCLUDE) or OmegaConf.create([]))
            base = check_folder(cfg, folder)
            if folder == "hydra.sweep.dir":
                check_missing_key(cfg, "hydra.sweep.subdir")
            check_no_chdir(cfg)
            check_saves(config)
            subdir = OmegaConf.select(cfg, "hydra.output_subdir")
        for overrides, cfg, config in composed:
            check_groups_chosen(overrides, cfg, config, chosen or {})
        check_shared_checkpoints([(overrides, config) for overrides, _, config in composed], fixed)
        home, searched, merged = search_order(primary["config_dir"], primary["config_name"], sys.argv[1:])
    except FrameworkError as e:
        sys.exit(fail(e, 2))
    failed: list[str] = []
    # (none for Hydra's info flags, --cfg hydra shows the config as given, nor a sampling sweeper's jobs)
    passed = Passed.make(chosen or {}, exclude) if configs else Passed()
    if configs and env_int("RANK", 0) != 0:   # Hydra's own lines ("Launching 2 jobs locally"): rank 0's alone
        passed = replace(passed, hydra=(*passed.hydra, QUIET))
    argv, sys.argv[1:] = list(sys.argv), with_added(searched, [*merged, *passed.task, *passed.hydra])   # (restored)
    try:
        _app(configs, on_point, failed, fixed, subdir, base, passed, home)()
    finally:
        sys.argv[:] = argv
    if failed:   # (the ranks of a torchrun sweep failed the same jobs: rank 0 says it for all)
        where = "their errors are" if len(failed) > 1 else "its error is"
        sys.exit(fail(f"{counted(len(failed), 'job')} of the sweep failed ({where} above): {', '.join(failed)}", 1)
                 if env_int("RANK", 0) == 0 else 1)
