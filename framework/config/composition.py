"""Composing a config (YAML < DeepSpeed config < overrides) and recording where each value came from."""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

from framework.comm.distributed import run_world
from framework.config import dsconfig, plainconf
from framework.config.checks import refuse_inert, root_value, validate
from framework.config.schema import Config, RootSchema, flat, get_key
from framework.config.searchpath import group_file, quoted, search_notes, search_order
from framework.core import files
from framework.core.errors import ConfigError
from framework.core.paths import conf_dir
from framework.core.registry import GROUPS, registry
from framework.core.utils import under
from framework.schedulers.warmup_lr import WarmupLRConfig, peak_notes

if TYPE_CHECKING:
    from omegaconf import DictConfig


Composer = Callable[[list[str]], tuple[Any, dict[str, str]]]


def have_hydra() -> bool:
    try:
        import hydra  # noqa: F401
    except ImportError:
        return False
    return True


def standalone_composer(overrides: list[str], *, config_dir: str | None = None,
                        config_name: str = "train") -> tuple[DictConfig, dict[str, str]]:
    """Compose conf/train.yaml outside a Hydra app; ``config_dir``/``config_name`` as ``--config-dir``/
    ``--config-name`` (a recipe's), searched in ``search_order``'s order, as the training command's Hydra app is."""
    if not have_hydra():
        return plainconf.plain_composer(overrides, config_dir=config_dir, config_name=config_name)
    primary, overrides, merged = search_order(config_dir, config_name, overrides)
    plainconf.check_aliases(primary, overrides + merged)
    return _hydra_compose(config_name, overrides + merged, primary)


def app_composer(overrides: list[str]) -> tuple[DictConfig, dict[str, str]]:
    """Compose inside a running Hydra app (its search path and --config-name set up)."""
    from hydra.core.hydra_config import HydraConfig

    hc = HydraConfig.get()   # (its search path's hydra.searchpath part is an override: given again, quoted)
    searched = [f"hydra.searchpath=[{','.join(map(quoted, hc.searchpath))}]"] if hc.searchpath else []
    return _hydra_compose(hc.job.config_name, [*overrides, *searched])


def parse_overrides(overrides: list[str]) -> list:
    """Hydra's parsed overrides; a syntax mistake is one line naming the override (Hydra's own
    message spans several)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    parser = OverridesParser.create()
    try:
        return parser.parse_overrides(list(overrides))
    except OverrideParseException as e:
        why = [line for line in str(e).splitlines() if line.strip() not in ("", "^")   # (a caret under the override)
               and not line.startswith(("Error parsing", "See "))]
        why = _unquoted(str(e), e.override, parser) or "; ".join(why)
        raise ConfigError(f"cannot parse override {e.override!r}: {why} "
                          "(overrides are key=value; the syntax: https://hydra.cc/docs/advanced/override_grammar/basic)"
                          ) from None


def _unquoted(error: str, override: str, parser: Any) -> str | None:
    """Where the lexer stopped at a character an unquoted value may not hold (a path's ~, é, ☃: Hydra's caret
    points at it), the fix: the value quoted."""
    lines = error.splitlines()
    head = "LexerNoViableAltException: "
    if len(lines) < 2 or not lines[0].startswith(head) or "^" not in lines[1]:
        return None
    at = lines[1].index("^") - len(head)
    key, eq, value = override.partition("=")
    if not eq or not len(key) < at < len(override):
        return None
    quote = "'" if "'" not in value else '"'
    form = f"{key}={quote}{value.replace(quote, chr(92) + quote)}{quote}"   # (Hydra's quoted strings take \' and \")
    say = f"an unquoted value may not hold {override[at]!r}; quote the value (inside the shell's quotes)"
    with contextlib.suppress(Exception):   # offered where it parses back to the value (a \ before a quote: not)
        if parser.parse_overrides([form])[0].value() == value:
            return f"{say}: {form}"
    return f"{say}, a quote inside it escaped with \\"


def _hydra_compose(name: str, overrides: list[str], config_dir: str | None = None) -> tuple[DictConfig, dict]:
    import yaml
    from hydra import compose as hydra_compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    for o in parse_overrides(overrides):   # a hydra.* key Hydra's own config lacks: one line naming the closest
        if o.key_or_group.startswith("hydra."):
            plainconf.check_hydra_key(o.key_or_group)
    try:
        with (initialize_config_dir(config_dir=config_dir, version_base="1.3") if config_dir
              else contextlib.nullcontext()):
            cfg = hydra_compose(name, overrides=overrides, return_hydra_config=True)
    except UnicodeDecodeError as e:   # (Hydra reads each file as UTF-8, and the error names no file)
        raise ConfigError(_not_utf8(e, Path(config_dir or conf_dir()), overrides)) from None
    except (HydraException, OmegaConfBaseException, ValueError) as e:
        # (Hydra raises a bare ValueError for a group choice that is not a name)
        primary = Path(config_dir or conf_dir()) / f"{name}.yaml"
        raise ConfigError("config: " + (plainconf.given_twice(str(e), overrides, primary)
                                        or plainconf.no_launcher(str(e)) or _ambiguous(str(e), overrides, primary)
                                        or _no_option(str(e))
                                        or plainconf.merge_line(str(e), e.__cause__)   # (not the ++ form given)
                                        or " ".join(str(e).replace("override ++", "override ").split()))) from None
    except yaml.YAMLError as e:   # (Hydra reads a searched folder's file unguarded: PyYAML's error, bare)
        raise ConfigError(_not_yaml(e, Path(config_dir or conf_dir()) / f"{name}.yaml")) from None
    except RecursionError:   # (the YAML parser and OmegaConf recurse once per nesting level)
        raise ConfigError(f"config: a value in the YAML of {config_dir or conf_dir()} ({name}.yaml or a file its "
                          f"defaults list names) is nested too deeply to compose; flatten it") from None
    return cfg, {k: v for k, v in cfg.hydra.runtime.choices.items() if k in GROUPS}


def _not_yaml(error: Any, primary: Path) -> str:
    """PyYAML's ``error`` as one line naming the file (``primary`` where its mark names none) and the line and
    column of each of its marks."""
    mark = getattr(error, "problem_mark", None) or getattr(error, "context_mark", None)
    path = mark.name if mark is not None and not mark.name.startswith("<") else primary
    why = re.sub(r'\s*in "[^"]*", line (\d+), column (\d+)', r" (line \1, column \2)", str(error))
    why = "; ".join(" ".join(line.split()) for line in why.splitlines() if line.strip())
    return f"config: {path} is not YAML: {why}; fix the file"


def _not_utf8(error: UnicodeDecodeError, primary: Path, overrides: list[str]) -> str:
    """The YAML file of the search path (``primary``'s folder, then the overrides' ``hydra.searchpath`` file://
    folders) that is not UTF-8, named with the line of its first such byte; one whose bytes Hydra read first."""
    folders = [primary, *(Path(x.removeprefix("file://")) for o in overrides
                          if plainconf.override_key(o) == "hydra.searchpath"
                          for x in plainconf.listed(o.partition("=")[2]) if x.startswith("file://"))]
    found = []
    # (the files check_aliases reads: none in a tool's folder, .git or a virtual environment, nor behind a link)
    for f in (f for folder in dict.fromkeys(folders) for f in files.config_files(folder)):
        with contextlib.suppress(OSError):
            data = f.read_bytes()
            try:
                data.decode("utf-8")
            except UnicodeDecodeError as e:
                found.append((f, data, data.count(b"\n", 0, e.start) + 1, data[e.start]))
    if not found:
        return (f"config: a YAML file of {', '.join(map(str, dict.fromkeys(folders)))} is not UTF-8 ({error}); "
                "save it as UTF-8 and run again")
    f, _, line, byte = next((x for x in found if error.object in x[1]), found[0])
    return f"config: {f} is not UTF-8 (byte {byte:#04x} on line {line}); save it as UTF-8 and run again"


def _no_option(message: str) -> str:
    """Hydra's search path after a group option no folder has (a defaults list's ``override optimizer: adamx``):
    the registry's line naming the closest, and where it was asked for."""
    if (m := re.search(r"Could not find '(\w+)/([^']*)'", message)) is None or m[1] not in GROUPS:
        return ""
    try:
        registry(m[1]).get(m[2])
    except ConfigError as e:
        return f"{str(e).removeprefix('config: ')} (chosen in a config file's defaults list)"
    return plainconf.no_yaml(m[1], m[2])   # (code, no YAML: not Hydra's search path, which omits the name)


def _code_missing(error: ConfigError, composer: Composer, overrides: list[str], group: str, name: str) -> ConfigError:
    """``error`` (an unknown name), or, where a folder of the search path holds its YAML, the line naming that
    file and where a component's code goes (composed only on this error's path, to read the search path)."""
    with contextlib.suppress(Exception):   # (no such YAML, or another error: the registry's line stands)
        cfg = composer(overrides)[0]
        folders = [conf_dir()] if isinstance(cfg, dict) else [
            Path(s.path) for s in cfg.hydra.runtime.config_sources if s.schema == "file"]
        found = next(f / group / f"{name}.yaml" for f in folders if (f / group / f"{name}.yaml").is_file())
        return ConfigError(f"config: {group} {name!r}: {found} has no code; a component is a module of "
                           f"{GROUPS[group].replace('.', '/')}/ or a `framework.{group}` entry point of an installed "
                           "package (docs/architecture.md#where-a-new-piece-goes)")
    return error


def _ambiguous(message: str, overrides: list[str], primary: Path) -> str:
    """Hydra's three-line advice for a comma-separated value without -m, naming the override as given (not the
    ``++`` form the framework passes a value key as); a list or a string is offered only where the key takes one
    (a group takes one name)."""
    if (m := re.match(r"Ambiguous value for argument '(?:\+\+)?([^=']*)=(.*)'\n", message)) is None:
        return ""
    key, value = m.groups()
    other = [f"a list as {key}=[{value}]", f"a string as {key}='{value}'"]
    takes = _takes(plainconf.override_key(key), overrides, primary)
    other = [o for o, kind in zip(other, ("list", "str")) if kind in takes]
    return (f"{key}={value} is several values: add -m (--multirun) to run one job each"
            + (f", or give {' or '.join(other)}" if other else ""))


def _takes(key: str, overrides: list[str], primary: Path) -> set[str]:
    """What the schema field ``key`` takes of list and str (empty: neither, or not known: a group, a component
    not chosen on the command line or in ``primary``'s defaults)."""
    group, _, rest = key.partition(".")
    schema: Any = RootSchema
    if group in GROUPS:
        chosen = [o.partition("=")[2] for o in overrides if plainconf.override_key(o) == group]
        try:
            schema, key = registry(group).get(chosen[-1] if chosen else plainconf.default_choice(primary, group)
                                              or "").config, rest
        except ConfigError:
            return set()
    for part in key.split(".") if key else ():
        hints = typing.get_type_hints(schema) if dataclasses.is_dataclass(schema) else {}
        schema = next((hints[f.name] for f in dataclasses.fields(schema) if plainconf.yaml_name(f.name) == part),
                      None) if hints else None
    hints = typing.get_args(schema) if typing.get_origin(schema) in (typing.Union, types.UnionType) else (schema,)
    return {kind for h in hints if (kind := plainconf.kind_of(h)) in ("list", "str")}


def compose(overrides: list[str] | tuple[str, ...] = (), *, ds_config: str | Path | Mapping | None = None,
            world: int | None = None, hidden_size: int | None = None, hidden_from_model: bool = True,
            composer: Composer = standalone_composer, config_dir: str | None = None,
            config_name: str = "train") -> Config:
    """Compose conf/train.yaml with Hydra-style overrides and validate it (library use). ``ds_config`` (a path or a
    dict; or ``ds_config=PATH`` among the overrides) layers a DeepSpeed config between our YAML and the overrides.
    ``world`` (default: the torchrun environment, else dist.nproc) sizes its batch triple; its "auto" bucket sizes
    use ``hidden_size``, or the model config's d_model when ``hidden_from_model``."""
    if config_dir is not None or config_name != "train":
        composer = functools.partial(standalone_composer, config_dir=config_dir, config_name=config_name)
    return compose_layers(overrides, ds_config=ds_config, world=world, hidden_size=hidden_size,
                          hidden_from_model=hidden_from_model, composer=composer)[1]


def compose_layers(overrides: list[str], *, ds_config: str | Path | Mapping | None = None,
                   world: int | Callable[[], int | None] | None = None, hidden_size: int | None = None,
                   hidden_from_model: bool = True,
                   composer: Composer = standalone_composer) -> tuple[DictConfig, Config]:
    """compose(), also returning the final composed DictConfig (``--cfg job`` prints it). ``world`` may be a
    function giving it (or None): called only for a DeepSpeed file, the one layer it sizes, so what it costs
    (a launcher's config composed) is paid only then."""
    if isinstance(overrides, str):   # (a str would be taken for a list of one-character overrides)
        raise ConfigError(f"config: overrides must be a list of strings, not the string {overrides!r}; "
                          f"pass [{overrides!r}]")
    overrides = list(overrides)
    if world is not None and not callable(world) and world < 1:
        raise ConfigError(f"config: world={world}: the number of ranks must be >= 1")
    cli = CommandLine.parse(overrides)
    for group in cli.named:   # an unknown name: one line naming the closest, before Hydra's search path
        reg = registry(group)   # (outside the try: its refusals, e.g. a config not frozen, are no unknown name)
        try:
            reg.get(cli.choices[group])
        except ConfigError as e:
            raise _code_missing(e, composer, overrides, group, cli.choices[group]) from None
    if ds_config is not None and cli.ds_config is not None:
        raise ConfigError("config: a DeepSpeed config given twice (ds_config= argument and override); give one")
    source = ds_config if ds_config is not None else cli.ds_config
    # The run's own config (no file's group choices), read for its choices, ds_config and scheduler only:
    # composed without ~key deletions of values, which may name a key only the file's choices have.
    own = None
    if source is None:
        own, refusal = _as_given(composer, list(cli.kept), cli)
        config = _validated(*own, cli, final=False)   # (final where it names no DeepSpeed file and deletes no key)
        if config.ds_config is None:
            if refusal is not None:   # (with a DeepSpeed file: where its group choices are composed too)
                raise refusal
            config = (_validated(*(own := composer(list(cli.forced))), cli) if cli.kept != cli.forced
                      else refuse_inert(config))
            return own[0], dataclasses.replace(config, sources=provenance(config, cli),
                                               notices=config.notices + search_notes(*own))
        source = config.ds_config   # named in a YAML config
    t = dsconfig.translate(dsconfig.load(source))
    # The run's config without the DeepSpeed values (Hugging Face's "training arguments"), with the file's
    # group choices unless the command line makes its own (a mismatch, see resolve).
    mine = {g: n for g, n in t.choices.items() if g not in cli.choices}
    if "stage" in mine:   # a defaults list (a recipe's) may choose the stage: the file must agree, as the
        own = own or composer(list(cli.kept))   # command line must, and adds no second choice (Hydra refuses it)
        if (run_stage := own[1].get("stage")) not in (None, mine["stage"]):
            raise ConfigError(f"ds_config: stage={run_stage} in the run's config (its defaults list), but "
                              f"{t.choice_keys['stage']} in the file means stage={mine['stage']}; make them agree")
        if run_stage is not None:
            del mine["stage"]
    choice_overrides = [plainconf.choice_override(g, n) for g, n in mine.items()]
    (cfg, choices), refusal = _as_given(composer, choice_overrides + list(cli.forced), cli)
    if refusal is not None:
        _validated(cfg, choices, cli, final=False)   # (an unknown key: its line)
        raise refusal
    label = str(source) if isinstance(source, (str, Path)) else "<dict>"
    if ds_config is not None:   # the argument, in the tree as a file named there is (ds_config_strict needs one)
        _set_key(cfg, "ds_config", label)
    # (read as validate reads it: ds_config_strict=yes is true, "off" false)
    strict = root_value("ds_config_strict", cli.strict if cli.strict is not None else cfg["ds_config_strict"])
    errors = list(t.errors)
    if strict and t.unknown:
        errors.append("keys DeepSpeed does not know (ds_config_strict=true): " + ", ".join(t.unknown))
    if len(errors) == 1:
        raise ConfigError(f"ds_config: {errors[0]}")
    if errors:
        raise ConfigError(f"ds_config: {len(errors)} problems:\n" + "\n".join(f"  - {e}" for e in errors))
    chosen_by = {g: t.choice_keys[g] for g in mine}   # the file's key behind each group it chose
    try:
        base = _validated(cfg, choices, cli, final=False)   # (the file's values laid on it below)
    except ConfigError as e:   # e.g. a stage and an offload the file chose that do not go together
        raise ConfigError(_from_file(str(e), {}, chosen_by)) from None
    values = flat(base.to_dict())
    if (world := world() if callable(world) else world) is None:
        world = run_world(base.dist.nproc)
    if hidden_from_model and hidden_size is None:   # from the model's config (e.g. a HF config.json)
        hidden_size = registry("model").get(base.choices["model"]).hidden_size(base.model)
    warmup, stated = None, t.settings.get("scheduler.warmup_num_steps")
    if (stated is not None and stated.source == dsconfig.DS_FILE
            and not cli.owns("scheduler.warmup_num_steps")):
        # Hugging Face's warm-up steps: those of the scheduler the run itself chooses. The file's must match
        # only where that is the file's scheduler and the run's YAML (not the group's own file) sets them:
        # known by composing without the group (~scheduler).
        own_cfg, own_choices = own or composer(list(cli.kept))
        node, name = own_cfg["scheduler"], own_choices.get("scheduler")
        set_by_yaml = False
        if name == t.choices.get("scheduler") and stated.value != dsconfig.AUTO:
            kept = [*cli.kept, *([] if "scheduler" in cli.deleted else ["~scheduler"])]
            set_by_yaml = "warmup_num_steps" in (composer(kept)[0].get("scheduler") or {})
        warmup = (int(node.get("warmup_num_steps", node.get("warmup_steps")) or 0), set_by_yaml)
    facts = dsconfig.RunFacts(world=world, hidden_size=hidden_size, value=values.__getitem__,
                              cli_keys=frozenset(cli.keys), cli_choices=dict(cli.choices), warmup=warmup,
                              cli_deleted=cli.deleted)
    resolved = dsconfig.resolve(t, facts)
    # The DeepSpeed layer goes under the command line: set wherever the command line does not set or delete.
    for key, value in resolved.values.items():
        if not cli.owns(key):
            _set_key(cfg, key, value)
    try:
        config = validate(cfg, choices)
    except ConfigError as e:   # a bad value the file states: name the file's key too
        raise ConfigError(_from_file(str(e), {k: v for k, v in resolved.ds_keys.items() if not cli.owns(k)},
                                     chosen_by)) from None
    sources = provenance(config, cli, {**{f"{g}.name": dsconfig.DS_FILE if g in mine else dsconfig.YAML
                                          for g in t.choices},
                                       **{k: v for k, v in resolved.sources.items() if not cli.deletes(k)}})
    own_notes = config.notices
    if resolved.sources.get("scheduler.warmup_max_lr") == dsconfig.DS_DEFAULT and \
            isinstance(config.scheduler, WarmupLRConfig):   # the file's note says where that peak comes from
        own_notes = tuple(n for n in own_notes if n not in peak_notes(config.scheduler, config))
    notices = own_notes + tuple(t.notices(strict, resolved.inert, resolved.notes)) + search_notes(cfg, choices)
    batch_world = world if isinstance(t.batch.get("train_batch_size"), int) else None
    return cfg, dataclasses.replace(config, ds_config=label, sources=sources, notices=notices, batch_world=batch_world)


def _as_given(composer: Composer, overrides: list[str],
              cli: "CommandLine") -> tuple[tuple[Any, dict[str, str]], ConfigError | None]:
    """``overrides`` composed, and None or the refusal Hydra's app would give later in its multi-line words: it
    composes the command line's plain ``key=value`` as given (not forced), and refuses one whose key the YAML
    files lack. Here one line, for a field of the schema its YAML file leaves out, naming ``+key``; the
    caller validates first, so another key gets ``validate``'s line naming the closest."""
    try:
        composed, key = composer([o[2:] if o in cli.plain else o for o in overrides]), None
        if isinstance(composed[0], dict) and cli.plain:   # (without Hydra: plainconf sets any key, as ++ does)
            base = composer([o for o in overrides if o not in cli.plain])[0]
            key = next((k for o in overrides if o in cli.plain and not _in(base, k := o[2:].partition("=")[0])), None)
    except ConfigError as e:
        composed, key = None, str(e).partition("config: Could not override '")[2].partition("'")[0]
        if not any(o[2:].partition("=")[0] == key for o in cli.plain):
            raise
    composed = composed or composer(overrides)
    if key is None or key.split(".")[0] in set(GROUPS) - set(composed[1]):   # (check_groups_chosen's: no choice)
        return composed, None
    return composed, ConfigError(   # (by key: a sweep's job holds one value, in Python's spelling, not the given)
        f"config: {key} is a field of its config but not in its YAML file, so Hydra adds it only with +: add + "
        f"before {key} on the command line (or set it in the YAML file)")


def _validated(cfg: Any, choices: dict[str, str], cli: "CommandLine", final: bool = True) -> Config:
    """``validate``, its unknown key of a group naming the group's YAML file where that file sets it and the
    command line does not (the line would read as if typed)."""
    try:
        return validate(cfg, choices, final=final)
    except ConfigError as e:
        key = e.unknown_key
        group, _, rest = key.partition(".") if key else ("", "", "")
        if not rest or group not in choices or any(under(k, {key}) or under(key, {k}) for k in cli.keys):
            raise
        path, found = group_file(cfg, group, choices[group]), False
        with contextlib.suppress(Exception):   # (Hydra read the file: only the words depend on it)
            found = path is not None and _in(plainconf.load_yaml(path), rest)
        if not found:
            raise
        said = f"config: unknown key '{key}'"
        raise ConfigError(str(e).replace(said, f"{said} in {path}", 1), unknown_key=key) from None


def _in(tree: Mapping, key: str) -> bool:
    """Whether the composed ``tree`` holds the dotted ``key``."""
    path, _, last = key.rpartition(".")
    return isinstance(node := get_key(tree, path) if path else tree, Mapping) and last in node


def _from_file(message: str, ds_keys: Mapping[str, str], choice_keys: Mapping[str, str]) -> str:
    """``message`` with "(from ds_config's KEY and ...)" on its first line, the file's keys behind those of
    ``ds_keys`` (our dotted keys) and ``choice_keys`` (groups the file chose, named as ``group=``) it names, in
    its order; unchanged when it names none."""
    hits = sorted({(m.start(), ds_key) for pattern, ds_key in (
        *((rf"(?<![\w.]){re.escape(key)}(?!\w)", k) for key, k in ds_keys.items()),
        *((rf"(?<![\w.]){re.escape(group)}=", k) for group, k in choice_keys.items()))
        if (m := re.search(pattern, message))})
    if not hits:
        return message
    first, *rest = message.split("\n", 1)
    named = list(dict.fromkeys(ds_key for _, ds_key in hits))
    return "\n".join([f"{first} (from ds_config's {' and '.join(named)})", *rest])


def _set_key(cfg: Any, key: str, value: Any) -> None:
    """``++key=value`` on a composed tree: the plain composer's dict or Hydra's."""
    if isinstance(cfg, dict):
        plainconf.set_key(cfg, plainconf.Override("++", key, value))
    else:
        from omegaconf import OmegaConf

        OmegaConf.update(cfg, key, value, merge=True, force_add=True)


@dataclass(frozen=True)
class CommandLine:
    """What the overrides set: value keys, group choices, and the DeepSpeed-config keys."""
    keys: frozenset[str]
    choices: Mapping[str, str]
    ds_config: str | None
    strict: Any               # as given (root_value reads it); None: not on the command line (the YAML's holds)
    named: frozenset[str]     # groups whose choice is one name (not a sweep or a list)
    deleted: frozenset[str]   # keys deleted (~key)
    # The overrides with plain ``key=value`` of non-group keys as ``++key=value``: Hydra's refusal of an unknown
    # key spans lines and names no suggestion; forced in, ``validate`` refuses it in one line naming the closest.
    forced: tuple[str, ...]
    kept: tuple[str, ...]     # forced less its deletions of values (~group.key; a group's ~group and ~ds_config stay)
    plain: frozenset[str] = frozenset()   # forced's lines that were plain (given without ++)

    def deletes(self, key: str) -> bool:
        """``~key``, or ``~`` of a node above it."""
        return under(key, self.deleted)

    def owns(self, key: str) -> bool:
        """The command line sets or deletes ``key``: no lower layer (the DeepSpeed file) sets it."""
        return key in self.keys or self.deletes(key)

    @staticmethod
    def parse(overrides: list[str]) -> "CommandLine":
        if have_hydra():
            parsed = [(o.key_or_group, o.is_delete(), o.value(), not (o.is_add() or o.is_force_add() or o.is_delete()))
                      for o in parse_overrides(overrides)]
        else:
            parsed = [(o.key, o.prefix == "~", o.value, False) for o in map(plainconf.parse, overrides)]
        keys, choices, ds_config, strict, named, deleted, forced, kept = set(), {}, None, None, set(), set(), [], []
        for line, (key, delete, value, plain) in zip(overrides, parsed):
            group = key.split("@")[0]
            of_value = group not in GROUPS and not key.startswith("hydra")   # (not a group's choice, not Hydra's)
            forced.append("++" + line if plain and of_value else line)
            if not (delete and of_value) or key == "ds_config":   # (~ds_config: no file, as ds_config=null)
                kept.append(forced[-1])
            if key.startswith("hydra"):
                continue
            if delete:
                deleted.add(key)
                ds_config = None if key == "ds_config" else ds_config
            elif group in GROUPS:
                if isinstance(value, list):
                    raise ConfigError(f"config: {line}: a config group takes one name, not a list; "
                                      f"give {line.partition('=')[0]}=NAME")
                if value is None or isinstance(value, (bool, int, float)):   # (Hydra: a traceback)
                    value = line.partition("=")[2].strip()
                    registry(group).get(value)
                    raise ConfigError(f"config: {line}: quote the name ({key}='{value}')")
                choices[group] = str(value)
                if isinstance(value, str):
                    named.add(group)
            elif key == "ds_config":
                ds_config = None if value is None else str(value)
            elif key == "ds_config_strict":
                strict = value
            else:
                keys.add(key)
        return CommandLine(frozenset(keys), choices, ds_config, strict, frozenset(named), frozenset(deleted),
                           tuple(forced), tuple(kept), frozenset(f for f, o in zip(forced, overrides) if f != o))


def provenance(config: Config, cli: CommandLine, layered: Mapping[str, str] | None = None) -> dict[str, str]:
    """Where each value of ``config`` came from: our defaults < YAML < the DeepSpeed file
    (``layered``) < the command line. A key the command line deletes has our default."""
    in_yaml = {f"{g}.name" for g in GROUPS if g != "stage"}   # train.yaml's defaults list chooses all but stage
    for prefix, path in (("", conf_dir() / "train.yaml"),
                         *((f"{g}.", conf_dir() / g / f"{config.choices[g]}.yaml") for g in GROUPS)):
        node = plainconf.load_yaml(path) if path.is_file() else {}
        in_yaml |= set(flat({k: v for k, v in node.items() if k not in ("defaults", "hydra")}, prefix))
    # (a deleted key has the code's default, not the YAML's value)
    out = {k: dsconfig.YAML if k in in_yaml and not cli.deletes(k) else dsconfig.DEFAULT
           for k in flat(config.to_dict())}
    on_cli = [*cli.keys, *(f"{g}.name" for g in cli.choices), *(["ds_config"] if cli.ds_config is not None else [])]
    above = {**(layered or {}), **dict.fromkeys(on_cli, dsconfig.COMMAND_LINE)}
    out.update({k: label for k, label in above.items() if k in out})   # only keys the config has
    return out

