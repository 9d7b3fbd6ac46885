"""The name-keyed view of a training state, and the state dict built on it.

``StateLayout`` turns a stage's ``piece_specs()`` into, per parameter name, its global shape and which rank holds
which range of its flattened elements in which piece. The state dict, checkpoints, weights and export all go
through it, so state moves between any two layouts.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from functools import partial
from typing import Any, Iterable, Mapping, Sequence

import torch

from framework.comm.distributed import agree
from framework.core.errors import FrameworkError, on_every_rank
from framework.engine.state import FORMAT, TrainState, is_newer, optimizer_leaves, with_scalars
from framework.precision import Policy, PrecisionState
from framework.stages import PieceSpec, check_shape, cover
from framework.core.utils import counted, few
from framework.persist.tensorfiles import nonfinite, read_per_device
from framework.persist.rng import derive


@dataclass(frozen=True)
class Holding:
    """Elements [lo, hi) of a flattened parameter, held by ``rank`` in its master piece ``piece`` from ``at`` on."""

    rank: int
    lo: int
    hi: int
    piece: int
    at: int

    def of(self, flat: torch.Tensor, lo: int | None = None, hi: int | None = None) -> torch.Tensor:
        """Elements [lo, hi) of the parameter (default: all this holds) as a view of ``flat``, its piece."""
        lo, hi = self.lo if lo is None else lo, self.hi if hi is None else hi
        return flat[self.at + lo - self.lo:self.at + hi - self.lo]


@dataclass(frozen=True)
class Param:
    name: str
    shape: tuple[int, ...]               # global (logical) shape
    dtype: torch.dtype | None            # the stored values' dtype (None: not known here)
    holdings: tuple[Holding, ...] = ()   # every rank's, once gathered; else this rank's


class StateLayout:
    """Parameters by name (in the order the pieces hold them) and where their elements lie."""

    def __init__(self, params: Iterable[Param], rank: int = 0, world: int = 1):
        self.params = {p.name: p for p in params}
        self.rank, self.world = rank, world

    @classmethod
    def of(cls, specs: Sequence[PieceSpec], *, rank: int = 0, world: int = 1, dist: Any = None,
           what: str = "layout gather") -> "StateLayout":
        """The layout of this rank's pieces; with ``dist`` (rank, world, ``all_gather_object``) every rank's."""
        mine: dict[str, tuple[tuple[int, ...], list]] = {}
        for k, spec in enumerate(specs):
            for s in spec.spans:
                mine.setdefault(s.name, (tuple(s.shape), []))[1].append((*s.param, k, s.piece[0]))
        if dist is not None:
            rank, world = dist.rank, dist.world
        ranks = enumerate(dist.all_gather_object(mine, what)) if dist is not None else [(rank, mine)]
        params: dict[str, tuple[tuple[int, ...], list[Holding]]] = {}
        for r, held in ranks:
            for name, (shape, hs) in held.items():
                params.setdefault(name, (tuple(shape), []))[1].extend(Holding(r, *h) for h in hs)
        return cls([Param(n, s, None, tuple(hs)) for n, (s, hs) in params.items()], rank, world)

    @classmethod
    def in_checkpoint(cls, metadata: Any, prefix: str = "model.") -> "StateLayout":
        """The parameters a DCP checkpoint's metadata holds under ``prefix`` (global shapes, stored dtypes)."""
        return cls(Param(k[len(prefix):], tuple(md.size), md.properties.dtype)
                   for k, md in metadata.state_dict_metadata.items()
                   if k.startswith(prefix) and hasattr(md, "properties") and hasattr(md, "chunks"))

    def mine(self) -> list[tuple[Param, Holding]]:
        return [(p, h) for p in self.params.values() for h in p.holdings if h.rank == self.rank]

    def replicated(self) -> list[tuple[Param, Holding]]:
        """Of a gathered layout: this rank's holdings whose range another rank holds too (ddp: all)."""
        return [(p, h) for p, h in self.mine()
                if any(o.rank != h.rank and (o.lo, o.hi) == (h.lo, h.hi) for o in p.holdings)]

    def share(self) -> list[tuple[Param, Holding, int, int]]:
        """This rank's (parameter, holding, lo, hi) of writing every parameter once (a gathered layout's): the ranks'
        parts tile each parameter, replicated elements spread (parameter i from rank ``i % world``)."""
        out = []
        for i, p in enumerate(self.params.values()):
            order = sorted(p.holdings, key=lambda h: (h.rank - i) % self.world)
            try:
                parts = cover(0, math.prod(p.shape), [(h.lo, h.hi) for h in order])
            except LookupError as e:
                raise FrameworkError(f"parameter {p.name!r}: {e} of any rank") from None
            out += [(p, order[j], a, b) for j, a, b in parts if order[j].rank == self.rank]
        return out

    def saved(self) -> dict:
        """As train_state.json keeps it: each parameter's shape, per rank the flat ranges it held (gathered layout)."""
        ranges = [{} for _ in range(self.world)]
        for p in self.params.values():
            for h in p.holdings:
                ranges[h.rank].setdefault(p.name, []).append([h.lo, h.hi])
        return {"parameters": {n: list(p.shape) for n, p in self.params.items()}, "fragments": ranges}


def pieces(state: TrainState, specs: Sequence[PieceSpec] | None = None) -> tuple[list[dict], dict, dict]:
    """Each master piece's flat tensors ({'master': values, optimizer path: state}), and ``optimizer_leaves``;
    ``specs`` checked to describe the pieces one for one (a stage bug otherwise)."""
    if specs is not None and [s.numel for s in specs] != [p.numel() for p in state.params]:
        raise ValueError(f"piece specs of {[s.numel for s in specs]} elements for master pieces of "
                         f"{[p.numel() for p in state.params]}")
    per, scalars = optimizer_leaves(state.opt_state, state.params)
    return [{k: t[i].reshape(-1) for k, t in [("master", state.params), *per.items()]}
            for i in range(len(state.params))], per, scalars


# --- the name-keyed state dict -------------------------------------------------------------

def host_copy(value: Any) -> Any:
    """A host copy of a tensor (later in-place steps do not change it); other values as they are."""
    return value.detach().to("cpu", copy=True) if isinstance(value, torch.Tensor) else value


def state_dict(state: TrainState, specs: Sequence[PieceSpec], *, policy: Policy, rank: int = 0,
               world: int = 1, whole: Mapping[str, torch.Tensor] | None = None) -> dict:
    """This rank's part of ``state`` keyed by parameter name, as host copies::

        {"format": 1, "rank": r, "world": w, "step": int, "data": int, "precision": {...},
         "dynamic_loss_scale": bool, "rng": [...],
         "optimizer": {"per_element": [path, ...], "scalars": {path: value}},
         "params": {name: {"shape": (...), "fragments": [
             {"range": (lo, hi), "master": 1-D tensor, "optim": {path: 1-D tensor}}, ...]}},
         "whole": {key: tensor}}   # only with ``whole``: the module's buffers and frozen parameters

    ``range``: of the flattened parameter. Each piece is copied to the host once (one transfer, not one per
    parameter) and its fragments are views of that copy."""
    flats, per, scalars = pieces(state, specs)
    mine = StateLayout.of(specs, rank=rank, world=world).mine()
    host = {k: {key: host_copy(t) for key, t in flats[k].items()} for k in {h.piece for _, h in mine}}
    params: dict[str, dict] = {}
    for p, h in mine:
        views = {k: h.of(t) for k, t in host[h.piece].items()}
        params.setdefault(p.name, {"shape": p.shape, "fragments": []})["fragments"].append(
            {"range": (h.lo, h.hi), "master": views.pop("master"), "optim": views})
    return {"format": FORMAT, "rank": rank, "world": world, "step": state.step, "data": state.data,
            "precision": asdict(state.precision), "dynamic_loss_scale": policy.dynamic,
            "rng": [host_copy(t) for t in state.rng],
            "optimizer": {"per_element": sorted(per), "scalars": {p: host_copy(v) for p, v in scalars.items()}},
            "params": params, **({} if whole is None else {"whole": {k: host_copy(t) for k, t in whole.items()}})}


def check_format(saved_format: Any, caller: str) -> None:
    if saved_format != FORMAT:
        newer = is_newer(saved_format, FORMAT)
        raise FrameworkError(f"{caller}: saved state of format {saved_format!r}, this version reads format {FORMAT}"
                             + (" (written by a newer version of the framework: load it with that version)"
                                if newer else ""))


def check_ranks(saved: Sequence[dict]) -> int:
    """The world size of the one run whose state dicts ``saved`` are, each of its ranks once; else one line."""
    how = "pass every rank's state dict (engine.state_dict on each rank), the same list on every rank"
    order = lambda v: (repr(type(v)), v if isinstance(v, int) else repr(v))  # noqa: E731 - (ints in number order)
    worlds = sorted({sd.get("world") for sd in saved}, key=order)
    odd = [w for w in worlds if type(w) is not int or w < 1]   # (bool is an int, not a world size)
    if odd:
        raise FrameworkError(f"load_state_dict: a state dict with world {odd[0]!r} is not a state dict of "
                             f"engine.state_dict: {how}")
    if len(worlds) > 1:
        raise FrameworkError(f"load_state_dict: the state dicts are of runs of {few(worlds)} ranks: {how}")
    world, ranks = worlds[0], sorted((sd.get("rank") for sd in saved), key=order)
    if ranks == list(range(world)):
        return world
    outside = sorted({r for r in ranks if type(r) is not int or not 0 <= r < world}, key=order)
    missing = sorted(set(range(world)) - set(ranks))
    twice = sorted({r for r in ranks if ranks.count(r) > 1}, key=order)
    why = "; ".join([*([f"rank {few(outside)} is not a rank of a {world}-rank run" if len(outside) == 1 else
                        f"ranks {few(outside)} are not ranks of a {world}-rank run"] if outside else []),
                     *([f"{counted(len(missing), 'rank')} missing ({few(missing)})"] if missing else []),
                     *([f"rank {few(twice)} given more than once"] if twice else [])])
    raise FrameworkError(f"load_state_dict: got the state dicts of ranks {ranks} of a {world}-rank run ({why}): "
                         f"{how}" + (f" (the dicts of all {world} ranks)" if world > 1 else ""))


def load_state_dict(state: TrainState, specs: Sequence[PieceSpec], saved: Sequence[dict], *, policy: Policy,
                    names: Iterable[str], rank: int = 0, world: int = 1, dist: Any = None,
                    whole: Mapping[str, torch.Tensor] | None = None, seed: int = 0,
                    device: torch.device | None = None) -> TrainState:
    """Copy the fragments of ``saved`` (every saving rank's state dict) into ``state``, all checked first, and return
    it with the saved scalars. ``names``: every trained parameter; ``whole``: the buffers and frozen parameters to
    fill; ``seed``, ``device``: a changed world size derives the generators. ``dist``: the ranks agree on the checks."""
    if dist is not None:
        rank, world = dist.rank, dist.world
    flats, per, scalars = pieces(state, specs)
    check = partial(_checked, per, scalars, specs, saved, names, rank, world, whole)
    if dist is None:
        first, saved_world, kept, plans = check()
    else:   # each rank checked only the list it was given: they must all have been given the same one
        (first, saved_world, kept, plans), given = agree(dist, check, "load_state_dict", shared=lambda out: (
            out[0]["step"], out[0]["data"], out[1], len(saved)))
        other = next((r for r, g in enumerate(given) if g != given[0]), None)
        if other is not None:
            raise on_every_rank(FrameworkError(f"load_state_dict: rank {other} was given {_list(*given[other])}, "
                                               f"rank 0 {_list(*given[0])}: pass the same list on every rank"))
    for plan, flat in zip(plans, flats):
        if not plan:
            continue
        for key, target in flat.items():
            # a device piece through one host copy of it: two transfers, however many fragments
            buf = target if target.device.type == "cpu" else target.to("cpu")
            for h, frags, parts in plan:
                for i, a, b in parts:
                    f = frags[i]
                    values = f["master"] if key == "master" else f["optim"][key]
                    h.of(buf, a, b).copy_(values[a - f["range"][0]:b - f["range"][0]])
            if buf is not target:
                target.copy_(buf)
    with torch.no_grad():
        for k, t in (kept or {}).items():
            whole[k].copy_(t)
    # The RNG: a rank of a run of the same world size resumes its own generators; otherwise each derives its own,
    # as a resume does (one saved rank's on every rank would draw the same dropout masks everywhere).
    if saved_world == world:
        rng = next(sd for sd in saved if sd["rank"] == rank)["rng"]
    else:
        rng = derive(seed, first["step"], rank, device if device is not None else torch.device("cpu"))[0]
        if rank == 0:
            print(f"load_state_dict: saved by {counted(saved_world, 'rank')}, loaded by {world}: each rank's random "
                  f"generators are derived from (seed, step, rank), so its draws (dropout) are not those of an "
                  f"uninterrupted run", flush=True)
    return with_saved_scalars(state, first, rng, first["optimizer"]["scalars"], policy)


def _list(step, data, world, n) -> str:
    return f"the {counted(n, 'state dict')} of step {step} (data position {data}) of a {world}-rank run"


def trainable_switch(trainable, saved, saved_whole, whole) -> str:
    """The parameters frozen when saved (``saved_whole`` holds ``frozen.<name>``) and trainable now, and the reverse,
    named for a message ('' if none): a switch, not a missing or unexpected parameter."""
    were = sorted(n for n in set(trainable) - set(saved) if f"frozen.{n}" in saved_whole)
    now = sorted(n for n in set(saved) - set(trainable) if f"frozen.{n}" in whole)
    return "; ".join(f"{few(names)} {how}" for names, how in (
        (were, "were frozen (requires_grad=False) when saved but are trainable in this run"),
        (now, "were trainable when saved but are frozen in this run")) if names)


def _checked(per, scalars, specs, saved, names, rank, world, whole):
    """``load_state_dict``'s checks: (the first saved dict, its world size, the saved whole tensors to fill or None,
    per piece the (holding, fragments, cover) to copy)."""
    if isinstance(saved, Mapping):   # (one rank's state dict: its keys would be read as the ranks' dicts)
        raise FrameworkError("load_state_dict: pass every rank's state dicts as a list: [sd] for a run of one rank")
    if not saved:
        raise FrameworkError("load_state_dict: no saved state given (pass the state dicts of every rank)")
    first = saved[0]
    for sd in saved:
        check_format(sd.get("format"), "load_state_dict")
    saved_world = check_ranks(saved)
    for sd in saved:
        if (sd["step"], sd["data"]) != (first["step"], first["data"]):
            raise FrameworkError(f"load_state_dict: the saved states are from different steps "
                                 f"({first['step']} on rank {first['rank']}, {sd['step']} on rank {sd['rank']})")
    saved_opt = first["optimizer"]
    if set(saved_opt["per_element"]) != set(per) or set(saved_opt["scalars"]) != set(scalars):
        raise FrameworkError(f"load_state_dict: the saved optimizer state has "
                             f"{sorted([*saved_opt['per_element'], *saved_opt['scalars']])} but this optimizer's has "
                             f"{sorted([*per, *scalars])}; load it with the optimizer it was saved with")
    index: dict[str, tuple[tuple[int, ...], list[dict]]] = {}
    for sd in saved:
        for name, entry in sd["params"].items():
            shape, frags = index.setdefault(name, (tuple(entry["shape"]), []))
            check_shape(name, entry["shape"], shape)  # ranks of one run agree
            for f in entry["fragments"]:
                lo, hi = f["range"]
                if f["master"].numel() != hi - lo:
                    raise FrameworkError(f"load_state_dict: a fragment of {name!r} for elements [{lo}, {hi}) "
                                         f"holds {f['master'].numel()} values")
            frags += entry["fragments"]
    kept = next((sd["whole"] for sd in saved if "whole" in sd), None) if whole is not None else None
    if switched := trainable_switch(names, index, kept or {}, whole or {}):
        raise FrameworkError(f"load_state_dict: parameters {switched}; set their requires_grad as when saved to load "
                             f"it (then framework.save_weights(engine, DIR) keeps its weights alone, which "
                             f"framework.load_weights(engine, DIR) loads into any choice of trainable parameters)")
    extra = sorted(set(index) - set(names))
    if extra:
        raise FrameworkError(f"load_state_dict: the saved state has parameters this model does not train: {few(extra)}")
    if kept is not None:
        if set(kept) != set(whole):
            raise FrameworkError(f"load_state_dict: the saved state holds the buffers and frozen parameters "
                                 f"{few(sorted(kept)) or 'none'}, this model {few(sorted(whole)) or 'none'}")
        for k, t in kept.items():
            if t.shape != whole[k].shape:
                raise FrameworkError(f"load_state_dict: {k!r} has shape {tuple(t.shape)} in the saved state but "
                                     f"{tuple(whole[k].shape)} in this model")
    # Every rank checks every fragment: one verdict everywhere on the values, before anything is written.
    bad = nonfinite_items([(f"{name} ({'master' if key is None else key})", f["master"] if key is None else f["optim"][key])
                           for sd in saved for name, entry in sd["params"].items() for f in entry["fragments"]
                           for key in [None, *sorted(f["optim"])]])
    bad += nonfinite_items(list((kept or {}).items()), nan_only=True)
    if bad:
        raise FrameworkError(f"load_state_dict: non-finite values (NaN or inf) in {few(bad)} of the saved state: not "
                             f"a state to train from; load one saved before training diverged")
    plans: list[list] = [[] for _ in specs]  # per piece: (holding, fragments, cover) of each holding
    for p, h in StateLayout.of(specs, rank=rank, world=world).mine():
        if p.name not in index:
            raise FrameworkError(f"load_state_dict: parameter {p.name!r} is not in the saved state "
                                 f"({len(index)} parameters from {counted(len(saved), 'rank')})")
        shape, frags = index[p.name]
        check_shape(p.name, shape, p.shape)
        try:
            parts = cover(h.lo, h.hi, [f["range"] for f in frags])
        except LookupError as e:
            raise FrameworkError(f"load_state_dict: parameter {p.name!r} {shape}: {e} of the "
                                 f"{counted(len(saved), 'saved rank')}") from None
        plans[h.piece].append((h, frags, parts))
    return first, saved_world, kept, plans


def nonfinite_items(items: list[tuple[str, torch.Tensor]], release=None, nan_only: bool = False) -> list[str]:
    """The names among ``items`` ((name, tensor)) holding NaN or inf (``nonfinite``; one sync per device)."""
    flags = []
    for n, t in items:
        if (flag := nonfinite(t, nan_only)) is not None:
            flags.append((n, flag))
            if release is not None:
                release(t)
    return sorted({n for n, bad in read_per_device(flags) if bad})


def with_saved_scalars(state: TrainState, saved: dict, rng: Sequence[torch.Tensor], scalars: dict,
                       policy: Policy) -> TrainState:
    """``state`` with the step, data position and loss scale of ``saved`` (a state dict or train state), ``rng`` and
    ``scalars``; the loss scale carries over only between two dynamic-scaling runs."""
    rng = tuple(rng)
    if len(rng) != len(state.rng):  # saved with another device type: its CPU generator only
        rng = rng[:1] + state.rng[1:]
    precision = PrecisionState(**saved["precision"])
    if not (saved["dynamic_loss_scale"] and policy.dynamic):
        precision = policy.continued(precision)
    else:   # a minimum raised or a hysteresis lowered since: it holds from now on
        precision = replace(precision, cur_scale=max(precision.cur_scale, policy.scaler.min_loss_scale),
                            cur_hysteresis=min(precision.cur_hysteresis, policy.scaler.hysteresis))
    return replace(state, step=saved["step"], data=saved["data"], precision=precision, rng=rng,
                   opt_state=with_scalars(state.opt_state, state.params, scalars))
