"""Where conf/ and csrc/ are (the source tree's top level, or inside an installed package), the cache, and
which file of a ``save_pretrained`` folder holds its weights."""
from __future__ import annotations

import os
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[1]   # framework/ (this file is framework/core/paths.py)
REPO_ROOT = PACKAGE_DIR.parent


def _find(top_level: str) -> Path:
    candidate = REPO_ROOT / top_level
    # A regular (non-editable) install maps conf/ -> framework/_conf and csrc/ -> framework/_csrc.
    return candidate if candidate.is_dir() else PACKAGE_DIR / f"_{top_level}"


def user_path(path: str) -> str:
    """``path`` with a leading ``~`` (``~user``) made the home folder, as every path setting reads it: a shell leaves
    ``key=~/x`` and ``--to=~/x`` as they are (it expands ``~`` only at a word's start or after ``NAME=``), and a
    folder named ``~`` made in the working folder would be a hazard (``rm -rf ~`` to tidy it)."""
    return os.path.expanduser(path)


def conf_dir() -> Path:
    return _find("conf")


def csrc_dir() -> Path:
    return _find("csrc")


def cache_dir() -> Path:
    """``$XDG_CACHE_HOME/framework`` (``~/.cache/framework``): compiled kernels, the bandwidth probe."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "framework"


# A save_pretrained folder's weight files, in the order a loader looks for them (the last one is found
# only to be refused: torch .bin shards are not read sharded).
WEIGHTS_INDEX = "model.safetensors.index.json"
WEIGHTS_SINGLE = "model.safetensors"
WEIGHT_FILES = (WEIGHTS_INDEX, WEIGHTS_SINGLE, "pytorch_model.bin", "pytorch_model.bin.index.json")
READ_WEIGHT_FILES = WEIGHT_FILES[:3]   # the ones a loader reads (the refused one left out)
WEIGHTS_READ = ", ".join(READ_WEIGHT_FILES)   # the names a message lists


def weights_file(folder: Path) -> Path | None:
    """The first of ``WEIGHT_FILES`` in ``folder``, or None."""
    return next((folder / name for name in WEIGHT_FILES if (folder / name).is_file()), None)
