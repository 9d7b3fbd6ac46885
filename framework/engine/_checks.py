"""What ``initialize`` refuses before any collective (every rank alike): one line instead of a traceback from
inside, and which open engine trains a parameter (a second engine on the same parameters is refused)."""
from __future__ import annotations

import inspect
import sys
import traceback
import weakref
from typing import Any, Mapping, Protocol, Sequence

import torch
from torch import Tensor, nn

from framework.config import Config
from framework.core.errors import ConfigError, FrameworkError, TrainingError
from framework.core.utils import counted, few
from framework.engine.state import optimizer_leaves
from framework.stages import zero3_sharded


class _Engine(Protocol):   # what ``owner`` and ``in_step`` read of an Engine (engine.build sits above this module)
    closed: bool
    _stepping: str | None


class Owner(weakref.ref):
    """The open engine training a parameter, held weakly in an attribute of the parameter (no registry
    outside it: a module sharing a submodule or a tied weight with the engine's sees it too); a copy or a
    pickle of the parameter is owned by nobody (its tensors are its own)."""

    def __reduce__(self):
        return type(None), ()


def owner(param: nn.Parameter) -> _Engine | None:
    """The open engine that trains ``param``, or None."""
    ref = getattr(param, "_framework_owner", None)
    engine = ref() if isinstance(ref, Owner) else None
    return engine if engine is not None and not engine.closed else None


def requires_grad_changed(what: str, module: nn.Module, changed: list[tuple[str, bool]]) -> TrainingError:
    """``changed``: (name, requires_grad at build) of each parameter whose flag differs now. A tied weight is named
    with its other names (one frozen by its second name is listed under its first): ``a.weight (tied: b.weight)``."""
    ids: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        ids.setdefault(id(p), []).append(name)
    ties = {n: [o for o in names if o != n] for names in ids.values() for n in names}
    parts = [f"{len(ns)} {kind} ({few(ns, 3, lambda n: f'{n} (tied: {few(ties[n], 3, str)})' if ties.get(n) else n)})"
             for kind, ns in (("frozen", [n for n, was in changed if was]),
                              ("unfrozen", [n for n, was in changed if not was])) if ns]
    return TrainingError(f"{what}: requires_grad of {counted(len(changed), 'parameter')} "
                         f"changed after initialize: {' and '.join(parts)}; the engine trains the parameters "
                         f"that required grad when it was built: set requires_grad before framework.initialize "
                         f"(or set it back); to change what trains, build a new engine (close this one first)")


def check_arguments(module: nn.Module, loss_fn, cfg: Config | None, ds_config: str | Mapping | None,
                    overrides: Sequence[str]) -> None:
    """``initialize``'s arguments and ``module``: a ConfigError or FrameworkError (one line) for one it cannot
    build an engine from."""
    if not isinstance(module, nn.Module):
        raise ConfigError(f"initialize: module must be a torch.nn.Module, got {type(module).__name__}")
    if not callable(loss_fn):
        raise ConfigError(f"initialize: loss_fn must be callable as loss_fn(module, micro_batch) -> scalar loss, "
                          f"got {type(loss_fn).__name__}")
    try:
        signature = inspect.signature(loss_fn, follow_wrapped=False)   # (a decorator's wrapper is what is called)
    except (TypeError, ValueError):   # (a builtin's or an extension's callable: not checked)
        signature = None
    if signature is not None:
        try:
            signature.bind(None, None)
        except TypeError as e:   # (else Python's TypeError from inside the first step)
            name = getattr(loss_fn, "__qualname__", type(loss_fn).__name__)
            raise ConfigError(f"initialize: loss_fn is called as loss_fn(module, micro_batch), which {name}{signature} "
                              f"cannot take ({e}); give it those two positional parameters") from None
    if cfg is not None and not isinstance(cfg, Config):
        raise ConfigError(f"initialize: cfg must be a framework Config, got {type(cfg).__name__}; build one with "
                          f"framework.compose([...overrides]) (or pass ds_config=/overrides=)")
    if cfg is not None and (ds_config is not None or overrides):
        raise ConfigError("initialize: pass either cfg or ds_config/overrides, not both")
    if zero3_sharded(module):
        raise FrameworkError("initialize: this module was sharded by a zero3 engine (its parameters are empty "
                             "shards, also after close() or a failed initialize); build a fresh module (or load "
                             "its weights into one: engine.consolidated_state_dict() before closing)")
    owned = [n for n, p in module.named_parameters() if owner(p) is not None]
    if owned:   # they are views of that engine's buffers: a second one would rebind them, and the first would go
        # on stepping buffers the module no longer reads (a shared submodule: one engine's updates lost)
        raise FrameworkError(f"initialize: {counted(len(owned), 'parameter')} of this module "
                             f"({few(owned, 3, str)}) {'are' if len(owned) != 1 else 'is'} trained by another open "
                             f"engine; close that one first (engine.close() or end its with block), or build a fresh "
                             f"module (one sharing no submodule or parameter with that engine's)")
    lazy = [n for n, t in (*module.named_parameters(), *module.named_buffers())
            if isinstance(t, nn.parameter.UninitializedTensorMixin)]
    if lazy:   # (else torch's message from inside the stage's layout, which blames load_state_dict)
        raise ConfigError(f"initialize: {few(lazy, 3, str)} {'are' if len(lazy) != 1 else 'is'} not initialised yet "
                          f"(a lazy module, such as nn.LazyLinear): run one forward on a dummy batch before "
                          f"framework.initialize, which gives them their shapes")
    if not any(p.requires_grad for p in module.parameters()):
        raise FrameworkError("initialize: the module has no parameters with requires_grad=True: nothing to "
                             "train; unfreeze at least one (p.requires_grad_(True))")
    complex_ = [n for n, p in module.named_parameters() if p.requires_grad and p.is_complex()]
    if complex_:   # every stage keeps masters in a real dtype: the imaginary part would be dropped
        raise ConfigError(f"initialize: complex trainable parameters are not supported ({few(complex_, 5, str)}); "
                          f"hold each as a real parameter with a last dimension of 2 and use "
                          f"torch.view_as_complex(p) in forward (or freeze it: requires_grad=False)")


def another_engine(what: str) -> FrameworkError:
    """The refusal of a state none of whose tensors is the engine's (``what``: the call refusing it): another
    engine's, or a copy (``copy.deepcopy``, often taken as a snapshot to return to), whose tensors no step updates."""
    return FrameworkError(f"{what}: this state belongs to another engine, or is a copy of one (copy.deepcopy; none of "
                          f"its tensors is this engine's): pass this engine's state (engine.state, or what its "
                          f"train_step returned); to keep a state to return to, take sd = engine.state_dict(state) "
                          f"and later state = engine.load_state_dict(engine.state, [sd]) (every rank's sd, at several "
                          f"ranks)")


def detached_error(what: str, names: Sequence[str], frozen: Sequence[str] = ()) -> TrainingError:
    """The refusal of trainable parameters whose storage ``nn.Module._apply`` replaced (``BaseStage.detached``) and
    of frozen ones it cast or moved (``BaseStage.cast_frozen``)."""
    parts = [f"{counted(len(ns), kind)} ({few(ns, 3, str)})"
             for kind, ns in (("trainable parameter", names), ("frozen parameter", frozen)) if ns]
    return TrainingError(f"{what}: module.to(), .half(), .float(), .double(), .cuda() or .cpu() after "
                         f"framework.initialize gave {' and '.join(parts)} "
                         f"storage of their own, which the engine's steps no longer reach (the forward would read "
                         f"stale weights, or mix dtypes and devices): leave the module where and as initialize put it "
                         f"(engine.device; the working dtype is precision=...); to go on from the engine's weights, "
                         f"call engine.discard_edits(engine.state)")


def check_optimizer(tx: Any, name: str, decay_mask: Sequence[bool], device: torch.device) -> Any:
    """``tx`` (``name``'s transformation over ``len(decay_mask)`` groups), or a one-line ConfigError for one that
    breaks the ``GradientTransformation`` contract where the run would break later, or silently: a state leaf the
    checkpoints and offload tiers cannot hold (a dict, a list of scalars), a scalar tensor ``update`` changes in
    place, or an ``update`` that is not elementwise (a norm over a group, which is a shard or host piece with
    padding, not a parameter: every layout trains another model).
    Made on two small groups of random numbers (the others empty, as a piece's step passes them), whole and cut
    in two, two steps each: milliseconds. ``device``: where the master groups live, so where ``update`` runs."""
    picked = sorted({next((i for i, d in enumerate(decay_mask) if d == want), 0) for want in (True, False)})
    gen = torch.Generator(device="cpu").manual_seed(0)   # (its own: the run's random streams stay untouched)
    size, cut = 12, 5
    # params, then two steps' grads
    draw = [{i: torch.randn(size, generator=gen, device="cpu").to(device) for i in picked} for _ in range(3)]
    # (its subset over those groups, where it has one: the check then costs the same at thousands of groups)
    groups, one = (range(len(decay_mask)), tx) if tx.subset is None else (picked, tx.subset(picked))

    def run(lo: int, hi: int) -> list[Tensor]:
        """Two steps over elements [lo, hi) of the picked groups: the updates, flattened and joined."""
        params = [draw[0][i][lo:hi].clone() if i in draw[0] else torch.empty(0, device=device) for i in groups]
        state, out = one.init(params), []
        scalars = _allowed_state(state, params, name, "init")
        for grads in draw[1:]:
            before = {p: (t, t.clone()) for p, t in scalars.items() if isinstance(t, Tensor)}
            updates, state = _pair(one.update([grads[i][lo:hi].clone() if i in grads else
                                               torch.empty(0, device=device) for i in groups], state, params, 1e-2),
                                   params, name)
            # a host step per piece updates from the same state: a scalar changed in place would advance per piece
            if changed := next((p for p, (t, was) in before.items() if not torch.equal(t, was)), None):
                raise ConfigError(f"optimizer {name!r}: its update changes the tensor at {changed!r} of the state it "
                                  f"was given in place: the offload tiers step each host piece from the same state, so "
                                  f"it would advance once per piece; return a new tensor (count + 1, not "
                                  f"count.add_(1)) (docs/architecture.md#where-a-new-piece-goes)")
            scalars = _allowed_state(state, params, name, "update")
            out += [u.reshape(-1).clone() for i, u in zip(groups, updates) if i in grads]
        return out

    whole, (first, second) = run(0, size), (run(0, cut), run(cut, size))
    split = [torch.cat(pair) for pair in zip(first, second)]
    if not all(w.shape == s.shape and torch.allclose(w, s, rtol=1e-5, atol=1e-7) for w, s in zip(whole, split)):
        raise ConfigError(f"optimizer {name!r}: its update is not elementwise (on a group cut in two it gives other "
                          f"numbers than on the whole group): a group is a flat shard or host piece of many parameters "
                          f"with padding, not a parameter, so a norm, mean or max over it (LAMB, LARS, Adafactor, "
                          f"Muon) trains another model at each stage, offload, bucket size and world size; make each "
                          f"update element depend only on the same element of grads, state and params (and scalars) "
                          f"(docs/architecture.md#where-a-new-piece-goes)")
    return tx


def _pair(result: Any, params: Sequence[Tensor], name: str) -> tuple[list[Tensor], Any]:
    """``update``'s ``(updates, new_state)``, or a one-line ConfigError when it returned something else (unpacked
    as that pair, a list of updates alone would be read as updates and a state)."""
    updates = result[0] if isinstance(result, (tuple, list)) and len(result) == 2 else None
    if not (isinstance(updates, (list, tuple)) and len(updates) == len(params) and all(
            isinstance(u, Tensor) and u.numel() == p.numel() for u, p in zip(updates, params))):
        got = f"a {type(result).__name__}" + (f" of {len(result)}" if isinstance(result, (list, tuple)) else "")
        raise ConfigError(f"optimizer {name!r}: its update returned {got}, not the pair (updates, new_state) with "
                          f"updates one tensor per group of the group's size (applied as params += updates); return "
                          f"(updates, state) (docs/architecture.md#where-a-new-piece-goes)")
    return list(updates), result[1]


def _allowed_state(state: Any, params: Sequence[Tensor], name: str, made_by: str) -> dict[str, Any]:
    """``state``'s scalar leaves (path: leaf), or a one-line ConfigError naming a leaf the checkpoints cannot save
    (as JSON, or resharded)."""
    scalars = optimizer_leaves(state, params)[1]
    for path, leaf in scalars.items():
        # (a one-element tensor is saved as JSON with its dtype and copied back into in place)
        if leaf is not None and not isinstance(leaf, (bool, int, float)) and not (
                isinstance(leaf, Tensor) and leaf.numel() == 1):
            raise ConfigError(
                f"optimizer {name!r}: its {made_by}'s state holds a {type(leaf).__name__} at "
                f"{repr(path) if path else 'its top'}, which checkpoints cannot save; a state is tuples or NamedTuples "
                f"(nested) whose leaves are lists with one tensor per group, of the group's size, or scalars (int, "
                f"float, bool, None, a one-element tensor): keep a per-group value as a tensor of the group's size "
                f"(docs/architecture.md#where-a-new-piece-goes)")
    return scalars


def in_step(engine: _Engine) -> str | None:
    """The step running on ``engine`` (its hooks, worker and buffers in use until it returns), or None. A marker
    with no such step on any thread's stack (this one's: close from loss_fn; another's: a watchdog's close) was
    left by an interrupt at its restore: cleared (frames read here, in close and discard_edits, never in a step)."""
    if engine._stepping is not None and not any(
            f.f_code.co_name in ("train_step", "eval_step") and f.f_locals.get("self") is engine
            for top in sys._current_frames().values() for f, _ in traceback.walk_stack(top)):
        engine._stepping = None
    return engine._stepping
