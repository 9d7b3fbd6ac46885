"""Where conf/ and csrc/ are: the source tree's top level, or inside an installed package."""
from __future__ import annotations

from importlib.resources import files
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def _find(top_level: str, packaged: str) -> Path:
    candidate = REPO_ROOT / top_level
    if candidate.is_dir():
        return candidate
    # A regular (non-editable) install maps conf/ -> framework/_conf and csrc/ -> framework/_csrc.
    return Path(str(files(packaged))).resolve()


def conf_dir() -> Path:
    return _find("conf", "framework._conf")


def csrc_dir() -> Path:
    return _find("csrc", "framework._csrc")
