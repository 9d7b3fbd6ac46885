"""A job's run folder around Hydra: Hydra's record of the job (hydra.output_subdir, .hydra/), which the job writes
itself once its checks passed, and what the CLI adds to Hydra's command line but leaves out of it; which process
writes the sweep's record (``first_rank``); removing the folders made for a job refused before it trained."""
from __future__ import annotations

import contextlib
import fcntl
import functools
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from framework.cli.launch import CHECKPOINT_LOCK, RUN_LOCK, slurm_task_env
from framework.comm.distributed import env_int
from framework.config import choice_override
from framework.core import files
from framework.core.errors import ConfigError
from framework.core.room import nearest_existing
from framework.persist.checkpoint import CHECKPOINTS

# Hydra would write its record of a job before the job runs, over a live run's record or into a folder refused a
# moment later: so it writes none, and the job writes it (``record_job``) once it holds the folder and passed.
NO_RECORD = "hydra.output_subdir=null"
OVERRIDE_DIRNAME_EXCLUDE = "hydra.job.config.override_dirname.exclude_keys"
QUIET = "hydra/hydra_logging=disabled"


@dataclass(frozen=True)
class Passed:
    """What the run adds to Hydra's command line and leaves out of its record: the DeepSpeed file's group choices
    (``task``), kept out of override_dirname by ``hydra``'s overrides (``exclude_keys``: the value given, or None)."""
    task: tuple[str, ...] = ()
    hydra: tuple[str, ...] = ()
    exclude_keys: list | None = None

    @staticmethod
    def make(chosen: Mapping[str, str], exclude_keys: list) -> "Passed":
        if not chosen:
            return Passed(hydra=(NO_RECORD,))
        keys = ",".join(f"'{k}'" for k in [*exclude_keys, *chosen])
        return Passed(tuple(choice_override(g, n) for g, n in chosen.items()),
                      (f"{OVERRIDE_DIRNAME_EXCLUDE}=[{keys}]", NO_RECORD), list(exclude_keys))

    def given(self, task: list[str]) -> list[str]:
        return [o for o in task if o not in self.task]


def record_job(task: DictConfig, hc: DictConfig, subdir: str | None, passed: Passed,
               ds_config: str | None = None) -> Callable[[Path], None] | None:
    """A picklable function writing Hydra's record of the job (as given) into a folder's ``subdir``, or None.
    Hydra's config.yaml lacks a DeepSpeed file's layer: with one, a first comment line says where the run's is."""
    if subdir is None:
        return None
    # a file in its place (.hydra): one line now, not a traceback once the model is built and the run has begun
    if not (base := nearest_existing(Path(hc.runtime.output_dir) / subdir)).is_dir():
        key = "hydra.sweep.dir" if hc.mode == RunMode.MULTIRUN else "hydra.run.dir"
        raise ConfigError(f"cannot write Hydra's record of the job (hydra.output_subdir={subdir}) in {base}: it is "
                          f"not a folder; move it away, or give this run a folder of its own: {key}=PATH")
    hydra_cfg = _as_given(OmegaConf.create({"hydra": OmegaConf.to_container(hc)}), subdir, passed)
    records = (("config.yaml", task), ("hydra.yaml", hydra_cfg), ("overrides.yaml", hydra_cfg.hydra.overrides.task))
    head = {"config.yaml": f"# Hydra's YAML layer, without the DeepSpeed file's values ({ds_config}): the run's "
                           f"config is summary.json's \"config\" (or --cfg job)\n"} if ds_config else {}
    return functools.partial(_write_record, subdir, {name: (head.get(name, "") + OmegaConf.to_yaml(node)).encode()
                                                     for name, node in records})


def _write_record(subdir: str, records: dict[str, bytes], folder: Path) -> None:
    (folder / subdir).mkdir(parents=True, exist_ok=True)   # with the umask's modes, as Hydra's (colleagues read them)
    for name, data in records.items():
        files.write_atomic(folder / subdir / name, data, shared=True)


def _as_given(cfg: DictConfig, subdir: str | None, passed: Passed) -> DictConfig:
    """``cfg`` (Hydra's under ``hydra``) with the user's output_subdir and exclude_keys, without what was ``passed``."""
    given = OmegaConf.to_container(cfg.hydra.overrides.hydra)   # as given: interpolations unresolved
    for line in passed.hydra:
        if line in given:
            del given[len(given) - 1 - given[::-1].index(line)]   # ours: the last one
    cfg.hydra.overrides.hydra, cfg.hydra.output_subdir = given, subdir
    cfg.hydra.overrides.task = passed.given(OmegaConf.to_container(cfg.hydra.overrides.task))
    if passed.exclude_keys is not None:
        cfg.hydra.job.config.override_dirname.exclude_keys = passed.exclude_keys
    return cfg


def record_sweep(sweep_dir: Path, subdir: str | None, passed: Passed) -> None:
    """Rewrite the sweep's multirun.yaml without ``passed`` (each job writes the same)."""
    path = sweep_dir / "multirun.yaml"
    try:
        cfg = OmegaConf.load(path)
    except FileNotFoundError:   # (a launcher that writes none)
        return
    if NO_RECORD in OmegaConf.to_container(cfg.hydra.overrides.hydra):
        files.write_atomic(path, OmegaConf.to_yaml(_as_given(cfg, subdir, passed)).encode(), shared=True)


def first_rank() -> bool:
    """Whether this process is global rank 0 (or alone): torchrun's RANK, else a submitit task's (before launch)."""
    rank = env_int("RANK", None)
    return (int(slurm_task_env().get("RANK", 0)) if rank is None else rank) == 0


def made_for(folder: Path, base: Path | None) -> list[Path]:
    """The folders Hydra made for this job below ``base``, deepest first; none where ``folder`` holds anything."""
    if base is None or base not in folder.parents or any(folder.iterdir()):
        return []
    return [folder, *(p for p in folder.parents if base in p.parents)]


def remove_made(made: list[Path], subdir: str | None, owned: bool, alike: bool = False) -> bool:
    """Remove the folders made for a job refused before it trained; whether the run folder went. Rank 0's (every
    rank's for an error raised ``alike``: another rank's Hydra may make it again); one it ``owned`` only under its
    locks again and while it holds only what the job wrote, else only if empty."""
    if not made or (not first_rank() and not alike):   # (rank 0 may still be writing into it)
        return False
    try:
        if owned:
            with contextlib.ExitStack() as held:
                if not _lock(held, made[0] / RUN_LOCK):
                    return False
                names = {p.name for p in made[0].iterdir()}
                if not names <= {"train.log", RUN_LOCK, CHECKPOINTS, *Path(subdir or ".").parts[:1]}:
                    return False
                # The run folder's own checkpoint root (the pre-flight made it, holding only its lock): listed only
                # under that lock, so a save committed before we took it is seen (and kept)
                checkpoints = made[0] / CHECKPOINTS
                if CHECKPOINTS in names and (checkpoints.is_symlink() or not _lock(held, checkpoints / CHECKPOINT_LOCK)
                                             or os.listdir(checkpoints) != [CHECKPOINT_LOCK]):
                    return False   # (a save, or another run saving there: kept)
                shutil.rmtree(made[0], ignore_errors=True)
        else:
            made[0].rmdir()   # (not empty: another run's now)
    except OSError:
        return False
    files.remove_made(made[1:])   # (up to one that holds another run's folder, or a sweep's multirun.yaml)
    return not made[0].exists()


def _lock(held: contextlib.ExitStack, path: Path) -> bool:
    """Whether the lock file at ``path`` was free and is now held until ``held`` closes."""
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    held.callback(os.close, fd)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    return True
