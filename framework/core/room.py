"""Room on the host: free disk space, available memory, and disk room summed over the ranks sharing a file system.

    mine = Claim.of(folder, need_bytes)                 # on every rank
    everyone = all_gather(mine)                         # the caller's collective
    for short in shortfalls(everyone): ...              # same answer on every rank

Ranks of one host often write into one folder, where each need may fit but not their sum: summed per
file system, every rank refuses at once with the same line (not a peer's bare "Connection closed").
"""
from __future__ import annotations

import contextlib
import errno
import os
import resource
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from framework.core.errors import ConfigError, FrameworkError
from framework.core.paths import user_path
from framework.core.units import size

DISK_FULL = (errno.ENOSPC, errno.EDQUOT)           # no room on the file system: the disk, a quota
FULL = (*DISK_FULL, errno.EFBIG)                   # no room: also a file size limit
DESCRIPTORS = (errno.EMFILE, errno.ENFILE)       # too many open files: this process's limit, the host's table
NAME_MAX, PATH_MAX = 255, 4096                     # bytes (Linux's; PATH_MAX counts the final NUL)

@dataclass(frozen=True)
class Claim:
    rank: int
    host: str
    device: int          # st_dev of the folder (or of its nearest existing parent)
    free: int            # bytes an unprivileged writer may use there now
    need: int            # bytes this rank will write
    folder: str
    missing: str | None = None   # the top-most folder of its path that does not exist yet (the writer makes it)

    @staticmethod
    def of(folder: str | os.PathLike, need: int, rank: int = 0) -> "Claim":
        path = Path(folder).absolute()
        probe = nearest_existing(path)
        missing = str(probe / path.relative_to(probe).parts[0]) if probe != path else None
        return Claim(rank, socket.gethostname(), os.stat(probe).st_dev, free_bytes(probe), int(need), str(folder),
                     missing)


def free_bytes(folder: str | os.PathLike) -> int:
    """Bytes an unprivileged writer may use on the file system of ``folder`` (``nearest_existing``)."""
    st = os.statvfs(nearest_existing(Path(folder)))
    return st.f_bavail * st.f_frsize


def free_note(folder: str | os.PathLike, fmt: str = "{} free", unknown: str = "") -> str:
    """``fmt`` filled with the free space on ``folder``'s file system (``unknown`` where it cannot be asked)."""
    try:
        return fmt.format(size(free_bytes(folder)))
    except OSError:
        return unknown


def available_ram() -> int | None:
    """Host memory the kernel can hand out without swapping (MemAvailable); None without /proc/meminfo."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:")) * 1024   # kB
    except (OSError, StopIteration):
        return None


def descriptors_line(e: OSError) -> str:
    """One line for an OSError of too many open files (``DESCRIPTORS``): the limit that was reached and how to
    raise it. (A limit set low, ``ulimit -n``: not a bug, for which a traceback would be the answer.)"""
    at = f" (opening {e.filename})" if e.filename else ""
    if e.errno == errno.ENFILE:
        return (f"too many open files on this host{at}: the system's table of open files is full; close other "
                "programs' files or raise the system's limit (sysctl fs.file-max)")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = max(4096, 2 * soft)
    if hard != resource.RLIM_INFINITY and hard <= soft:   # (``ulimit -n N`` sets the hard limit too)
        fix = (f"its hard limit is {hard} too: raise both in a new shell (or the hard limit as root, "
               f"/etc/security/limits.conf), e.g. ulimit -n {want}, and run again")
    else:
        want = want if hard == resource.RLIM_INFINITY else min(want, hard)
        fix = f"raise ulimit -n, e.g. ulimit -n {want}, and run again"
    return f"too many open files{at}: this process may have {soft} open (ulimit -n); {fix}"


def descriptors_in(error: BaseException) -> str | None:
    """``descriptors_line`` where ``error``, a backend's RuntimeError (gloo's sockets, epoll), says the process ran
    out of descriptors; else None."""
    for code in (errno.ENFILE, errno.EMFILE):   # (the host's table first: its text holds the other's)
        if os.strerror(code) in str(error):
            return descriptors_line(OSError(code, os.strerror(code)))
    return None


@contextlib.contextmanager
def descriptors_named() -> Iterator[None]:
    """Within the block, an OSError of too many open files is a FrameworkError of one line (``descriptors_line``)."""
    try:
        yield
    except OSError as e:
        if e.errno not in DESCRIPTORS:
            raise
        raise FrameworkError(descriptors_line(e)) from None


def nearest_existing(path: Path, key: str | None = None) -> Path:
    """``path`` or its nearest parent that exists (a folder about to be made lives there). With ``key`` (the
    setting naming the folder, which is made as given): a leading ``~``, a name too long (``check_name``) or a
    link to nothing on the way is a ConfigError (a folder named ~, or a traceback making it)."""
    given, path = path, Path(path).absolute()   # not abspath: ".." after a link is the kernel's to resolve
    if key is not None:
        check_name(given, key)
        if str(given).startswith("~"):   # (Path.absolute keeps it: a folder named ~ in the working folder)
            raise ConfigError(f"{key}={given}: a leading ~ is not expanded there; write the home folder's path: "
                              f"{key}={user_path(str(given))}")
    while not path.exists() and path.parent != path:
        if key is not None and path.is_symlink():
            raise ConfigError(f"{key}={given}: {path} is a link to a missing folder ({os.readlink(path)}); make "
                              f"that folder or set {key} to another")
        path = path.parent
    return path


def check_name(path: str | os.PathLike, key: str) -> None:
    """One line where ``path`` is a name the kernel refuses (ENAMETOOLONG, a traceback wherever it is first used):
    a part of it over NAME_MAX bytes, or all of it (made absolute) over PATH_MAX."""
    whole = os.fsencode(os.path.abspath(path))
    part = max(whole.split(b"/"), key=len)
    if len(part) > NAME_MAX:
        why = (f"its part {part[:16].decode(errors='ignore')}... is {len(part)} bytes, over the {NAME_MAX} a file "
               f"name may have")
    elif len(whole) >= PATH_MAX:
        why = f"it is {len(whole)} bytes long (made absolute), over the {PATH_MAX - 1} a path may have"
    else:
        return
    raise ConfigError(f"{key}={path}: {why}; set {key} to a shorter path")


@dataclass(frozen=True)
class Shortfall:
    folders: tuple[str, ...]
    ranks: tuple[int, ...]
    need: int
    free: int

    def describe(self, what: str, verb: str = "need") -> str:
        where = ", ".join(self.folders)
        ranks = (f"rank {self.ranks[0]}" if len(self.ranks) == 1
                 else f"ranks {', '.join(map(str, self.ranks))}, sharing this file system,")
        return (f"{where}: {what} of {ranks} {verb} {size(self.need)} but the file system has {size(self.free)} free")


def shortfalls(claims: list[Claim]) -> list[Shortfall]:
    """The file systems (host, device) whose free space is below the sum of the claims on it."""
    groups: dict[tuple[str, int], list[Claim]] = {}
    for c in claims:
        groups.setdefault((c.host, c.device), []).append(c)
    out = []
    for members in groups.values():
        need, free = sum(c.need for c in members), min(c.free for c in members)
        if need > free:
            out.append(Shortfall(tuple(dict.fromkeys(c.folder for c in members)),
                                 tuple(sorted(c.rank for c in members)), need, free))
    return out
