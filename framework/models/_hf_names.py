"""Checkpoint tensor names of a transformers model: how ``from_pretrained`` maps a folder's keys to the model's, and
whether a folder needs transformers' load-time key conversions (read from the file's index or header only)."""
from __future__ import annotations

import re
from collections.abc import Collection, Iterable
from pathlib import Path

import torch
from torch import nn

from framework.core import files
from framework.core.errors import ConfigError
from framework.core.paths import weights_file


def has_conversions(model: nn.Module) -> bool:
    """Whether transformers renames or fuses some checkpoint keys of ``model``'s class on load (its
    ``transformers.conversion_mapping``: e.g. Mixtral's unfused experts, GPT-NeoX's embed_out)."""
    return bool(_conversions(model))


def _conversions(model: nn.Module) -> list:
    """``model``'s class conversion mapping; [] where there is none."""
    try:   # (transformers 5's loader internals: a release without them converts nothing the framework knows of)
        from transformers.conversion_mapping import get_model_conversion_mapping
    except ImportError:
        return []
    return get_model_conversion_mapping(model, add_legacy=False) or []


def class_converts(class_name: str, model_type: str) -> bool:
    """Whether transformers has a conversion mapping for a model class or its model_type (a look-up by name; False
    where a transformers release lacks those loader internals, as ``has_conversions``)."""
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    except ImportError:
        return False
    return bool(get_checkpoint_conversion_mapping(class_name) or get_checkpoint_conversion_mapping(model_type))


def unconverted(model: nn.Module, folder: Path) -> str | None:
    """A tensor of ``folder``'s weights that maps to no name of ``model`` (``checkpoint_names``) and that a
    conversion of the class renames or fuses, or None; None too where the names cannot be read (the loader then says
    what is wrong with the file). A key no conversion matches is another model's: the strict load names it."""
    if not (ways := _conversions(model)):   # (nothing to convert: the folder is not read)
        return None
    names = set(model.state_dict())   # (tied aliases included; on meta nothing is read)
    mapped = checkpoint_names(model, _weight_names(folder), names)
    return _first_converted(ways, [key for key, n in mapped.items() if n is not None and n not in names])


def converted(model: nn.Module, keys: Iterable[str]) -> str | None:
    """The first of ``keys`` that a conversion of ``model``'s class (``has_conversions``) renames or fuses."""
    return _first_converted(_conversions(model), keys)


def _first_converted(ways: list, keys: Iterable[str]) -> str | None:
    """The first of ``keys`` that one of the conversions ``ways`` renames or fuses."""
    if not ways:   # (also where transformers lacks its loader internals: no conversions known, none to blame)
        return None
    # (ways came from transformers.conversion_mapping, which imports these itself)
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
    renames, converts = ([w for w in ways if isinstance(w, kind)] for kind in (WeightRenaming, WeightConverter))
    return next((key for key in keys if rename_source_key(key, renames, converts) != (key, None)), None)


def _weight_names(folder: Path) -> list[str]:
    """The tensor names of a save_pretrained folder's weights, read from the index or the safetensors header (a
    torch file's, from its mapped zip: no data read); [] where they cannot be read so. (Not persist's reader:
    models sit below persistence.)"""
    path = weights_file(folder)
    try:
        if path is None:
            return []
        if path.name.endswith(".index.json"):
            return list(files.parse_json(path.read_text())["weight_map"])
        if path.suffix == ".safetensors":
            with path.open("rb") as f:   # an 8-byte little-endian length, then that many bytes of JSON header
                size = int.from_bytes(f.read(8), "little")
                header = files.parse_json(f.read(size)) if size <= path.stat().st_size else {}
            return [k for k in header if k != "__metadata__"]
        state = torch.load(path, map_location="meta", weights_only=True, mmap=True)
        return list(state) if isinstance(state, dict) else []
    except Exception:  # noqa: BLE001 - a bad file: the loader reads it and says what is wrong
        return []


def checkpoint_names(module: nn.Module, keys: Iterable[str], names: Collection[str]) -> dict[str, str | None]:
    """Each checkpoint key -> the tensor name (of ``names``) it loads into, as ``from_pretrained`` maps keys:
    ``base_model_prefix`` added or stripped where needed; ``None`` for a key the class ignores on load
    (``_keys_to_ignore_on_load_unexpected``, old ``rotary_emb.inv_freq`` / ``position_ids`` buffers); any other
    maps to itself (for a strict load to report)."""
    prefix = getattr(module, "base_model_prefix", "") or ""
    patterns = set(getattr(module, "_keys_to_ignore_on_load_unexpected", None) or ())
    buffers = [n for n, _ in module.named_buffers()]   # non-persistent ones too, as transformers looks
    for suffix, pattern in (("rotary_emb.inv_freq", r"rotary_emb\.inv_freq"), ("position_ids", r"(^|\.)position_ids$")):
        if any(n.endswith(suffix) for n in buffers):
            patterns.add(pattern)
    ignore = re.compile("|".join(f"({p})" for p in patterns)) if patterns else None
    keys = list(keys)
    out: dict[str, str | None] = {k: k for k in keys if k in names}
    claimed = set(out)
    for k in keys:
        if k in out:
            continue
        stripped = k[len(prefix) + 1:] if prefix and k.startswith(prefix + ".") else None
        for name in (stripped, f"{prefix}.{k}" if prefix else None):
            if name is not None and name in names and name not in claimed:
                out[k] = name
                claimed.add(name)
                break
        else:
            out[k] = None if ignore is not None and ignore.search(k) else k
    return out


def refuse_unconverted(model: nn.Module, folder: Path, model_type: str) -> None:
    """Our loader reads tensors under the model's own names only: refuse a checkpoint whose keys transformers would
    rename or fuse on load (the hub's Mixtral experts, GPT-NeoX's embed_out). Decided by the folder's names (its
    index or header), not the class: a folder already under the model's names (our own export) needs none."""
    if name := unconverted(model, folder):
        raise ConfigError(f"model.pretrained: this {model_type} checkpoint's tensor names (e.g. {name!r}) need key "
                          f"conversions on load (transformers.conversion_mapping renames or fuses them), which "
                          f"framework's sliced loader does not apply; load it with "
                          f"AutoModelForCausalLM.from_pretrained and pass the model to framework.initialize, or use "
                          f"model.config to train one from scratch")
