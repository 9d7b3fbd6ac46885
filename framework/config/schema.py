"""The typed schemas of the top-level keys, the frozen ``Config`` a composed config becomes, and
the table of which offload targets each stage supports."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping

from framework.core.registry import GROUPS

DEFAULT_STAGE = "ddp"  # no +stage=... means replicated data parallelism


@dataclass(frozen=True, kw_only=True)
class TrainLoopConfig:
    steps: int
    micro_batch: int
    grad_accum: int = 1
    log_every: int = 25
    eval_every: int = 100       # 0: evaluate only at the end
    eval_batches: int = 16
    grad_clip: float = 1.0      # max global gradient norm; 0 disables clipping
    on_nonfinite: str = "stop"  # non-finite loss, or gradient norm outside fp16 loss scaling: stop | warn (skip the step)


@dataclass(frozen=True, kw_only=True)
class DistConfig:
    nproc: int = 1              # >1: spawn this many local ranks (under torchrun: 1 or its WORLD_SIZE)
    backend: str = "auto"       # auto | gloo | nccl
    timeout_s: float = 300.0    # any collective waiting longer fails with a message


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    dir: str | None = None      # None: checkpoints/ in the run folder; relative paths: to the working directory
    every: int = 0              # save every N steps and after the last one; 0: never save
    keep_last: int = 2          # committed checkpoints kept (older ones deleted after a commit); 0: all
    resume: str = "auto"        # auto (newest complete checkpoint in dir) | off | latest (newest of any run) | PATH
    # YAML key `async`: write files in a background thread while training goes on (a swapped state,
    # offload=nvme, is written from the swap file on the training thread: no host copy of it)
    async_: bool = False
    timeout_s: float = 1800.0   # checkpoint collectives (their own gloo group) wait at most this long


@dataclass(frozen=True, kw_only=True)
class RootSchema:
    seed: int = 1337
    train: TrainLoopConfig
    dist: DistConfig = field(default_factory=DistConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    ds_config: str | None = None      # a DeepSpeed JSON config ("<dict>": given as a dict), under the command line
    ds_config_strict: bool = False    # keys DeepSpeed does not know in it: an error instead of a warning


ROOT_KEYS = tuple(f.name for f in dataclasses.fields(RootSchema))


class ReadOnlyDict(dict):
    """A mapping of the frozen ``Config`` (``choices``, ``sources``): a write is refused like a field's, since
    ``initialize`` reads it without checking again. A dict, not a mappingproxy, so that it pickles (a spawned
    rank's Config) and hashes (the Config does)."""

    def _refuse(self, *_args, **_kwargs):
        raise TypeError("the composed config is read-only (its checks ran at compose): compose again with the "
                        "change as an override, e.g. framework.compose([..., 'optimizer=sgd'])")

    __setitem__ = __delitem__ = __ior__ = update = pop = popitem = clear = setdefault = _refuse

    def __reduce__(self):   # (pickle's default refills the dict through __setitem__)
        return type(self), (dict(self),)

    def __hash__(self) -> int:
        return hash(frozenset(self.items()))


def _plain(value: Any) -> Any:
    """``value`` with the tuples a composed config holds its lists in as lists again (YAML/JSON/W&B form)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return [_plain(v) for v in value] if isinstance(value, (tuple, list)) else value


def tuples(node: Any) -> Any:
    """``node`` (a frozen component config) with its list fields as tuples, at every level: frozen all through
    (an append after compose would skip the checks) and hashable."""
    if dataclasses.is_dataclass(node):
        changed = {f.name: new for f in dataclasses.fields(node) if f.init
                   and (new := tuples(old := getattr(node, f.name))) is not old}
        return dataclasses.replace(node, **changed) if changed else node
    return tuple(map(tuples, node)) if isinstance(node, (list, tuple)) else node


@dataclass(frozen=True)
class Config(RootSchema):
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
    # Where each value came from, keyed like flat(to_dict()): default, YAML, DeepSpeed file,
    # DeepSpeed default, auto, command line.
    sources: Mapping[str, str] = field(default_factory=dict)
    notices: tuple[str, ...] = ()    # the DeepSpeed config's and the components' notes, printed once at start-up
    # The world size a DeepSpeed file's train_batch_size was divided over (None: no such batch); a
    # launch with another world size is refused (its global batch would not be the file's).
    batch_world: int | None = None
    # checkpoint.resume as the user gave it where the launch resolved it to a folder (latest): what messages say
    resume_given: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "choices", ReadOnlyDict(self.choices))
        object.__setattr__(self, "sources", ReadOnlyDict(self.sources))
        for group in GROUPS:   # (a group swapped in with dataclasses.replace(cfg, stage=...) is frozen alike)
            object.__setattr__(self, group, tuples(getattr(self, group)))

    def to_dict(self) -> dict:
        """Plain, resolved config (for logging and summary files)."""
        out = {k: getattr(self, k) for k in ROOT_KEYS}
        for k in ("train", "dist", "checkpoint"):   # YAML spells the schema's async_ (a Python keyword) async
            out[k] = {f.rstrip("_"): v for f, v in dataclasses.asdict(out[k]).items()}
        return _plain(out | {g: {"name": self.choices[g], **dataclasses.asdict(getattr(self, g))} for g in GROUPS})


def flat(tree: Mapping, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1} (lists and empty mappings are leaves)."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping) and value:
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def get_key(tree: Mapping, dotted: str) -> Any:
    """``tree["a"]["b"]`` for ``"a.b"``; None where a part is missing."""
    for part in dotted.split("."):
        tree = tree.get(part) if isinstance(tree, Mapping) else None
    return tree


# Which offload targets each stage supports (the one table; tested). ZeRO stages add rows.
COMPATIBLE: Mapping[str, tuple[str, ...]] = {"ddp": ("none",),
                                             **dict.fromkeys(("zero1", "zero2", "zero3"), ("none", "cpu", "nvme"))}


def reads_grad_accum_dtype(stage: str, grad_accum: int, reduce_fp32: bool) -> bool:
    """Whether ``stage`` reads precision.grad_accum_dtype: zero2 and zero3 keep their gradients in it; ddp and
    zero1 only sum earlier micro batches in it (train.grad_accum > 1) or land a wider wire's sums (bf16's
    reduce_fp32)."""
    return stage not in ("ddp", "zero1") or grad_accum > 1 or reduce_fp32
