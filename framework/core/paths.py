"""Where conf/ and csrc/ are: the source tree's top level, or inside an installed package."""
from __future__ import annotations

from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[1]   # framework/ (this file is framework/core/paths.py)
REPO_ROOT = PACKAGE_DIR.parent


def _find(top_level: str, packaged: str) -> Path:
    candidate = REPO_ROOT / top_level
    if candidate.is_dir():
        return candidate
    # A regular (non-editable) install maps conf/ -> framework/_conf and csrc/ -> framework/_csrc.
    return PACKAGE_DIR / packaged


def conf_dir() -> Path:
    return _find("conf", "_conf")


def csrc_dir() -> Path:
    return _find("csrc", "_csrc")
