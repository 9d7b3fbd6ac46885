"""Which checkpoint a run resumes from: where a run's checkpoints go, the newest committed one
(``checkpoint.resume=latest`` also looks in the run folders under the working directory), the
candidates of ``auto`` or a path, best first, and the refusal, before any rank starts, of a
checkpoint another model or optimizer saved."""
from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

from framework.core.errors import ConfigError
from framework.persist.checkpoint import _folder
from framework.persist.checkpoint._load import OTHER_RUN


def checkpoint_root(cfg, run_dir: Path | None, job: str | None = None) -> Path:
    """Where a run's checkpoints go: ``checkpoint.dir``, else ``checkpoints/`` in the run folder
    (so a run never meets another run's checkpoints unless pointed at them), else (library use
    without a run folder) ``checkpoints/`` in the working directory. Under an explicit
    ``checkpoint.dir`` each multirun job gets ``<dir>/<its overrides>``."""
    c = cfg.checkpoint
    if c.dir is None:
        return (Path(run_dir) if run_dir is not None else Path.cwd()).resolve() / "checkpoints"
    root = Path(c.dir).expanduser().resolve()
    return root / _job_folder(job) if job else root


# Where ``checkpoint.resume=latest`` looks besides the run's own folder: run folders of Hydra's
# default layout under the working directory (outputs/<date>/<time>, multirun/<date>/<time>/<job>)
# or any folder one to three levels below them.
_RUN_TREES = ("outputs", "multirun")


def find_latest(root: Path, cwd: Path | None = None) -> Path | None:
    """The newest committed checkpoint (by commit time) in ``root`` and in the ``checkpoints``
    folders of the run folders under ``outputs/`` and ``multirun/``; None if there is none."""
    cwd = cwd or Path.cwd()
    roots = {root}
    for tree in _RUN_TREES:
        for depth in ("*", "*/*", "*/*/*"):
            roots.update(p for p in (cwd / tree).glob(f"{depth}/checkpoints") if p.is_dir() and not p.is_symlink())
    best: tuple[float, Path] | None = None
    for r in roots:
        found = _folder.committed(r)
        if found:
            t = (found[0] / _folder.MANIFEST).stat().st_mtime
            if best is None or t > best[0]:
                best = (t, found[0])
    return best[1] if best else None


# Model keys that may change between a save and a resume: how the same weights are computed.
_MODEL_FREE = {"activation_checkpointing", "attn_implementation", "dropout", "pretrained"}


def preflight(cfg, run_dir: Path | None, job: str | None = None, quiet: bool = False):
    """Before any rank starts: the checkpoint ``checkpoint.resume`` selects (``latest`` resolved to
    its path, so every rank loads the same), refused on one line when it was saved by another model
    or optimizer (which no rank could load); returns ``cfg`` with ``latest`` resolved. A damaged
    or unreadable candidate is left to the ranks (they fall back and say so)."""
    c = cfg.checkpoint
    root = checkpoint_root(cfg, run_dir, job)
    if c.resume == "off":
        return cfg
    if c.resume == "latest":
        folder = find_latest(root)
        if folder is None:
            quiet or print(f"checkpoint: resume=latest: no checkpoint in {root} or in the run folders under "
                  f"{', '.join(t + '/' for t in _RUN_TREES)}; starting from step 0", flush=True)
            return dataclasses.replace(cfg, checkpoint=dataclasses.replace(c, resume="off"))
        cfg = dataclasses.replace(cfg, checkpoint=dataclasses.replace(c, resume=str(folder)))
        folders = [folder]
    else:
        folders = candidates(c.resume, root)[0]
    if not folders:
        return cfg
    folder = folders[0]
    try:
        saved = json.loads((folder / _folder.TRAIN_STATE).read_text())["config"]
    except (OSError, ValueError, KeyError, TypeError):
        return cfg
    mine = cfg.to_dict()
    diffs = [k for k in changed(saved.get("model", {}), mine["model"]) if k not in _MODEL_FREE]
    if diffs:
        what = ", ".join(f"model.{k} {_flat_get(saved['model'], k)!r} vs {_flat_get(mine['model'], k)!r}"
                         for k in diffs[:4])
        raise ConfigError(f"checkpoint.resume={c.resume}: {folder} was saved by another model ({what}; saved vs "
                          f"this run){OTHER_RUN}")
    theirs = saved.get("optimizer", {}).get("name")
    if theirs is not None and theirs != mine["optimizer"]["name"]:
        raise ConfigError(f"checkpoint.resume={c.resume}: {folder} was saved with optimizer={theirs}, this run uses "
                          f"optimizer={mine['optimizer']['name']}; resume with optimizer={theirs}{OTHER_RUN}")
    return cfg


def _flat_get(node: dict, dotted: str):
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def candidates(resume: str, root: Path) -> tuple[list[Path], list[str]]:
    """Candidate folders for ``checkpoint.resume``, best first, and one line per ``step-<N>`` folder
    passed over (no manifest, an unreadable one, a link): for ``auto`` every committed checkpoint
    under ``root``, newest first (a damaged one falls back to the next); for a path, that step
    folder, or the committed checkpoints of that directory."""
    if resume == "off":
        return [], []
    if resume == "auto":
        return _folder.scan(root)
    path = Path(resume).expanduser()
    if (path / _folder.MANIFEST).is_file() or (path / _folder.TRAIN_STATE).exists():
        return [path], []
    if path.is_dir():
        found, notes = _folder.scan(path)
        if found:
            return found, notes
    raise ConfigError(f"checkpoint.resume={resume}: no checkpoint there (expected a step-<N> folder with "
                      f"{_folder.MANIFEST}, or a directory holding them); use checkpoint.resume=auto or off")


def _job_folder(job: str) -> str:
    """A folder name for a multirun job (its overrides): readable, short enough for any file system."""
    name = job.replace("/", "_")
    if len(name) > 120:
        name = f"{name[:100]}-{hashlib.sha256(job.encode()).hexdigest()[:12]}"
    return name


def changed(a: dict, b: dict, prefix: str = "") -> list[str]:
    out = []
    for k in sorted(set(a) | set(b)):
        x, y = a.get(k), b.get(k)
        if isinstance(x, dict) and isinstance(y, dict):
            out += changed(x, y, f"{prefix}{k}.")
        elif x != y and not (prefix == "checkpoint." or f"{prefix}{k}" == "dist.nproc"):
            out.append(f"{prefix}{k}")
    return out
