"""A job's run folder around its launch: which process writes the sweep's record (``first_rank``), and removing
the folders made for a job refused before it trained (``made_for``, ``remove_made``)."""
from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
from pathlib import Path

from framework.cli.launch import CHECKPOINT_LOCK, RUN_LOCK, slurm_task_env
from framework.comm.distributed import env_int
from framework.core import files
from framework.persist.checkpoint import CHECKPOINTS


def first_rank() -> bool:
    """Whether this process is global rank 0 (or alone), read before ``launch`` sets the rank variables of a task
    Hydra's submitit launcher started (torchrun's RANK, else that task's, as ``slurm_task_env`` gives them)."""
    rank = env_int("RANK", None)
    return (int(slurm_task_env().get("RANK", 0)) if rank is None else rank) == 0


def made_for(folder: Path, base: Path | None) -> list[Path]:
    """The folders Hydra made for this job below ``base``, deepest first; none where ``folder`` holds anything."""
    if base is None or base not in folder.parents or any(folder.iterdir()):
        return []
    return [folder, *(p for p in folder.parents if base in p.parents)]


def remove_made(made: list[Path], subdir: str | None, owned: bool, alike: bool = False) -> bool:
    """Remove the folders made for a job refused before it trained (rank 0's; every rank's where the error was
    raised ``alike``: another rank's Hydra may make the folder again after rank 0 removed it). One it ``owned``
    goes only under its lock again (and its checkpoint folder's) and while it holds only what the job wrote; one
    it never held only if empty. Whether the run folder was removed."""
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
    """Whether the lock file at ``path`` was free and is now held until ``held`` closes (locked by another run, or
    a file system without locks: not)."""
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    held.callback(os.close, fd)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    return True
