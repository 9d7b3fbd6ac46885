"""zero3's gather units: which parameters each unit gathers, and which stay gathered.

Shared by the stage and the memory model (``framework.memory.model``), so the two cannot disagree.
"""
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


def unit_groups(named: Named) -> list[tuple[str, Named]]:
    """A unit's flat groups: matrices ('decay') and vectors ('no_decay'), empty ones dropped."""
    return [(kind, members) for kind, members in (("decay", [x for x in named if x[1].ndim >= 2]),
                                                  ("no_decay", [x for x in named if x[1].ndim < 2]))
            if members]


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
    # Merge own-parameter modules that share a parameter (union-find over module ids).
    parent: dict[int, int] = {key[1]: key[1] for key in where.values() if key[0] == "own"}

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for hs in holders.values():
        if len(hs) > 1 and all(h[0] == "own" for h in hs):
            first, *rest = [h[1] for h in hs]
            for r in rest:
                parent[find(r)] = find(first)
    merged: dict[int, list[int]] = {}
    for m in parent:
        merged.setdefault(find(m), []).append(m)
    by_id = {id(sub): sub for sub in module.modules()}
    units: list[tuple[str, list[nn.Module]]] = [("<root>", [module])]
    index = {("root",): 0}
    for i, (name, sub) in enumerate(gather):
        index[("unit", i)] = len(units)
        units.append((name, [sub]))
    for members in merged.values():
        members.sort(key=order.__getitem__)
        for m in members:
            index[("own", m)] = len(units)
        units.append(("+".join(names[m] for m in members), [by_id[m] for m in members]))
    owner: dict[int, int] = {}
    for pid, hs in holders.items():
        found = {index[h if h[0] != "own" else ("own", find(h[1]))] for h in hs}
        owner[pid] = found.pop() if len(found) == 1 else -1
    return units, owner
