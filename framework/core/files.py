"""Creating files and folders in folders the user names, without following planted links.

    fd = create_new(folder / "x.tmp")              # O_EXCL | O_NOFOLLOW, owner-only
    write_atomic(folder / "latest", b"step-4")     # temporary (one per process) + fsync + rename, in one folder
    make_dirs(folder)                              # missing folders made 0700 (parents too)
    fd = open_nofollow(folder / "x", os.O_RDONLY)  # an existing file, never through a link
    write_at(fd, values, offset)                   # a host tensor's bytes at a byte offset (read_into: back)
    fd = lock(folder / "x.lock", busy, what)       # an exclusive flock, held while fd is open
    data = parse_json(path.read_bytes())           # json.loads; too deep a nesting is a ValueError too
    data = parse_yaml(path.read_text())            # yaml.safe_load; an alias bomb is a ValueError
    refuse_alias_bomb(text)                        # that ValueError alone (a text without an anchor: unparsed)
    config_files(folder)                           # the *.yaml below it, tools' folders (.git, a venv) skipped

In a folder others may write to (a shared scratch disk) a planted link would make a plain ``open``
overwrite its target: every open here refuses a link in the final component (``UnsafePathError``).
The folder the user gave may itself be a link.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import json
import os
import re
import socket
import stat
import sys
import tempfile
from pathlib import Path
from typing import Callable, Iterable

import torch

from framework.core.errors import FrameworkError, UnsafePathError

PRIVATE_FILE = 0o600
PRIVATE_DIR = 0o700
DIRECT_ALIGN = 4096   # O_DIRECT unit: file offsets, lengths and buffer addresses are multiples of it
# offload.sub_group_size's floor: fp32 elements in one such unit (each swapped tensor is padded to whole units,
# so a smaller tile multiplies the memory, disk and IO requests its elements need)
SMALLEST_TILE = DIRECT_ALIGN // 4
_BASE = os.O_NOFOLLOW | os.O_CLOEXEC
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC   # the folder itself may be a link the user made


def _refused(path: os.PathLike | str, what: str = "") -> UnsafePathError:
    return UnsafePathError(f"{path} is a symbolic link{what}; refusing to follow it (the framework writes "
                           f"its own files there): remove the link or choose another folder")


def is_link(path: os.PathLike | str, dir_fd: int | None = None) -> bool:
    try:
        return stat.S_ISLNK(os.lstat(path, dir_fd=dir_fd).st_mode)
    except (FileNotFoundError, NotADirectoryError):   # (a path under a file is no link: the file is what is wrong)
        return False


def refuse_links(*paths: os.PathLike | str) -> None:
    """Raise ``UnsafePathError`` naming the first of ``paths`` that is a symbolic link."""
    for p in paths:
        if is_link(p):
            raise _refused(p)


def open_nofollow(path: os.PathLike | str, flags: int, *, dir_fd: int | None = None, mode: int = PRIVATE_FILE) -> int:
    """``os.open`` that never follows a symbolic link in the final component (``O_EXCL`` refuses one too)."""
    try:
        return os.open(path, flags | _BASE, mode, dir_fd=dir_fd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.EMLINK, errno.EEXIST) and is_link(path, dir_fd):
            raise _refused(path) from None
        raise


def create_new(path: os.PathLike | str, *, dir_fd: int | None = None, shared: bool = False) -> int:
    """A new owner-only file (``O_CREAT | O_EXCL``; ``shared``: the umask's mode, for records colleagues read)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
    fd = open_nofollow(path, flags, dir_fd=dir_fd, mode=0o666 if shared else PRIVATE_FILE)
    if not shared:
        os.fchmod(fd, PRIVATE_FILE)   # the mode given to open is masked by the umask
    return fd


def write_new(path: os.PathLike | str, data: bytes | Iterable[bytes], *, dir_fd: int | None = None,
              shared: bool = False, durable: bool = True) -> None:
    """``data``: the bytes, or chunks of them (a file larger than memory)."""
    fd = create_new(path, dir_fd=dir_fd, shared=shared)
    try:
        for chunk in [data] if isinstance(data, (bytes, bytearray, memoryview)) else data:
            view = memoryview(chunk)
            while view:
                view = view[os.write(fd, view):]
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: os.PathLike | str) -> None:
    fd = os.open(path, _DIR)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_name(name: str) -> str:
    """``write_atomic``'s temporary for the file ``name``: ``<name>.<host>.<pid>.tmp``, one per process, so two
    processes writing one file (ranks of a sweep, tasks on a shared file system) never take each other's."""
    return f"{name}.{_host()}.{os.getpid()}.tmp"


@functools.cache   # (constant for the process: looked up once, not per write and per temporary listed)
def _host() -> str:
    return socket.gethostname().partition(".")[0][:32] or "host"


def _stale_temp(entry: str, name: str) -> bool:
    """Whether ``entry`` is a temporary of ``name`` that no live writer will rename: the fixed ``<name>.tmp`` of
    older versions, or this host's ``temp_name`` of a process that is gone (or this one's, left by an interrupted
    write). Another host's is never taken: its process cannot be looked up from here."""
    if entry == f"{name}.tmp":
        return True
    host, _, pid = entry.removeprefix(f"{name}.").removesuffix(".tmp").rpartition(".")
    if not (entry.startswith(f"{name}.") and pid.isdigit() and host == _host()):
        return False
    if int(pid) == os.getpid():
        return True
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except OSError:   # another user's process: alive
        pass
    return False


def write_atomic(path: os.PathLike | str, data: bytes | Iterable[bytes], *, shared: bool = False, durable: bool = True,
                 sweep: bool = True) -> None:
    """A reader sees the old file or the new one, never a part: ``temp_name`` written and fsynced, renamed
    over it through one descriptor of the folder, and the folder fsynced (the rename survives a crash).
    ``durable=False``: no fsync (each costs milliseconds, more on NFS/Lustre), for a record written often whose
    loss in a crash is harmless: the rename is still atomic for a reader, but a crash may leave the old file (or,
    on some file systems, an empty one). ``sweep=False``: only this process's own temporary is looked for, not
    every writer's (for a record rewritten in the training loop, swept at its first write)."""
    path = Path(path)
    tmp = temp_name(path.name)
    dfd = os.open(path.parent, _DIR)
    try:
        # temporaries left by interrupted writers (a live one's is kept)
        for entry in os.listdir(dfd) if sweep else [tmp]:
            if entry.endswith(".tmp") and _stale_temp(entry, path.name):
                with contextlib.suppress(FileNotFoundError):
                    if stat.S_ISREG(os.lstat(entry, dir_fd=dfd).st_mode):
                        os.unlink(entry, dir_fd=dfd)
        try:
            write_new(tmp, data, dir_fd=dfd, shared=shared, durable=durable)
            os.rename(tmp, path.name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except UnsafePathError:   # (not ours to remove)
            raise _refused(path.parent / tmp) from None
        except BaseException:   # (a full disk, chunks that failed, a folder under that name): no temporary left behind
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dfd)
            raise
        if durable:
            os.fsync(dfd)
    finally:
        os.close(dfd)


def open_append(path: os.PathLike | str):
    """A text file opened for appending (created owner-only when missing), never through a link."""
    return os.fdopen(open_nofollow(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT), "a", buffering=1)


def make_dir(path: os.PathLike | str, *, exist_ok: bool = True) -> None:
    """Create the folder ``path`` owner-only (0700); an existing one keeps its mode. A link in its place is
    refused unless ``exist_ok`` and it points at a folder (the user's: framework-made names pass False)."""
    try:
        os.mkdir(path, PRIVATE_DIR)
    except FileExistsError:
        if exist_ok and os.path.isdir(path):
            return
        if is_link(path):
            raise _refused(path, " to something that is not a folder" if exist_ok else "") from None
        if not exist_ok:
            raise
        raise FileExistsError(errno.EEXIST, "exists and is not a folder", str(path)) from None
    os.chmod(path, PRIVATE_DIR)   # mkdir's mode is masked by the umask


def make_dirs(path: os.PathLike | str) -> list[Path]:
    """``mkdir -p`` making every folder 0700 (``Path.mkdir(parents=True)`` gives parents the umask's mode); the
    folders it made, innermost first (for ``remove_made`` after a failure)."""
    path = Path(path)
    if os.path.isdir(path):
        return []
    made = make_dirs(path.parent) if path.parent != path else []
    if not os.path.lexists(path):   # (one made meanwhile by another process is not ours to remove)
        made.insert(0, path)
    make_dir(path)
    return made


def remove_made(made: list[Path]) -> None:
    """Remove the folders ``make_dirs`` made, innermost first, each only while empty (a link is not followed)."""
    for folder in made:
        try:
            os.rmdir(folder)
        except OSError:
            break


def holder_text() -> str:
    """What ``lock`` writes in the file it holds: this process, as another process's refusal names it."""
    return f"pid {os.getpid()} on host {socket.gethostname()}"


def read_holder(fd: int) -> str:
    """The holder ``lock`` wrote in the file open at ``fd`` ("" where it is none or not printable text)."""
    holder = os.read(fd, 200).decode(errors="replace").strip()
    return holder if holder.isprintable() else ""


def lock(path: os.PathLike | str, busy: Callable[[str], str], undetected: str | None) -> int:
    """A descriptor holding an exclusive ``flock`` on ``path`` (made if missing, this process's id written in it)
    while open; FrameworkError ``busy(" (pid N on host H)")`` where another process holds it; a note where the
    file system cannot lock (``undetected``: what then goes unnoticed; None: no note). A holder may remove the file before it
    closes the descriptor: a lock taken on a file so removed is taken again on the one now there."""
    while True:
        fd = open_nofollow(path, os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = read_holder(fd)
            os.close(fd)
            raise FrameworkError(busy(f" ({holder})" if holder else "")) from None
        except OSError as e:   # a file system without flock (Lustre without -o flock, NFS without lockd): unlocked
            if e.errno not in (errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):
                os.close(fd)
                raise
            if undetected:
                print(f"note: {Path(path).parent}'s file system cannot lock {Path(path).name} "
                      f"({os.strerror(e.errno)}): {undetected} is not detected", file=sys.stderr, flush=True)
            return fd
        try:
            if os.path.samestat(os.fstat(fd), os.lstat(path)):
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    with contextlib.suppress(OSError):   # (only said to a process it stops: a full disk keeps the lock)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{holder_text()}\n".encode(), 0)
    return fd


def parse_json(text: str | bytes, **kwargs) -> object:
    """``json.loads(text, **kwargs)``, raising ``ValueError`` for every unreadable text: the parser recurses once
    per nesting level, so a file nested some thousand levels deep raises ``RecursionError`` instead (bad bytes
    already raise ``UnicodeDecodeError``, a ``ValueError``). Readers of user files catch one type."""
    try:
        return json.loads(text, **kwargs)
    except RecursionError:
        raise ValueError("nested too deeply to parse") from None


# Nodes a config file's YAML aliases may add: past a plain use of merge keys (a 100-key base merged into 101
# entries adds 2e4), short of an alias bomb's (nested anchors that each repeat the one before: ten levels of ten are
# 10**10 nodes), which OmegaConf would expand for ever; OmegaConf builds some 2e4 nodes a second, so the bound keeps
# the worst accepted file to a few seconds of composing.
YAML_ALIAS_NODES = 50_000


# An anchor's indicator (``&`` and a name): aliases need one to name, so a text without any expands nothing. A
# superset of PyYAML's and libyaml's anchor names (a ``&`` inside a quoted string only costs a parse).
_ANCHOR = re.compile(r"&[^\s,\[\]{}]")


def refuse_alias_bomb(text: str) -> None:
    """Raise ``ValueError`` where the aliases of YAML ``text`` would add more than ``YAML_ALIAS_NODES`` nodes when
    expanded (or an alias names a node that holds it): counted over the parser's events, each anchored node's size
    kept, in time linear in the text; a text without an anchor is not parsed. Other unreadable text may raise
    ``yaml.YAMLError``."""
    if not _ANCHOR.search(text):
        return
    import yaml   # (PyYAML: a core dependency; imported where a config file is read)

    try:   # (libyaml's parser where PyYAML was built with it: the pure-Python one takes seconds a megabyte)
        added = _alias_nodes(yaml.parse(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)))
    except yaml.YAMLError:   # (libyaml's nesting limit and wording differ: PyYAML's own parser has the last word)
        added = _alias_nodes(yaml.parse(text, Loader=yaml.SafeLoader))
    if added > YAML_ALIAS_NODES:
        raise ValueError(f"its aliases expand to {added:.3g} more nodes (over {YAML_ALIAS_NODES:,}: an alias bomb?); "
                         f"write the repeated values out or nest fewer aliases")


# Folders tools make, thousands of files in a project root given as a config folder: no config group's (a
# defaults list may name a dot folder, ``.local: mine``, so other dot folders are read). A virtual environment,
# whatever its name, is told by its pyvenv.cfg, a conda environment (``.conda``, ``.pixi/envs/x``) by its conda-meta
# folder. Hydra's .hydra (a run's composed config written out, one per run folder: 0.16 s a compose for 1,000 runs)
# holds no anchor: OmegaConf writes none.
_TOOL_DIRS = frozenset({".git", ".hg", ".svn", "__pycache__", "node_modules", ".tox", ".nox", ".hydra"})


def config_files(folder: os.PathLike | str) -> list[Path]:
    """The ``*.yaml`` files below ``folder`` (itself included) that a config search path could name, sorted: none
    in a tool's folder (``_TOOL_DIRS``, ``.*_cache``, a virtual or conda environment), which is not walked. A link
    to a folder is not followed (a project root's ``data -> /datasets`` would be read on every compose), so a
    linked group folder's files are not listed (a known limit: Hydra follows the link)."""
    found = []
    for top, dirs, names in os.walk(folder):
        if top != str(folder) and ("pyvenv.cfg" in names or "conda-meta" in dirs):
            dirs[:] = []
            continue
        dirs[:] = [d for d in dirs if d not in _TOOL_DIRS and not (d.startswith(".") and d.endswith("_cache"))]
        found += [Path(top, n) for n in names if n.endswith(".yaml")]
    return sorted(found)


def _alias_nodes(events: Iterable) -> int:
    """The nodes the aliases of a YAML event stream add when expanded (an undefined alias adds none: the reader
    refuses it)."""
    import yaml

    anchors: dict[str, list] = {}   # an anchor -> its node's [nodes it expands to (itself included), closed]
    stack, distinct = [[0, False]], 0   # the open collections' nodes, below them the whole stream's
    for e in events:
        if isinstance(e, yaml.AliasEvent) and (node := anchors.get(e.anchor)) is not None:
            if not node[1]:
                raise ValueError("an alias names a node that holds it, which expands for ever; write the values out")
            stack[-1][0] += node[0]
        elif isinstance(e, (yaml.ScalarEvent, yaml.CollectionStartEvent)):
            distinct, node = distinct + 1, [1, isinstance(e, yaml.ScalarEvent)]
            if e.anchor is not None:   # (a name given twice: the reader refuses it)
                anchors[e.anchor] = node
            if node[1]:
                stack[-1][0] += 1
            else:
                stack.append(node)
        elif isinstance(e, yaml.CollectionEndEvent):
            node = stack.pop()
            node[1], stack[-1][0] = True, stack[-1][0] + node[0]
    return stack[0][0] - distinct


def parse_yaml(text: str) -> object:
    """``yaml.safe_load(text)``, raising ``ValueError`` for an alias bomb (``refuse_alias_bomb``). Other unreadable
    text raises ``yaml.YAMLError``."""
    import yaml

    refuse_alias_bomb(text)
    return yaml.load(text, Loader=yaml.SafeLoader)   # (safe_load's: the values and messages it gives, unchanged)


def probe_writable(folder: os.PathLike | str) -> None:
    """Create and remove a file in ``folder`` (OSError on failure): ``os.access`` misses ACLs and root-squashed NFS."""
    fd, probe = tempfile.mkstemp(prefix=".probe-", dir=folder)
    os.close(fd)
    os.unlink(probe)


def _bytes_of(t: torch.Tensor, what: str) -> memoryview:
    """The bytes of host tensor ``t``, refused unless contiguous (else a reshape would use a hidden copy)."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(f"{what}: needs a contiguous host tensor, got {t.device} "
                         f"{'contiguous' if t.is_contiguous() else 'strided'}")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())   # host sync: no (a host tensor)


def write_at(fd: int, values: torch.Tensor, offset: int) -> None:
    """The bytes of ``values`` -> ``fd`` at ``offset`` (pwrite repeated until all are written)."""
    view = _bytes_of(values, "write_at")
    while len(view):
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def read_into(fd: int, out: torch.Tensor, offset: int) -> int | None:
    """``out``'s bytes read from ``fd`` at ``offset``; where the file ended first (None: read whole)."""
    view, done = _bytes_of(out, "read_into"), 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            return offset + done
        done += n
    return None
