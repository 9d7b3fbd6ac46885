"""The on-disk protocol of a checkpoint folder: atomic commit, manifest, checksums, pruning.

    <dir>/step-<N>.tmp/   being written (removed by the next save; read only in place of a step-<N> that its
                          commit moved aside to step-<N>.old: ``interrupted``)
    <dir>/step-<N>/       committed: DCP files + train_state.json + rng-<rank>.json + manifest.json
                          (+ model_16bit/: zero3's 16-bit weights, when saved with the step)
    <dir>/step-<N>.del/   being deleted by rotation (removed by the next save)
    <dir>/latest          a text file naming the newest committed folder ("step-<N>")
    <dir>/.lock           locked by the one run saving here (the CLI's; no step folder: passed over here)

Rank 0 writes ``manifest.json`` last (size and sha256 of every file, and of its own body), then renames
``step-N.tmp`` to ``step-N`` (the commit point); older folders go only after that, through ``step-N.del``: a kill
at any moment leaves every committed folder intact. Files are owner-only, never opened through links.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import stat
import sys
from pathlib import Path
from typing import Any

from framework.core import files
from framework.core.errors import CheckpointError, ConfigError, UnsafePathError
from framework.engine.state import FORMAT as STATE_FORMAT, is_newer

MANIFEST = "manifest.json"
TRAIN_STATE = "train_state.json"
LATEST = "latest"
WEIGHTS16 = "model_16bit"   # the one subfolder: its files are in the manifest as "model_16bit/<name>"
FORMAT = 1
# train_state.json's own "format" (its "state_format" is the state's layout: ``framework.engine.state.FORMAT``)
TRAIN_STATE_FORMAT = 1
LOCK = ".lock"   # the CLI's lock of the folder it saves into, naming its holder ("pid N on host H")
SELF_SHA = "manifest_sha256"   # the manifest's checksum of its own body (older manifests have none)
_STEP = re.compile(r"^step-(\d+)$")
_AROUND = re.compile(r"(step-\d+)\.(tmp|old)")   # a step a commit has under way (``interrupted``)
_LEFTOVER = (".tmp", ".old", ".del", f".{WEIGHTS16}")


class NewerVersion(ConfigError):
    """A checkpoint file a newer version wrote: no damage, so never fallen back past, overwritten, rotated away or
    read as this version's. ``what``: the line without its advice, for a caller to give its own."""

    def __init__(self, what: str, advice: str = "read it with that version"):
        super().__init__(f"{what}: {advice}")
        self.what = what


def check_version(value: Any, reads: int, what: str, folder: Path) -> None:
    """NewerVersion where the version field ``what`` of a file in ``folder`` is a number above ``reads`` (read first:
    a newer layout may lack or rename the other fields); a value that is no number is the caller's to call damage."""
    if is_newer(value, reads):
        raise NewerVersion(f"checkpoint {folder} was saved by a newer version of the framework ({what} {value}, this "
                           f"one reads {reads})")


def train_state_versions(body: Any, folder: Path) -> None:
    """``check_version`` of train_state.json ``body``'s own format and its state's (none in a body that is no dict)."""
    body = body if isinstance(body, dict) else {}
    check_version(body.get("format"), TRAIN_STATE_FORMAT, "train_state.json format", folder)
    check_version(body.get("state_format"), STATE_FORMAT, "state format", folder)


def removed_while_read(step: Path, advice: str) -> str:
    """The line for ``step`` removed while it was read (no damage): the rotation of the run holding the folder's lock.
    Where none holds it (the text would name a run long ended), or this process does (it rotates nothing before it
    saves), another process (a library loop takes no lock, a user's ``rm``)."""
    lock = step.parent / LOCK
    try:
        fd = files.open_nofollow(lock, os.O_RDONLY)
    except (OSError, UnsafePathError):   # none (no CLI run ever saved there), or a link in its place
        fd = None
    held = None   # not known: a file system without locks
    if fd is not None:
        with os.fdopen(fd, "rb") as f:
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)   # (released as it is closed)
                held = False
            except BlockingIOError:
                held = True
            except OSError:
                pass
            holder = files.read_holder(f.fileno()) if held else ""
    if held is False or fd is None:
        who = f"another process removed it (no run holds {lock})"
    elif holder == files.holder_text():   # (a CLI run resuming from the folder it saves into)
        who = f"another process removed it (this run holds {lock})"
    else:
        who = (f"the run holding {lock} ({holder})" if holder else f"a run saving into {step.parent}") + \
            " rotates its checkpoints"
    return f"{step} was removed while it was read: {who}; {advice}"


def files_of(folder: Path) -> list[str]:
    """The files a manifest lists, sorted: all but itself, ``model_16bit/<name>`` in that subfolder (no links)."""
    names = [p.name for p in folder.iterdir() if p.name != MANIFEST and (p.is_file() or p.is_symlink())]
    sub = folder / WEIGHTS16
    files.refuse_links(sub)
    if sub.is_dir():
        inner = list(sub.iterdir())
        files.refuse_links(*inner)
        names += [f"{WEIGHTS16}/{p.name}" for p in inner if p.is_file()]
    return sorted(names)


_SAVED = re.compile(r"(.+\.distcp|\.metadata|rng-\d+\.json|" + re.escape(TRAIN_STATE) + "|" + re.escape(WEIGHTS16) + "/.+)")


def a_save_writes(name: str) -> bool:
    """Whether a save may write ``name`` (``files_of``'s); others (an editor's swap file, a user's notes) are no
    part of a checkpoint, and no damage."""
    return _SAVED.fullmatch(name) is not None


def file_entry(folder: Path, name: str, *, own: bool = True) -> dict:
    """A file's manifest entry (size, sha256), read never through a link; ``own``: made owner-only (DCP uses the
    umask)."""
    sub, _, base = name.rpartition("/")
    if not sub:
        fd = files.open_nofollow(folder / name, os.O_RDONLY)
    else:
        files.refuse_links(folder / sub)   # by name (a link made since fails the open: O_NOFOLLOW)
        dir_fd = files.open_nofollow(folder / sub, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fd = os.open(base, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        finally:
            os.close(dir_fd)
    with os.fdopen(fd, "rb") as f:
        if own:
            os.fchmod(f.fileno(), 0o600)
        h = hashlib.sha256()   # (hashlib.file_digest is Python 3.11+; we support 3.10)
        while chunk := f.read(1 << 22):
            h.update(chunk)
        return {"bytes": os.fstat(f.fileno()).st_size, "sha256": h.hexdigest()}


def write_manifest(folder: Path, files_: dict[str, dict], **fields: Any) -> None:
    body = {"format": FORMAT, **fields, "files": files_}
    body[SELF_SHA] = _body_sha(body)
    files.write_new(folder / MANIFEST, json.dumps(body, indent=1, sort_keys=True).encode())
    files.fsync_dir(folder)


def _body_sha(body: dict) -> str:
    """The sha256 of a manifest's canonical JSON but its own checksum: a flipped bit that still parses (a ``seq``
    changed picks another checkpoint to resume) is damage too."""
    rest = {k: v for k, v in body.items() if k != SELF_SHA}
    return hashlib.sha256(json.dumps(rest, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def read_json(path: Path, what: str) -> Any:
    """A JSON file of a checkpoint, never through a link; CheckpointError naming it otherwise."""
    try:
        with os.fdopen(files.open_nofollow(path, os.O_RDONLY), "rb") as f:
            return files.parse_json(f.read())
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path.parent}: {path.name} is missing ({what})") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path.parent}: {path} is unreadable as {what} "
                              f"({' '.join(str(e).split())})") from None
    except UnsafePathError as e:
        raise CheckpointError(f"checkpoint {path.parent}: {e}") from None


def read_manifest(folder: Path) -> dict:
    path = folder / MANIFEST
    try:
        os.lstat(path)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {folder}: no {MANIFEST} (deleted, or an interrupted save): "
                              "not a checkpoint") from None
    except OSError:
        pass   # (read_json names it unreadable, with the system's reason)
    body = read_json(path, "the manifest")
    if isinstance(body, dict):
        check_version(body.get("format"), FORMAT, "manifest format", folder)
    if not isinstance(body, dict) or body.get("format") != FORMAT or not isinstance(body.get("files"), dict):
        raise CheckpointError(f"checkpoint {folder}: {path} is not a format-{FORMAT} manifest")
    # (a manifest written before it had its own checksum is read as it was: its files are still checked)
    if SELF_SHA in body and body[SELF_SHA] != _body_sha(body):
        raise CheckpointError(f"checkpoint {folder}: {path} does not match its own sha256 checksum "
                              f"({SELF_SHA}: altered or corrupted)")
    return body


def check_file(folder: Path, name: str, want: dict) -> str | None:
    """None if the file has the manifest's size and checksum, else what is wrong (naming it)."""
    sub, _, base = name.rpartition("/")
    if sub not in ("", WEIGHTS16) or base in ("", ".", ".."):   # an edited manifest must not reach outside its folder
        return f"{folder / MANIFEST} names {name!r}, which is not a file name in the folder (edited)"
    p = folder / name
    try:
        if sub and stat.S_ISLNK(os.lstat(folder / sub).st_mode):
            return f"{folder / sub} is a symbolic link (not written by a save)"
        st = os.lstat(p)
    except FileNotFoundError:
        return f"{p} is missing"
    if stat.S_ISLNK(st.st_mode):
        return f"{p} is a symbolic link (not written by a save)"
    if st.st_size != want["bytes"]:
        return f"{p} has {st.st_size} bytes, the manifest says {want['bytes']} (truncated or overwritten)"
    if file_entry(folder, name, own=False)["sha256"] != want["sha256"]:
        return f"{p} does not match its sha256 checksum in the manifest (altered or corrupted)"
    return None


def check_weights16(path: Path) -> None:
    """Where ``path`` is (in) a committed step's ``model_16bit/``: a CheckpointError naming its files that differ
    from the step's manifest (safetensors carry no checksum)."""
    sub = Path(path).absolute()
    sub = sub if sub.name == WEIGHTS16 else sub.parent
    step = sub.parent
    if sub.name != WEIGHTS16 or not _STEP.match(step.name):
        return
    entries = {n: e for n, e in read_manifest(step)["files"].items() if n.startswith(f"{WEIGHTS16}/")}
    if not entries:
        raise CheckpointError(f"checkpoint {step}: {MANIFEST} lists no {WEIGHTS16}/ files, so {sub} was not "
                              "written by that save")
    problems = [p for n, e in sorted(entries.items()) if (p := check_file(step, n, e))]
    if problems:
        raise CheckpointError(f"checkpoint {step} is damaged: " + "; ".join(problems))


def committed_step(path: Path) -> Path | None:
    """The committed ``step-<N>`` folder (one holding a manifest) that ``path`` is or lies in, else None."""
    real = Path(path).resolve()   # (through links: a link to a step folder writes into it too)
    for p in (real, *real.parents):
        if _STEP.match(p.name) and os.path.lexists(p / MANIFEST):
            return p
    return None


def scan(root: Path, around: bool = False, manifests: bool = False) -> tuple[list, list[str]]:
    """The committed ``step-<N>`` folders under ``root``, newest commit first (``seq``, then the step: a rewound run
    goes on from its own newest save), and a note for each ``step-<N>`` that is not one. A manifest that does not
    parse is damage, listed last: a resume fails naming it rather than start afresh over it. ``around``: an
    ``interrupted`` step listed where it lies (a reader renames nothing). ``manifests``: (folder, manifest or None)."""
    if not root.is_dir():
        return [], []
    out, notes = [], []
    aside = [(p, final.name) for p, final in interrupted(root)] if around else []
    for p, name in [*((p, p.name) for p in root.iterdir()), *aside]:
        m = _STEP.match(name)
        if m and p.is_symlink():
            notes.append(f"{p} is a symbolic link, not a checkpoint this run wrote; ignored")
        elif m and p.is_dir():
            try:
                manifest = read_manifest(p)
                out.append((seq(manifest), int(m.group(1)), p, manifest))
            except NewerVersion:
                # Listed first: a resume refuses it (not a fall back to an older step whose saves would replace
                # it); no manifest to pass on, so neither rotation nor a commit's count reads or removes it.
                out.append((float("inf"), int(m.group(1)), p, None))
            except CheckpointError as e:
                if os.path.lexists(p / MANIFEST):
                    out.append((-1, int(m.group(1)), p, None))
                    notes.append(f"{str(e).removeprefix('checkpoint ')}; a damaged checkpoint, tried last")
                else:
                    notes.append(f"{str(e).removeprefix('checkpoint ')}; ignored")
    found = [(p, manifest) for *_, p, manifest in sorted(out, key=lambda e: e[:3], reverse=True)]
    return (found if manifests else [p for p, _ in found]), sorted(notes)


def seq(manifest: dict) -> int:
    """A committed folder's commit number (0 in manifests that predate it)."""
    n = manifest.get("seq", 0)
    return n if isinstance(n, int) and not isinstance(n, bool) else 0


def next_seq(root: Path) -> int:
    """The commit number of the next save under root: above every committed folder's."""
    return 1 + max((seq(m) for _, m in scan(root, manifests=True)[0] if m is not None), default=0)


def held_for(folder: Path) -> Path | None:
    """The ``step-<N>`` that a ``step-<N>.tmp`` or ``step-<N>.old`` folder holds the step of, else None."""
    m = _AROUND.fullmatch(folder.name)
    return folder.with_name(m.group(1)) if m else None


def step_of(folder: Path) -> int:
    m = _STEP.match(folder.name)
    return int(m.group(1)) if m else -1


def named_step(folder: Path) -> int:
    """The step ``folder``'s name says (``step-<N>``, or its commit's ``step-<N>.tmp``/``.old``); -1 for another."""
    return step_of(held_for(folder) or folder)


def copied_manifest(folder: Path, manifest: dict) -> list[str]:
    """The line where ``manifest`` records another step than its folder's name says (copied from another step's
    folder: it explains why every file fails its check), else none."""
    step, named = manifest.get("step"), named_step(folder)
    if named < 0 or not isinstance(step, int) or step == named:
        return []
    return [f"{folder / MANIFEST} is step {step}'s, not step {named}'s (copied from another step's folder?)"]


def newest_other(folder: Path) -> Path | None:
    """The newest committed step folder beside ``folder`` (the way out of a damaged one a resume named); None."""
    try:
        found = scan(folder.parent, manifests=True)[0]
    except (CheckpointError, UnsafePathError, OSError):
        return None
    return next((p for p, m in found if m is not None and p.resolve() != folder.resolve()), None)


def _step_versions(folder: Path, manifest: dict | None = None) -> None:
    """NewerVersion where the step ``folder``'s manifest (unless ``manifest``, read already) or its train state was
    written by a newer version; CheckpointError/UnsafePathError/OSError where either cannot be read."""
    if manifest is None:
        read_manifest(folder)
    train_state_versions(read_json(folder / TRAIN_STATE, "the train state"), folder)


def refuse_newer_above(step: Path, last: int) -> list[str]:
    """NewerVersion where the folder of ``step`` (resumed from, saved into) holds a newer version's step above it and
    at or below the run's last step ``last``: a save of this run would reach it and never replace it (``commit``), so
    it is refused at the start, not after the training. One above ``last`` is left alone, as rotation leaves it.
    Returns the step folders between (their names, in order): a run resumed from ``step`` that saves into its folder
    saves over them or rotates them out (``prune`` keeps none past its newest)."""
    n, later = step_of(step), []
    for p, manifest in scan(step.parent, manifests=True)[0]:
        if not n < step_of(p) <= last:
            continue
        later.append(p)
        try:
            _step_versions(p, manifest)   # (no manifest passed: a newer version's, or damage)
        except NewerVersion as e:
            raise NewerVersion(e.what, f"this run resumes from {step.name} below it and trains to step {last}, so "
                               "it would save that step in its place; set checkpoint.dir to another folder or "
                               f"train.steps below {step_of(p)} (or resume that step with that version)") from None
        except (CheckpointError, UnsafePathError, OSError):
            pass   # (damage: a save replaces it, as ever)
    return [p.name for p in sorted(later, key=step_of)]


def commit(tmp: Path, final: Path, on_point) -> str | None:
    """Rename ``step-N.tmp`` to ``step-N`` (an older one moved aside first), then point ``latest`` at it; rank 0. A
    failure after the rename (the commit point) is returned, to warn."""
    root = final.parent
    files.refuse_links(final, root / f"{final.name}.old", root / files.temp_name(LATEST))
    aside = None
    if final.exists():  # the same step saved again (resumed from an older checkpoint)
        try:   # (never one of a newer version: resumed from an older step of its folder)
            _step_versions(final)
        except NewerVersion as e:
            raise NewerVersion(e.what, "not replaced by this run's save of that step; set checkpoint.dir to another "
                               "folder") from None
        except (CheckpointError, UnsafePathError):
            pass   # (damage: replaced, as before)
        aside = root / f"{final.name}.old"
        _remove_tree(aside)
        os.replace(final, aside)
    on_point("before-rename")
    os.replace(tmp, final)
    files.fsync_dir(root)
    try:
        on_point("before-latest")
        files.write_atomic(root / LATEST, final.name.encode())
        if aside is not None:
            _remove_tree(aside)
    except (OSError, UnsafePathError) as e:
        return (f"{final} committed; {root / LATEST} not updated ({getattr(e, 'strerror', None) or e}): a resume "
                f"finds {final.name} by its manifest, and the next save writes {LATEST}")
    return None


def prune(root: Path, newest: Path, keep_last: int, on_point=None) -> tuple[list[Path], list[Path]]:
    """Delete committed folders older than ``newest`` beyond the ``keep_last`` newest (0 keeps all), never the newest
    verified one nor one whose manifest cannot be read; later steps (another run's) are left alone. The folders
    deleted, and the ``step-N.del`` ones a deletion could not empty (no checkpoint: the next save tries again)."""
    if keep_last <= 0:
        return [], []
    chain = [(p, m) for p, m in scan(root, manifests=True)[0] if step_of(p) <= step_of(newest)]
    good = next((p for p, m in chain if m is not None and m.get("verified") is True), None)
    older = [(p, m) for p, m in chain if step_of(p) < step_of(newest)]
    gone, left = [], []
    for p in (p for p, m in older[keep_last - 1:] if p != good and m is not None):
        # Renamed first: a kill halfway leaves a step-N.del folder, never a half checkpoint.
        doomed = p.with_name(p.name + ".del")
        _remove_tree(doomed)
        os.replace(p, doomed)
        if on_point is not None:
            on_point("pruning")
        _remove_tree(doomed)
        if os.path.lexists(doomed):
            left.append(doomed)
        else:
            gone.append(p)
    return gone, left


def remove_stale(root: Path, keep: Path | None = None) -> list[str]:
    """After ``restore``: remove the folders of interrupted saves and deletions but ``keep`` (never a link); a
    complete ``step-<N>.tmp`` with no ``step-<N>`` moved aside is one of them (the resume passed it over). Those it
    could not delete, each said as "<folder> (why)"."""
    stuck = []
    if root.is_dir():
        restore(root)
        for p in sorted(root.iterdir()):
            if (p.name.startswith("step-") and p.name.endswith(_LEFTOVER) and p != keep and not p.is_symlink()
                    and p.is_dir() and (why := _remove_tree(p))):
                stuck.append(f"{p} ({why})")
    return stuck


def interrupted(root: Path) -> list[tuple[Path, Path]]:
    """(folder, ``step-<N>``) for each step ``commit`` moved aside to ``step-<N>.old`` and left so: a complete
    ``step-<N>.tmp`` holds it, else that ``.old``. A complete ``.tmp`` with no ``.old`` (killed before its first
    commit) is not restored: that would commit a checkpoint of the abandoned run."""
    out = []
    for p in sorted(root.iterdir()) if root.is_dir() else []:
        m = _AROUND.fullmatch(p.name)
        if not m or os.path.lexists(final := root / m.group(1)) or p.is_symlink() or not p.is_dir():
            continue
        if not (root / f"{final.name}.old").is_dir():
            continue
        tmp = root / f"{final.name}.tmp"
        complete = (tmp / MANIFEST).is_file() and not tmp.is_symlink()
        if complete == (m.group(2) == "tmp"):   # the new folder when complete, else the one moved aside
            out.append((p, final))
    return out


def restore(root: Path) -> list[Path]:
    """Put back each ``interrupted`` step, said; only where this run saves (elsewhere a commit may be under way)."""
    done = []
    for p, final in interrupted(root):
        os.replace(p, final)
        files.fsync_dir(root)
        print(f"checkpoint: {final} was missing after an interrupted save: restored it from {p.name}"
              + (" (complete: its manifest was written)" if p.suffix == ".tmp" else " (the copy moved aside)"),
              flush=True)
        done.append(final)
    return done


def _remove_tree(p: Path) -> str | None:
    """Delete ``p`` as far as it goes (never through a link); why it is still there (its first error), or None."""
    if p.is_symlink():
        raise UnsafePathError(f"{p} is a symbolic link; refusing to delete through it: remove the link")
    errors: list[tuple[str, BaseException]] = []   # (rmtree's path: the error's own filename may be relative)
    if sys.version_info >= (3, 12):   # (onerror is deprecated there, to be removed)
        shutil.rmtree(p, onexc=lambda fn, path, e: errors.append((path, e)))
    else:
        shutil.rmtree(p, onerror=lambda fn, path, info: errors.append((path, info[1])))
    if not os.path.lexists(p):
        return None
    path, e = errors[0] if errors else (None, None)
    if isinstance(e, OSError) and e.strerror:
        return f"{e.strerror}: {path or e.filename}" if path or e.filename else e.strerror
    return str(e) if e is not None else "not deleted"
