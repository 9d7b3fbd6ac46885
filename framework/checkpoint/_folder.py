"""The on-disk protocol of a checkpoint folder: atomic commit, manifest, checksums, pruning.

    <dir>/step-<N>.tmp/   being written (ignored by every reader, removed by the next save)
    <dir>/step-<N>/       committed: DCP files + train_state.json + rng-<rank>.json + manifest.json
    <dir>/latest          a text file naming the newest committed folder ("step-<N>")

Order of a save: every rank writes its files into ``step-N.tmp/`` and fsyncs them; rank 0 writes
``manifest.json`` last (size and sha256 of every file, world size, stage, step, config hash),
fsyncs it and the folder, renames the folder to ``step-N/`` (the commit point), then points
``latest`` at it by writing ``latest.tmp`` and renaming it. Older folders are deleted only after
that. A kill at any moment leaves every committed folder intact; a folder without a manifest
that parses is not a checkpoint. Files and folders are owner-only (0600 / 0700).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

from framework.errors import CheckpointError

MANIFEST = "manifest.json"
LATEST = "latest"
FORMAT = 1
_STEP = re.compile(r"^step-(\d+)$")


def mkdir_private(path: Path) -> None:
    """Create ``path`` readable by its owner only; an existing folder keeps its mode (it may be
    the user's own, such as the working directory: each step folder inside is 0700 anyway)."""
    if not path.is_dir():
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(path, 0o700)  # mkdir's mode is masked by the umask


def write_private(path: Path, data: bytes) -> None:
    """Write, fsync and close a file readable by its owner only."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def files_of(folder: Path) -> list[str]:
    """Every file of a checkpoint folder except the manifest, sorted (what the manifest lists)."""
    return sorted(p.name for p in folder.iterdir() if p.is_file() and p.name != MANIFEST)


def file_entry(folder: Path, name: str) -> dict:
    p = folder / name
    os.chmod(p, 0o600)  # DCP's writer creates files with the umask's mode
    return {"bytes": p.stat().st_size, "sha256": sha256(p)}


def write_manifest(folder: Path, files: dict[str, dict], **fields: Any) -> None:
    body = {"format": FORMAT, **fields, "files": files}
    write_private(folder / MANIFEST, json.dumps(body, indent=1, sort_keys=True).encode())
    fsync_dir(folder)


def read_manifest(folder: Path) -> dict:
    path = folder / MANIFEST
    try:
        body = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {folder}: no {MANIFEST} (an interrupted save, not a checkpoint)") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {folder}: {path} is unreadable ({e})") from None
    if not isinstance(body, dict) or body.get("format") != FORMAT or not isinstance(body.get("files"), dict):
        raise CheckpointError(f"checkpoint {folder}: {path} is not a format-{FORMAT} manifest")
    return body


def check_file(folder: Path, name: str, want: dict) -> str | None:
    """None if the file has the manifest's size and checksum, else what is wrong (naming it)."""
    p = folder / name
    try:
        size = p.stat().st_size
    except FileNotFoundError:
        return f"{p} is missing"
    if size != want["bytes"]:
        return f"{p} has {size} bytes, the manifest says {want['bytes']} (truncated or overwritten)"
    if sha256(p) != want["sha256"]:
        return f"{p} does not match its sha256 checksum in the manifest (altered or corrupted)"
    return None


def committed(root: Path) -> list[Path]:
    """Folders ``step-<N>`` under ``root`` with a manifest that parses, newest step first (their
    files are checked at load time)."""
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        m = _STEP.match(p.name)
        if m and p.is_dir() and (p / MANIFEST).is_file():
            try:
                read_manifest(p)
            except CheckpointError:
                continue
            out.append((int(m.group(1)), p))
    return [p for _, p in sorted(out, reverse=True)]


def step_of(folder: Path) -> int:
    m = _STEP.match(folder.name)
    return int(m.group(1)) if m else -1


def commit(tmp: Path, final: Path, fault) -> None:
    """Rename ``step-N.tmp`` to ``step-N`` (replacing an older folder of that step, which is
    moved aside first and deleted after), then point ``latest`` at it. Rank 0 only."""
    root = final.parent
    aside = None
    if final.exists():  # the same step saved again (resumed from an older checkpoint)
        aside = root / f"{final.name}.old"
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(final, aside)
    fault("before-rename")
    os.replace(tmp, final)
    fsync_dir(root)
    fault("before-latest")
    write_private(root / f"{LATEST}.tmp", final.name.encode())
    os.replace(root / f"{LATEST}.tmp", root / LATEST)
    fsync_dir(root)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


def prune(root: Path, newest: Path, keep_last: int) -> list[Path]:
    """Delete committed folders older than ``newest`` beyond the ``keep_last`` newest (0 keeps
    all). Folders of later steps (another run's, in the same dir) are left alone."""
    if keep_last <= 0:
        return []
    older = [p for p in committed(root) if step_of(p) < step_of(newest)]
    gone = older[keep_last - 1:]
    for p in gone:
        # Unlink the manifest first: a kill halfway leaves no half folder that looks committed.
        (p / MANIFEST).unlink(missing_ok=True)
        shutil.rmtree(p, ignore_errors=True)
    return gone


def remove_stale(root: Path) -> None:
    """Folders of interrupted saves (``*.tmp``, ``*.old``): never checkpoints, removed."""
    if root.is_dir():
        for p in root.iterdir():
            if p.is_dir() and (p.name.endswith(".tmp") or p.name.endswith(".old")) and p.name.startswith("step-"):
                shutil.rmtree(p, ignore_errors=True)
