"""Consolidate a training checkpoint into safetensors that the plain model loads (``python -m framework.export``).

The masters (``model.<name>``), frozen parameters and buffers (``frozen.``, ``buffer.``) are read one tensor at a
time, so peak memory stays near one tensor. Not a checkpoint: ConfigError; a damaged one: CheckpointError.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import itertools
import os
import re
import sys
from pathlib import Path

import torch

from framework.core.errors import ConfigError
from framework.core.utils import few
from framework.persist import stepfolders
from framework.persist.checkpoint import glue, verify
from framework.persist.layout import StateLayout
from framework.persist.tensorfiles import is_output, output_dir, plan_files, save_files

def resolve(checkpoint) -> Path:
    """The DCP step folder of ``checkpoint``: itself; in a folder of our committed step folders the one its
    ``latest`` names (a link, or a file naming it; said when a newer one is there: a save that failed to update it),
    the newest, as ``checkpoint.resume=auto`` picks it, where ``latest`` names no committed one (said) or is absent;
    one a commit moved aside read where it lies; else what its ``latest`` points at."""
    path, seen = Path(checkpoint), set()
    found = [] if (path / ".metadata").is_file() else stepfolders.scan(path, around=True)[0]   # (renames nothing)
    if found:
        latest = path / "latest"   # (a link to the step folder, as allowed above: named by its target)
        named = (Path(os.readlink(latest)).name if latest.is_symlink()
                 else latest.read_text().strip() if latest.is_file() else None)
        # (step-N.tmp or .old: step-N, its commit under way or interrupted)
        chosen = next((p for p in found if p.name.split(".")[0] == named), None)
        newest = found[0].name.split(".")[0]
        if chosen is not None and chosen != found[0]:
            print(f"warning: export: {path}/latest names {named}, exported; {newest} there is newer (give its "
                  f"folder, {found[0]}, to export it)", file=sys.stderr, flush=True)
        elif chosen is None and named is not None:
            print(f"warning: export: {path}/latest names {named or 'nothing'}, not a committed checkpoint there; "
                  f"exporting {found[0].name}, the newest", file=sys.stderr, flush=True)
        return chosen or found[0]
    while not (path / ".metadata").is_file():
        if path.resolve() in seen:   # a 'latest' pointing at its own folder, or round a loop
            raise ConfigError(f"export: {path}/latest points back at {path} (a loop); point it at a step folder "
                              "(e.g. step-100), or give the step folder itself")
        seen.add(path.resolve())
        latest = path / "latest"
        if latest.is_symlink() or latest.is_dir():
            try:
                path = latest.resolve()
            except (RuntimeError, OSError):   # a link loop (RuntimeError before Python 3.13)
                raise ConfigError(f"export: {latest} is a link that loops; point it at a step folder") from None
        elif latest.is_file():
            path = path / latest.read_text().strip()
        elif not os.path.lexists(path):   # (a mistyped step: the steps there are the fix)
            steps = stepfolders.scan(path.parent)[0]
            there = (f"; the committed checkpoints in {path.parent}: {few((p.name for p in steps), show=str)}"
                     if steps else "")
            raise ConfigError(f"export: {path} does not exist{there}")
        else:
            raise ConfigError(f"export: {path} is not a checkpoint (no .metadata, no 'latest' pointing at a step "
                              "folder)")
    return path


class Checkpoint:
    """A DCP step folder opened through the checkpoint's readers (nothing pickled runs); one our save wrote (a
    manifest, train state or rng file in it) checked against its manifest first: damage is a CheckpointError."""

    def __init__(self, checkpoint):
        d = self.step_dir = resolve(checkpoint)
        if any(os.path.lexists(d / n) for n in ("manifest.json", "train_state.json")) or any(d.glob("rng-*.json")):
            verify(d, resume=True)   # (as a resume, export never reads the zero3 16-bit copy: damage there is a line)
        self.metadata = glue().read_metadata(d / ".metadata")
        # {alias: name} of the tied parameters, saved once
        state = d / stepfolders.TRAIN_STATE
        body = stepfolders.read_json(state, "train state") if state.is_file() else {}
        tied = body.get("tied") if isinstance(body, dict) else None
        self.tied = {a: n for a, n in tied.items() if isinstance(n, str)} if isinstance(tied, dict) else {}
        self.params, self.keys = {}, {}   # name -> its DCP key's prefix
        # the masters, then frozen parameters and buffers (in checkpoints written since they are)
        for prefix in ("model.", "frozen.", "buffer."):
            found = StateLayout.in_checkpoint(self.metadata, prefix).params
            if prefix == "model." and not found:
                raise ConfigError(f"export: {d} holds no 'model.<name>' tensors")
            self.params.update(found)
            self.keys.update(dict.fromkeys(found, prefix))

    def read(self, names) -> dict[str, torch.Tensor]:
        """Full tensors ``names`` (global shapes, stored dtypes), assembled by DCP from every rank's files."""
        sd = {n: torch.empty(self.params[n].shape, dtype=self.params[n].dtype, device="cpu") for n in names}
        glue().read(self.step_dir, self.metadata, {self.keys[n] + n: t for n, t in sd.items()}, no_dist=True)
        return sd


# Another model's weights (safetensors, Hugging Face's torch files): beside an export, a loader could take them in.
_WEIGHTS = re.compile(r".*\.safetensors(\.index\.json)?|pytorch_model.*\.bin(\.index\.json)?")


def check_output(out_dir: Path, overwrite: bool = False) -> None:
    """Refuse an output folder holding other weights (an earlier export's are replaced with ``overwrite``) or a
    ``config.json``, which export does not write (with ``overwrite``: kept, with a warning)."""
    if stepfolders.committed_step(out_dir) is not None:   # (refused as such by create_files)
        return
    try:
        names = sorted(p.name for p in out_dir.iterdir())
    except OSError:   # (made, or refused as not writable, by create_files)
        return
    ours = [n for n in names if is_output(n)]
    other = [n for n in names if _WEIGHTS.fullmatch(n) and not is_output(n)]
    config = "config.json" in names
    if other:
        raise ConfigError(f"export: {out_dir} holds {few(other, show=str)}: weights the export would leave beside its "
                          f"own; choose an empty folder (or remove them)")
    if (ours or config) and not overwrite:
        stays = " (its config.json stays as it is: export writes only the weights)" if config else ""
        held = [*ours, "config.json"] if config else ours
        raise ConfigError(f"export: {out_dir} already holds {few(held, 2, str)}: "
                          f"choose an empty folder, or give --overwrite to replace the weights there{stays}")
    if config:
        print(f"warning: export: {out_dir / 'config.json'} stays as it is (export writes only the weights); check "
              f"that it describes the exported model", file=sys.stderr, flush=True)


def export(checkpoint, out_dir, *, dtype: torch.dtype | None = None, max_shard_size: int | str = "5GB",
           overwrite: bool = False) -> list[Path]:
    """The checkpoint's weights as consolidated safetensors (``dtype``: default as stored); the paths. ``overwrite``:
    replace an earlier export there (``check_output``), which stays whole if this one fails."""
    out_dir = output_dir(out_dir, dtype, "export")
    check_output(out_dir, overwrite)
    ckpt = Checkpoint(checkpoint)
    plans = plan_files([(n, p.shape, p.dtype) for n, p in ckpt.params.items()], max_shard_size, dtype)
    # The folders this export makes, innermost first, removed again (each only while empty) if it fails; from the
    # path as the kernel resolves its "..", so that a folder of the user's named through one is never taken for it.
    target = Path(os.path.abspath(out_dir))
    made = list(itertools.takewhile(lambda p: not os.path.lexists(p), (target, *target.parents)))

    # The freed heap memory goes back to the OS after each tensor: glibc keeps DCP's freed read buffers, and an
    # export's footprint would ratchet up (measured: 12-34 MB instead of about one 4 MiB tensor).
    trim = lambda: None   # noqa: E731 (not glibc: nothing to do)
    with contextlib.suppress(OSError, AttributeError):
        trim = functools.partial(ctypes.CDLL("libc.so.6").malloc_trim, 0)

    def write(writer) -> None:
        for e in (e for plan in plans for e in plan.entries):
            value = ckpt.read([e.name])[e.name].reshape(-1)
            writer.write(e, 0, value)
            del value
            trim()

    try:   # (an OSError the writes do not name as theirs is a checkpoint read)
        return save_files(out_dir, plans, "export", write, dtype, check=False)
    except BaseException:   # an earlier export there stays whole (finish_files replaces it last)
        for folder in made:
            try:
                folder.rmdir()   # (only an empty folder; a link is not followed)
            except OSError:
                break
        raise


def get_fp32_state_dict_from_checkpoint(checkpoint) -> dict[str, torch.Tensor]:
    """The checkpoint's consolidated fp32 weights ``{name: tensor}`` in memory (DeepSpeed's
    ``get_fp32_state_dict_from_zero_checkpoint``); a tied parameter under each of its names, as ``state_dict``."""
    ckpt = Checkpoint(checkpoint)
    sd = {n: t.float() if t.is_floating_point() else t for n, t in ckpt.read(list(ckpt.params)).items()}
    return {**sd, **{alias: sd[name] for alias, name in ckpt.tied.items() if name in sd and alias not in sd}}
