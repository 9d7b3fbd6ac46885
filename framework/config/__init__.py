"""Typed, strict configuration: Hydra composes YAML, these schemas validate it.

Every node is checked against a dataclass: the top-level keys against ``RootSchema`` and each
group's node against the schema of the component chosen for that group. An unknown key, a
typo or a wrong type raises ConfigError with one line naming the bad key and the closest
valid one. The result is a frozen ``Config`` that is plain data (it pickles to spawned ranks).
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

try:
    from omegaconf import DictConfig, OmegaConf
    from omegaconf.errors import OmegaConfBaseException
except ImportError:   # a machine without Hydra/OmegaConf (a GPU image): framework.config.plainconf composes
    DictConfig = OmegaConf = None

    class OmegaConfBaseException(Exception):
        pass

from framework.config import plainconf
from framework.core.errors import ConfigError
from framework.core.registry import GROUPS, closest, closest_hint, registry

DEFAULT_STAGE = "ddp"  # no +stage=... means replicated data parallelism


@dataclass(kw_only=True)
class TrainLoopConfig:
    steps: int
    micro_batch: int
    grad_accum: int = 1
    log_every: int = 50
    eval_every: int = 500       # 0: evaluate only at the end
    eval_batches: int = 8
    grad_clip: float = 1.0      # max global gradient norm; 0 disables clipping
    on_nonfinite: str = "stop"  # non-finite loss/gradient norm outside fp16 loss scaling: stop | warn (skip the step)


@dataclass(kw_only=True)
class DistConfig:
    nproc: int = 1              # >1: spawn this many local ranks (ignored under torchrun)
    backend: str = "auto"       # auto | gloo | nccl
    timeout_s: float = 300.0    # any collective waiting longer fails with a message


@dataclass(kw_only=True)
class CheckpointConfig:
    dir: str | None = None      # None: checkpoints/ in the run folder; relative paths: to the working directory
    every: int = 0              # save every N steps and after the last one; 0: never save
    keep_last: int = 2          # committed checkpoints kept (older ones deleted after a commit); 0: all
    resume: str = "auto"        # auto (newest complete checkpoint in dir) | off | latest (newest of any run) | PATH
    # YAML key `async`: write files in a background thread while training goes on (a swapped state,
    # offload=nvme, is written from the swap file on the training thread: no host copy of it)
    async_: bool = False
    timeout_s: float = 1800.0   # checkpoint collectives (their own gloo group) wait at most this long


@dataclass(kw_only=True)
class RootSchema:
    seed: int = 1337
    train: TrainLoopConfig
    dist: DistConfig = field(default_factory=DistConfig)
    ds_config: str | None = None      # a DeepSpeed JSON config, layered between our YAML and the command line
    ds_config_strict: bool = False    # keys DeepSpeed does not know in it: an error instead of a warning
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

ROOT_KEYS = ("seed", "train", "dist", "checkpoint", "ds_config", "ds_config_strict")


@dataclass(frozen=True)
class Config:
    seed: int
    train: TrainLoopConfig
    dist: DistConfig
    checkpoint: CheckpointConfig
    choices: Mapping[str, str]      # group -> registry name of the chosen component
    # One typed node per conf/ group (the chosen component's config dataclass).
    model: Any
    data: Any
    optimizer: Any
    scheduler: Any
    precision: Any
    offload: Any
    logger: Any
    stage: Any
    ds_config: str | None = None     # the DeepSpeed config's path ("<dict>" when given as a dict)
    ds_config_strict: bool = False
    # Where each value came from, keyed like flat(to_dict()): default, YAML, DeepSpeed file,
    # DeepSpeed default, auto, command line.
    sources: Mapping[str, str] = field(default_factory=dict)
    notices: tuple[str, ...] = ()    # the DeepSpeed config's warnings, printed once at start-up

    def to_dict(self) -> dict:
        """Plain, resolved config (for logging and summary files)."""
        out = {"seed": self.seed, "train": dataclasses.asdict(self.train), "dist": dataclasses.asdict(self.dist),
               "checkpoint": _yaml_keys(dataclasses.asdict(self.checkpoint)),
               "ds_config": self.ds_config, "ds_config_strict": self.ds_config_strict}
        for g in GROUPS:
            out[g] = {"name": self.choices[g], **dataclasses.asdict(getattr(self, g))}
        return out


def flat(tree: Mapping, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1} (lists are leaves)."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping) and value:
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _yaml_keys(node: dict) -> dict:
    """Schema field names -> YAML keys (``async_`` is ``async``, a Python keyword)."""
    return {k.rstrip("_"): v for k, v in node.items()}


def _schema_keys(node: Any) -> Any:
    if isinstance(node, Mapping) and "async" in node:
        node = {("async_" if k == "async" else k): v for k, v in node.items()}
    return node


def _check_keys(node: Any, schema: type, prefix: str) -> None:
    if not isinstance(node, Mapping):
        raise ConfigError(f"config: {prefix.rstrip('.') or 'config'} must be a mapping, got {node!r}")
    hints = typing.get_type_hints(schema)
    valid = [f.name for f in dataclasses.fields(schema)]
    for key, value in node.items():
        if key not in valid:
            match = closest(key, valid)
            hint = f" (did you mean '{prefix}{match}'?)" if match else ""
            raise ConfigError(f"config: unknown key '{prefix}{key}'{hint}; valid keys under "
                              f"{prefix.rstrip('.') or 'the top level'}: {', '.join(valid) or 'none'}")
        if dataclasses.is_dataclass(hints[key]) and isinstance(value, Mapping):
            _check_keys(value, hints[key], f"{prefix}{key}.")


def _typed(node: Mapping, schema: type, prefix: str) -> Any:
    _check_keys(node, schema, prefix)
    if OmegaConf is None:
        return plainconf.typed(node, schema, prefix)
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), node)
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or ""
        msg = str(e).splitlines()[0]
        raise ConfigError(f"config: {prefix}{key}: {msg}" if key else f"config: {prefix.rstrip('.')}: {msg}") from None


def validate(cfg: DictConfig | Mapping, choices: Mapping[str, str]) -> Config:
    """Check a composed config against the schemas; return the typed, frozen Config."""
    if OmegaConf is None:
        import copy
        raw = copy.deepcopy(dict(cfg))
        raw.pop("hydra", None)
    else:
        raw = OmegaConf.to_container(cfg, resolve=False) if isinstance(cfg, DictConfig) else dict(cfg)
        raw.pop("hydra", None)  # Hydra's own node; some of its fields only resolve inside a job
        try:
            raw = OmegaConf.to_container(OmegaConf.create(raw), resolve=True)
        except OmegaConfBaseException as e:
            raise ConfigError(f"config: {' '.join(str(e).split())}") from None
    roots = list(ROOT_KEYS) + list(GROUPS)
    for key in raw:
        if key not in roots:
            raise ConfigError(f"config: unknown key '{key}'{closest_hint(key, roots)}; "
                              f"valid top-level keys: {', '.join(roots)}")
    if "checkpoint" in raw:
        raw["checkpoint"] = _schema_keys(raw["checkpoint"])
    root = _typed({k: raw[k] for k in ROOT_KEYS if k in raw}, RootSchema, "")
    chosen, nodes = {}, {}
    for group in GROUPS:
        name = choices.get(group) or (DEFAULT_STAGE if group == "stage" else None)
        if name is None:
            raise ConfigError(f"config: no {group} chosen; add {group}=NAME "
                              f"(one of {', '.join(registry(group).names())})")
        schema = registry(group).get(name).config
        nodes[group] = _typed(raw.get(group) or {}, schema, f"{group}.")
        chosen[group] = name
    _check_numbers(root, "")
    for group, node in nodes.items():
        _check_numbers(node, f"{group}.")
    _check_values(root)
    check_compatible(chosen["stage"], chosen["offload"])
    notes = _check_inert_stage_keys(chosen["stage"], nodes["stage"])
    check = registry("offload").get(chosen["offload"]).check
    if check is not None:
        nodes["offload"] = check(nodes["offload"], chosen["stage"])
    return Config(seed=root.seed, train=root.train, dist=root.dist, checkpoint=root.checkpoint, choices=chosen,
                  ds_config=root.ds_config,
                  ds_config_strict=root.ds_config_strict, notices=tuple(notes), **nodes)


INT_LIMIT = 2 ** 63   # every integer key ends up in a C long or int64 tensor somewhere


def _check_numbers(node: Any, prefix: str) -> None:
    """Every number of a typed node (and its nested nodes) finite and within int64: NaN or inf
    (``nan``, ``1e309``) would silently disable a comparison-based limit (``norm > nan`` is
    never true) and an integer beyond int64 ends in an OverflowError deep inside torch."""
    for f in dataclasses.fields(node):
        value, key = getattr(node, f.name), f"{prefix}{f.name.rstrip('_')}"
        if dataclasses.is_dataclass(value):
            _check_numbers(value, f"{key}.")
            continue
        for v in (value if isinstance(value, (list, tuple)) else [value]):
            if isinstance(v, bool):
                continue
            if isinstance(v, float) and not math.isfinite(v):
                raise ConfigError(f"config: {key}={v} is not a finite number; give a finite value")
            if isinstance(v, int) and not -INT_LIMIT <= v < INT_LIMIT:
                raise ConfigError(f"config: {key}={v} is out of range (integers must lie within +-2^63); "
                                  "give a realistic value")


def _check_values(root: RootSchema) -> None:
    t = root.train
    for key in ("steps", "micro_batch", "grad_accum", "log_every", "eval_batches"):
        if getattr(t, key) < 1:
            raise ConfigError(f"config: train.{key} must be >= 1, got {getattr(t, key)}")
    if t.eval_every < 0 or t.grad_clip < 0:
        raise ConfigError("config: train.eval_every and train.grad_clip must be >= 0")
    if t.on_nonfinite not in ("stop", "warn"):
        raise ConfigError(f"config: train.on_nonfinite must be stop or warn, got {t.on_nonfinite!r}")
    if root.dist.nproc < 1 or root.dist.timeout_s <= 0:
        raise ConfigError("config: dist.nproc must be >= 1 and dist.timeout_s > 0")
    c = root.checkpoint
    if c.every < 0 or c.keep_last < 0 or c.timeout_s <= 0:
        raise ConfigError(f"config: checkpoint.every ({c.every}) and checkpoint.keep_last ({c.keep_last}) must be "
                          f">= 0 and checkpoint.timeout_s ({c.timeout_s:g}) > 0")
    if not c.resume.strip() or (c.dir is not None and not c.dir.strip()):
        raise ConfigError("config: checkpoint.resume must be auto, off, latest or a path, and checkpoint.dir a path "
                          "(or null: checkpoints/ in the run folder)")
    if c.async_ and c.every == 0:
        raise ConfigError("config: checkpoint.async=true does nothing with checkpoint.every=0 (no saves); "
                          "set checkpoint.every=N or remove checkpoint.async")


def _check_inert_stage_keys(stage: str, node: Any) -> list[str]:
    """DeepSpeed keys that the ZeRO stages accept (so that configs port over) but whose other value
    would do nothing here: refused, naming the fix, rather than silently ignored; or, where a
    DeepSpeed config sets them for a reason our path already meets, one note saying why."""
    notes = []
    if stage == "zero1" and node.round_robin_gradients:
        notes.append("note: stage.round_robin_gradients=true changes nothing with zero1: its gradients are "
                     "reduced and copied to the host after backward, by every rank at once (DeepSpeed uses it "
                     "to spread those copies across ranks)")
    if stage == "zero1" and not node.contiguous_gradients:
        raise ConfigError("config: stage.contiguous_gradients=false has no effect with stage=zero1 (its gradients "
                          "always accumulate in one contiguous flat buffer); remove it, or use +stage=zero2")
    return notes


# Which offload targets each stage supports (the one table; tested). ZeRO stages add rows.
COMPATIBLE: Mapping[str, tuple[str, ...]] = {
    "ddp": ("none",),
    "zero1": ("none", "cpu", "nvme"),
    "zero2": ("none", "cpu", "nvme"),
    "zero3": ("none", "cpu", "nvme"),
}


def check_compatible(stage: str, offload: str) -> None:
    if offload not in COMPATIBLE.get(stage, ()):
        combos = "; ".join(f"stage {s} with offload {'|'.join(o)}" for s, o in COMPATIBLE.items())
        raise ConfigError(f"config: offload={offload} is not supported with stage={stage}; valid: {combos}")


def group_overrides_to_force(overrides: list[str]) -> list[str]:
    """Turn plain ``key=value`` overrides of non-group keys into ``++key=value``.

    Hydra rejects an unknown key with a multi-line message and no suggestion; forcing the
    key in lets ``validate`` reject it against the schema with one line and the closest
    valid key. Group choices (``optimizer=lion``, ``+stage=zero3``) and hydra.* pass as is.
    """
    if not have_hydra():   # the plain composer sets every key it is given; validate judges them
        return list(overrides)
    from hydra.core.override_parser.overrides_parser import OverridesParser

    out = []
    for line, o in zip(overrides, OverridesParser.create().parse_overrides(overrides)):
        key = o.key_or_group
        is_plain = not (o.is_add() or o.is_force_add() or o.is_delete())
        is_choice = key.split("@")[0] in GROUPS
        out.append("++" + line if is_plain and not is_choice and not key.startswith("hydra") else line)
    return out


Composer = Callable[[list[str]], tuple[Any, dict[str, str]]]


def have_hydra() -> bool:
    """Whether Hydra can be imported (else ``compose`` composes with ``framework.config.plainconf``)."""
    try:
        import hydra  # noqa: F401
    except ImportError:
        return False
    return True


def standalone_composer(overrides: list[str], *, config_dir: str | None = None,
                        config_name: str = "train") -> tuple[DictConfig, dict[str, str]]:
    """Compose conf/train.yaml with Hydra's compose API (outside a Hydra app).

    ``config_dir``/``config_name`` select another primary config, as ``--config-dir`` and
    ``--config-name`` do on the command line (a recipe's ``config.yaml``, which lists ``train`` in
    its defaults); conf/ stays on the search path so its groups resolve.
    """
    if not have_hydra():
        return plainconf.plain_composer(overrides, config_dir=config_dir, config_name=config_name)
    from hydra import compose as hydra_compose, initialize_config_dir
    from hydra.errors import HydraException

    from framework.core.paths import conf_dir

    primary, extra = str(conf_dir()), []
    if config_dir is not None:
        given = Path(config_dir).expanduser().resolve()
        if not given.is_dir():
            raise ConfigError(f"config: --config-dir {config_dir} is not a folder")
        # Hydra finds the primary config only in the folder it is initialised with; the other folder
        # joins any search path the overrides give (Hydra takes one hydra.searchpath value).
        other = conf_dir()
        if (given / f"{config_name}.yaml").is_file():
            primary = str(given)
        else:
            other = given
        paths, rest = [], []
        for o in overrides:
            key, _, value = o.lstrip("+").partition("=")
            if key == "hydra.searchpath" and value.startswith("[") and value.endswith("]"):
                paths += [x.strip() for x in value[1:-1].split(",") if x.strip()]
            else:
                rest.append(o)
        overrides = rest
        extra = [f"hydra.searchpath=[{','.join(dict.fromkeys(paths + [f'file://{other}']))}]"]
    try:
        with initialize_config_dir(config_dir=primary, version_base="1.3"):
            cfg = hydra_compose(config_name, overrides=overrides + extra, return_hydra_config=True)
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError("config: " + " ".join(str(e).split())) from None
    return cfg, {k: v for k, v in cfg.hydra.runtime.choices.items() if k in GROUPS}


def app_composer(overrides: list[str]) -> tuple[DictConfig, dict[str, str]]:
    """Compose inside a running Hydra app (its config search path is already set up)."""
    from hydra import compose as hydra_compose
    from hydra.core.hydra_config import HydraConfig
    from hydra.errors import HydraException

    try:
        # The app's own primary config: train, or the one --config-name chose (a recipe's).
        cfg = hydra_compose(HydraConfig.get().job.config_name, overrides=overrides, return_hydra_config=True)
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError("config: " + " ".join(str(e).split())) from None
    return cfg, {k: v for k, v in cfg.hydra.runtime.choices.items() if k in GROUPS}


def compose(overrides: list[str] | tuple[str, ...] = (), *, ds_config: str | Path | Mapping | None = None,
            world: int | None = None, hidden_size: int | None = None, hidden_from_model: bool = True,
            composer: Composer = standalone_composer, config_dir: str | None = None,
            config_name: str = "train") -> Config:
    """Compose conf/train.yaml with Hydra-style overrides and validate it (library use).

    ``ds_config`` (a path or a dict; or ``ds_config=PATH`` among the overrides) layers a DeepSpeed
    config between our YAML and the overrides (framework.config.dsconfig). ``world`` (default: the
    torchrun environment, else dist.nproc) sizes its batch triple; its "auto" bucket sizes use
    ``hidden_size``, or the model config's d_model when ``hidden_from_model``. ``config_dir`` and
    ``config_name`` pick another primary config (``--config-dir``/``--config-name``; see
    ``standalone_composer``).
    """
    if config_dir is not None or config_name != "train":
        composer = functools.partial(standalone_composer, config_dir=config_dir, config_name=config_name)
    return compose_layers(list(overrides), ds_config=ds_config, world=world, hidden_size=hidden_size,
                          hidden_from_model=hidden_from_model, composer=composer)[1]


def compose_layers(overrides: list[str], *, ds_config: str | Path | Mapping | None = None, world: int | None = None,
                   hidden_size: int | None = None, hidden_from_model: bool = True,
                   composer: Composer = standalone_composer) -> tuple[DictConfig, Config]:
    """compose(), also returning the final composed DictConfig (``--cfg job`` prints it)."""
    from framework.config import dsconfig

    cli = CommandLine.parse(overrides)
    check_choices(cli)
    if ds_config is not None and cli.ds_config is not None:
        raise ConfigError("config: a DeepSpeed config given twice (ds_config= argument and override); give one")
    source = ds_config if ds_config is not None else cli.ds_config
    forced = group_overrides_to_force(overrides)
    if source is None:
        cfg, choices = composer(forced)
        config = validate(cfg, choices)
        return cfg, dataclasses.replace(config, sources=provenance(config, cli))
    t = dsconfig.translate(dsconfig.load(source))
    errors = list(t.errors)
    if cli.strict and t.unknown:
        errors.append("keys DeepSpeed does not know (ds_config_strict=true): " + ", ".join(t.unknown))
    if errors:
        if len(errors) == 1:
            raise ConfigError(f"ds_config: {errors[0]}")
        raise ConfigError("ds_config: " + f"{len(errors)} problems:\n" + "\n".join(f"  - {e}" for e in errors))
    # The run's config without the DeepSpeed values (Hugging Face's "training arguments"), with
    # the file's group choices unless the command line makes its own (a mismatch, see resolve).
    choice_overrides = [f"{'+' if g == 'stage' else ''}{g}={n}" for g, n in t.choices.items()
                        if g not in cli.choices]
    base = validate(*composer(choice_overrides + forced))
    values = flat(base.to_dict())
    if world is None:
        env_world = int(os.environ.get("WORLD_SIZE", "1"))
        world = env_world if env_world > 1 else base.dist.nproc
    if hidden_from_model and hidden_size is None:   # from the model's config (e.g. a HF config.json)
        hidden_size = registry("model").get(base.choices["model"]).hidden_size(base.model)
    facts = dsconfig.RunFacts(world=world, hidden_size=hidden_size, value=values.__getitem__,
                              cli_keys=frozenset(cli.keys), cli_choices=dict(cli.choices))
    resolved = dsconfig.resolve(t, facts)
    ds_overrides = [f"++{k}={dsconfig.hydra_value(v)}" for k, v in resolved.values.items()]
    cfg, choices = composer(choice_overrides + ds_overrides + forced)
    config = validate(cfg, choices)
    label = str(source) if isinstance(source, (str, Path)) else "<dict>"
    sources = provenance(config, cli, {**{f"{g}.name": dsconfig.DS_FILE for g in t.choices}, **resolved.sources})
    return cfg, dataclasses.replace(config, ds_config=label, sources=sources,
                                    notices=config.notices + tuple(t.notices(cli.strict, resolved.inert,
                                                                             resolved.notes)))


@dataclass(frozen=True)
class CommandLine:
    """What the overrides set: value keys, group choices, and the DeepSpeed-config keys."""
    keys: frozenset[str]
    choices: Mapping[str, str]
    ds_config: str | None
    strict: bool
    named: frozenset[str] = frozenset()   # groups whose choice is one name (not a sweep or a list)

    @staticmethod
    def parse(overrides: list[str]) -> "CommandLine":
        if have_hydra():
            from hydra.core.override_parser.overrides_parser import OverridesParser
            parsed = [(o.key_or_group, o.is_delete(), o.value()) for o in
                      OverridesParser.create().parse_overrides(overrides)]
        else:
            parsed = [(o.key, o.prefix == "~", o.value) for o in map(plainconf.parse, overrides)]
        keys, choices, ds_config, strict, named = set(), {}, None, False, set()
        for key, delete, value in parsed:
            if key.startswith("hydra") or delete:
                continue
            if key.split("@")[0] in GROUPS:
                choices[key.split("@")[0]] = str(value)
                if isinstance(value, str):
                    named.add(key.split("@")[0])
            elif key == "ds_config":
                ds_config = None if value is None else str(value)
            elif key == "ds_config_strict":
                strict = value in (True, "true", "True")
            else:
                keys.add(key)
        return CommandLine(frozenset(keys), choices, ds_config, strict, frozenset(named))


def check_choices(cli: "CommandLine") -> None:
    """A group choice that names no component: the same one line as an unknown key (the closest
    name and the valid ones), before Hydra would print its search path."""
    for group in cli.named:
        registry(group).get(cli.choices[group])   # ConfigError: unknown <group> 'x' (did you mean 'y'?); available: ...


def provenance(config: Config, cli: CommandLine, layered: Mapping[str, str] | None = None) -> dict[str, str]:
    """Where each value of ``config`` came from: our defaults < YAML < the DeepSpeed file
    (``layered``) < the command line."""
    from framework.config.dsconfig import COMMAND_LINE, DEFAULT, YAML
    from framework.core.paths import conf_dir

    def yaml_keys(path: Path, prefix: str) -> set[str]:
        if not path.is_file():
            node = {}
        elif OmegaConf is None:
            node = plainconf.load_yaml(path)
        else:
            node = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
        return set(flat({k: v for k, v in (node or {}).items() if k not in ("defaults", "hydra")}, prefix))

    in_yaml = yaml_keys(conf_dir() / "train.yaml", "")
    for g in GROUPS:
        in_yaml |= yaml_keys(conf_dir() / g / f"{config.choices[g]}.yaml", f"{g}.")
        if g != "stage":  # the defaults list of train.yaml chooses every group but stage
            in_yaml.add(f"{g}.name")
    out = {k: YAML if k in in_yaml else DEFAULT for k in flat(config.to_dict())}
    for key, label in (layered or {}).items():
        if key in out:
            out[key] = label
    for key in cli.keys:
        if key in out:
            out[key] = COMMAND_LINE
    for g in cli.choices:
        out[f"{g}.name"] = COMMAND_LINE
    if cli.ds_config is not None:
        out["ds_config"] = COMMAND_LINE
    return out
