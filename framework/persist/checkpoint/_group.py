"""The checkpoint's collectives and how their failures read: its own gloo group, and the exchange
of outcomes that ends every rank with the same line."""
from __future__ import annotations

import contextlib
import errno
import resource
import shutil
from pathlib import Path
from typing import Any

import torch.distributed as tdist

from framework.comm.distributed import agree
from framework.core.errors import CheckpointError, ConfigError, DistributedError, FrameworkError, on_every_rank
from framework.core.room import DESCRIPTORS, DISK_FULL, descriptors_line, free_note
from framework.core.units import size
from framework.core.utils import counted


def glue():
    """``_dcp``, imported on first use: importing DCP costs most of a second (DTensor, sympy)."""
    from framework.persist.checkpoint import _dcp
    return _dcp


class Group:
    """The checkpoint's collectives on their own gloo group (``checkpoint.timeout_s``): a background save never
    shares a group with training (concurrent collectives on one group can deadlock)."""

    def __init__(self, dist, timeout_s: float):
        self.rank, self.world, self.timeout_s, self.dist = dist.rank, dist.world, timeout_s, dist
        self.pg = dist.gloo_group(timeout_s, "checkpoint group creation")

    def all_gather(self, obj: Any, what: str) -> list:
        return self.all_gather_object(obj, f"checkpoint {what}")

    def all_gather_object(self, obj: Any, what: str) -> list:
        """``Dist.all_gather_object`` on this group, with its timeout (and so a ``dist`` for ``agree``)."""
        return self.dist.all_gather_object(obj, what, self.pg, (self.timeout_s, "checkpoint.timeout_s"))

    def enter(self, stack: contextlib.ExitStack, context, what: str):
        """``stack.enter_context(context)``, agreed on: when it fails on a rank (a damaged swap file), all raise."""
        return agree(self, lambda: stack.enter_context(context), f"checkpoint {what}")

    def dcp_kwargs(self) -> dict:
        return {"process_group": self.pg} if self.world > 1 else {"no_dist": True}

    def close(self) -> None:
        if self.pg is not None:
            tdist.destroy_process_group(self.pg)
            self.pg = None


def agree_save(group: Group, what: str, fn, tmp: Path, *, cleanup: bool = True, need: int = 0, largest: int = 0,
               keep_last: int | None = None) -> list:
    """``fn()`` on every rank, outcomes exchanged; every rank's result. A failure anywhere: rank 0 removes ``tmp``
    (``cleanup``), every rank raises one CheckpointError naming the rank and cause, or the interrupt (``_stop``).
    ``need``: the checkpoint's bytes, for a full disk's message; ``largest``: its largest file's, for a file size
    limit's; ``keep_last``: the save's checkpoint.keep_last, for the remedies a full disk's message offers."""
    result, problem, stop = None, None, None
    try:
        result = fn()
    except (Exception, glue().CheckpointException) as e:   # noqa: BLE001 - DCP's exception is a BaseException
        if (stop := _stop(e)) is None:
            # DCP raises on every rank what failed on some: named after the ranks that failed
            ranks = sorted(e.failures) if isinstance(e, glue().CheckpointException) and e.failures else [group.rank]
            problem = (tuple(ranks), f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: "
                                     f"{_write_error(e, tmp, need, largest, keep_last)}")
    everyone = _exchange(group, (result, problem, stop), stop, what)
    # One failure per set of failed ranks, in the first reporter's words: DCP raises rank 1's full disk on every
    # rank, and each measures the free bytes at its own moment (a busy disk: two numbers, one cause).
    said: dict = {}
    for ranks, text in (p for _, p, _ in everyone if p):
        said.setdefault(ranks, text)
    problems = list(said.values())
    stops = [s for _, _, s in everyone if s is not None]
    if (problems or stops) and cleanup and group.rank == 0 and not tmp.is_symlink():   # (a planted link is only named)
        shutil.rmtree(tmp, ignore_errors=True)
    if stops:
        raise stop or stops[0]
    if problems:
        raise on_every_rank(CheckpointError(
            f"checkpoint: saving {tmp.name.removesuffix('.tmp')} failed ({what}): {problems[0]}"
            + (f" (and {counted(len(problems) - 1, 'more rank')})" if len(problems) > 1 else "")
            + "; the previous checkpoints are kept"))
    return [r for r, _, _ in everyone]


def agree_load(group: Group, what: str, fn):
    """``fn()`` on every rank, outcomes exchanged: every rank raises one kind (ConfigError: no fallback;
    CheckpointError: fall back; another FrameworkError: stop; an interrupt wins over all), its own if of that kind."""
    result, problem, stop = None, None, None
    try:
        result = fn()
    except FrameworkError as e:   # (and whether it is the group's: then no rank's error is marked)
        problem = (next(k for k in (ConfigError, CheckpointError, FrameworkError) if isinstance(e, k)), str(e),
                   isinstance(e, DistributedError))
        mine, stop = e, _stop(e)
    except (Exception, glue().CheckpointException) as e:   # noqa: BLE001 - DCP's exception is a BaseException
        problem = (CheckpointError, f"{what}: {glue().describe(e)}", False)
        mine, stop = CheckpointError(problem[1]), _stop(e)
    everyone = _exchange(group, (problem, stop), stop, what)
    if stops := [s for _, s in everyone if s is not None]:
        raise stop or stops[0]
    problems = [p for p, _ in everyone if p]
    if not problems:
        return result
    # One kind on every rank, failed or not: a refusal that stops the run wins over damage (fall back).
    kind = next(k for k in (ConfigError, FrameworkError, CheckpointError) if any(p[0] is k for p in problems))
    every = not any(group_failed for _, _, group_failed in problems)   # (a DistributedError: the group is unusable)
    if problem is not None and problem[0] is kind:
        raise on_every_rank(mine, every)
    raise on_every_rank(kind(next(text for k, text, _ in problems if k is kind)), every) from (
        mine if problem is not None else None)


def _exchange(group: Group, outcome: tuple, stop: BaseException | None, what: str) -> list:
    """Every rank's ``outcome``; where the exchange fails, this rank's own ``stop`` rather than a dead peer (the
    whole group got the Ctrl-C or SIGTERM)."""
    try:
        return group.all_gather(outcome, what)
    except DistributedError:
        if stop is not None:
            raise stop from None
        raise


def _stop(e: BaseException) -> KeyboardInterrupt | SystemExit | None:
    """The Ctrl-C or SIGTERM that DCP wrapped in ``e``, as a plain one (it pickles), else None: read as a failure, it
    would let a sweep go on or a resume fall back. Causes only: a save inside ``except KeyboardInterrupt:`` would
    report a full disk as a Ctrl-C."""
    for c in glue().causes(e, implicit=False):
        if isinstance(c, KeyboardInterrupt):
            return KeyboardInterrupt()
        if isinstance(c, SystemExit):
            return SystemExit(c.code)
    return None


def room_fixes(keep_last: int | None) -> str:
    """What frees room for a save that keeps ``keep_last`` checkpoints (None: not known): a lower keep_last only
    where one lower than it keeps fewer (1 is the fewest; 0 keeps every checkpoint)."""
    keep = (", set checkpoint.keep_last=N to keep only the N newest checkpoints" if keep_last == 0 else
            "" if keep_last == 1 else ", lower checkpoint.keep_last")
    return f"free space{keep} or set checkpoint.dir to a larger disk"


def _write_error(e: BaseException, tmp: Path, need: int, largest: int = 0, keep_last: int | None = None) -> str:
    """One line for a failed write: a full disk (torch's zip writer: "unexpected pos") with the free and needed bytes;
    EFBIG first (hidden by that too): a file size limit, named (this process's RLIMIT_FSIZE where it is at most the
    largest file it must admit, ``largest`` else ``need``; else the file system's), with that file's size."""
    found = glue().causes(e)
    if (many := next((c for c in found if isinstance(c, OSError) and c.errno in DESCRIPTORS), None)) is not None:
        return descriptors_line(many)
    if any(isinstance(c, OSError) and c.errno == errno.EFBIG for c in found):
        limit, largest = resource.getrlimit(resource.RLIMIT_FSIZE)[0], largest or need
        named, fix = (("the file system's largest file size", "") if limit == resource.RLIM_INFINITY or
                      limit > largest else   # (a generous ulimit: a FAT-like file system's own maximum stopped it)
                      (f"this process's file size limit (RLIMIT_FSIZE: {size(limit)})",   # (a shell's blocks differ)
                       f"raise the file size limit above that (bash: ulimit -f {-(-largest // 1024)} or more, in "
                       f"1024-byte blocks) or "))
        return (f"{named} stopped the writes in {tmp.parent} (its largest file needs about {size(largest)}): "
                f"{fix}set checkpoint.dir to a file system that takes larger files")
    if any(isinstance(c, OSError) and c.errno in DISK_FULL or "unexpected pos" in str(c) or "No space left" in str(c)
           for c in found):
        return (f"the file system of {tmp.parent} is full ({free_note(tmp.parent, unknown='free space unknown')}; "
                f"the checkpoint needs about {size(need)}): {room_fixes(keep_last)}")
    return glue().describe(e)
