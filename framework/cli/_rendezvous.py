"""The private folders spawned ranks rendezvous in (a FileStore in the temp folder), and their clean-up.

The launcher and every rank hold a shared lock on owner.lock while they live: the next launch removes the
folders of runs killed with -9, never a live run's.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import time

from framework.core import files
from framework.core.errors import DistributedError, FrameworkError

PREFIX = "framework-rdzv-"
LOCK = "owner.lock"
UNLOCKED_AGE_S = 3600   # a folder without a lock file: removed once this old
YOUNG_S = 60            # between making a folder and locking it a launch holds no lock yet


def ready_path(store_dir: str, rank: int) -> str:
    """Made by a rank once its signal handlers are installed (``_stop`` may send it SIGINT then)."""
    return os.path.join(store_dir, f"ready-{rank}")


def peer_lost_path(store_dir: str, rank: int) -> str:
    """Made by a rank whose error was a lost peer (a DistributedError): the launcher names another's first."""
    return os.path.join(store_dir, f"peer-lost-{rank}")


def alike_path(store_dir: str, rank: int) -> str:
    """Holds the message of the error a rank raised alike on every rank (``every_rank``)."""
    return os.path.join(store_dir, f"alike-{rank}")


def mark_error(store_dir: str, rank: int, e: FrameworkError) -> bool:
    """For the launcher, once every rank ended: a lost peer (named after another rank's error), or the message of an
    error raised alike on every rank (given once); whether it holds such a message (the launcher gives it)."""
    lost = isinstance(e, DistributedError)
    if lost or e.every_rank:
        with contextlib.suppress(OSError, FrameworkError):   # (FrameworkError: a link in the mark's place)
            fd = files.open_nofollow((peer_lost_path if lost else alike_path)(store_dir, rank),
                                     os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            with os.fdopen(fd, "w") as f:
                f.write("" if lost else str(e))
            return not lost
    return False


def marked_alike(store_dir: str, nproc: int) -> dict[int, str]:
    """{rank: message} of the ranks that marked an error raised alike (not said by the rank itself; a rank that
    lost its peer marks "" and said its own line: left out)."""
    texts = {}
    for rank in range(nproc):   # (none; cut short mid-character: left out)
        with contextlib.suppress(OSError, ValueError), open(alike_path(store_dir, rank), encoding="utf-8") as f:
            texts[rank] = f.read()
    return {rank: text for rank, text in texts.items() if text}


def raised_alike(store_dir: str, nproc: int) -> str | None:
    """The message all ``nproc`` ranks marked as their error raised alike; None unless all marked the same."""
    return all_alike(marked_alike(store_dir, nproc), nproc)


def all_alike(marked: dict[int, str], nproc: int) -> str | None:
    """The message of ``marked`` (``marked_alike``'s) when all ``nproc`` ranks marked the same; else None."""
    texts = set(marked.values())
    return texts.pop() if len(marked) == nproc and len(texts) == 1 else None


def hold(path: str, create: bool = False) -> int:
    """A descriptor holding a shared lock on ``path`` while open (the kernel drops it when the process dies)."""
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = os.open(path, flags, 0o600)
    fcntl.flock(fd, fcntl.LOCK_SH)
    return fd


def remove_dead(tmp: str) -> list[str]:
    """Remove (and return) this user's rendezvous folders in ``tmp`` no live process holds (unlocked: after an hour)."""
    gone = []
    try:
        entries = list(os.scandir(tmp))
    except OSError:
        return gone
    for entry in entries:
        if not entry.name.startswith(PREFIX) or not entry.is_dir(follow_symlinks=False):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:   # removed meanwhile by another launch's clean-up
            continue
        if st.st_uid != os.geteuid() or time.time() - st.st_mtime < YOUNG_S:
            continue   # another user's, or a launch that may not hold its lock yet
        try:
            fd = os.open(os.path.join(entry.path, LOCK), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            if time.time() - st.st_mtime <= UNLOCKED_AGE_S:
                continue
        except OSError:
            continue
        else:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)   # granted only when nobody holds it: a dead run
            except BlockingIOError:
                continue   # a live run
            finally:
                os.close(fd)
        shutil.rmtree(entry.path, ignore_errors=True)
        gone.append(entry.path)
    return gone
