"""TrainState: everything that changes from step to step, and nothing else.

The container is immutable; tensors inside may be updated in place by ``train_step`` (like
donated buffers in JAX), so always continue from the state it returns.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any, Iterable, Sequence

import torch

from framework.core.errors import FrameworkError
from framework.precision import Policy, PrecisionState
from framework.stages import PieceSpec, check_shape, cover


@dataclass(frozen=True)
class TrainState:
    step: int                        # train_step calls so far (optimizer steps, skipped ones included)
    params: tuple[torch.Tensor, ...]  # master parameters as the stage lays them out (flat, per group/partition)
    opt_state: Any                   # the optimizer transformation's state
    precision: PrecisionState        # loss scale and skipped-step bookkeeping
    rng: tuple[torch.Tensor, ...]    # generator states after the last step: CPU, then the device's (dropout)
    data: int                        # data position: global batches consumed

    @property
    def applied_steps(self) -> int:
        """Optimizer updates actually applied; the LR schedule is indexed by this."""
        return self.step - self.precision.skipped_steps


def capture_rng(device: torch.device) -> tuple[torch.Tensor, ...]:
    if device.type == "cuda":
        return torch.get_rng_state(), torch.cuda.get_rng_state(device)
    return (torch.get_rng_state(),)


def restore_rng(rng: tuple[torch.Tensor, ...], device: torch.device) -> None:
    torch.set_rng_state(rng[0])
    if device.type == "cuda":
        torch.cuda.set_rng_state(rng[1], device)


# --- the name-keyed state dict -------------------------------------------------------------
# ``TrainState.params`` is a positional list of master pieces whose count depends on the
# configuration; a stage's ``piece_specs()`` (framework.stages._spec) names what each holds.
# ``state_dict`` turns this rank's pieces into fragments keyed by parameter name, and
# ``load_state_dict`` re-slices the fragments of every rank of a saving run into this run's
# pieces, whatever world size, stage, offload ratio or bucket size either side used.

FORMAT = 1


def optimizer_leaves(opt_state: Any, params: Sequence[torch.Tensor]) -> tuple[dict[str, list], dict[str, Any]]:
    """An optimizer state's leaves by path (``'0.mu'``: chain index, then field name):
    (per-element leaves, scalar leaves). A list of tensors aligned with ``params`` (one per
    piece, same number of elements) holds per-element state (Adam's moments, Lion's and SGD's
    momentum, Adagrad's sums); every other leaf is a scalar (a step count)."""
    numels = [p.numel() for p in params]
    per: dict[str, list] = {}
    scalars: dict[str, Any] = {}

    def walk(tree: Any, path: str) -> None:
        if _aligned(tree, numels):
            per[path] = tree
        elif isinstance(tree, tuple):
            for key, value in zip(_keys(tree), tree):
                walk(value, f"{path}.{key}" if path else str(key))
        else:
            scalars[path] = tree

    walk(opt_state, "")
    return per, scalars


def with_scalars(opt_state: Any, params: Sequence[torch.Tensor], scalars: dict[str, Any]) -> Any:
    """``opt_state`` with its scalar leaves replaced by ``scalars`` (paths as ``optimizer_leaves``);
    per-element leaves are kept (same tensors), a tensor scalar is overwritten in place."""
    numels = [p.numel() for p in params]

    def build(tree: Any, path: str) -> Any:
        if _aligned(tree, numels):
            return tree
        if isinstance(tree, tuple):
            items = [build(value, f"{path}.{key}" if path else str(key)) for key, value in zip(_keys(tree), tree)]
            return tuple(items) if type(tree) is tuple else type(tree)(*items)
        if isinstance(tree, torch.Tensor):
            tree.copy_(scalars[path])
            return tree
        return scalars[path]

    return build(opt_state, "")


def _aligned(tree: Any, numels: list[int]) -> bool:
    return (isinstance(tree, list) and len(tree) == len(numels)
            and all(isinstance(t, torch.Tensor) and t.numel() == n for t, n in zip(tree, numels)))


def _keys(tree: tuple) -> Sequence:
    # A NamedTuple (every optimizer state) is keyed by field name, a plain tuple (chain) by index.
    return range(len(tree)) if type(tree) is tuple else type(tree)._fields


def _host(value: Any) -> Any:
    """A host copy of a tensor, independent of later in-place steps; other values as they are."""
    return value.detach().to("cpu", copy=True) if isinstance(value, torch.Tensor) else value


def _check_aligned(specs: Sequence[PieceSpec], params: Sequence[torch.Tensor]) -> None:
    """A stage's specs describe its master pieces one for one (a stage bug otherwise)."""
    if [s.numel for s in specs] != [p.numel() for p in params]:
        raise ValueError(f"piece specs of {[s.numel for s in specs]} elements for master pieces of "
                         f"{[p.numel() for p in params]}")


def dynamic_loss_scale(policy: Policy) -> bool:
    return policy.scaler is not None and policy.scaler.loss_scale == 0


def state_dict(state: TrainState, specs: Sequence[PieceSpec], *, policy: Policy, rank: int = 0,
               world: int = 1) -> dict:
    """This rank's part of ``state`` keyed by parameter name, as host copies::

        {"format": 1, "rank": r, "world": w, "step": int, "data": int, "precision": {...},
         "dynamic_loss_scale": bool, "rng": [...],
         "optimizer": {"per_element": [path, ...], "scalars": {path: value}},
         "params": {name: {"shape": (...), "fragments": [
             {"range": (lo, hi), "master": 1-D tensor, "optim": {path: 1-D tensor}}, ...]}}}

    ``range`` is a range of the flattened parameter; ``specs`` (``stage.piece_specs()``) say
    which ranges each piece of ``state.params`` holds. Each piece tensor is copied to the host
    once (one transfer, not one per parameter) and its fragments are views of that copy."""
    _check_aligned(specs, state.params)
    per, scalars = optimizer_leaves(state.opt_state, state.params)
    params: dict[str, dict] = {}
    for k, (spec, master) in enumerate(zip(specs, state.params)):
        if not spec.spans:  # all padding
            continue
        flat = _host(master.reshape(-1))
        opt = {path: _host(ts[k].reshape(-1)) for path, ts in per.items()}
        for span in spec.spans:
            a, b = span.piece
            entry = params.setdefault(span.name, {"shape": span.shape, "fragments": []})
            entry["fragments"].append({"range": span.param, "master": flat[a:b],
                                       "optim": {path: t[a:b] for path, t in opt.items()}})
    return {"format": FORMAT, "rank": rank, "world": world, "step": state.step, "data": state.data,
            "precision": asdict(state.precision), "dynamic_loss_scale": dynamic_loss_scale(policy),
            "rng": [_host(t) for t in state.rng],
            "optimizer": {"per_element": sorted(per), "scalars": {p: _host(v) for p, v in scalars.items()}},
            "params": params}


def load_state_dict(state: TrainState, specs: Sequence[PieceSpec], saved: Sequence[dict], *, policy: Policy,
                    names: Iterable[str], rank: int = 0, world: int = 1) -> TrainState:
    """Copy the fragments of ``saved`` (the state dicts of every rank of the saving run) into the
    tensors of ``state`` (master pieces and per-element optimizer state, in place) and return it
    with the saved scalars. ``names``: every trained parameter of the model (all ranks).
    Everything is checked before anything is written: a missing or extra parameter, a shape
    mismatch, elements no fragment holds or another optimizer's state raise
    ``FrameworkError`` and leave ``state`` as it was. Padding keeps its values. The loss scale
    carries over only between two runs with dynamic loss scaling (fp16); otherwise ``policy``'s
    initial scale applies, and only the step bookkeeping (iterations, skipped steps) is loaded."""
    _check_aligned(specs, state.params)
    if not saved:
        raise FrameworkError("load_state_dict: no saved state given (pass the state dicts of every rank)")
    first = saved[0]
    for sd in saved:
        if sd.get("format") != FORMAT:
            raise FrameworkError(f"load_state_dict: saved state of format {sd.get('format')!r}, this version "
                                 f"reads format {FORMAT}")
        if (sd["step"], sd["data"]) != (first["step"], first["data"]):
            raise FrameworkError(f"load_state_dict: the saved states are from different steps "
                                 f"({first['step']} on rank {first['rank']}, {sd['step']} on rank {sd['rank']})")
    per, scalars = optimizer_leaves(state.opt_state, state.params)
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
    extra = sorted(set(index) - set(names))
    if extra:
        shown = ", ".join(map(repr, extra[:5])) + (f" and {len(extra) - 5} more" if len(extra) > 5 else "")
        raise FrameworkError(f"load_state_dict: the saved state has parameters this model does not train: {shown}")
    plans: list[list] = [[] for _ in specs]  # per piece: (span, fragments, cover) of each span
    for k, spec in enumerate(specs):
        for span in spec.spans:
            if span.name not in index:
                raise FrameworkError(f"load_state_dict: parameter {span.name!r} is not in the saved state "
                                     f"({len(index)} parameters from {len(saved)} rank(s))")
            shape, frags = index[span.name]
            check_shape(span.name, shape, span.shape)
            try:
                parts = cover(*span.param, [f["range"] for f in frags])
            except LookupError as e:
                raise FrameworkError(f"load_state_dict: parameter {span.name!r} {shape}: {e} of the "
                                     f"{len(saved)} saved rank(s)") from None
            plans[k].append((span, frags, parts))
    for k, plan in enumerate(plans):
        if plan:
            for key, t in [("master", state.params[k]), *((p, ts[k]) for p, ts in per.items())]:
                _fill(t.reshape(-1), plan, key)
    # Scalars are the same on every rank, except the RNG: a rank of a run of the same world size
    # resumes its own generators; otherwise (no rank to match) all take rank 0's.
    mine = next((sd for sd in saved if sd["rank"] == rank), first) if len(saved) == world else first
    rng = tuple(mine["rng"])
    if len(rng) != len(state.rng):  # saved with another device type: its CPU generator only
        rng = rng[:1] + state.rng[1:]
    precision = PrecisionState(**first["precision"])
    if not (first["dynamic_loss_scale"] and dynamic_loss_scale(policy)):
        precision = replace(policy.init_state(), cur_iter=precision.cur_iter, skipped_steps=precision.skipped_steps)
    return replace(state, step=first["step"], data=first["data"], precision=precision, rng=rng,
                   opt_state=with_scalars(state.opt_state, state.params, saved_opt["scalars"]))


def _fill(target: torch.Tensor, plan: list, key: str) -> None:
    """Write the planned fragment slices (``key``: 'master' or an optimizer path) into ``target``.
    A device tensor is filled through one host copy of it: two transfers per piece, however many
    fragments it takes (padding keeps its values)."""
    buf = target if target.device.type == "cpu" else target.to("cpu")
    for span, frags, parts in plan:
        for i, a, b in parts:
            f = frags[i]
            values = f["master"] if key == "master" else f["optim"][key]
            dst = span.piece[0] + a - span.param[0]
            into, src = buf[dst:dst + b - a], values[a - f["range"][0]:b - f["range"][0]]
            if src.dtype == into.dtype and src.data_ptr() == into.data_ptr() and src.device == into.device:
                continue   # read straight into place (a mapped swap file): touching it again costs its pages
            into.copy_(src)
    if buf is not target:
        target.copy_(buf)
