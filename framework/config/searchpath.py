"""The config search path: the folders Hydra searches (``--config-dir``, conf/, ``hydra.searchpath``) in one
order for the composed config and the training command's Hydra app, and the files one folder hides in another."""
from __future__ import annotations

import contextlib
import re
import shlex
from pathlib import Path
from typing import Any, Mapping

from framework.config import plainconf
from framework.core.errors import ConfigError
from framework.core.paths import conf_dir, user_path


CONFIG_DIR = ("--config-dir", "-cd")   # (its value: the next word, or after "=")


def search_order(config_dir: str | None, config_name: str, overrides: list[str]) -> tuple[str, list[str], list[str]]:
    """(the folder Hydra is initialised with, ``overrides`` less any ``hydra.searchpath``, the one override giving
    the rest of the search path), alike for the composed config and the training command's Hydra app. A
    ``--config-dir`` folder holding ``<config_name>.yaml`` comes first, then conf/ (Hydra finds the primary config
    only in the folder it is initialised with); another comes after conf/; then the primary config's own
    ``hydra.searchpath`` folders and the overrides' (Hydra takes one value, which replaces the file's: all are merged
    into it). ``overrides`` may be a whole command line (its --config-dir value becomes the folder found: Hydra's
    own read would keep a leading ~)."""
    given = primary = conf_dir()
    if config_dir is not None:
        given = Path(user_path(config_dir)).resolve()
        if not given.is_dir():
            raise ConfigError(f"config: --config-dir {config_dir} is not a folder")
        primary = given if (given / f"{config_name}.yaml").is_file() else conf_dir()
    mine = own_searchpath(primary / f"{config_name}.yaml")
    if config_dir is None and not mine:
        return str(primary), list(overrides), []
    other = [] if config_dir is None else [conf_dir() if primary == given else given]
    paths, rest = [*(quoted(f"file://{f}") for f in other), *map(quoted, mine)], []
    for o in overrides:
        key, (_, eq, value) = plainconf.override_key(o), o.partition("=")
        if key == "hydra.searchpath" and o[0] != "~" and value.startswith("[") and value.endswith("]"):
            paths += [x.strip() for x in plainconf._split(value[1:-1]) if x.strip()]   # (quotes kept whole)
        elif (key in CONFIG_DIR and eq) or (rest and rest[-1] in CONFIG_DIR):   # (Hydra's own read keeps a ~)
            rest.append(f"{key}={given}" if eq else str(given))
        else:
            rest.append(o)
    return str(primary), rest, [f"hydra.searchpath=[{','.join(dict.fromkeys(paths))}]"]


def own_searchpath(path: Path) -> list[str]:
    """The ``hydra: searchpath:`` entries of the primary config ``path`` as Hydra reads them: interpolations
    (``file://${oc.env:DATA}/conf``) resolved, and refused in one line unless a list of strings."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        if "searchpath" not in path.read_text(errors="replace"):   # (none: conf/train.yaml is not parsed again
            return []                                                # on every compose)
        node = OmegaConf.create(plainconf.load_yaml(path))
    except Exception:  # noqa: BLE001 - no such file, not YAML, not a mapping: Hydra's read words it
        return []
    try:
        entries = OmegaConf.select(node, "hydra.searchpath")
        entries = OmegaConf.to_container(entries, resolve=True) if OmegaConf.is_config(entries) else entries
    except OmegaConfBaseException as e:
        raise ConfigError(f"config: {path}: hydra.searchpath: {str(e).splitlines()[0]}; fix the entry") from None
    if entries is not None and not (isinstance(entries, list) and all(isinstance(x, str) for x in entries)):
        raise ConfigError(f"config: {path}: hydra.searchpath must be a list of strings (as Hydra's), not "
                          f"{entries!r}; give searchpath: [file:///a/folder, pkg://a.package]")
    return entries or []


def quoted(entry: str) -> str:
    """``entry`` as one quoted value in Hydra's grammar (a comma would split it; a ' escaped, \\ doubled before one)."""
    return "'" + re.sub(r"(\\*)('|$)", lambda m: m[1] * 2 + "\\'" * bool(m[2]), entry) + "'"


def pasted(key: str, value: str) -> str:
    """``key=value`` as one argument to paste in a shell: plain where Hydra and the shell read it so, else the value
    quoted for Hydra (a comma, a space) and the whole quoted for the shell."""
    if re.fullmatch(r"[A-Za-z0-9_./+@%-]+", value):
        return f"{key}={value}"
    arg = f"{key}={quoted(value)}"
    return f'"{arg}"' if not re.search(r'["$`\\!]', value) else shlex.quote(arg)


def search_notes(cfg: Any, choices: Mapping[str, str]) -> tuple[str, ...]:
    """The composed files (the primary config, the root configs its defaults list names, each group's choice) that
    more than one folder of the search path holds: a --config-dir file used in place of conf/'s is a note; a file
    hidden by an earlier folder's is refused in one line (it would be silently ignored)."""
    if isinstance(cfg, dict):
        return ()   # (composed without Hydra: conf/ alone)
    from omegaconf import OmegaConf

    if OmegaConf.select(cfg, "hydra.runtime.config_sources") is None:
        return ()
    folders = list(dict.fromkeys(Path(s.path).resolve() for s in cfg.hydra.runtime.config_sources
                                 if s.schema == "file"))
    conf, notes, rels = conf_dir().resolve(), [], [f"{cfg.hydra.job.config_name}.yaml"]
    for rel in rels:   # (Hydra keeps no choice for a root config a defaults list names: `train`)
        with contextlib.suppress(Exception):   # (Hydra read it: only a note depends on it here)
            defaults = plainconf.load_yaml(next(f / rel for f in folders if (f / rel).is_file())).get("defaults")
            rels += [f"{d.lstrip('/')}.yaml" for d in defaults or [] if isinstance(d, str) and d != "_self_"
                     and f"{d.lstrip('/')}.yaml" not in rels]
    for rel in (*rels, *(f"{g}/{n}.yaml" for g, n in choices.items())):
        used, *hidden = [f for f in folders if (f / rel).is_file()] or [None]
        if mine := [f for f in hidden if f != conf]:
            raise ConfigError(
                f"config: {mine[0] / rel} is hidden by {used / rel}, which comes first on the search path (a "
                f"--config-dir folder comes before conf/ only where it holds the primary config, "
                f"{cfg.hydra.job.config_name}.yaml; hydra.searchpath's folders come last); give its folder as "
                "--config-dir with a config file of its own (defaults: [train, _self_]) named by --config-name, or "
                "set its values as overrides")
        if hidden:
            notes.append(f"note: config: {used / rel} is used in place of {conf / rel} (a --config-dir folder "
                         "holding the primary config comes before conf/)")
    return tuple(notes)


def group_file(cfg: Any, group: str, name: str) -> Path | None:
    """The YAML file the composed ``cfg`` read for ``group=name``: the first search-path folder holding it (conf/
    alone where composed without Hydra), or None."""
    folders = [conf_dir()]
    if not isinstance(cfg, dict):
        from omegaconf import OmegaConf

        sources = OmegaConf.select(cfg, "hydra.runtime.config_sources")
        folders = [Path(s.path) for s in sources or () if s.schema == "file"] or folders
    return next((f / group / f"{name}.yaml" for f in folders if (f / group / f"{name}.yaml").is_file()), None)
