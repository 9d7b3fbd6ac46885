"""The check, before each save, that the checkpoint folder's lock this run took is still the folder's: a folder
removed during the run (``rm -rf``) is made again by the next save, and with no lock in it a second run would be
let in to save, overwrite and rotate steps beside this one."""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

from framework.core import files
from framework.core.errors import FrameworkError, say
from framework.persist import stepfolders


class LockTaken(FrameworkError):
    """Another run holds the lock of the folder this run lost: the checkpoints there are that run's."""


def identity(fd: int) -> tuple[int, int]:
    """The (device, inode) of the file open at ``fd``: what ``HeldLock`` compares the folder's lock file with."""
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


class HeldLock:
    """``root``'s lock file (``stepfolders.LOCK``) that this run holds, known by its ``identity`` (the caller keeps
    the descriptor: the CLI's launcher, maybe another process than rank 0's)."""

    def __init__(self, root: Path, held: tuple[int, int]):
        self.root, self.held = root, held
        self.fd: int | None = None   # the lock taken again by ``check``, held until ``close``

    def check(self) -> None:
        """One stat; where the folder's lock file is another or gone (the folder removed and made again), the lock
        taken again with one line, or a FrameworkError where another run holds it now (never two runs in one)."""
        path, kept = self.root / stepfolders.LOCK, False
        with contextlib.suppress(FileNotFoundError):
            st = os.lstat(path)
            if (st.st_dev, st.st_ino) == self.held:
                return
        with contextlib.suppress(FileNotFoundError):   # (the lock file alone removed: the checkpoints are there)
            kept = any(stepfolders.step_of(p) >= 0 for p in self.root.iterdir())
        files.make_dirs(self.root)
        try:
            fd = files.lock(path, lambda holder: (
                f"checkpoint.dir {self.root} lost this run's {stepfolders.LOCK} (the folder removed during the run?) "
                f"and another run{holder} saves there now: not saving beside it; end that run, or run this one again "
                "with checkpoint.dir set to a folder of its own"), None)
        except FrameworkError as e:
            raise LockTaken(str(e)) from None
        if self.fd is not None:
            os.close(self.fd)
        self.fd, self.held = fd, identity(fd)
        cause, tail = (("removed during the run?", "its checkpoints are still there") if kept else
                       ("the folder removed during the run?", "checkpoints removed with it are gone"))
        say(f"warning: checkpoint: checkpoint.dir {self.root} lost this run's {stepfolders.LOCK} ({cause}): locked it "
            f"again, so that no other run saves there; {tail}")

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
