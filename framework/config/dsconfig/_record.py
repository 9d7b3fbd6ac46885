"""What the walk over a DeepSpeed config collects (``Translation``), with the typing and notes each
section's walk shares."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from framework.precision import scale_power
from framework.config.dsconfig._keys import AUTO, DS_FILE, NOWHERE, close, misplaced, section_meant

KINDS = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string"}


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

    def notices(self, strict: bool, inert: list[str], notes: list[str]) -> list[str]:
        """The one-line warnings to print at start-up (unknown keys are errors when strict)."""
        out = [f"warning: ds_config: {w}" for w in self.warnings]
        if self.unknown and not strict:
            out.append("warning: ds_config: keys DeepSpeed does not know, ignored (ds_config_strict=true makes "
                       "this an error): " + ", ".join(self.unknown))
        if self.inert or inert:
            out.append("note: ds_config: accepted, change nothing here: " + "; ".join([*self.inert, *inert]))
        return out + [f"note: ds_config: {n}" for n in notes]

    def error(self, msg: str) -> None:
        self.errors.append(msg)

    def section(self, node: Any, path: str, known, aliases: Mapping[str, str] | None = None,
                strict: bool = False) -> dict:
        """The section's keys after alias, typo and placement checks (unknown keys dropped; a key of another
        section is an error: DeepSpeed would ignore it here and the run would go without it; keys starting with
        "_" are comments); ``strict``: an unknown key there is an error (DeepSpeed refuses it too: pydantic
        extra="forbid", optimizer/scheduler kwargs; or, directly under optimizer/scheduler, ignores it)."""
        if not isinstance(node, dict):
            self.error(f"{path} must be a JSON object, got {json.dumps(node)}")
            return {}
        out, aliases, pre, refused = {}, aliases or {}, f"{path}." if path else "", []
        for key, value in node.items():
            if key.startswith("_"):   # a comment ("_comment"), in any section
                self.inert_key(pre + key, "a comment")
                continue
            if key in aliases:
                self.warnings.append(f"'{pre}{key}' is deprecated; use '{aliases[key]}'")
            if key in known or key in aliases:
                out[key] = value
            elif key in NOWHERE:
                self.error(f"'{pre}{key}': {NOWHERE[key]}")
            elif (where := misplaced(key, path)) is not None:
                self.error(f"'{pre}{key}' belongs {where}; move it there")
            elif (near := close(key, [*known, *aliases])) is not None:
                self.error(f"unknown key '{pre}{key}' (did you mean '{pre}{near}'?){_as_power(near, value)}")
            elif not path and (meant := section_meant(key, value)) is not None:
                self.error(f"unknown key '{key}' (did you mean '{meant}'?): DeepSpeed ignores an unknown top-level "
                           f"key, so the run would go without it")
            elif strict:
                refused.append(key)
            else:
                self.unknown.append(pre + key)
        if refused:
            many, it = len(refused) > 1, "them" if len(refused) > 1 else "it"
            # optimizer and scheduler: DeepSpeed reads only type and params and ignores the rest; refused
            # here all the same, as a key that is accepted must do something
            why = (f"DeepSpeed ignores {it} here" if path in ("optimizer", "scheduler")
                   else f"DeepSpeed rejects unknown keys in {path}")
            self.error(f"{path}: unknown key{'s' if many else ''} {', '.join(refused)} ({why}); remove {it}")
        return out

    def set(self, key: str, value: Any, ds_key: str, source: str = DS_FILE, rule: str = "") -> None:
        self.settings[key] = Setting(value, ds_key, source, rule)

    def choose(self, group: str, name: str, ds_key: str) -> None:
        self.choices[group] = name
        self.choice_keys[group] = ds_key

    def inert_key(self, ds_key: str, why: str) -> None:
        self.inert.append(f"{ds_key} ({why})")

    def inert_keys(self, node: Mapping, whys: Mapping[str, str], path: str = "") -> None:
        """A note for each key of ``whys`` that ``node`` has."""
        for key in (k for k in whys if k in node):
            self.inert_key(path + key, whys[key])

    def put(self, node: Mapping, key: str, kind: str, ours: str, path: str, use: bool = True, why: str = "") -> None:
        """``node[key]``, when given and good: our key ``ours`` where ``use``, else a note (``why``)."""
        v = self.typed(node[key], kind, path + key) if key in node else None
        if v is not None and use:
            self.set(ours, v, path + key)
        elif v is not None:
            self.inert_key(path + key, why)

    def inert_or_error(self, inert: bool, ds_key: str, error: str, why: str = "switched off") -> None:
        """A key whose one value changes nothing here (a note) and whose others are refused."""
        if inert:
            self.inert_key(ds_key, why)
        else:
            self.error(error)

    def typed(self, value: Any, kind: str, ds_key: str, auto_ok: bool = False) -> Any:
        """A JSON value as ``kind`` (an integral float such as 1e9 is an int); None when bad (an error)."""
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if value == AUTO and auto_ok:
            return AUTO
        if value == AUTO:
            self.error(f"{ds_key} is \"auto\" but no rule fills it here; give a value")
        elif isinstance(value, float) and not math.isfinite(value) and kind in ("int", "float"):
            # json reads NaN, Infinity and 1e309 (inf): a NaN limit disables its comparison (never clips)
            self.error(f"{ds_key} must be a finite number, got {json.dumps(value)}")
        elif number and (kind == "int" or kind == "float" and isinstance(value, int)) and abs(value) >= 2 ** 63:
            shown = f"={json.dumps(value)}" if abs(value) < 2 ** 80 else " (25 digits or more)"   # (not 400 of them)
            self.error(f"{ds_key}{shown} is out of range (integers must lie within +-2^63)")
        elif kind == "int" and number and (isinstance(value, int) or value.is_integer()):
            return int(value)
        elif {"float": number, "bool": isinstance(value, bool), "str": isinstance(value, str)}.get(kind):
            return float(value) if kind == "float" else value
        else:
            self.error(f"{ds_key} must be {KINDS[kind]}, got {json.dumps(value)}")
        return None


def _as_power(near: str, value: Any) -> str:
    """A loss scale given under a key that takes its power of 2 (Megatron's initial_loss_scale): the power."""
    power = scale_power(value) if near == "initial_scale_power" else None
    return "" if power is None else f": it takes the power of 2, {power} for a scale of {value:g}"
