"""Consolidate a training checkpoint into safetensors that the plain model loads (``python -m framework.export``).

The masters (``model.<name>``), frozen parameters and buffers (``frozen.``, ``buffer.``) are read one tensor at a
time, so peak memory stays near one tensor. Not a checkpoint: ConfigError; a damaged one: CheckpointError.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import sys
from pathlib import Path

import torch

from framework.core import files
from framework.core.errors import CheckpointError, ConfigError, FrameworkError, first_line
from framework.core.utils import few
from framework.models.hf import CLASS_KEY, causal_lm_class, without_dtype
from framework.persist import stepfolders
from framework.persist.checkpoint import glue, verify
from framework.persist.layout import StateLayout, check_format, nonfinite_items
from framework.persist.tensorfiles import output_dir, plan_files, save_files
from framework.persist.weights import check_output

def resolve(checkpoint, say: bool = True) -> Path:
    """The DCP step folder of ``checkpoint``: itself; in a folder of committed step folders the newest, as resume=auto
    picks it (said when ``latest`` names another, unless not ``say``); else what its ``latest`` points at (a link, or
    a file naming it)."""
    path, seen = Path(checkpoint), set()
    found = [] if (path / ".metadata").is_file() else stepfolders.scan(path, around=True)[0]   # (renames nothing)
    if found:
        latest = path / "latest"   # (a link to the step folder, as allowed above: named by its target)
        named = (Path(os.readlink(latest)).name if latest.is_symlink()
                 else latest.read_text().strip() if latest.is_file() else None)
        step = found[0].name.split(".")[0]   # (step-N.tmp or .old: step-N, its commit under way or interrupted)
        if named != step and say:
            print(f"warning: export: {path} holds {step}, its newest committed checkpoint, but its latest "
                  f"names {named or 'nothing'}; exporting {found[0].name}", file=sys.stderr, flush=True)
        return found[0]
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
    """A DCP step folder opened through the checkpoint's readers (nothing pickled runs); one our save wrote checked
    against its manifest first."""

    def __init__(self, checkpoint):
        d = self.step_dir = resolve(checkpoint)
        state = d / stepfolders.TRAIN_STATE
        try:   # a newer version's checkpoint is refused, never read as this version's
            if any(os.path.lexists(d / n) for n in ("manifest.json", "train_state.json")) or any(d.glob("rng-*.json")):
                verify(d, resume=True)   # (as a resume: export never reads zero3's 16-bit copy; its damage is a line)
            body = stepfolders.read_json(state, "train state") if state.is_file() else {}
            body = body if isinstance(body, dict) else {}   # (nothing of it read)
            stepfolders.train_state_versions(body, d)
        except stepfolders.NewerVersion as e:
            raise stepfolders.NewerVersion(f"export: {e.what}", "export it with that version") from None
        if "state_format" in body:
            check_format(body["state_format"], f"export: {d}")
        self.metadata = glue().read_metadata(d / ".metadata")
        config = body.get("model_config")   # a Hugging Face model's resolved config (model=hf)
        self.model_config = config if isinstance(config, dict) else None
        model = body["config"].get("model") if isinstance(body.get("config"), dict) else None
        self.model_name = model.get("name") if isinstance(model, dict) else None
        tied = body.get("tied")   # {alias: name} of the tied parameters, saved once
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


def export(checkpoint, out_dir, *, dtype: torch.dtype | None = None, max_shard_size: int | str = "5GB",
           overwrite: bool = False) -> list[Path]:
    """The checkpoint's weights as consolidated safetensors (``dtype``: default as stored); the paths. ``overwrite``:
    replace an earlier export there, which stays whole if this one fails."""
    out_dir = output_dir(out_dir, dtype, "export")
    # A Hugging Face model's checkpoint records its config: written as config.json (for from_pretrained), so one
    # already there is refused only where it describes another model.
    recorded = _recorded(checkpoint)
    check_output(out_dir, "export", overwrite, config=recorded is not None and _same_config(out_dir, recorded))

    def write(ckpt: Checkpoint) -> list[Path]:
        return _export(ckpt, out_dir, dtype, max_shard_size) + _config(ckpt, out_dir, dtype)
    return _reading(checkpoint, write)


def _recorded(checkpoint) -> dict | None:
    """The model config a ``model=hf`` checkpoint's train state records (unchecked: a damaged one is refused by
    the read after); None for another model, or where it cannot be read."""
    try:
        # (quiet: the read after resolves it again, and says once what it exports)
        body = stepfolders.read_json(resolve(checkpoint, say=False) / stepfolders.TRAIN_STATE, "train state")
    except (FrameworkError, OSError, ValueError):
        return None
    config = body.get("model_config") if isinstance(body, dict) else None
    return config if isinstance(config, dict) else None


def _same_config(out_dir: Path, recorded: dict) -> bool:
    """Whether ``out_dir`` holds no config.json or one of the model ``recorded`` describes; else ConfigError."""
    path = out_dir / "config.json"
    files.refuse_links(path)   # (before any weight is written: read through a link, it would be refused after)
    if not os.path.lexists(path):
        return True
    try:
        from transformers import AutoConfig
        config = AutoConfig.from_pretrained(str(out_dir))
        theirs = without_dtype(config.to_dict())
    except (OSError, ValueError, TypeError, KeyError) as e:
        theirs = f"not read as a transformers config: {first_line(e)}"
    else:   # (the class: an earlier export's names the one trained, the checkpoint's record may not; another
        # head's, GPT2ForSequenceClassification's, is another model)
        trained = [getattr(causal_lm_class(config), "__name__", None)]
        if theirs.get(CLASS_KEY) in (None, recorded.get(CLASS_KEY), trained):
            theirs[CLASS_KEY] = recorded.get(CLASS_KEY)
    if theirs == recorded:
        return True
    if isinstance(theirs, dict):   # (the model type first: another one says it all)
        keys = sorted((k for k in {*theirs, *recorded} if theirs.get(k) != recorded.get(k)),
                      key=lambda k: (k != "model_type", k))
        differ = few([f"{k} {theirs.get(k)!r} vs {recorded.get(k)!r}" for k in keys], 2, str)
        differ += ": its vs the checkpoint's"
    else:
        differ = theirs
    raise ConfigError(f"export: {path} describes another model than the checkpoint's ({differ}); remove it (the "
                      f"export writes the checkpoint's own config.json), or choose an empty folder")


def _config(ckpt: Checkpoint, out_dir: Path, dtype: torch.dtype | None) -> list[Path]:
    """config.json from the model config the checkpoint records, as ``save_pretrained`` writes it (one of the same
    model there replaced); where it records none of a Hugging Face model, a line saying how to add it."""
    path = out_dir / "config.json"
    if ckpt.model_config is None:
        if ckpt.model_name == "hf":   # (saved before checkpoints recorded it)
            print(f"note: export: {ckpt.step_dir} records no model config: for from_pretrained, copy the model's "
                  f"config.json into {out_dir}", file=sys.stderr, flush=True)
        return []
    try:
        from transformers import AutoConfig
        config = AutoConfig.for_model(**ckpt.model_config)
    except (ValueError, TypeError, KeyError) as e:   # e.g. a model type this transformers does not know
        print(f"note: export: no config.json written ({first_line(e)}): for from_pretrained, copy the model's "
              f"config.json into {out_dir}", file=sys.stderr, flush=True)
        return []
    # As save_pretrained: the dtype written (from_pretrained casts to the config's: a bfloat16 one would round fp32
    # weights), so one of the same model already there (its source's dtype, or an earlier export's) is replaced,
    # whole; and model=hf's class (AutoModelForCausalLM's: pipeline and AutoModel read it), a model of one's own
    # keeping what its config says.
    config.dtype = dtype if dtype is not None else next(p.dtype for n, p in ckpt.params.items()
                                                        if ckpt.keys[n] == "model.")
    if ckpt.model_name == "hf" and (cls := causal_lm_class(config)) is not None:
        config.architectures = [cls.__name__]
    files.refuse_links(path)
    text = config.to_json_string(use_diff=True).encode()
    try:   # (said only where it changes: a re-export of the same checkpoint writes the same bytes)
        replaced = path.read_bytes() != text
    except FileNotFoundError:
        replaced = False
    except OSError:
        replaced = True
    # (its temporary created new, never through a link; readable as save_pretrained's is)
    files.write_atomic(path, text, shared=True)
    if replaced:
        print(f"note: export: {path} (of the same model) replaced by the checkpoint's config, with the dtype "
              "written", file=sys.stderr, flush=True)
    return [path]


def _export(ckpt: Checkpoint, out_dir: Path, dtype: torch.dtype | None, max_shard_size: int | str) -> list[Path]:
    plans = plan_files([(n, p.shape, p.dtype) for n, p in ckpt.params.items()], max_shard_size, dtype)
    # The freed heap memory goes back to the OS after each tensor: glibc keeps DCP's freed read buffers, and an
    # export's footprint would ratchet up (measured: 12-34 MB instead of about one 4 MiB tensor).
    trim = lambda: None   # noqa: E731 (not glibc: nothing to do)
    with contextlib.suppress(OSError, AttributeError):
        trim = functools.partial(ctypes.CDLL("libc.so.6").malloc_trim, 0)

    def write(writer) -> None:
        for e in (e for plan in plans for e in plan.entries):
            value = ckpt.read([e.name])[e.name].reshape(-1)
            # (a save refuses such a state, so these values are damage its manifest was resealed over, as resume
            # says; refused before the files are published). Buffers and frozen parameters: NaN only, as saves and
            # resume check them (an inf there may be by design, an additive attention mask).
            if nonfinite_items([(e.name, value)], nan_only=ckpt.keys[e.name] != "model."):
                raise CheckpointError(f"checkpoint {ckpt.step_dir}: non-finite values (NaN or inf) in "
                                      f"'{e.name}': not weights to export; export an earlier step")
            writer.write(e, 0, value)
            del value
            trim()

    # (an OSError the writes do not name as theirs is a checkpoint read)
    return save_files(out_dir, plans, "export", write, dtype, check=False)


def get_fp32_state_dict_from_checkpoint(checkpoint) -> dict[str, torch.Tensor]:
    """The checkpoint's consolidated fp32 weights ``{name: tensor}`` in memory (DeepSpeed's
    ``get_fp32_state_dict_from_zero_checkpoint``); a tied parameter under each of its names, as ``state_dict``."""
    def read(ckpt: Checkpoint) -> dict[str, torch.Tensor]:
        sd = {n: t.float() if t.is_floating_point() else t for n, t in ckpt.read(list(ckpt.params)).items()}
        return {**sd, **{alias: sd[name] for alias, name in ckpt.tied.items() if name in sd and alias not in sd}}
    return _reading(checkpoint, read)


def _reading(checkpoint, fn):
    """``fn(Checkpoint(checkpoint))``; where the step folder is gone meanwhile (a live run rotated it away), the newest
    step then, once, where ``checkpoint`` is the folder of the steps; else one line naming that run."""
    for again in (False, True):
        step = resolve(checkpoint)
        try:
            return fn(Checkpoint(step))
        except (FrameworkError, OSError, glue().CheckpointException):
            if os.path.lexists(step):
                raise
            if not again and step.resolve() != Path(checkpoint).resolve():
                continue
            raise FrameworkError("export: " + stepfolders.removed_while_read(
                step, "run the export again, or export a step that run keeps (checkpoint.keep_last)")) from None
