"""Component registries: one conf/ group = one registry = one folder of code.

A component is a public module (no leading underscore, not base.py) of the group's package defining
``COMPONENT = Component(config=<dataclass>, build=<callable>)``, named by its file name (also the YAML
file name in ``conf/<group>/``); or ``COMPONENTS = {name: Component, ...}`` for several (the model
sizes, zero1 and zero2). Discovery is read-only: nothing registers itself at import time. A group's package
may define ``UNKNOWN_HINT``: what an unknown name's error adds (another way to name what was meant; a function
of the name where that depends on it), and
``check_entry(module_name, name, component)``: what its entries need beyond a ``Component`` (the models' loss,
the optimizers' lr), refused in one line when discovered.

Components of other packages: an installed distribution's entry points in group ``framework.<group>``
(``framework.optimizer``, ...), each named by its component name and naming a module (read as above) or a
``module:attribute`` ``Component``; checked as the package's own, a name taken twice refused. Their YAML files
go in a folder of the user's (``--config-dir`` or ``hydra.searchpath``). Discovery reads ``sys.path`` once per
group and process (``registry.cache_clear()`` reads it again).
"""
from __future__ import annotations

import dataclasses
import difflib
import importlib
import inspect
import pkgutil
import re
from dataclasses import dataclass, field
from functools import cache
from importlib.metadata import EntryPoint, entry_points
from types import MappingProxyType, ModuleType
from typing import Any, Callable, Mapping

from framework.core.errors import ConfigError

# conf/ group name -> package that holds its components.
GROUPS: Mapping[str, str] = MappingProxyType({
    "model": "framework.models",
    "data": "framework.data",
    "optimizer": "framework.optimizers",
    "scheduler": "framework.schedulers",
    "precision": "framework.precision",
    "offload": "framework.offload",
    "logger": "framework.loggers",
    "stage": "framework.stages",
})

# How the framework calls each group's ``build`` (docs/architecture.md): a component whose build cannot be called
# so is refused when its registry is read, not with a TypeError inside the engine.
BUILD_CALLS: Mapping[str, tuple[str, ...]] = MappingProxyType({
    "model": ("build(cfg, vocab_size=V)",),
    "data": ("build(cfg, seed=S, context=C)",),
    "optimizer": ("build(cfg, decay_mask)",),
    "scheduler": ("build(cfg, base_lr=LR, total_steps=N)",),
    "precision": ("build(cfg)",),
    "offload": ("build(cfg, accelerator=A)", "build(cfg)"),
    "logger": ("build(cfg, run=R)",),
    "stage": ("build(cfg, dist=D, offload=O)",),
})


@dataclass(frozen=True)
class Component:
    """A buildable thing: ``config`` is the typed schema of its YAML node, ``build`` makes it.
    ``check(node, stage, nodes)`` validates the node against the chosen stage and the other groups' nodes
    (``nodes``: group -> node, read-only), one line per error, and returns it with ``auto`` values resolved;
    ``notes(node, config)`` returns the notices its values call for (``config``: the run's checked
    ``framework.config.Config``, every group's node resolved, e.g. ``config.train.steps``). So the configuration
    layer imports no component.
    ``vocab(node, seed=, context=)``: a data source's ``vocab_size`` without building it, where building costs
    more than learning it (the memory tools need only the vocabulary)."""

    config: type
    build: Callable[..., Any]
    check: Callable[[Any, str, Mapping[str, Any]], Any] | None = field(default=None, kw_only=True)
    notes: Callable[[Any, Any], list[str]] | None = field(default=None, kw_only=True)
    vocab: Callable[..., int] | None = field(default=None, kw_only=True)


@dataclass(frozen=True)
class Registry:
    group: str
    entries: Mapping[str, Component]
    hint: str | Callable[[str], str] = ""   # the package's UNKNOWN_HINT

    def names(self) -> list[str]:
        return sorted(self.entries)

    def get(self, name: str) -> Component:
        if name not in self.entries:
            hint = self.hint(name) if callable(self.hint) else self.hint
            raise ConfigError(f"config: unknown {self.group} {name!r}{closest_hint(name, self.entries)}; "
                              f"available: {', '.join(self.names())}{'; ' + hint if hint else ''}")
        return self.entries[name]


def closest(name: str, valid, cutoff: float = 0.5, aliases: Mapping[str, str] | None = None) -> str | None:
    """The valid name closest to a mistyped one (None: nothing close): every "did you mean" comes from here.
    ``aliases``: other tools' names (lower case) for valid ones, which no spelling distance finds."""
    return next(iter(closest_all(name, valid, cutoff, aliases)), None)


def closest_all(name: str, valid, cutoff: float = 0.5, aliases: Mapping[str, str] | None = None) -> list[str]:
    """Every valid name as close as the closest one (empty: nothing close). A tie is named whole:
    picking one (shakespeare_char: _gpu, not _cpu) would point a user at whichever name sorts last."""
    valid, name = [str(v) for v in valid], str(name)
    if name in valid:   # (before the aliases: a key of that very name beats another tool's meaning)
        return [name]
    if (alias := (aliases or {}).get(name.lower())) in valid:
        return [alias]
    # Another case or CamelCase names the one meant before any spelling distance (AdamW: adamw, not adam;
    # WarmupCosineLR: warmup_cosine_lr, not warmup_cosine).
    folded = {v.lower(): v for v in valid}
    snake = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).lower()
    if (same := folded.get(name.lower()) or folded.get(snake)) is not None:
        return [same]
    # Of the close ones, those that start with what was typed first (gpt2: gpt2-small, not gpt-1b).
    near = difflib.get_close_matches(name.lower(), folded, n=max(1, len(folded)), cutoff=cutoff)
    near = [m for m in near if m.startswith(name.lower())] or near
    score = {m: difflib.SequenceMatcher(None, m, name.lower()).ratio() for m in near}   # (get_close_matches' order)
    return [folded[m] for m in near if score[m] == score[near[0]]]


def closest_hint(name: str, valid, aliases: Mapping[str, str] | None = None) -> str:
    *most, last = sorted(closest_all(name, valid, aliases=aliases)) or [None]
    return f" (did you mean {', '.join(repr(m) for m in most)}{' or ' if most else ''}{last!r}?)" if last else ""


@cache
def registry(group: str) -> Registry:
    """The registry of one conf/ group, discovered once from its package."""
    if group not in GROUPS:
        raise ConfigError(f"unknown config group {group!r}{closest_hint(group, GROUPS)}")
    package = importlib.import_module(GROUPS[group])
    entries: dict[str, Component] = {}
    defined_by: dict[str, str] = {}   # name -> the module defining it
    check = getattr(package, "check_entry", None)

    def add(found: dict[str, Component], source: str, where: str, yaml: str, point: EntryPoint | None = None) -> None:
        for name, component in found.items():
            # (a second module's entry would silently replace the first for every run choosing that name)
            if name in defined_by:
                raise ConfigError(f"{group} {name!r} is defined by both {defined_by[name]} and {where}: rename one "
                                  f"(and its YAML file {yaml}{group}/{name}.yaml)")
            defined_by[name] = source
            try:
                _check_build(group, source, name, component)
                _check_frozen(group, source, name, component.config)
                if check is not None:
                    check(source, name, component)
            except ConfigError as e:
                if point is None:
                    raise
                # checked like a built-in, so it stops runs that never choose it: say whose it is and the way out
                raise ConfigError(f"{e} ({name!r} is an entry point of {_owner(point)}, read by every run: fix it "
                                  f"there, or {_uninstall(point)})") from None
        entries.update(found)

    for info in pkgutil.iter_modules(package.__path__):
        if info.name.startswith("_") or info.name == "base":  # protocols, not components
            continue
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        add(components_of(module, info.name), module.__name__, module.__name__, "conf/")
    for point in entry_points(group=f"framework.{group}"):   # other packages' components (see above)
        add(_plugin(group, point), point.value, f"{point.value} (entry point of {_owner(point)})", "", point)
    return Registry(group, MappingProxyType(entries), getattr(package, "UNKNOWN_HINT", ""))


def _plugin(group: str, point: EntryPoint) -> dict[str, Component]:
    """The entries of one entry point: a module (its ``COMPONENT``, under the entry point's name, or its
    ``COMPONENTS``) or a ``module:attribute`` naming a ``Component``."""
    try:
        loaded = point.load()
    except Exception as e:   # (another package's code: whatever it raises is that package's to fix)
        raise ConfigError(f"{group} {point.name!r}: its entry point {point.value} (group framework.{group}, of "
                          f"{_owner(point)}) failed to load: {type(e).__name__}: {e}; fix or uninstall that "
                          f"package") from None
    if isinstance(loaded, Component):
        return {point.name: loaded}
    if isinstance(loaded, ModuleType) and (hasattr(loaded, "COMPONENT") or hasattr(loaded, "COMPONENTS")):
        return components_of(loaded, point.name)
    raise ConfigError(f"{group} {point.name!r}: its entry point {point.value} (group framework.{group}, of "
                      f"{_owner(point)}) names neither a module defining COMPONENT (or COMPONENTS) nor a Component")


def _owner(point: EntryPoint) -> str:
    return f"package {point.dist.name}" if point.dist is not None else "an installed package"


def _uninstall(point: EntryPoint) -> str:
    return f"pip uninstall {point.dist.name}" if point.dist is not None else "uninstall that package"


def _check_build(group: str, module_name: str, name: str, component: Component) -> None:
    """``component.build`` callable as the framework calls it (``BUILD_CALLS``): one line naming the call."""
    try:
        signature = inspect.signature(component.build)
    except (TypeError, ValueError):   # (a builtin without one: left to the call)
        return
    for call in BUILD_CALLS.get(group, ()):
        args = call[call.index("(") + 1:-1].split(", ")
        try:
            signature.bind(*(None for a in args if "=" not in a), **{a.split("=")[0]: None for a in args if "=" in a})
        except TypeError as e:
            raise ConfigError(f"{group} {name!r} ({module_name}): its build{signature} cannot be called as the "
                              f"framework calls it, {call} ({e}); give it that signature (docs/architecture.md)"
                              ) from None


def _check_frozen(group: str, module_name: str, name: str, config: type) -> None:
    """A component's config is a frozen dataclass: every check runs at compose time, so a field set afterwards
    (``cfg.optimizer.lr = -3``) would train unchecked. It is the class: a node's values make an instance of it."""
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        raise ConfigError(f"{group} {name!r} ({module_name}): its config is an instance of {type(config).__name__}, "
                          f"not the class; give the class: Component(config={type(config).__name__}, ...)")
    if not (dataclasses.is_dataclass(config) and config.__dataclass_params__.frozen):
        what = "not frozen" if dataclasses.is_dataclass(config) else "not a dataclass"
        raise ConfigError(f"{group} {name!r} ({module_name}): its config {getattr(config, '__name__', config)} is "
                          f"{what} (a composed config is checked once and cannot change after); declare it "
                          f"@dataclass(frozen=True, kw_only=True)")


def require_fields(group: str, module_name: str, name: str, config: type, fields: tuple[tuple[str, str], ...],
                   why: str) -> None:
    """A package's ``check_entry``: one line where ``config`` lacks any of ``fields`` (each a name and the
    declaration the line tells to add), saying ``why`` training reads them."""
    have = {f.name for f in dataclasses.fields(config)} if dataclasses.is_dataclass(config) else set()
    if missing := [(f, declared) for f, declared in fields if f not in have]:
        raise ConfigError(f"{group} {name!r} ({module_name}): its config {config.__name__} has no field "
                          f"{' and no field '.join(f for f, _ in missing)} ({why}); add "
                          f"{', '.join(declared for _, declared in missing)} to it (its YAML file may set "
                          f"{'them' if len(missing) > 1 else 'it'})")


def components_of(module, name: str) -> dict[str, Component]:
    """The entries a public module (``name``) of a registry package defines: its ``COMPONENTS``, or its
    ``COMPONENT`` under its own name. Every public module there is read as one (a helper is private: ``_name``)."""
    if hasattr(module, "COMPONENTS"):
        return dict(module.COMPONENTS)
    if hasattr(module, "COMPONENT"):
        return {name: module.COMPONENT}
    raise ConfigError(f"{module.__name__} is in a registry package but defines no COMPONENT (or COMPONENTS): if "
                      f"it is a helper, not a component, prefix its file name with _ ({name}.py -> _{name}.py)")
