"""A job's run folder around its launch: which process writes the sweep's record (``first_rank``), and removing
the folders made for a job refused before it trained (``made_for``, ``remove_made``)."""
from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path

from framework.cli.launch import RUN_LOCK, slurm_task_env
from framework.comm.distributed import env_int
from framework.core import files


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
    goes only under its lock again and while it holds only what the job wrote; one it never held only if empty.
    Whether the run folder was removed."""
    if not made or (env_int("RANK", 0) != 0 and not alike):   # (rank 0 may still be writing into it)
        return False
    try:
        if owned:
            fd = files.open_nofollow(made[0] / RUN_LOCK, os.O_RDWR)
            try:   # (locked by another run, or a file system without locks: nothing removed)
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                if not {p.name for p in made[0].iterdir()} <= {"train.log", RUN_LOCK, *Path(subdir or ".").parts[:1]}:
                    return False
                shutil.rmtree(made[0], ignore_errors=True)
            finally:
                os.close(fd)
        else:
            made[0].rmdir()   # (not empty: another run's now)
    except OSError:
        return False
    for p in made[1:]:
        try:
            p.rmdir()
        except OSError:   # holds another run's folder (or a sweep's multirun.yaml)
            break
    return not made[0].exists()
