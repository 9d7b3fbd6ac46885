"""Checking a composed config against its dataclasses (``RootSchema``, each chosen component's schema),
then its values, the stage/offload combination and each chosen component's own rules (``Component.check``
and ``notes``). Typed by OmegaConf, or without it by ``plainconf``."""
from __future__ import annotations

import copy
import dataclasses
import math
import re
import typing
from types import MappingProxyType
from typing import Any, Mapping

try:
    from omegaconf import DictConfig, OmegaConf
    from omegaconf.errors import OmegaConfBaseException
except ImportError:   # a machine without Hydra/OmegaConf (a GPU image): framework.config.plainconf composes
    DictConfig = OmegaConf = OmegaConfBaseException = None   # only read where OmegaConf is present

from framework.config import plainconf
from framework.config.dsconfig import COMMAND_LINE
from framework.config.schema import (COMPATIBLE, DEFAULT_STAGE, ROOT_KEYS, Config, RootSchema, flat, get_key,
                                     reads_grad_accum_dtype, tuples)
from framework.core.errors import ConfigError, on_every_rank
from framework.core.paths import conf_dir
from framework.core.registry import GROUPS, closest, closest_hint, registry
from framework.core.utils import counted, yaml_spelling


# Other tools' names for our keys (lower case), which no spelling distance finds: a "did you mean" names ours.
KEY_ALIASES = {"batch_size": "micro_batch", "micro_batch_size": "micro_batch", "max_steps": "steps",
               "num_steps": "steps", "gradient_accumulation_steps": "grad_accum", "max_grad_norm": "grad_clip",
               "n_embd": "d_model", "hidden_size": "d_model", "n_layers": "n_layer", "num_layers": "n_layer",
               "num_hidden_layers": "n_layer", "n_heads": "n_head", "num_heads": "n_head",
               "num_attention_heads": "n_head", "block_size": "context", "seq_len": "context", "seq_length": "context",
               "max_seq_len": "context", "learning_rate": "lr", "per_device_train_batch_size": "micro_batch",
               "save_steps": "every", "logging_steps": "log_every", "eval_steps": "eval_every", "world_size": "nproc",
               "adam_epsilon": "eps", "adam_beta1": "beta1", "adam_beta2": "beta2",
               "gradient_checkpointing": "activation_checkpointing"}


def _check_keys(node: Any, schema: type, prefix: str, option: str | None = None) -> dict:
    """``node`` with its keys as the schema's field names (``async`` is ``async_``), at every level; an
    unknown key is one line. ``option``: the chosen name of the group ``prefix`` names: a key of its other
    options is told apart from a typo, with both ways out (stage is not in train.yaml's defaults list,
    so Hydra adds it with +)."""
    group = prefix.rstrip(".")
    if not isinstance(node, Mapping):
        raise ConfigError(f"config: {group or 'config'} must be a mapping, got {node!r}")
    hints = typing.get_type_hints(schema)
    fields = {plainconf.yaml_name(f.name): f.name for f in dataclasses.fields(schema)}
    valid, out = list(fields), {}
    for key, value in node.items():
        if key not in fields:
            owners = [] if option is None else [n for n in registry(group).names() if n != option and key in
                                                {f.name for f in dataclasses.fields(registry(group).get(n).config)}]
            if owners and value is None:   # (the suggestion first where the key takes a null)
                owners.sort(key=lambda n: type(None) not in typing.get_args(
                    typing.get_type_hints(registry(group).get(n).config).get(key)))
            if owners:
                spelled = yaml_spelling(value)
                choose = plainconf.choice_override(group, owners[0])
                named = ", ".join(f"{group}={n}" for n in owners[:4]) + (", ..." if len(owners) > 4 else "")
                raise ConfigError(f"config: {group}.{key} is a key of {named}, not of {group}={option} (chosen); "
                                  f"choose such an option ({choose} {group}.{key}={spelled}) or drop {group}.{key}")
            # a nested key run together (aio_block_size: aio.block_size) is as close as one at this level
            match = closest(key, [*valid, *_nested_keys(schema)], aliases=KEY_ALIASES)
            hint = f" (did you mean '{prefix}{match}'?)" if match else ""
            where = (f"valid keys under {group or 'the top level'}: {', '.join(valid)}" if valid
                     else f"{group}={option} has no keys")
            raise ConfigError(f"config: unknown key '{prefix}{key}'{hint}; {where}", unknown_key=f"{prefix}{key}")
        sub = hints[name := fields[key]]
        out[name] = _check_keys(value, sub, f"{prefix}{key}.") if dataclasses.is_dataclass(sub) and \
            isinstance(value, Mapping) else plainconf.number(value, sub, f"{prefix}{key}")
    return out


def _nested_keys(schema: type, prefix: str = "") -> list[str]:
    """The keys of ``schema``'s nested schemas, dotted below it as YAML spells them (``aio.block_size``)."""
    hints, keys = typing.get_type_hints(schema), []
    for f in dataclasses.fields(schema):
        if dataclasses.is_dataclass(sub := hints[f.name]):
            name = f"{prefix}{plainconf.yaml_name(f.name)}."
            keys += [name + plainconf.yaml_name(g.name) for g in dataclasses.fields(sub)] + _nested_keys(sub, name)
    return keys


def _typed(node: Mapping, schema: type, prefix: str, option: str | None = None) -> Any:
    node = _check_keys(node, schema, prefix, option)
    _check_given(node, schema, prefix, option)
    if OmegaConf is None:
        return plainconf.typed(node, schema, prefix)
    try:
        return OmegaConf.to_object(OmegaConf.merge(writable(OmegaConf.structured(schema), schema), node))
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or ""
        key = ".".join(map(plainconf.yaml_name, key.split(".")))   # as YAML spells the field
        if not key:
            raise ConfigError(f"config: {prefix.rstrip('.')}: {str(e).splitlines()[0]}") from None
        value, hint = get_key(node, str(e.full_key)), schema   # (the value as given: OmegaConf's may be its node)
        for part in str(e.full_key).split("."):
            hint = typing.get_type_hints(hint).get(part) if dataclasses.is_dataclass(hint) else None
        raise ConfigError("config: " + plainconf.library_line(prefix + key, str(e).splitlines()[0], value, hint)
                          ) from None


def writable(node: DictConfig, schema: type) -> DictConfig:
    """``node`` (``schema``'s) with its nested nodes writable: a frozen schema's are read-only, and the values
    merge into them (the objects ``to_object`` makes stay frozen: a field set after compose is refused, not
    ignored). A nested schema without a default gets its node here (its missing fields are ``_check_given``'s)."""
    OmegaConf.set_readonly(node, False)
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        if dataclasses.is_dataclass(sub := hints[f.name]):
            if OmegaConf.is_missing(node, f.name):
                node[f.name] = OmegaConf.structured(sub)
            writable(node[f.name], sub)
    return node


def _check_given(node: Mapping, schema: type, prefix: str, option: str | None) -> None:
    """A field without a default that ``node`` leaves out (or gives as ``???``): one line naming both places to
    give it (a key the YAML file lacks is added with + on Hydra's command line)."""
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        if dataclasses.is_dataclass(hints[f.name]) and isinstance(node.get(f.name), Mapping):
            _check_given(node[f.name], hints[f.name], f"{prefix}{plainconf.yaml_name(f.name)}.", None)
        elif (f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
                and node.get(f.name, "???") == "???"):
            name, key = plainconf.yaml_name(f.name), prefix + plainconf.yaml_name(f.name)
            where = (f"{name} in its YAML file ({prefix.rstrip('.')}/{option}.yaml), or give +{key}=VALUE"
                     if option else f"{key} in the config file or on the command line")
            raise ConfigError(f"config: {key} has no value (a missing mandatory value: {schema.__name__} gives it no "
                              f"default); set {where}")


def root_value(key: str, value: Any) -> Any:
    """``value`` of the top-level ``key`` as ``validate`` types it (a bad one: its one-line error)."""
    one = dataclasses.make_dataclass("One", [(key, typing.get_type_hints(RootSchema)[key])])   # (no other field)
    return getattr(_typed({key: value}, one, ""), key)


def validate(cfg: DictConfig | Mapping, choices: Mapping[str, str], *, final: bool = True) -> Config:
    """Check a composed config against the schemas; return the typed, frozen Config. ``final=False``: a
    config that a DeepSpeed file's values may still change, so without ``refuse_inert``'s refusals."""
    raw = copy.deepcopy(dict(cfg)) if OmegaConf is None else (
        OmegaConf.to_container(cfg, resolve=False) if isinstance(cfg, DictConfig) else dict(cfg))
    raw.pop("hydra", None)  # Hydra's own node; some of its fields only resolve inside a job
    _refuse_hydra_resolver(raw, "")
    if OmegaConf is not None:
        try:
            raw = OmegaConf.to_container(OmegaConf.create(raw), resolve=True)
        except OmegaConfBaseException as e:
            if (m := re.search(r"Environment variable '([^']*)' not found", str(e))) and (key := e.full_key):
                raise ConfigError(f"config: {key}: the environment variable {m.group(1)} is not set; set it, or give a "
                                  f"default: ${{oc.env:{m.group(1)},VALUE}}") from None
            raise ConfigError(f"config: {' '.join(str(e).split())}") from None
    roots = list(ROOT_KEYS) + list(GROUPS)
    for key in raw:
        if key not in roots:   # did you mean: the key of that name (or another tool's name for it) anywhere in the
            # run's config (steps=5: train.steps), else (a mapping given: only) a top-level key or group close to it
            leaf = None if isinstance(raw[key], Mapping) else leaf_key(key, choices)
            hint = f" (did you mean '{leaf}'?)" if leaf else closest_hint(key, roots)
            raise ConfigError(f"config: unknown key '{key}'{hint}; valid top-level keys: {', '.join(roots)}",
                              unknown_key=key)
    root = _typed({k: raw[k] for k in ROOT_KEYS if k in raw}, RootSchema, "")
    chosen, nodes = {}, {}
    for group in GROUPS:
        name = choices.get(group) or (DEFAULT_STAGE if group == "stage" else None)
        if name is None:
            raise ConfigError(f"config: no {group} chosen; add {group}=NAME "
                              f"(one of {', '.join(registry(group).names())})")
        try:
            nodes[group] = _typed(raw.get(group) or {}, registry(group).get(name).config, f"{group}.", name)
        except ConfigError as e:   # (a model is any gpt*.yaml file dropped in conf/model/: the line names it)
            if group != "model" or not name.startswith("gpt") or ".yaml" in str(e):   # (not hf: its file is ours)
                raise
            raise ConfigError(f"{e} (model={name}: its YAML file model/{name}.yaml, or a model.* override)",
                              unknown_key=e.unknown_key) from None
        chosen[group] = name
    for prefix, node in (("", root), *((f"{group}.", node) for group, node in nodes.items())):
        _check_numbers(node, prefix)
    _check_values(root)
    check_compatible(chosen["stage"], chosen["offload"], defaulted=not choices.get("stage"))
    if root.checkpoint.async_ and chosen["offload"] == "nvme":
        raise ConfigError("config: checkpoint.async=true has no effect with offload=nvme (a swapped state is saved "
                          "from its swap files on the training thread: a background save would need a host copy of "
                          "all of it); remove checkpoint.async")
    for group in GROUPS:
        component = registry(group).get(chosen[group])
        if component.check is not None:
            nodes[group] = component.check(nodes[group], chosen["stage"], MappingProxyType(nodes))
    nodes = {group: tuples(node) for group, node in nodes.items()}
    # (after every check: a note may read another group's resolved node, a warm-up's the optimizer's lr)
    config = Config(**vars(root), choices=chosen, **nodes)
    notes = [note for group in GROUPS if (component := registry(group).get(chosen[group])).notes is not None
             for note in component.notes(nodes[group], config)]
    config = dataclasses.replace(config, notices=tuple(notes))
    return refuse_inert(config) if final else config


def refuse_inert(config: Config) -> Config:
    """``config``, or a one-line ConfigError for a key stated where another key's value makes it do nothing. Taken
    on the run's final config only: a DeepSpeed file laid on later may set that other key (its
    gradient_accumulation_steps, communication_data_type, an optimizer's weight_decay)."""
    p, stage = config.precision, config.choices["stage"]   # (its value checked by the precision's own check first)
    if p.grad_accum_dtype != "fp32" and not reads_grad_accum_dtype(
            stage, config.train.grad_accum, config.choices["precision"] == "bf16" and p.reduce_fp32):
        raise ConfigError(f"config: precision.grad_accum_dtype={p.grad_accum_dtype} has no effect with stage={stage} "
                          "and train.grad_accum=1 (one micro batch a step: nothing is summed in it); remove it, or "
                          "set train.grad_accum > 1")
    o = config.optimizer   # (decay_1d: a field of every optimizer's config; weight_decay of the built-in ones)
    if o.decay_1d and getattr(o, "weight_decay", None) == 0:   # (a DeepSpeed file's one group: not set, _resolve)
        raise ConfigError(f"optimizer.decay_1d=true has no effect with optimizer.weight_decay=0 for "
                          f"{config.choices['optimizer']} (nothing is decayed); set optimizer.weight_decay > 0 or drop "
                          "optimizer.decay_1d")
    return config


def leaf_key(key: str, choices: Mapping[str, str] | None = None) -> str | None:
    """The dotted key whose last name is ``key`` or another tool's name for it (``seq_len``: model.context) in
    the config of ``choices`` (None: conf/train.yaml's defaults); None: no such key. Leaves match by name only:
    a hundred of them hold many similar names (``save_steps`` is not train.steps)."""
    if choices is None:
        choices = {g: n for g in GROUPS if (n := plainconf.default_choice(conf_dir() / "train.yaml", g)) is not None}
    by_leaf = {}
    schemas = [("", RootSchema), *((f"{g}.", registry(g).get(n).config) for g in GROUPS
                                   if (n := choices.get(g) or (DEFAULT_STAGE if g == "stage" else None)))]
    for prefix, schema in schemas:   # (breadth first: a nested schema's appended while the list is walked)
        for f in dataclasses.fields(schema):
            name = plainconf.yaml_name(f.name)
            if dataclasses.is_dataclass(sub := typing.get_type_hints(schema)[f.name]):
                schemas.append((f"{prefix}{name}.", sub))
            else:
                by_leaf.setdefault(name, prefix + name)
    match = closest(key, by_leaf, 1.0, KEY_ALIASES)
    return by_leaf[match] if match else None


def _refuse_hydra_resolver(node: Any, prefix: str) -> None:
    """A ``${hydra:...}`` value: one line. The config is composed and checked before Hydra runs (and its
    run folder exists), where only a job could resolve it: the checks would have judged another value."""
    items = node.items() if isinstance(node, Mapping) else enumerate(node) if isinstance(node, list) else ()
    for k, v in items:
        key = f"{prefix.rstrip('.')}[{k}]" if isinstance(node, list) else f"{prefix}{k}"
        if isinstance(v, str) and "${hydra:" in v:
            raise ConfigError(f"config: {key}={v}: hydra: interpolations are not supported in framework keys (they "
                              "resolve only inside Hydra's job, after the config is checked); checkpoint.dir defaults "
                              "to the run folder's checkpoints/, else use ${oc.env:...} or an explicit path")
        _refuse_hydra_resolver(v, f"{key}.")


INT_LIMIT = 2 ** 63   # every integer key ends up in a C long or int64 tensor somewhere
MAX_TIMEOUT_S = 1e9   # timedelta ends near 8.6e13 s; torch takes a timeout as int64 milliseconds


def _check_numbers(node: Any, prefix: str) -> None:
    """Every number of a typed node (and its nested nodes) finite and within int64: NaN or inf
    (``nan``, ``1e309``) would silently disable a comparison-based limit (``norm > nan`` is
    never true) and an integer beyond int64 ends in an OverflowError deep inside torch."""
    for f in dataclasses.fields(node):
        value, key = getattr(node, f.name), f"{prefix}{f.name.rstrip('_')}"
        if dataclasses.is_dataclass(value):
            _check_numbers(value, f"{key}.")
        for v in (value if isinstance(value, (list, tuple)) else [value]):   # (a bool is an int within range)
            if isinstance(v, float) and not math.isfinite(v):
                raise ConfigError(f"config: {key}={v} is not a finite number; give a finite value")
            if isinstance(v, int) and not -INT_LIMIT <= v < INT_LIMIT:
                raise ConfigError(f"config: {key}={v} is out of range (integers must lie within +-2^63); "
                                  "give a realistic value")


def _check_values(root: RootSchema) -> None:
    t, d, c = root.train, root.dist, root.checkpoint
    for key, value, valid in (("train.on_nonfinite", t.on_nonfinite, ("stop", "warn")),
                              ("dist.backend", d.backend, ("auto", "gloo", "nccl"))):
        if value not in valid:
            raise ConfigError(f"config: {key} must be {', '.join(valid[:-1])} or {valid[-1]}, got "
                              f"{value!r}{closest_hint(value, valid)}")
    least = {**{f"train.{k}": (getattr(t, k), 1) for k in ("steps", "micro_batch", "grad_accum", "log_every",
                                                           "eval_batches")},
             "train.eval_every": (t.eval_every, 0), "train.grad_clip": (t.grad_clip, 0), "dist.nproc": (d.nproc, 1),
             "checkpoint.every": (c.every, 0), "checkpoint.keep_last": (c.keep_last, 0)}
    for key, (value, bound) in least.items():
        if value < bound:
            raise ConfigError(f"config: {key} must be >= {bound}, got {value:g}")
    for key, value in (("dist.timeout_s", d.timeout_s), ("checkpoint.timeout_s", c.timeout_s)):
        if value <= 0:
            raise ConfigError(f"config: {key} must be > 0, got {value:g}")
        if value > MAX_TIMEOUT_S:   # a larger one overflows the timeout torch is given
            raise ConfigError(f"config: {key} must be at most {MAX_TIMEOUT_S:g} s (about 31 years), got {value:.17g}")
    if not c.resume.strip() or (c.dir is not None and not c.dir.strip()):
        raise ConfigError("config: checkpoint.resume must be auto, off, latest or a path, and checkpoint.dir a path "
                          "(or null: checkpoints/ in the run folder)")
    if root.ds_config_strict and root.ds_config is None:
        raise ConfigError("config: ds_config_strict=true does nothing without a DeepSpeed file; add ds_config=FILE "
                          "or remove ds_config_strict")


def check_compatible(stage: str, offload: str, defaulted: bool = False) -> None:
    """``defaulted``: no stage was chosen, so the fix is choosing one, as +stage= (stage=zero3, after the
    table's "stage zero3", is a second error: the group has no default to override)."""
    table = "config.COMPATIBLE (framework/config/schema.py)"
    if stage not in COMPATIBLE:   # (a stage of one's own, or another package's: the table is in-tree only)
        raise ConfigError(f"config: stage {stage} has no row in {table}; add {stage!r}: (the offload tiers it "
                          f"supports, e.g. \"none\",) there")
    if not any(offload in o for o in COMPATIBLE.values()):
        raise ConfigError(f"config: offload {offload} is in no row of {table}; add it to the rows of the stages "
                          f"that support it")
    if offload not in COMPATIBLE[stage]:
        combos = "; ".join(f"stage {s} with offload {'|'.join(o)}" for s, o in COMPATIBLE.items())
        fix = " or ".join(", ".join(f"+stage={s}" for s, o in COMPATIBLE.items() if offload in o).rsplit(", ", 1))
        raise ConfigError(f"config: offload={offload} is not supported with stage={stage}; valid: {combos}"
                          f"{f'; add {fix}' if defaulted and fix else ''}")


def check_batch_world(cfg: Config, world: int) -> None:
    """One line for a DeepSpeed file's train_batch_size divided over another world size than the run has
    (composed before the launcher's world was known): its global batch would silently not be the file's."""
    if cfg.batch_world is None or cfg.batch_world == world:
        return
    per_rank = cfg.train.micro_batch * cfg.train.grad_accum
    raise ConfigError(f"ds_config: its train_batch_size={per_rank * cfg.batch_world} was divided over "
                      f"{counted(cfg.batch_world, 'rank')} when the config was composed, but this run has {world} (a global "
                      f"batch of {per_rank * world}); compose it for {counted(world, 'rank')} (framework.compose(..., "
                      f"world={world}); under torchrun, or Hydra's submitit launcher with -m, the world is known "
                      f"then), or give the file train_micro_batch_size_per_gpu and gradient_accumulation_steps "
                      f"instead of train_batch_size")


def check_ranks_agree(configs: list[Mapping]) -> None:
    """One line, raised alike on every rank, where a rank's composed config (``Config.to_dict``, one per rank)
    differs from rank 0's: every rank trains rank 0's, so a per-rank override would be dropped without a word."""
    first = flat(configs[0])
    for rank, config in enumerate(configs[1:], 1):
        other = flat(config)
        if key := next((k for k in {**first, **other} if first.get(k, _UNSET) != other.get(k, _UNSET)), None):
            said = [repr(c.get(key)) if key in c else "unset" for c in (other, first)]
            # (a ${now:...} resolves on each rank at its own instant: the same override, differing text)
            now = "; a ${now:...} in it resolves per rank: give the value literally, or put it in hydra.run.dir " \
                  "(rank 0's is used)" if all(isinstance(c.get(key), str) for c in (other, first)) else ""
            raise on_every_rank(ConfigError(
                f"config: rank {rank}'s config differs from rank 0's at {key} ({said[0]} vs {said[1]}): every rank "
                f"must be given the same config and overrides (the framework splits the data across the ranks "
                f"itself{now})"))


_UNSET = object()


def check_model_vocab(cfg: Config, data_vocab: int) -> None:
    """A model.vocab_size stated on the command line that the data's vocabulary (which sets the model's) overrides:
    one line, from training and the estimate alike. Every rank has the same config and data: raised alike on each
    (the launcher prints it once, not as a rank's exit)."""
    if cfg.sources.get("model.vocab_size") == COMMAND_LINE and cfg.model.vocab_size != data_vocab:
        raise on_every_rank(ConfigError(
            f"model.vocab_size={cfg.model.vocab_size} differs from the {data_vocab} token ids of the data, which set "
            "the model's vocabulary; drop model.vocab_size (set data.vocab_size where the data source has it)"))
