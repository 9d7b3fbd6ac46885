"""Typed, strict configuration: Hydra composes YAML, these schemas validate it.

Every node is checked against a dataclass: the top-level keys against ``RootSchema`` and each
group's node against the schema of the component chosen for that group. An unknown key, a
typo or a wrong type raises ConfigError with one line naming the bad key and the closest
valid one. The result is a frozen ``Config`` that is plain data (it pickles to spawned ranks).
"""
from __future__ import annotations

import dataclasses
import difflib
import typing
from dataclasses import dataclass, field
from typing import Any, Mapping

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from framework.errors import ConfigError
from framework.registry import GROUPS, closest_hint, registry

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


@dataclass(kw_only=True)
class DistConfig:
    nproc: int = 1              # >1: spawn this many local ranks (ignored under torchrun)
    backend: str = "auto"       # auto | gloo | nccl
    timeout_s: float = 300.0    # any collective waiting longer fails with a message


@dataclass(kw_only=True)
class RootSchema:
    seed: int = 1337
    train: TrainLoopConfig
    dist: DistConfig = field(default_factory=DistConfig)


@dataclass(frozen=True)
class Config:
    seed: int
    train: TrainLoopConfig
    dist: DistConfig
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

    def to_dict(self) -> dict:
        """Plain, resolved config (for logging and summary files)."""
        out = {"seed": self.seed, "train": dataclasses.asdict(self.train), "dist": dataclasses.asdict(self.dist)}
        for g in GROUPS:
            out[g] = {"name": self.choices[g], **dataclasses.asdict(getattr(self, g))}
        return out


def _check_keys(node: Any, schema: type, prefix: str) -> None:
    if not isinstance(node, Mapping):
        raise ConfigError(f"config: {prefix.rstrip('.') or 'config'} must be a mapping, got {node!r}")
    hints = typing.get_type_hints(schema)
    valid = [f.name for f in dataclasses.fields(schema)]
    for key, value in node.items():
        if key not in valid:
            match = difflib.get_close_matches(str(key), valid, n=1, cutoff=0.5)
            hint = f" (did you mean '{prefix}{match[0]}'?)" if match else ""
            raise ConfigError(f"config: unknown key '{prefix}{key}'{hint}; valid keys under "
                              f"{prefix.rstrip('.') or 'the top level'}: {', '.join(valid) or 'none'}")
        if dataclasses.is_dataclass(hints[key]) and isinstance(value, Mapping):
            _check_keys(value, hints[key], f"{prefix}{key}.")


def _typed(node: Mapping, schema: type, prefix: str) -> Any:
    _check_keys(node, schema, prefix)
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), node)
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or ""
        msg = str(e).splitlines()[0]
        raise ConfigError(f"config: {prefix}{key}: {msg}" if key else f"config: {prefix.rstrip('.')}: {msg}") from None


def validate(cfg: DictConfig | Mapping, choices: Mapping[str, str]) -> Config:
    """Check a composed config against the schemas; return the typed, frozen Config."""
    raw = OmegaConf.to_container(cfg, resolve=False) if isinstance(cfg, DictConfig) else dict(cfg)
    raw.pop("hydra", None)  # Hydra's own node; some of its fields only resolve inside a job
    try:
        raw = OmegaConf.to_container(OmegaConf.create(raw), resolve=True)
    except OmegaConfBaseException as e:
        raise ConfigError(f"config: {' '.join(str(e).split())}") from None
    roots = [f.name for f in dataclasses.fields(RootSchema)] + list(GROUPS)
    for key in raw:
        if key not in roots:
            raise ConfigError(f"config: unknown key '{key}'{closest_hint(key, roots)}; "
                              f"valid top-level keys: {', '.join(roots)}")
    root = _typed({k: raw[k] for k in ("seed", "train", "dist") if k in raw}, RootSchema, "")
    chosen, nodes = {}, {}
    for group in GROUPS:
        name = choices.get(group) or (DEFAULT_STAGE if group == "stage" else None)
        if name is None:
            raise ConfigError(f"config: no {group} chosen; add {group}=NAME "
                              f"(one of {', '.join(registry(group).names())})")
        schema = registry(group).get(name).config
        nodes[group] = _typed(raw.get(group) or {}, schema, f"{group}.")
        chosen[group] = name
    _check_values(root)
    check_compatible(chosen["stage"], chosen["offload"])
    _check_inert_stage_keys(chosen["stage"], nodes["stage"])
    nodes["offload"] = _check_offload(chosen["stage"], chosen["offload"], nodes["offload"])
    return Config(seed=root.seed, train=root.train, dist=root.dist, choices=chosen, **nodes)


def _check_values(root: RootSchema) -> None:
    t = root.train
    for key in ("steps", "micro_batch", "grad_accum", "log_every", "eval_batches"):
        if getattr(t, key) < 1:
            raise ConfigError(f"config: train.{key} must be >= 1, got {getattr(t, key)}")
    if t.eval_every < 0 or t.grad_clip < 0:
        raise ConfigError("config: train.eval_every and train.grad_clip must be >= 0")
    if root.dist.nproc < 1 or root.dist.timeout_s <= 0:
        raise ConfigError("config: dist.nproc must be >= 1 and dist.timeout_s > 0")


def _check_offload(stage: str, offload: str, node: Any) -> Any:
    """Offload keys that depend on the stage; returns the node with ``auto`` values resolved."""
    if offload == "nvme":
        from framework.offload.nvme import resolve
        return resolve(node, stage)
    if offload == "cpu":
        if node.params not in ("none", "cpu"):
            hint = {"nvme": " (parameter shards on disk: offload=nvme)",
                    "True": " (the former offload.params=true is offload.params=cpu)",
                    "False": " (the former offload.params=false is offload.params=none)"}.get(str(node.params), "")
            raise ConfigError(f"config: offload.params must be none or cpu with offload=cpu, got "
                              f"{node.params!r}{hint}")
        if node.params == "cpu" and stage != "zero3":
            raise ConfigError(f"config: offload.params=cpu (parameter offload) needs +stage=zero3, got "
                              f"stage={stage}; use offload.params=none or +stage=zero3")
    return node


def _check_inert_stage_keys(stage: str, node: Any) -> None:
    """DeepSpeed keys that the ZeRO stages accept (so that configs port over) but whose other value
    would do nothing here: refused, naming the fix, rather than silently ignored."""
    if stage in ("zero1", "zero2") and node.round_robin_gradients:
        raise ConfigError(f"config: stage.round_robin_gradients=true is not implemented with stage={stage} "
                          f"(DeepSpeed's interleaving of gradient partitions for host copies); remove it or set false")
    if stage == "zero1" and not node.contiguous_gradients:
        raise ConfigError("config: stage.contiguous_gradients=false has no effect with stage=zero1 (its gradients "
                          "always accumulate in one contiguous flat buffer); remove it, or use +stage=zero2")


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
    from hydra.core.override_parser.overrides_parser import OverridesParser

    out = []
    for line, o in zip(overrides, OverridesParser.create().parse_overrides(overrides)):
        key = o.key_or_group
        is_plain = not (o.is_add() or o.is_force_add() or o.is_delete())
        is_choice = key.split("@")[0] in GROUPS
        out.append("++" + line if is_plain and not is_choice and not key.startswith("hydra") else line)
    return out


def compose(overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Compose conf/train.yaml with Hydra-style overrides and validate it (library use)."""
    from hydra import compose as hydra_compose, initialize_config_dir
    from hydra.errors import HydraException

    from framework.paths import conf_dir

    try:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
            cfg = hydra_compose("train", overrides=group_overrides_to_force(list(overrides)),
                                return_hydra_config=True)
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError("config: " + " ".join(str(e).split())) from None
    choices = {k: v for k, v in cfg.hydra.runtime.choices.items() if k in GROUPS}
    return validate(cfg, choices)
