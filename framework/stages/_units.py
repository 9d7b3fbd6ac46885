"""zero3's gather units: which parameters each unit gathers and which stay gathered, for the stage
(``_gather``) and the memory model (``framework.memory.model``) alike, so the two cannot disagree."""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from framework.models.hf import declared_layers

Named = list[tuple[str, nn.Parameter]]


@dataclass(frozen=True)
class UnitPlan:
    name: str                 # for messages and records
    modules: list[nn.Module]  # whose forward hooks gather the unit
    named: Named              # the parameters it gathers, in registration order


def plan_units(module: nn.Module, gather_unit, split_root: bool,
               persistence_threshold: int) -> tuple[list[UnitPlan], Named]:
    """The gather units (the root first, kept even when empty: its hooks open and close every pass)
    and the parameters that stay gathered: the small ones, then those shared in a way no unit covers."""
    unit_modules, owner = _assign_units(module, gather_unit, split_root)
    all_named = list(module.named_parameters())
    units, persistent = [], []
    for idx, (uname, subs) in enumerate(unit_modules):
        named = [(n, p) for n, p in all_named if owner[id(p)] == idx]
        small = [(n, p) for n, p in named if p.numel() < persistence_threshold]
        persistent += small
        big = [x for x in named if x not in small]
        if idx > 0 and not big:  # nothing left to gather: no unit, no hooks
            continue
        units.append(UnitPlan(uname, subs, big))
    return units, persistent + [(n, p) for n, p in all_named if owner[id(p)] == -1]


def _assign_units(module: nn.Module, gather_unit, split_root: bool) -> tuple[list[tuple[str, list[nn.Module]]], dict[int, int]]:
    """The unit candidates as (name, modules) and per parameter id its candidate's index (-1: shared
    in a way no one unit covers). 0 is the root, then each outermost ``gather_unit`` module; with
    ``split_root`` also every module with parameters of its own, merged where they share one (tied weights).
    """
    # A Hugging Face model's transformer layers are units too (its _no_split_modules classes).
    classes = set(gather_unit) | set(declared_layers(module))
    gather: list[tuple[str, nn.Module]] = []
    where: dict[int, tuple] = {}   # id(module) -> ("root",) | ("unit", i) | ("own", id)
    for name, sub in module.named_modules():
        if sub is module or id(sub) in where:
            continue
        if type(sub).__name__ in classes:
            for inner in sub.modules():
                where[id(inner)] = ("unit", len(gather))
            gather.append((name, sub))
        elif split_root and any(True for _ in sub.parameters(recurse=False)):
            where[id(sub)] = ("own", id(sub))
    names = {id(sub): name for name, sub in module.named_modules()}
    order = {m: i for i, m in enumerate(names)}   # registration order
    holders: dict[int, set] = {}   # id(param) -> the candidates whose modules register it
    for i, (_, sub) in enumerate(gather):  # all of a unit's parameters, also ones another unit shares
        for p in sub.parameters():
            holders.setdefault(id(p), set()).add(("unit", i))
    for sub in module.modules():
        if where.get(id(sub), ("root",))[0] != "unit":
            for p in sub.parameters(recurse=False):
                holders.setdefault(id(p), set()).add(where.get(id(sub), ("root",)))
    # Own-parameter modules that share a parameter are one unit (each member maps to one shared set).
    group: dict[int, set] = {key[1]: {key[1]} for key in where.values() if key[0] == "own"}
    for hs in holders.values():
        if len(hs) > 1 and all(h[0] == "own" for h in hs):
            merged = set().union(*(group[h[1]] for h in hs))
            for m in merged:
                group[m] = merged
    by_id = {id(sub): sub for sub in module.modules()}
    units: list[tuple[str, list[nn.Module]]] = [("<root>", [module])]
    index = {("root",): 0}
    for i, (name, sub) in enumerate(gather):
        index[("unit", i)] = len(units)
        units.append((name, [sub]))
    for m in group:   # in registration order: each merged unit where its first member is
        if ("own", m) in index:
            continue
        members = sorted(group[m], key=order.__getitem__)
        for k in members:
            index[("own", k)] = len(units)
        units.append(("+".join(names[k] for k in members), [by_id[k] for k in members]))
    owner: dict[int, int] = {}
    for pid, hs in holders.items():
        found = {index[h] for h in hs}
        owner[pid] = found.pop() if len(found) == 1 else -1
    return units, owner
