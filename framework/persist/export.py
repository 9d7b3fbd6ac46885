"""Consolidate a training checkpoint into safetensors that the plain model loads (the command:
``python -m framework.export``, framework/cli/export.py).

The fp32 masters (``model.<name>``), with the frozen parameters and persistent buffers (``frozen.<name>``,
``buffer.<name>``) where the checkpoint holds them, are read one tensor at a time, so peak memory stays near one
tensor; the output loads with the plain model's ``load_state_dict`` and with ``load_weights``. What is not a
checkpoint is a ConfigError; a damaged one (a checksum, a DCP file that does not read) a CheckpointError.
"""
from __future__ import annotations

import ctypes
import os
import re
import sys
from functools import partial
from pathlib import Path

import torch

from framework.core.errors import ConfigError
from framework.core.utils import few
from framework.persist import stepfolders
from framework.persist.checkpoint import glue, verify
from framework.persist.layout import StateLayout
from framework.persist.tensorfiles import (Writer, create_files, finish_files, is_output, output_dir, plan_files,
                                           remove_tmp, warn_overflow, writing)

def resolve(checkpoint) -> Path:
    """The DCP step folder of ``checkpoint``: itself; in a folder of our committed step folders the newest, as
    ``checkpoint.resume=auto`` picks it (said when ``latest`` names another: a save that failed to update it);
    else what its ``latest`` points at (a symbolic link, or a file holding the step folder's name)."""
    path = Path(checkpoint)
    found = [] if (path / ".metadata").is_file() else stepfolders.scan(path)[0]
    if found:
        latest = path / "latest"   # (a link to the step folder, as allowed above: named by its target)
        named = (Path(os.readlink(latest)).name if latest.is_symlink()
                 else latest.read_text().strip() if latest.is_file() else None)
        if named != found[0].name:
            print(f"warning: export: {path} holds {found[0].name}, its newest committed checkpoint, but its latest "
                  f"names {named or 'nothing'}; exporting {found[0].name}", file=sys.stderr, flush=True)
        return found[0]
    return _resolve(path, set())


def _resolve(path: Path, seen: set[Path]) -> Path:
    if (path / ".metadata").is_file():
        return path
    if path.resolve() in seen:   # a 'latest' pointing at its own folder, or round a loop
        raise ConfigError(f"export: {path}/latest points back at {path} (a loop); point it at a step folder "
                          "(e.g. step-100), or give the step folder itself")
    seen.add(path.resolve())
    latest = path / "latest"
    if latest.is_symlink() or latest.is_dir():
        try:
            target = latest.resolve()
        except (RuntimeError, OSError):   # a link loop (RuntimeError before Python 3.13)
            raise ConfigError(f"export: {latest} is a link that loops; point it at a step folder") from None
        return _resolve(target, seen)
    if latest.is_file():
        return _resolve(path / latest.read_text().strip(), seen)
    if not os.path.lexists(path):   # (a mistyped step: the steps there are the fix)
        steps = stepfolders.scan(path.parent)[0]
        there = (f"; the committed checkpoints in {path.parent}: {few((p.name for p in steps), show=str)}" if steps
                 else "")
        raise ConfigError(f"export: {path} does not exist{there}")
    raise ConfigError(f"export: {path} is not a checkpoint (no .metadata, no 'latest' pointing at a step folder)")


class Checkpoint:
    """A DCP step folder opened through the checkpoint's readers (nothing pickled runs). One our save wrote (a
    manifest, train state or rng file in it; a plain DCP folder has none) is checked against its manifest first:
    a damaged file, or the manifest deleted, is one CheckpointError naming it, never exported weights."""

    def __init__(self, checkpoint):
        d = self.step_dir = resolve(checkpoint)
        if any(os.path.lexists(d / n) for n in ("manifest.json", "train_state.json")) or any(d.glob("rng-*.json")):
            verify(d, resume=True)   # (as a resume, export never reads the zero3 16-bit copy: damage there is a line)
        self.metadata = glue().read_metadata(d / ".metadata")
        # {alias: name} of the tied parameters, saved once (our saves record them since they do)
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


# Another model's weights (safetensors, or torch files as Hugging Face names them): left beside an export, a
# loader could take them for part of it.
_WEIGHTS = re.compile(r".*\.safetensors(\.index\.json)?|pytorch_model.*\.bin(\.index\.json)?")


def check_output(out_dir: Path, overwrite: bool = False) -> None:
    """Refuse, in one line, an output folder holding another model's files: weights (an earlier export's own file
    names are replaced with ``overwrite``, any other weights never: they would stay beside the export), or a
    ``config.json``, which export does not write (with ``overwrite`` it stays as it is, said in a warning)."""
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
    """Write the checkpoint's weights as consolidated safetensors (``dtype``: default as stored); the paths. An
    output folder holding weights or a config.json is refused (``check_output``); ``overwrite`` replaces the
    weights an earlier export there wrote (they stay whole if this one fails)."""
    out_dir = output_dir(out_dir, dtype, "export")
    check_output(out_dir, overwrite)
    ckpt = Checkpoint(checkpoint)
    plans = plan_files([(n, p.shape, p.dtype) for n, p in ckpt.params.items()], max_shard_size, dtype)
    written = partial(writing, out_dir, plans, "export")   # (an OSError outside these blocks is a checkpoint read)
    # The outermost folder this export makes (None: --to exists), removed again if it fails; from the path as
    # the kernel resolves its "..", so that a folder of the user's named through one is never taken for it.
    made = target = Path(os.path.abspath(out_dir))
    while not os.path.lexists(made.parent) and made.parent != made:
        made = made.parent
    made = None if os.path.lexists(made) else made
    try:
        with written():
            create_files(out_dir, plans, "export")
    except BaseException:
        _remove_made(target, made)
        raise
    try:
        with Writer(out_dir, check=False) as writer:
            for e in (e for plan in plans for e in plan.entries):
                value = ckpt.read([e.name])[e.name].reshape(-1)
                with written():
                    writer.write(e, 0, value)
                del value
                _trim()   # (the tensor is freed once written)
            with written():
                over = writer.finish()[0]   # finite values that became inf (fp32 to fp16)
        with written():
            paths = finish_files(out_dir, plans)
    except BaseException:   # an earlier export there stays whole (finish_files replaces it last)
        remove_tmp(out_dir)
        _remove_made(target, made)
        raise
    warn_overflow(over, dtype, "export")
    return paths


def _remove_made(out_dir: Path, made: Path | None) -> None:
    """Remove the folders up to ``made`` that a failed export created, each only while empty."""
    if made is None:
        return
    for folder in (out_dir, *out_dir.parents):
        try:
            folder.rmdir()   # (only an empty folder; a link is not followed)
        except OSError:
            return
        if folder == made:
            return


def _trim() -> None:
    """Hand freed heap memory back to the OS (glibc keeps DCP's freed per-item read buffers): without
    it an export's footprint ratchets up (measured: 12-34 MB instead of about one 4 MiB tensor)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


def get_fp32_state_dict_from_checkpoint(checkpoint) -> dict[str, torch.Tensor]:
    """The checkpoint's consolidated fp32 weights ``{name: tensor}`` (DeepSpeed's
    ``get_fp32_state_dict_from_zero_checkpoint``): the whole model in memory, where ``export`` streams. A tied
    parameter is there under each of its names (one tensor), as the model's ``state_dict`` has it, where the
    checkpoint records them (``train_state.json``'s ``tied``; the files, as ``export`` writes, hold it once)."""
    ckpt = Checkpoint(checkpoint)
    sd = {n: t.float() if t.is_floating_point() else t for n, t in ckpt.read(list(ckpt.params)).items()}
    return {**sd, **{alias: sd[name] for alias, name in ckpt.tied.items() if name in sd and alias not in sd}}
