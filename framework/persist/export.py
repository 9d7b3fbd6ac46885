"""Consolidate a training checkpoint into safetensors that the plain model loads (the command:
``python -m framework.export``, framework/cli/export.py).

CHECKPOINT is a checkpoint step folder (a torch.distributed.checkpoint folder whose keys
``model.<parameter name>`` hold the fp32 masters at their global shapes) or the checkpoint
directory itself (its ``latest`` is followed). The output is ``model.safetensors``, or shards
plus ``model.safetensors.index.json`` when larger than ``--max-shard-size``, under the
parameter names (tied weights once, as the checkpoint holds them): ``model.load_state_dict``
of the plain model loads it (``strict=False`` where a tied alias is absent), and so does
``framework.persist.weights.load_weights``. It is streamed: one output file's tensors are read from the
checkpoint at a time, so peak memory stays near one output shard, not the model.

In Python, ``get_fp32_state_dict_from_checkpoint(dir)`` (the name DeepSpeed's ``zero_to_fp32``
users know) returns the whole consolidated fp32 state dict.
"""
from __future__ import annotations

import ctypes
import os
import warnings
from pathlib import Path

import torch

from framework.core import files
from framework.core.errors import ConfigError, FrameworkError
from framework.persist.layout import StateLayout
from framework.persist.tensorfiles import create_files, finish_files, plan_files, write_at

PREFIX = "model."
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve(checkpoint) -> Path:
    """The DCP step folder of ``checkpoint``: itself, or what its ``latest`` points at (a
    symbolic link, or a file holding the step folder's name)."""
    path = Path(checkpoint)
    if (path / ".metadata").is_file():
        return path
    latest = path / "latest"
    if latest.is_symlink() or latest.is_dir():
        return resolve(latest.resolve())
    if latest.is_file():
        return resolve(path / latest.read_text().strip())
    raise ConfigError(f"export: {path} is not a checkpoint (no .metadata, no 'latest' pointing at a step folder)")


class Checkpoint:
    """A DCP step folder opened for reading: its metadata is unpickled once, with the checkpoint
    module's allow-list (a crafted ``.metadata`` cannot run code), and tensors are read with DCP's
    reader (``torch.load(weights_only=True)`` per item; pickled objects are never loaded)."""

    def __init__(self, step_dir: Path):
        from framework.persist.checkpoint import read_metadata

        self.step_dir = step_dir
        self.metadata = read_metadata(step_dir / ".metadata")
        self.tensors = {n: (p.shape, p.dtype) for n, p in StateLayout.in_checkpoint(self.metadata, PREFIX).params.items()}
        if not self.tensors:
            raise ConfigError(f"export: {step_dir} holds no '{PREFIX}<name>' tensors")

    def read(self, names) -> dict[str, torch.Tensor]:
        """Full tensors ``names`` at their global shapes and stored dtypes, assembled by DCP from
        every rank's shard files (only their byte ranges are read). No process group needed."""
        import torch.distributed.checkpoint as dcp

        from framework.persist.checkpoint import LoadPlanner, SafeReader

        sd = {PREFIX + n: torch.empty(self.tensors[n][0], dtype=self.tensors[n][1], device="cpu") for n in names}
        try:
            with warnings.catch_warnings():   # no_dist is what we ask for: DCP's "assuming single process" note
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.load(sd, storage_reader=SafeReader(self.step_dir, self.metadata), planner=LoadPlanner(),
                         no_dist=True)
        except FrameworkError:
            raise
        except Exception as e:  # noqa: BLE001 - DCP wraps per-item failures in its own exception types
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ConfigError(f"export: reading {self.step_dir} failed: {first}") from None
        return {k[len(PREFIX):]: v for k, v in sd.items()}


def export(checkpoint, out_dir, *, dtype: torch.dtype | None = None, max_shard_size: int | str = "5GB") -> list[Path]:
    """Write the checkpoint's model weights as consolidated safetensors (``dtype``: default the
    stored fp32). One output file at a time: its tensors are read, converted, written, freed."""
    ckpt = Checkpoint(resolve(checkpoint))
    tensors = ckpt.tensors
    out_dtype = {n: (dtype if dtype is not None and dt.is_floating_point else dt) for n, (_, dt) in tensors.items()}
    plans = plan_files([(n, shape, out_dtype[n]) for n, (shape, _) in tensors.items()], max_shard_size)
    out_dir = Path(out_dir)
    create_files(out_dir, plans)
    for plan in plans:   # one output file at a time, one tensor at a time into it
        fd = files.open_nofollow(out_dir / (plan.name + ".tmp"), os.O_WRONLY)
        try:
            for e in plan.entries:
                value = ckpt.read([e.name])[e.name]
                write_at(fd, e.offset, value.reshape(-1).to(e.dtype).contiguous())
                del value
                _trim()
        finally:
            os.close(fd)
    return finish_files(out_dir, plans)


def _trim() -> None:
    """Hand freed heap memory back to the OS (glibc): DCP's per-item read buffers are freed after
    each tensor, but glibc keeps them in its heap, so without this the footprint ratchets up by
    a few tensors' worth over an export (measured: 12-34 MB instead of about one 4 MiB tensor)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


def get_fp32_state_dict_from_checkpoint(checkpoint) -> dict[str, torch.Tensor]:
    """The checkpoint's consolidated fp32 model weights, ``{name: tensor}`` at global shapes
    (DeepSpeed's ``get_fp32_state_dict_from_zero_checkpoint``, for a checkpoint of ours). The
    whole model is in memory: to write files, use ``export`` (streamed)."""
    ckpt = Checkpoint(resolve(checkpoint))
    return {n: t.float() if t.is_floating_point() else t for n, t in ckpt.read(list(ckpt.tensors)).items()}
