"""The walk over a DeepSpeed config: its top level, with the ZeRO sections in ``_zero`` and the
training sections in ``_training``; what it finds is collected in a ``Translation`` (group
choices, settings of our keys, errors and notices), nothing is composed."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from framework.config.dsconfig._keys import (ALIASES_TOP, AUTO, DS_DEFAULT, DS_FILE, FEATURES, INERT_TOP, MAPPED_TOP,
                                             close, switched_off)
from framework.config.dsconfig._training import activation_checkpointing, optimizer, precision, scheduler
from framework.config.dsconfig._zero import aio_keys, zero


@dataclass(frozen=True)
class Setting:
    value: Any          # a plain value, or AUTO
    ds_key: str         # where it is in the DeepSpeed file
    source: str         # DS_FILE or DS_DEFAULT
    rule: str = ""      # for AUTO: which Hugging Face rule fills it


@dataclass
class Translation:
    choices: dict[str, str] = field(default_factory=dict)       # group -> registry name
    choice_keys: dict[str, str] = field(default_factory=dict)   # group -> the DeepSpeed key that chose it
    settings: dict[str, Setting] = field(default_factory=dict)  # our dotted key -> setting
    batch: dict[str, Any] = field(default_factory=dict)         # the batch triple as the file states it
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)           # deprecated aliases
    unknown: list[str] = field(default_factory=list)            # keys resembling nothing DeepSpeed knows
    inert: list[str] = field(default_factory=list)              # accepted, change nothing here

    def notices(self, strict: bool, inert: tuple[str, ...] | list[str] = (), notes=()) -> list[str]:
        """The one-line warnings to print at start-up (unknown keys are errors when strict)."""
        out = [f"warning: ds_config: {w}" for w in self.warnings]
        if self.unknown and not strict:
            out.append("warning: ds_config: keys DeepSpeed does not know, ignored (ds_config_strict=true makes "
                       "this an error): " + ", ".join(self.unknown))
        if self.inert or inert:
            out.append("note: ds_config: accepted, change nothing here: " + "; ".join([*self.inert, *inert]))
        out += [f"note: ds_config: {n}" for n in notes]
        return out

    def error(self, msg: str) -> None:
        self.errors.append(msg)

    def section(self, node: Any, path: str, known, aliases: Mapping[str, str] | None = None) -> dict:
        """The section's keys after alias and typo checks (unknown keys dropped)."""
        if not isinstance(node, dict):
            self.error(f"{path} must be a JSON object, got {json.dumps(node)}")
            return {}
        out, aliases, pre = {}, aliases or {}, f"{path}." if path else ""
        for key, value in node.items():
            if key in known:
                out[key] = value
            elif key in aliases:
                self.warnings.append(f"'{pre}{key}' is deprecated; use '{aliases[key]}'")
                out[key] = value
            elif (near := close(key, [*known, *aliases])) is not None:
                self.error(f"unknown key '{pre}{key}' (did you mean '{pre}{near}'?)")
            else:
                self.unknown.append(pre + key)
        return out

    def set(self, key: str, value: Any, ds_key: str, source: str = DS_FILE, rule: str = "") -> None:
        self.settings[key] = Setting(value, ds_key, source, rule)

    def choose(self, group: str, name: str, ds_key: str) -> None:
        self.choices[group] = name
        self.choice_keys[group] = ds_key

    def inert_key(self, ds_key: str, why: str) -> None:
        self.inert.append(f"{ds_key} ({why})")

    def typed(self, value: Any, kind: str, ds_key: str, auto_ok: bool = False) -> Any:
        """Check and convert a JSON value: 'int' (integral floats such as 1e9 accepted), 'float',
        'bool', 'str'. None when the value is bad (the error is recorded)."""
        if value == AUTO:
            if auto_ok:
                return AUTO
            self.error(f"{ds_key} is \"auto\" but no rule fills it here; give a value")
            return None
        ok = None
        if isinstance(value, float) and not math.isfinite(value) and kind in ("int", "float"):
            # Python's json reads NaN and Infinity (and 1e309 as inf): a NaN limit disables the
            # comparison it feeds (gradient_clipping: NaN would never clip).
            self.error(f"{ds_key} must be a finite number, got {json.dumps(value)}")
            return None
        if kind == "int" and not isinstance(value, bool):
            if isinstance(value, int):
                ok = value
            elif isinstance(value, float) and value.is_integer():
                ok = int(value)
            if ok is not None and not -2 ** 63 <= ok < 2 ** 63:
                self.error(f"{ds_key}={json.dumps(value)} is out of range (integers must lie within +-2^63)")
                return None
        elif kind == "float" and isinstance(value, (int, float)) and not isinstance(value, bool):
            ok = float(value)
        elif kind in ("bool", "str") and isinstance(value, bool if kind == "bool" else str):
            ok = value
        if ok is None:
            want = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string"}[kind]
            self.error(f"{ds_key} must be {want}, got {json.dumps(value)}")
        return ok

    def run(self, ds: dict) -> Translation:
        top = self.section(ds, "", [*MAPPED_TOP, *INERT_TOP, *FEATURES], ALIASES_TOP)
        if "bfloat16" in top:
            if "bf16" in top:
                self.error("both 'bf16' and its deprecated alias 'bfloat16' are given; keep 'bf16'")
            top["bf16"] = top.pop("bfloat16")
        for key, why in INERT_TOP.items():
            if key in top:
                self.inert_key(key, why)
        for key, what in FEATURES.items():
            if key in top and not switched_off(top[key], key):
                self.error(f"'{key}': {what} is not implemented here; remove it")
            elif key in top:
                self.inert_key(key, "switched off")
        if "zero_optimization" in top:
            zero(self, top["zero_optimization"], top.get("aio"))
        elif "aio" in top:
            aio_keys(self, top["aio"], applies=False)
        precision(self, top)
        optimizer(self, top.get("optimizer"))
        scheduler(self, top.get("scheduler"))
        for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
            if key in top:
                value = self.typed(top[key], "int", key, auto_ok=True)
                if value is not None and value != AUTO and value < 1:
                    self.error(f"{key} must be >= 1, got {value}")
                elif value is not None:
                    self.batch[key] = value
        if "gradient_clipping" in top:
            value = self.typed(top["gradient_clipping"], "float", "gradient_clipping", auto_ok=True)
            if value is not None:
                self.set("train.grad_clip", value, "gradient_clipping", rule="train.grad_clip")
        else:  # DeepSpeed clips only when asked
            self.set("train.grad_clip", 0.0, "gradient_clipping", DS_DEFAULT)
        activation_checkpointing(self, top.get("activation_checkpointing"))
        return self


def translate(ds: dict) -> Translation:
    return Translation().run(ds)
