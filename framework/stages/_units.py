"""zero3's gather units: which parameters each unit gathers and which stay gathered, for the stage and the
memory model alike, so the two cannot disagree."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from framework.core.errors import ConfigError
from framework.core.registry import closest_hint
from framework.models.hf import declared_layers

Named = list[tuple[str, nn.Parameter]]
# Our GPT's layer: a unit by default where present (a model without it has none); other names must match.
DEFAULT_GATHER_UNIT = ("Block",)
# Modules whose own forward reads their children's weights directly, not through the children's forwards
# (MultiheadAttention passes out_proj.weight to a functional call): a child's hooks would never gather them.
_READS_CHILDREN = (nn.MultiheadAttention,)
# A torch.jit.script'ed module takes no Python hooks and runs its children inside TorchScript: its parent's
# hooks gather all of it.
_NO_HOOKS = (torch.jit.ScriptModule,)


@dataclass(frozen=True)
class UnitPlan:
    name: str                 # for messages and records
    modules: list[nn.Module]  # whose forward hooks gather the unit
    named: Named              # the parameters it gathers, in registration order
    split: bool = False       # a unit only as split_root made it (no stage.gather_unit class, not the root)


def plan_units(module: nn.Module, gather_unit, split_root: bool,
               persistence_threshold: int) -> tuple[list[UnitPlan], Named]:
    """The gather units (the root first, even when empty: its hooks open and close every pass) and the
    parameters that stay gathered: the small ones, then those shared in a way no unit covers. Frozen
    parameters are in neither (whole on every rank)."""
    unit_modules, owner = _assign_units(module, gather_unit, split_root)
    all_named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    units, persistent = [], []
    for idx, (uname, subs, split) in enumerate(unit_modules):
        named = [(n, p) for n, p in all_named if owner[id(p)] == idx]
        persistent += [(n, p) for n, p in named if p.numel() < persistence_threshold]
        big = [(n, p) for n, p in named if p.numel() >= persistence_threshold]
        if idx == 0 or big:   # else nothing left to gather: no unit, no hooks
            units.append(UnitPlan(uname, subs, big, split))
    return units, persistent + [(n, p) for n, p in all_named if owner[id(p)] == -1]


def all_persistent_note(persistent: Named, threshold: int) -> str:
    """The start-up line when no unit has a parameter to gather: the gather keys (prefetch, max_live, reuse
    distance, gather_unit) then change nothing."""
    largest = max(p.numel() for _, p in persistent)
    return (f"note: zero3: every trainable parameter stays gathered (the largest has {largest:,} elements, "
            f"stage.stage3_param_persistence_threshold={threshold:,}): each rank holds the whole model (gradients "
            "and optimizer state are still partitioned) and the stage3_* gather keys change nothing; lower "
            "stage.stage3_param_persistence_threshold (0: every parameter is partitioned and gathered per unit)")


def reuse_notes(node, config) -> list[str]:
    """zero3's notes: a reuse distance below the prefetch bucket, which keeps a unit for reuse anyway
    (``Gatherer`` keeps one whose next use is within max(reuse distance, prefetch bucket - its size))."""
    reuse, prefetch = node.stage3_max_reuse_distance, node.stage3_prefetch_bucket_size
    return [f"note: stage.stage3_max_reuse_distance={reuse:,} is below stage.stage3_prefetch_bucket_size="
            f"{prefetch:,}: a unit stays gathered while at most max(reuse distance, prefetch bucket - its size) "
            "elements come between its uses, so below the bucket the reuse distance changes little or nothing; "
            "lower stage.stage3_prefetch_bucket_size too (or stage.stage3_max_live_parameters) to release units "
            "sooner"] if reuse < prefetch else []


def _assign_units(module: nn.Module, gather_unit,
                  split_root: bool) -> tuple[list[tuple[str, list[nn.Module], bool]], dict[int, int]]:
    """The unit candidates as (name, modules, made by split_root) and per parameter id its candidate's index
    (-1: shared in a way no one unit covers). 0 is the root, then each outermost ``gather_unit`` module; with
    ``split_root`` also every module with parameters of its own (with those it gathers for, ``_gathered_by``),
    merged where they share one (tied weights, or a scripted module that several of them hold)."""
    by = _gathered_by(module)
    owns = {id(g) for m in module.modules() if any(True for _ in m.parameters(recurse=False)) for g in by[id(m)]}
    present = {type(m).__name__ for m in module.modules()}
    if tuple(gather_unit) != DEFAULT_GATHER_UNIT:
        # (a scripted module's class name is a hint too: a near miss of it leads to its own refusal)
        scripted = {getattr(m, "original_name", None) for m in module.modules() if isinstance(m, _NO_HOOKS)}
        for name in gather_unit:
            _refuse_scripted_unit(module, name, by)
            if name not in present:
                raise ConfigError(f"stage.gather_unit: {name!r} matches no module of the model"
                                  f"{closest_hint(name, present | scripted - {None})}")
            _check_named_unit(module, name, by)
    # A Hugging Face model's transformer layers are units too (its _no_split_modules classes).
    classes = set(gather_unit) | set(declared_layers(module))
    cands: list[tuple[str, nn.Module]] = [("<root>", module)]   # 0, then units and own-parameter modules
    where: dict[int, int] = {}   # id(module) -> its candidate (absent: the root)
    gather: list[int] = []       # the candidates that are gather units
    for name, sub in module.named_modules():
        if sub is module or id(sub) in where:
            continue
        if by[id(sub)][0] is not sub:   # gathered with the module whose forward reads it (visited before)
            if id(by[id(sub)][0]) in where:
                where[id(sub)] = where[id(by[id(sub)][0])]
            continue
        if type(sub).__name__ in classes:
            gather.append(len(cands))
            where.update((id(inner), len(cands)) for inner in sub.modules())
        elif split_root and id(sub) in owns:
            where[id(sub)] = len(cands)
        else:
            continue
        cands.append((name, sub))
    holders: dict[int, set] = {}   # id(param) -> the candidates whose modules register it
    is_unit = set(gather)
    for i in gather:  # all of a unit's parameters, also ones another unit shares
        for p in cands[i][1].parameters():
            holders.setdefault(id(p), set()).add(i)
    for sub in module.modules():   # (with every further module that reads it: a shared scripted one)
        for at in {where.get(id(sub), 0)} | {where.get(id(g), 0) for g in by[id(sub)][1:]}:
            if at not in is_unit:
                for p in sub.parameters(recurse=False):
                    holders.setdefault(id(p), set()).add(at)
    # A module inside a unit that a module outside it also holds runs in that module's forward too, where the
    # unit is not gathered (its own hooks are not registered, being a unit's part): it stays gathered.
    for parent in module.modules():
        at = where.get(id(parent), 0)
        for child in parent.children():
            inside = where.get(id(child), 0)
            if inside in is_unit and inside != at and child is not cands[inside][1]:
                for p in child.parameters():
                    holders.setdefault(id(p), set()).add(at)
    # Own-parameter modules that share a parameter are one unit (each member maps to one shared set).
    group = {i: {i} for i in range(1, len(cands)) if i not in is_unit}
    for hs in holders.values():
        if len(hs) > 1 and all(h in group for h in hs):
            merged = set().union(*(group[h] for h in hs))
            for m in merged:
                group[m] = merged
    index = {0: 0} | {i: k + 1 for k, i in enumerate(gather)}
    units = [("<root>", [module], False)] + [(cands[i][0], [cands[i][1]], False) for i in gather]
    for m in group:   # in registration order: each merged unit where its first member is
        if m not in index:
            members = sorted(group[m])
            index.update((k, len(units)) for k in members)
            units.append(("+".join(cands[k][0] for k in members), [cands[k][1] for k in members], True))
    found = {pid: {index[h] for h in hs} for pid, hs in holders.items()}
    return units, {pid: min(f) if len(f) == 1 else -1 for pid, f in found.items()}


def _check_named_unit(module: nn.Module, name: str, by: dict[int, tuple[nn.Module, ...]]) -> None:
    """Refuse a ``gather_unit`` class name that would gather nothing."""
    subs = [m for m in module.modules() if type(m).__name__ == name and m is not module]
    if not subs:
        raise ConfigError(f"stage.gather_unit: {name} is the root module, always a unit: to gather the whole model "
                          f"as one unit set stage.gather_unit=[] and stage.split_root=false")
    if all(by[id(m)][0] is not m for m in subs):
        if all(type(m).forward is nn.Module.forward for m in subs):
            raise ConfigError(f"stage.gather_unit: {name} has no forward of its own (it is never called, so its "
                              f"hooks never gather): name the modules inside it")
        raise ConfigError(f"stage.gather_unit: {name} is read by its parent's own forward, so it is gathered with "
                          f"{type(by[id(subs[0])][0]).__name__}: name that class")
    if not any(p.requires_grad for m in subs for p in m.parameters()):
        raise ConfigError(f"stage.gather_unit: {name} holds no trainable parameters: name a module class that does")


def _refuse_scripted_unit(module: nn.Module, name: str, by: dict[int, tuple[nn.Module, ...]]) -> None:
    """Refuse a ``gather_unit`` name that matches only torch.jit.script'ed modules (by the class they were
    scripted from, or by ScriptModule's own class names), saying so: they are there, but cannot be units."""
    subs = [m for m in module.modules() if m is not module and isinstance(m, _NO_HOOKS)
            and name in (type(m).__name__, getattr(m, "original_name", None))]
    if not subs or any(type(m).__name__ == name for m in module.modules()
                       if m is not module and not isinstance(m, _NO_HOOKS)):
        return
    scripted = getattr(subs[0], "original_name", type(subs[0]).__name__)
    # Scripted as part of a scripted ancestor, it cannot be passed unscripted alone: the outermost one can.
    top = next(m for m in module.modules() if isinstance(m, _NO_HOOKS) and any(k is subs[0] for k in m.modules()))
    outer = getattr(top, "original_name", type(top).__name__)
    what = f"{scripted} is" if top is subs[0] else f"{scripted} is inside {outer}, which is"
    holder = by[id(subs[0])][0]
    with_it = ("the root module's unit" if holder is module
               else f"the unit of the module that calls it ({type(holder).__name__}: name that class instead)")
    raise ConfigError(f"stage.gather_unit: {what} torch.jit.script'ed: a ScriptModule takes no Python hooks, "
                      f"so it cannot be a unit and zero3 gathers it with {with_it}; or pass {outer} unscripted")


def _gathered_by(module: nn.Module) -> dict[int, tuple[nn.Module, ...]]:
    """Per module id, the modules whose forward hooks must gather its own parameters: itself, except a module
    with no forward of its own (``nn.ParameterList``: its parent reads them) and everything inside a
    ``_READS_CHILDREN`` or ``_NO_HOOKS`` module, which go with that parent. A shared module that goes with its
    parent goes with every parent that holds it: each one's forward runs it without hooks of its own."""
    by: dict[int, tuple[nn.Module, ...]] = {}

    def visit(m: nn.Module, parent: nn.Module | None, whole: bool) -> None:   # whole: in a _READS_CHILDREN one
        # (containers go with their parent too: their children are judged on their own)
        own = parent is None or not whole and not isinstance(m, _NO_HOOKS) and type(m).forward is not nn.Module.forward
        via = (m,) if own else by[id(parent)]
        if id(m) in by:   # met before (pre-order, as named_modules): one that gathers itself is done already
            via = () if own else tuple(g for g in via if all(g is not k for k in by[id(m)]))
            if not via:
                return
        by[id(m)] = by.get(id(m), ()) + via
        for c in m.children():
            visit(c, m, whole or isinstance(m, _READS_CHILDREN + _NO_HOOKS))

    visit(module, None, False)
    return by
