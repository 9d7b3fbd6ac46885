"""Composing and typing configs without Hydra or OmegaConf (a GPU image with only torch's stack;
the command line itself needs Hydra): the same conf/ files and override spellings that library
code uses (``group=name``, ``+stage=name``, ``key.path=value``, ``++key=value``, ``~key``), then the
same ``validate``. Interpolations, ``--config-dir`` and sweeps are errors saying they need Hydra; a value
Hydra's grammar takes only quoted (``~/ckpt``, ``a;b``) is refused as there, so a command works on both or neither.
"""
from __future__ import annotations

import dataclasses
import keyword
import re
import types
import typing
from pathlib import Path
from typing import Any, Iterator, Mapping

from framework.core import files, utils
from framework.core.errors import ConfigError
from framework.core.registry import GROUPS, closest, closest_hint, registry
from framework.config.schema import DEFAULT_STAGE


@dataclasses.dataclass(frozen=True)
class Override:
    prefix: str        # "" | "+" | "++" | "~"
    key: str
    value: Any = None


def override_key(override: str) -> str:
    """An override's key as every reader compares it: without its ``+``/``++``/``~`` prefix or its value. A
    leading ``/`` stays: Hydra's grammar refuses it (``+/stage=zero3``), so every tool calls that key unknown."""
    return override.partition("=")[0].lstrip("+~")


def choice_override(group: str, name: str) -> str:
    """The override choosing ``name`` for ``group`` (a DeepSpeed file's, another option's): ``+stage=`` as no
    defaults list of ours chooses a stage."""
    return f"{'+' if group == 'stage' else ''}{group}={name}"


def parse(line: str) -> Override:
    """One override in Hydra's spelling (the subset above)."""
    prefix = next((p for p in ("~", "++", "+") if line.startswith(p)), "")
    key, eq, text = line[len(prefix):].partition("=")
    if not key or (not eq and prefix != "~"):
        raise ConfigError(f"config: cannot parse override {line!r}; expected key=value")
    if key != "".join(key.split()):   # (as Hydra's grammar)
        raise ConfigError(f"config: cannot parse override {line!r}: a key holds no spaces; remove them")
    # an unquoted '{'; a comma outside quotes and brackets (a sweep)
    marks = {c for c, plain, depth in _walk(text) if plain and (c == "{" or c == "," and depth == 0)}
    hydra_only = any(c in text for c in ("${", "choice(", "range(", "glob("))
    if "," in marks and not hydra_only:   # no sweep either, as Hydra's grammar reads it: a parse error there
        if any(not item.strip() for item in _split(text)):
            raise ConfigError(f"config: cannot parse override {line!r}: it has an empty item; drop the extra comma")
        if any(c == "(" and plain for c, plain, _ in _walk(text)):
            raise ConfigError(f"config: cannot parse override {line!r}: parentheses hold only a sweep's choice(), "
                              f"range() or glob(); a list is written [a,b]")
    if hydra_only or "," in marks:
        raise ConfigError(f"config: override {line!r} uses Hydra syntax that needs Hydra (interpolation or "
                          f"sweep); install hydra-core or give a plain value")
    if "{" in marks:
        raise ConfigError(f"config: override {line!r} gives a mapping ({{...}}), which needs Hydra; install "
                          f"hydra-core or set its keys one by one ({key}.NAME=VALUE)")
    return Override(prefix, key, value(text) if eq else None)


def _walk(text: str) -> Iterator[tuple[str, bool, int]]:
    """Each character of ``text``, whether it is plain (outside quotes, not a quote or an escape or escaped)
    and the bracket depth there."""
    depth, quote, escaped = 0, None, False
    for c in text:
        plain = not (escaped or quote) and c not in "\\'\""
        if escaped:
            escaped = False
        elif quote:
            quote = None if c == quote else quote
        elif c == "\\":
            escaped = True
        elif c in "'\"":
            quote = c
        elif c == "[":
            depth += 1
        elif c == "]":
            depth -= 1
        yield c, plain, depth


def value(text: str) -> Any:
    """A value as Hydra reads it: null, booleans, numbers (1e9 is a float), quoted or plain
    strings, and [a, b] lists of those."""
    tokens = _TOKEN.findall(text)   # (an escaped space at either end stays: a\  is 'a ')
    kept = [i for i, t in enumerate(tokens) if t not in (" ", "\t")]
    tokens = tokens[kept[0]:kept[-1] + 1] if kept else []
    text = "".join(tokens)
    if text[:1] in ("'", '"') and (end := _closing(text)) is None:   # 'a\': its last quote is escaped
        escaped = f" (\\{text[0]} is a quote inside the value)" if "\\" + text[0] in text else ""
        raise ConfigError(f"config: the value {text} has no closing {text[0]}{escaped}; end it with an unescaped "
                          f"{text[0]}")
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        if end != len(text) - 1:   # 'a'/'b': Hydra's grammar refuses it (the inner quotes would stay here)
            raise ConfigError(f"config: the value {text} is quoted in parts; quote it once as a whole (a quote "
                              f"inside it escaped: \\{text[0]})")
        # As Hydra's grammar: only backslashes before a quote (or the closing one) escape; C:\\data keeps both
        q = text[0]
        return re.sub(rf"(\\+)({q}|$)", lambda m: "\\" * (len(m.group(1)) // 2) + m.group(2), text[1:-1])
    if text.startswith("[") and text.endswith("]"):
        inner = text[1:-1].strip()
        items = _split(inner) if inner else []
        if any(not x.strip() for x in items):   # [a,] or [a,,b]: Hydra's grammar has no empty item
            raise ConfigError(f"config: the list {text} has an empty item; drop the extra comma")
        return [value(x) for x in items]
    if not text.isascii():   # as Hydra's grammar: 12 in other scripts' digits is no number, nor a plain string
        raise ConfigError(f"config: the value {text!r} has characters other than ASCII; quote it ('{text}')")
    if bad := next((t for t in tokens if len(t) == 1 and not (t.isalnum() or t in _UNQUOTED)), None):
        quote = '"' if "'" in text else "'"
        quoted = text.replace(quote, "\\" + quote)   # (the suggestion is then one quoted value, not one in parts)
        raise ConfigError(f"config: the value {text!r} has a character ({bad!r}) that an override value holds only "
                          f"quoted; quote it ({quote}{quoted}{quote})")
    text = "".join(t[-1] for t in tokens)   # Hydra's escapes in an unquoted value: a\ b is 'a b'
    constants = {"null": None, "true": True, "false": False}
    if text.lower() in constants:
        return constants[text.lower()]
    if _INT.fullmatch(text):
        return int(text)
    if _FLOAT.fullmatch(text):
        return float(text)
    return text


def _closing(text: str) -> int | None:
    """Where ``text``'s opening quote closes (the last character when quoted once; earlier, as in 'a'/'b', when
    quoted in parts); None: it never does. A backslash escapes the character after it."""
    m = re.match(rf"(?:\\.|[^\\{text[0]}])*{text[0]}", text[1:], re.S)
    return m.end() if m else None


# Hydra's numbers (its override grammar): ASCII digits, '_' only between digits, no leading zero on an
# integer part but 0 itself, inf and nan in any case; anything else (007, 1_, Infinity) is a string.
_UINT = r"(?:0|[1-9](?:_?[0-9])*)"
_DIGITS = r"[0-9](?:_?[0-9])*"
_POINT = rf"(?:{_UINT}\.|(?:{_UINT})?\.{_DIGITS})"
_INT = re.compile(rf"[+-]?{_UINT}")
_FLOAT = re.compile(rf"[+-]?(?:(?:{_UINT}|{_POINT})[eE][+-]?{_DIGITS}|{_POINT}|[Ii][Nn][Ff]|[Nn][Aa][Nn])")
# Hydra's unquoted values: letters, digits, these characters and its escapes (\ before one of \()[]{}:=, and
# space or tab); anything else (~ # ; & ' ( = ...) is a parse error there unless the value is quoted.
_UNQUOTED = "_-/\\+.$%*@?|: \t"
_TOKEN = re.compile(r"\\[\\()\[\]{}:=, \t]|.", re.S)


def _split(inner: str) -> list[str]:
    """Top-level comma split of a list body (quotes, nested brackets and escapes kept together)."""
    cuts = [i for i, (c, plain, depth) in enumerate(_walk(inner)) if plain and c == "," and depth == 0]
    return [inner[a + 1:b] for a, b in zip([-1, *cuts], [*cuts, len(inner)])]


def load_yaml(path: Path, tool: str = "config") -> dict:   # (tool: the command whose line it raises)
    text = path.read_text(encoding="utf-8")
    try:
        node = files.parse_yaml(text)
    except ValueError as e:   # (an alias bomb: yaml.YAMLError, not a ValueError, is the callers' to word)
        raise ConfigError(f"{tool}: {path}: {e}") from None
    return dict(node or {})


def check_aliases(primary: str, overrides: list[str]) -> None:
    """Refuse an alias bomb (``load_yaml``'s line) in the YAML of the folders Hydra will search but conf/ (the
    package's own): each ``*.yaml`` of the primary folder, of the ``file://`` entries of ``hydra.searchpath=[...]``
    overrides, and of every folder below them but tools' and links (``files.config_files``: group folders, the user's
    own too, ``+experiment=x``; a linked one is not checked), read first (Hydra's would expand it for ever)."""
    from framework.core.paths import conf_dir

    given = [x for o in overrides if override_key(o) == "hydra.searchpath" for x in listed(o.partition("=")[2])]
    folders = {Path(f.removeprefix("file://")).resolve() for f in (primary, *given) if "://" not in f or
               f.startswith("file://")} - {conf_dir().resolve()}
    for path in (p for f in sorted(folders) for p in files.config_files(f)):   # (no anchor: one regex search)
        try:
            files.refuse_alias_bomb(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeError):   # (unreadable: Hydra's read says what is wrong, as for bad YAML below)
            continue
        except ValueError as e:
            raise ConfigError(f"config: {path}: {e}") from None
        except Exception:  # noqa: BLE001 - yaml.YAMLError, RecursionError: Hydra's read words them
            continue


def listed(text: str) -> list[str]:
    """The strings of the list override value ``text`` as Hydra reads them (unquoted); none for another value."""
    try:
        items = value(text)
    except ConfigError:   # (Hydra's read words it)
        return []
    return [x for x in items if isinstance(x, str)] if isinstance(items, list) else []


def no_yaml(group: str, name: str) -> str:
    """The line for a registered component that no ``<group>/<name>.yaml`` on the search path configures."""
    config = registry(group).get(name).config
    fields = ", ".join(yaml_name(f.name) for f in dataclasses.fields(config))
    return (f"{group} {name!r} ({config.__module__}) has no YAML file; add conf/{group}/{name}.yaml (or {group}/"
            f"{name}.yaml in a --config-dir or hydra.searchpath folder) with its fields ({fields or 'none'})")


def plain_composer(overrides: list[str], *, config_dir: str | None = None,
                   config_name: str = "train") -> tuple[dict, dict[str, str]]:
    """(config tree, group choices) for conf/train.yaml and ``overrides``, as Hydra would compose them."""
    from framework.core.paths import conf_dir

    if config_dir is not None or config_name != "train":
        raise ConfigError("config: --config-dir / --config-name need Hydra: pip install -e . (or pip install "
                          "'hydra-core>=1.3.2,<1.4')")
    conf = conf_dir()
    primary = load_yaml(conf / "train.yaml")
    defaults = primary.pop("defaults", [])
    primary.pop("hydra", None)
    # (override hydra/...: Hydra's own settings, its log file)
    choices = {str(group): str(name) for entry in defaults if isinstance(entry, Mapping)
               for group, name in entry.items() if not str(group).startswith("override hydra/")}
    parsed = [parse(o) for o in overrides]
    for line, o in zip(overrides, parsed):
        # Hydra's own keys (the command line's run folder, logs, sweeps) compose to nothing a Config holds, with
        # Hydra or without: taken as Hydra takes them, a typo named. Its search path alone changes what is composed.
        if o.key == "hydra.searchpath":
            raise ConfigError(f"config: {line}: a search path for config groups needs Hydra: pip install -e . (or "
                              "pip install 'hydra-core>=1.3.2,<1.4')")
        if o.key == "hydra":   # (as Hydra words it)
            raise ConfigError("config: Could not override 'hydra'. No match in the defaults list")
        if o.key.startswith("hydra."):
            check_hydra_key(o.key)
    parsed = [o for o in parsed if not o.key.startswith("hydra.")]
    for o in [o for o in parsed if o.key in GROUPS]:
        if o.prefix == "~":   # the group's choice dropped, as Hydra drops it from the defaults list
            line = o.key if o.value is None else f"{o.key}={o.value}"
            if o.key not in choices or (o.value is not None and choices[o.key] != str(o.value)):
                raise ConfigError(f"config: Could not delete '{line}'. No match in the defaults list")
            del choices[o.key]
            continue
        if o.prefix == "++":
            raise ConfigError(f"config: force-add of config groups is not supported: '++{o.key}={o.value}'")
        if o.key in choices and o.prefix == "+":
            raise ConfigError("config: " + given_twice(f"Multiple values for {o.key}.", overrides, conf / "train.yaml"))
        if o.key not in choices and o.prefix == "":
            raise ConfigError("config: " + given_twice(f"Could not override '{o.key}'. No match in the defaults list",
                                                       overrides, conf / "train.yaml"))
        choices[o.key] = str(o.value)
    tree: dict = {}
    for group, name in choices.items():
        path = conf / group / f"{name}.yaml"
        if not path.is_file():
            registry(group).get(name)   # raises, naming the closest option
            raise ConfigError(f"config: {no_yaml(group, name)}")
        tree[group] = load_yaml(path)
    _merge(tree, primary)
    for o in parsed:
        if o.key not in GROUPS:
            set_key(tree, o)
    return tree, {g: n for g, n in choices.items() if g in GROUPS}


# Hydra 1.3's own config (hydra.conf.HydraConf), its structured nodes spelled out: without Hydra there is no
# schema to read (tests/config/test_plainconf.py checks this against Hydra's). Below a key with no keys under it
# here (launcher, sweeper, job_logging, job.env_set, ...) any key is Hydra's to check.
HYDRA_KEYS = frozenset((
    "callbacks defaults help help.app_name help.footer help.header help.template hydra_help hydra_help.hydra_help "
    "hydra_help.template hydra_logging job job.chdir job.config job.config.override_dirname "
    "job.config.override_dirname.exclude_keys job.config.override_dirname.item_sep job.config.override_dirname.kv_sep "
    "job.config_name job.env_copy job.env_set job.id job.name job.num job.override_dirname job_logging launcher mode "
    "output_subdir overrides overrides.hydra overrides.task run run.dir runtime runtime.choices runtime.config_sources "
    "runtime.cwd runtime.output_dir runtime.version runtime.version_base searchpath sweep sweep.dir sweep.subdir "
    "sweeper verbose").split())


def check_hydra_key(key: str) -> None:
    """One line naming the closest key for a ``hydra.*`` key Hydra's own config lacks: Hydra's advice for a
    typo (``+hydra.run.dri=X``) adds a key nothing reads, and the run goes into the default folder."""
    parts = key.split(".")[1:]
    for n in range(1, len(parts) + 1):
        path = ".".join(parts[:n])
        if path not in HYDRA_KEYS:
            match = closest(key.removeprefix("hydra."), sorted(HYDRA_KEYS))   # (all share "hydra.")
            hint = f" (did you mean 'hydra.{match}'?)" if match else ""
            raise ConfigError(f"config: unknown key '{key}' of Hydra's config{hint}; --cfg hydra shows its keys")
        if not any(k.startswith(path + ".") for k in HYDRA_KEYS):
            return


def given_twice(message: str, overrides: list[str], primary: Path) -> str:
    """Hydra's advice for a group added twice (``override stage: zero2``) is defaults-list syntax, which no command
    line takes. Added once, the group is in the primary config's defaults already: the fix is to override that choice
    (no ``+``); added twice, to give it once (Hydra words it, with the chosen name, as the group appearing more than
    once). A group with no choice in the defaults (``stage``) is added with ``+``, and an override with no key
    (``=5``) is named as given, not as the ``++`` form the framework passes. Empty: another message."""
    if m := re.match(r"Could not override '([\w/]+)'\. No match in the defaults list", message):
        given = next((o for o in overrides if override_key(o) == m[1]), m[1] + "=NAME")
        absent = f" ({DEFAULT_STAGE} when none is given)" if m[1] == "stage" else ""
        return f"{m[1]} has no choice in the defaults{absent}: use +{given.lstrip('~')}"
    if message.startswith("force-add of config groups is not supported: '++="):
        given = next((o for o in overrides if override_key(o) == ""), message.rpartition(": ")[2].strip("'+"))
        return f"override {given.lstrip('+')!r} has no key: write key=value"
    if (m := re.match(r"Multiple values for ([\w/]+)\.|([\w/]+) appears more than once in the final defaults list",
                      message)) is None:
        return ""
    group = m.group(1) or m.group(2)
    given = [o for o in overrides if override_key(o) == group]
    default = default_choice(primary, group)
    chosen = f"already chosen in the defaults{f' ({group}: {default})' if default is not None else ''}"
    if len(given) == 1:
        return f"{group} is {chosen}: use {given[0].lstrip('+')}, without +"
    listed = ", ".join(given)
    twice = f"{group} given twice{f' ({listed})' if given else ''}"
    if default is not None:
        return f"{twice} and {chosen}: give {group}=NAME once, without +"
    return f"{twice}: give +{group}=NAME once"


def default_choice(primary: Path, group: str) -> str | None:
    """``group``'s choice in the defaults list of the config file ``primary`` (None: not there, or unreadable)."""
    try:
        defaults = load_yaml(primary).get("defaults") or []
    except Exception:   # (only the wording of an error depends on it)
        return None
    return next((str(entry[group]) for entry in defaults if isinstance(entry, Mapping) and group in entry), None)


def _merge(dst: dict, src: Mapping) -> None:
    for k, v in src.items():
        if isinstance(v, Mapping) and isinstance(dst.get(k), dict):
            _merge(dst[k], v)
        else:
            dst[k] = v


def check_delete(key: str, current: Any, value: Any) -> None:
    """Hydra's refusal of ``~key=value`` where ``key`` holds ``current``: it deletes only that value (None: any)."""
    if value is not None and current != value:
        raise ConfigError(f"config: Could not delete from config. The value of '{key}' is {current} and not {value}.")


def set_key(tree: dict, o: Override) -> None:
    """``o`` applied to ``tree`` as Hydra applies it to the composed config, with Hydra's refusals."""
    *path, last = o.key.split(".")
    node = tree
    for part in path:
        if not isinstance(node.get(part), dict):
            if o.prefix == "~":   # (refused below)
                node = {}
                break
            node[part] = {}
        node = node[part]
    if o.prefix == "~":
        if last not in node:
            raise ConfigError(f"config: Could not delete from config. '{o.key}' does not exist."
                              f"{closest_hint(o.key, list(_flat_keys(tree)))}")
        if node[last] is None:   # Hydra takes a null value for none
            raise ConfigError(f"config: Could not delete from config. '{o.key}' does not exist. (It is null, "
                              f"its default: drop ~{o.key})")
        check_delete(o.key, node[last], o.value)
        del node[last]
    elif o.prefix == "+" and last in node:
        raise ConfigError(f"config: Could not append to config. An item is already at '{o.key}'. Either remove + "
                          f"prefix: '{o.key}={o.value}' Or add a second + to add or override '{o.key}': "
                          f"'++{o.key}={o.value}'")
    else:
        node[last] = o.value


def _flat_keys(node: Mapping, prefix: str = ""):
    for k, v in node.items():
        yield f"{prefix}{k}"
        if isinstance(v, Mapping):
            yield from _flat_keys(v, f"{prefix}{k}.")


def yaml_name(field: str) -> str:
    """A schema field's key as YAML spells it: a field named after a Python keyword carries a trailing _
    (``async_``), which is no key of the config (YAML writes ``async``)."""
    return field[:-1] if field.endswith("_") and keyword.iskeyword(field[:-1]) else field


def typed(node: Mapping, schema: type, prefix: str) -> Any:
    """``schema`` (a dataclass) built from ``node`` as OmegaConf builds it; one-line errors."""
    hints = typing.get_type_hints(schema)
    kwargs = {}
    for f in dataclasses.fields(schema):
        key = f"{prefix}{yaml_name(f.name)}"
        if f.name in node:
            kwargs[f.name] = _convert(node[f.name], hints[f.name], key)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"config: {key}: Missing mandatory value: {key}")
    return schema(**kwargs)


def number(v: Any, hint: Any, key: str) -> Any:
    """A number given for a bool or int field (``X | None`` too) typed as here, before either composer's typing
    (OmegaConf takes any integer, or a string of one ('2'), for true, and refuses 5e8, a float in Hydra's grammar,
    for an integer)."""
    base = next((a for a in typing.get_args(hint) if a is not type(None)), hint)
    if base in (bool, int) and isinstance(v, (int, float)) and not isinstance(v, bool):
        return _convert(v, base, key)
    if base is bool and isinstance(v, str):
        try:
            n = int(v)
        except ValueError:
            return v
        return _convert(n if n in (0, 1) else v, base, key)
    return v


def _convert(v: Any, hint: Any, key: str) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return v
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        if len(inner) != 1 or len(args) != 2:   # a schema bug, not a user's: OmegaConf takes X | None only
            raise TypeError(f"schema of {key}: {hint} is not 'X | None', the only union a config field may have")
        return None if v is None else _convert(v, inner[0], key)
    if v is None:
        raise ConfigError(f"config: {wrong_type(key, None, kind_of(hint))}")
    if dataclasses.is_dataclass(hint) or origin is dict or hint is dict:
        if not isinstance(v, Mapping):
            raise ConfigError(f"config: {key} must be a mapping, got {v!r}")
        return typed(v, hint, f"{key}.") if dataclasses.is_dataclass(hint) else dict(v)
    if origin in (list, tuple) or hint in (list, tuple):
        if not isinstance(v, (list, tuple)):
            raise ConfigError(f"config: {wrong_type(key, v, 'list')}")
        inner = args[0] if args else Any
        return [_convert(x, inner, f"{key}[{i}]") for i, x in enumerate(v)]
    if hint is bool:
        if isinstance(v, int) and v in (0, 1):   # bool too
            return bool(v)
        if isinstance(v, str) and v.lower() in ("true", "false", "yes", "no", "y", "n", "on", "off"):   # OmegaConf's
            return v.lower() in ("true", "yes", "y", "on")
    elif hint in (int, float):
        # an int where a float is expected widens; a float where an int is expected only when integral (5e8)
        if isinstance(v, int) and not isinstance(v, bool) or hint is float and isinstance(v, float):
            return hint(v)
        if isinstance(v, float) and v.is_integer():
            return int(v)
        if isinstance(v, str):
            try:
                return hint(v)
            except ValueError:
                pass
    elif hint is str:
        if isinstance(v, (str, int, float)):   # bool too, as OmegaConf does
            return str(v)
    else:
        return v
    name = getattr(hint, "__name__", str(hint))
    raise ConfigError(f"config: {wrong_type(key, v, name)}")


# What a key of each type takes, as the one line of a value of another type says it (OmegaConf's words name its
# own classes: "could not be converted to Int", "AnyNode is not a ListConfig").
TAKES = {"int": "an integer (5e8 reads as 500000000)", "float": "a number (such as 3e-4)",
         "bool": "true or false (also yes/no, on/off, 1/0)", "str": "a string", "list": "a list"}


def library_line(key: str, message: str, v: Any, hint: Any = None) -> str:
    """``key: message`` of OmegaConf's first line about ``key``, a value ``v`` of another type (of the field's
    type ``hint``, where known) said as here."""
    m = re.search(r"could not be converted to (Int|Float|Bool)|(is not a ListConfig)|for field of type '(\w+)'|"
                  r"Cannot convert '\w+Config' to (str)ing|(is not Optional)", message)
    kind = m and ((m[1] or "").lower() or ("list" if m[2] else m[3] or m[4]) or (hint is not None and kind_of(hint)))
    return wrong_type(key, v, kind) if kind else f"{key}: {message}"


def kind_of(hint: Any) -> str:
    """The name TAKES knows the type ``hint`` by (list: any list or tuple)."""
    if typing.get_origin(hint) in (list, tuple) or hint in (list, tuple):
        return "list"
    return getattr(hint, "__name__", str(hint))


def wrong_type(key: str, v: Any, kind: str) -> str:
    """The line for ``v`` given to ``key`` of type ``kind`` (int, float, bool, str or list; another: its name)."""
    got = f"'{v}'" if isinstance(v, str) else utils.yaml_spelling(v)
    fix = "" if kind != "list" or isinstance(v, Mapping) else f"; give {key}=[] for none" if v is None else \
        f"; give {key}=[{v}]"
    return f"{key} takes {TAKES.get(kind, kind)}, got {got}{fix}"


def no_launcher(message: str) -> str:
    """Hydra's list of the launchers it has and its search path, where the missing one is an extra's."""
    if (m := re.search(r"Could not find 'hydra/launcher/(submitit_\w+)'", message)) is None:
        return ""
    return (f"hydra/launcher={m.group(1)} needs Hydra's submitit launcher, which is not installed: "
            f"pip install -e '.[slurm]'")


def merge_line(message: str, cause: BaseException | None) -> str:
    """Hydra's "Error merging override" of a mapping for a list key (or a list for a mapping): what the key takes,
    the override as given (not the ``++`` form the framework passes a value key as)."""
    m = re.match(r"Error merging override (?:\+\+)?([^=]*)=(.*)", message)
    into = re.search(r"Cannot merge \w+ with \w+(?:.|\n)*object_type=(list|dict)", str(cause or ""))
    if m is None or into is None:
        return ""
    takes = "a list" if into[1] == "list" else f"a mapping (or its keys one by one: {m[1]}.NAME=VALUE)"
    return f"{m[1]} takes {takes}, got {m[2]}"
