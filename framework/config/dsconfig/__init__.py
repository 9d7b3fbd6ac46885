"""DeepSpeed JSON configs, mapped onto the composed config (semantics: docs/deepspeed.md).

    python -m framework.train ds_config=ds_zero2.json train.steps=100     # the file, then overrides
    framework.initialize(model, loss_fn, ds_config="ds_zero3.json")         # or a dict

Precedence: our defaults and YAML < the DeepSpeed file < the command line; keys a file leaves out
follow DeepSpeed's defaults where DeepSpeed's engine decides, our config where it leaves them to
its client. The package is pure: ``load`` parses, ``translate`` maps the file to group choices and
settings, ``resolve`` fills "auto" by Hugging Face's rules and checks the file against the run.
"""
from __future__ import annotations

import base64
import json
import os
from functools import partial
from pathlib import Path
from typing import Mapping

from framework.core.errors import ConfigError
from framework.core.files import parse_json
from framework.core.paths import user_path
from framework.config.dsconfig._keys import AUTO, COMMAND_LINE, DEFAULT, DS_DEFAULT, DS_FILE, YAML
from framework.config.dsconfig._resolve import RunFacts, resolve
from framework.config.dsconfig._translate import translate


def load(source: str | Path | Mapping) -> dict:
    """The config as a dict: a JSON file (duplicate keys refused), base64-encoded JSON or a mapping (copied)."""
    if isinstance(source, Mapping):   # (an OmegaConf DictConfig too)
        return _plain(source, "")   # a deep, plain copy
    if not str(source).strip():
        raise ConfigError("ds_config: an empty path; give a DeepSpeed JSON file (or null for none)")
    path = Path(user_path(str(source)))
    if os.path.exists(path) and not os.path.isfile(path):
        what = "a directory" if path.is_dir() else "not a regular file"
        raise ConfigError(f"ds_config: {path} is {what}; give a DeepSpeed JSON file")
    if not os.path.isfile(path):
        # DeepSpeed's third form: the JSON base64-encoded (as launchers pass it); isfile is False, not an
        # error, for a name too long for a path (a real config in base64 is). The padding restored: Hydra's
        # override grammar takes no bare '='.
        text = str(source)
        try:   # (binascii.Error and UnicodeDecodeError are ValueErrors)
            text = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)).decode()
        except ValueError:
            text = ""
        if not text.lstrip().startswith("{"):   # (a mistyped path decodes to anything but a JSON object)
            raise ConfigError(f"ds_config: no such file: {path}")
        return _parse(text, "the base64-encoded config")
    try:
        text = path.read_text(encoding="utf-8")   # (JSON is UTF-8 whatever the locale)
    except UnicodeDecodeError as e:
        raise ConfigError(f"ds_config: {path}: not UTF-8 text ({e.reason})") from None
    except OSError as e:
        raise ConfigError(f"ds_config: cannot read {path} ({e.strerror}); fix its permissions or set "
                          "ds_config to a readable file") from None
    return _parse(text, str(path))


def _parse(text: str, where: str) -> dict:
    """The JSON object in ``text`` (a leading byte-order mark skipped, duplicate keys refused: json keeps
    the last one silently); ``where`` names it in errors."""
    if not text.strip():
        raise ConfigError(f"ds_config: {where} is empty; give a JSON object ({{}} for DeepSpeed's defaults)")
    try:
        data = parse_json(text.removeprefix("\ufeff"), object_pairs_hook=partial(_no_duplicates, where))
    except ConfigError:   # (a key given twice: a ValueError too)
        raise
    except json.JSONDecodeError as e:
        raise ConfigError(f"ds_config: {where}: line {e.lineno} column {e.colno}: {e.msg} "
                          f"(strict JSON: no comments or trailing commas)") from None
    except ValueError as e:
        raise ConfigError(f"ds_config: {where}: {e}; give a plain JSON object") from None
    if not isinstance(data, dict):
        got = "an array" if isinstance(data, list) else json.dumps(data)[:40]
        raise ConfigError(f"ds_config: {where}: the top level must be a JSON object, got {got}")
    return data


def _plain(value, key: str):
    """``value`` as JSON would hold it: a Path as its string, a numpy scalar as its Python number, an
    OmegaConf node as its container; anything else is one error naming the key."""
    if type(value).__name__ in ("DictConfig", "ListConfig"):   # (omegaconf imported only for such a value)
        from omegaconf import OmegaConf
        from omegaconf.errors import OmegaConfBaseException

        try:
            value = OmegaConf.to_container(value, resolve=True)
        except OmegaConfBaseException as e:   # (an interpolation that does not resolve)
            where = ".".join(k for k in (key, getattr(e, "full_key", None)) if k) or "the config"
            raise ConfigError(f"ds_config: {where}: {' '.join(str(e).splitlines()[0].split())}") from None
    if isinstance(value, Mapping):
        return {str(k): _plain(v, f"{key}.{k}" if key else str(k)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, f"{key}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, Path):
        return str(value)
    if type(value).__module__ == "numpy" and hasattr(value, "item") and getattr(value, "ndim", None) == 0:
        value = value.item()
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    raise ConfigError(f"ds_config: {key}: a value of type {type(value).__name__} is not a JSON value; give a "
                      f"string, number, boolean, null, list or dict")


def _no_duplicates(where: str, pairs: list) -> dict:
    """A json object_pairs_hook (``where`` bound) refusing a key given twice in one object."""
    if len(out := dict(pairs)) < len(pairs):
        key = next(k for i, (k, _) in enumerate(pairs) if k in dict(pairs[:i]))
        raise ConfigError(f"ds_config: {where}: key {key!r} appears twice in one object")
    return out


__all__ = ["AUTO", "COMMAND_LINE", "DEFAULT", "DS_DEFAULT", "DS_FILE", "YAML", "RunFacts", "load", "resolve",
           "translate"]
