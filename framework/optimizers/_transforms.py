"""Functional, optax-style gradient transformations over lists of flat fp32 tensors: ``init(params) -> state``,
``update(grads, state, params, lr) -> (updates, new_state)``, then ``apply_updates`` (``p += u``).

Groups may hold 100M+ elements, so everything is in place: updates overwrite the grads, state tensors are
shared by the returned state (a state passed to ``update`` is not used again), and a needed temporary is a
bounded chunked scratch buffer. Step counts are python ints: no device sync.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import torch
from torch import Tensor

from framework import ops
from framework.core.errors import ConfigError
from framework.core.utils import finite_fp32, fp32_inf

_CHUNK = 1 << 22   # elements per chunk of a temporary: 16 MiB of fp32 scratch, negligible launch overhead


class GradientTransformation(NamedTuple):
    """``init(params) -> state`` and ``update(grads, state, params, lr) -> (updates, new_state)`` over the groups.

    A group is a flat fp32 tensor: a shard of several parameters with padding, or a host piece of one, cut by
    stage, offload, bucket size and world size; no parameter shape reaches the optimizer. So ``update`` is
    elementwise: each element of an update depends only on the same element of grads, state and params, and on
    scalars (lr, step counts). A norm, mean or max over a group (LAMB or LARS trust ratios, Adafactor's factored
    moments, Muon's orthogonalisation) cannot be expressed: it would train another model in each layout.
    A state is tuples or NamedTuples (nested; a field name is the key its tensors are saved under) whose leaves
    are lists of tensors, one per group and of its size, or scalars (int, float, bool, None, or a one-element
    tensor such as a step count, saved as JSON with its dtype); no dict, no list of scalars. ``initialize``
    checks both on small groups (``engine._checks.check_optimizer``) and refuses a transformation that breaks
    them in one line."""

    init: Callable[[Sequence[Tensor]], Any]
    update: Callable[[list[Tensor], Any, Sequence[Tensor], float], tuple[list[Tensor], Any]]
    # Optional fast path doing what ``step`` does (``fused(grads, state, params, lr, out16) -> state``), or
    # None, nothing changed, where it cannot take the tensors: one pass over memory instead of ~10.
    fused: Callable[..., Any] | None = None
    # Optional ``subset(indices)``: this transformation over those groups only (what depends on a group's
    # position, the decay mask, re-indexed), so a step of a few groups costs their size, not the group count
    # (``step_groups``; without it the other groups go in as empty slices).
    subset: Callable[[Sequence[int]], "GradientTransformation"] | None = None


def step(tx: GradientTransformation, grads: list[Tensor], state: Any, params: Sequence[Tensor],
         lr: float, out16: Sequence[Tensor] | None = None) -> Any:
    """One optimizer step in place on ``params``; returns the new state. ``out16`` (one 16-bit tensor per
    group): also write the updated params' copy there."""
    new_state = None if tx.fused is None else tx.fused(grads, state, params, lr, out16)
    if new_state is None:
        updates, new_state = tx.update(grads, state, params, lr)
        apply_updates(params, updates)
        if out16 is not None:
            copy_16bit(out16, params)
    return new_state


def copy_16bit(out16: Sequence[Tensor], params: Sequence[Tensor]) -> None:
    """``out16[i] = params[i]`` rounded to out16's dtype (as ``Tensor.to``), shapes aside."""
    for o, p in zip(out16, params, strict=True):
        o.view(-1).copy_(p.view(-1))


def apply_updates(params: Sequence[Tensor], updates: Sequence[Tensor]) -> None:
    # (torch._foreach_* here and below: no public multi-tensor op; torch.optim's own steps use the same ones)
    torch._foreach_add_(list(params), list(updates))


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Compose transforms left to right; the state is the tuple of the inner states."""

    def update(grads: list[Tensor], state: tuple, params: Sequence[Tensor], lr: float) -> tuple[list[Tensor], tuple]:
        new_state = []
        for transform, inner in zip(transforms, state, strict=True):

            grads, inner = transform.update(grads, inner, params, lr)
            new_state.append(inner)
        return grads, tuple(new_state)

    return GradientTransformation(lambda params: tuple(t.init(params) for t in transforms), update)


def optimizer(cfg: Any, decay_mask: Sequence[bool], direction: GradientTransformation | None, *, decoupled: bool,
              kernel: str | None = None, hyper: dict[str, Any] | None = None,
              cuda: Callable | None = None) -> GradientTransformation:
    """The chain ``decay, direction, -lr`` (L2, as torch) or, ``decoupled``, ``direction, decay, -lr``, decaying
    groups whose ``decay_mask`` is True (False: 1-D params) or all with ``cfg.decay_1d``. Fast paths: the C++
    kernel ``ops.<kernel>`` (``hyper``: its hyperparameters), else ``cuda(grads, direction_state, params, lr,
    mask)`` (torch's fused kernel), else the transforms; all keep the transforms' state."""
    mask = [bool(decayed) or cfg.decay_1d for decayed in decay_mask]
    decay = add_decayed_weights(cfg.weight_decay, mask)
    inner = [] if direction is None else [direction]
    tx = chain(*inner, decay, scale_by_lr()) if decoupled else chain(decay, *inner, scale_by_lr())
    # A piece's groups are the same every step: its transformation (closures over the config, no state of its
    # own) is built once, not thousands of times a step; at most one per piece, freed with this one.
    @functools.lru_cache(maxsize=None)
    def subset(groups: tuple[int, ...]) -> GradientTransformation:
        return optimizer(cfg, [decay_mask[i] for i in groups], direction, decoupled=decoupled, kernel=kernel,
                         hyper=hyper, cuda=cuda)

    tx = tx._replace(subset=lambda groups: subset(tuple(groups)))
    if kernel is None:
        return tx
    index = 0 if decoupled else 1   # where the direction's state sits in the chain

    def fused(grads: list[Tensor], state: tuple, params: Sequence[Tensor], lr: float,
              out16: Sequence[Tensor] | None) -> tuple | None:
        inner = state[index]
        counted = "count" in inner._fields   # Lion keeps no step count
        step = {"step": inner.count + 1} if counted else {}
        new_state = state[:index] + (inner._replace(count=inner.count + 1),) + state[index + 1:] if counted else state
        # A subset step (``step_groups``) passes the other groups as empty slices, perhaps on another device:
        # dropped, else the kernel would decline the host pieces and torch's get a mixed-device list.
        keep = [i for i, p in enumerate(params) if p.numel()]
        if not keep:
            return new_state
        params, grads, decays = ([xs[i] for i in keep] for xs in (params, grads, mask))
        out16 = None if out16 is None else [out16[i] for i in keep]
        lists = tuple([ts[i] for i in keep] for ts in (inner[1:] if counted else inner))
        inner = inner._replace(**dict(zip(inner._fields[1 if counted else 0:], lists)))

        # The first param only (CUDA tensors never trigger a build): the kernel checks every tensor itself
        # and declines (``strict=False``), cheaper than a check per tensor here.
        usable = ops.usable(params[:1])
        # A 16-bit copy on the host is written in the kernel's pass; one elsewhere after the step.
        in_pass = out16 if usable and out16 and ops.usable(out16=out16[:1]) else None
        if not (usable and getattr(ops, kernel)(
                params, grads, *lists, weight_decay=cfg.weight_decay,
                decay_mask=decays, out16=in_pass, strict=False, lr=lr, **step, **(hyper or {}))):
            # torch's fused kernels want contiguous tensors (a strided CPU param comes out wrong) on one device.
            device = params[0].device
            if cuda is None or not all(
                    p.device == device and device.type in ("cuda", "cpu") and p.is_contiguous() and g.is_contiguous()
                    for p, g in zip(params, grads)):
                return None
            cuda(grads, inner, params, lr, decays)
            in_pass = None
        if out16 is not None and in_pass is None:
            copy_16bit(out16, params)
        return new_state

    return tx._replace(fused=fused)


def positive_fp32(value: float) -> bool:
    """Whether ``value`` is > 0 as the fp32 optimizer state holds it: 1e-50 is > 0 as a Python float but 0
    there, and an eps of 0 turns the update 0/0 = NaN."""
    return bool(torch.tensor(value, dtype=torch.float32, device="cpu") > 0)


def check(name: str, cfg: Any, betas: Sequence[str] = (), nonneg: Sequence[str] = (),
          positive: Sequence[str] = (), fractions: Sequence[str] = ()) -> Any:
    """``cfg``, or a one-line ConfigError: lr and weight_decay finite in fp32 and >= 0, ``betas`` in [0, 1),
    ``fractions`` in [0, 1], ``nonneg`` >= 0, ``positive`` (an eps added to a denominator that is 0 where a gradient
    and its state are) > 0 in fp32, the state's dtype."""
    for keys, rule, ok in ((("lr", "weight_decay"), ">= 0", lambda v: finite_fp32(v) and v >= 0),
                           (betas, "in [0, 1)", lambda v: 0 <= v < 1),
                           (fractions, "in [0, 1]", lambda v: 0 <= v <= 1), (nonneg, ">= 0", lambda v: v >= 0),
                           (positive, "> 0", positive_fp32)):
        for key in keys:
            if not ok(value := getattr(cfg, key)):
                why = (" (an eps of 0 makes the update 0/0 = NaN wherever a gradient and its running state are 0, as in "
                       "the flat buffers' padding); give a small positive value such as 1e-8" if key in positive else "")
                if key in ("lr", "weight_decay") and math.isfinite(value) and value > 0:   # inf in fp32
                    raise ConfigError(f"optimizer.{key} must be finite in fp32 (the optimizer state's dtype) for "
                                      f"{name}, {fp32_inf(value)}")
                fp32 = ", which is 0 in fp32, the optimizer state's dtype" if key in positive and value > 0 else ""
                raise ConfigError(f"optimizer.{key} must be {rule} for {name}, got {value}{fp32}{why}")
    return cfg


# --- the transforms --------------------------------------------------------------------------

# The transforms' states; their field names are the keys their tensors are saved under.
EmptyState = NamedTuple("EmptyState", [])   # a stateless transform's
ScaleByAdamState = NamedTuple("ScaleByAdamState", [("count", int), ("mu", list[Tensor]), ("nu", list[Tensor])])
ScaleByLionState = NamedTuple("ScaleByLionState", [("mu", list[Tensor])])
TraceState = NamedTuple("TraceState", [("count", int), ("trace", list[Tensor])])
ScaleByRssState = NamedTuple("ScaleByRssState", [("count", int), ("sum_of_squares", list[Tensor])])


def _chunks(*tensors: Tensor) -> Iterator[tuple[Tensor, ...]]:
    """``(scratch, *views)`` per chunk: aligned views of at most ``_CHUNK`` elements of same-sized
    tensors (no copies), led by as long a view of one scratch buffer for the chunk's temporary."""
    flat = [t.view(-1) for t in tensors]
    scratch = torch.empty(min(flat[0].numel(), _CHUNK), dtype=flat[0].dtype, device=flat[0].device)
    for start in range(0, flat[0].numel(), _CHUNK):
        views = tuple(t[start:start + _CHUNK] for t in flat)
        yield (scratch[:views[0].numel()], *views)


def scale_by_adam(b1: float, b2: float, eps: float, bias_correction: bool = True) -> GradientTransformation:
    """Adam's direction ``m_hat / (sqrt(v_hat) + eps)``, op for op as torch's single-tensor Adam."""

    def init(params: Sequence[Tensor]) -> ScaleByAdamState:
        return ScaleByAdamState(0, [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params])

    def update(grads: list[Tensor], state: ScaleByAdamState, params: Sequence[Tensor], lr: float):
        count = state.count + 1
        torch._foreach_lerp_(state.mu, grads, 1 - b1)  # torch uses lerp, not mul+add
        torch._foreach_mul_(state.nu, b2)
        torch._foreach_addcmul_(state.nu, grads, grads, value=1 - b2)
        bc1 = 1 - b1 ** count if bias_correction else 1.0
        bc2_sqrt = (1 - b2 ** count) ** 0.5 if bias_correction else 1.0
        for g, m, v in zip(grads, state.mu, state.nu):
            # g is consumed: its storage holds the denominator, then the update.
            torch.sqrt(v, out=g)
            if bias_correction:
                g.div_(bc2_sqrt)
            g.add_(eps)
            torch.div(m, g, out=g)
            if bias_correction:
                g.div_(bc1)
        return grads, ScaleByAdamState(count, state.mu, state.nu)

    return GradientTransformation(init, update)


def add_decayed_weights(weight_decay: float, mask: Sequence[bool]) -> GradientTransformation:
    """``u += weight_decay * p`` where the mask is True: L2 before the direction, decoupled decay after it."""

    def update(grads: list[Tensor], state: EmptyState, params: Sequence[Tensor], lr: float):
        for u, p, decayed in zip(grads, params, mask, strict=True):
            if decayed and weight_decay != 0:
                u.add_(p, alpha=weight_decay)
        return grads, state

    def init(params: Sequence[Tensor]) -> EmptyState:
        # Checked when the state is made: the fused kernels index the mask by group without a check.
        if len(mask) != len(params):
            raise ValueError(f"weight-decay mask has {len(mask)} entries for {len(params)} groups")
        return EmptyState()

    return GradientTransformation(init, update)


def scale_by_lr() -> GradientTransformation:
    """``u *= -lr``: the final step that turns a direction into a descent update."""

    def update(grads: list[Tensor], state: EmptyState, params: Sequence[Tensor], lr: float):
        torch._foreach_mul_(grads, -lr)
        return grads, state

    return GradientTransformation(lambda params: EmptyState(), update)


def scale_by_lion(b1: float, b2: float) -> GradientTransformation:
    """Lion (Chen et al. 2023): ``u = sign(b1*m + (1-b1)*g)``, then ``m = b2*m + (1-b2)*g``."""

    def update(grads: list[Tensor], state: ScaleByLionState, params: Sequence[Tensor], lr: float):
        for g, m in zip(grads, state.mu):
            # Both outputs read old g and old m: one goes through a (chunked) temporary.
            for tmp, g_c, m_c in _chunks(g, m):
                torch.mul(m_c, b1, out=tmp).add_(g_c, alpha=1 - b1)
                m_c.mul_(b2).add_(g_c, alpha=1 - b2)
                torch.sign(tmp, out=g_c)
        return grads, state

    return GradientTransformation(lambda params: ScaleByLionState([torch.zeros_like(p) for p in params]), update)


def trace(momentum: float, dampening: float, nesterov: bool) -> GradientTransformation:
    """SGD momentum as torch.optim.SGD: ``buf = g`` first, then ``momentum*buf + (1-dampening)*g``; the update
    is ``buf``, or with Nesterov ``g + momentum*buf``."""

    def update(grads: list[Tensor], state: TraceState, params: Sequence[Tensor], lr: float):
        if state.count == 0:
            torch._foreach_copy_(state.trace, grads)
        else:
            torch._foreach_mul_(state.trace, momentum)
            torch._foreach_add_(state.trace, grads, alpha=1 - dampening)
        if nesterov:
            torch._foreach_add_(grads, state.trace, alpha=momentum)
        else:
            # Copy rather than return the buffer: later transforms scale updates in place.
            torch._foreach_copy_(grads, state.trace)
        return grads, TraceState(state.count + 1, state.trace)

    return GradientTransformation(lambda params: TraceState(0, [torch.zeros_like(p) for p in params]), update)


def scale_by_rss(initial_accumulator_value: float, eps: float, lr_decay: float) -> GradientTransformation:
    """Adagrad as torch.optim.Adagrad: ``s += g*g``; ``u = g / (sqrt(s) + eps) / (1 + (step-1)*lr_decay)``."""


    def init(params: Sequence[Tensor]) -> ScaleByRssState:
        return ScaleByRssState(0, [torch.full_like(p, initial_accumulator_value) for p in params])

    def update(grads: list[Tensor], state: ScaleByRssState, params: Sequence[Tensor], lr: float):
        count = state.count + 1
        torch._foreach_addcmul_(state.sum_of_squares, grads, grads, value=1)
        decay = 1 + (count - 1) * lr_decay
        for g, s in zip(grads, state.sum_of_squares):
            # g is both numerator and destination, so the denominator needs a temporary.
            for std, g_c, s_c in _chunks(g, s):
                torch.sqrt(s_c, out=std).add_(eps)
                g_c.div_(std)
        if decay != 1:
            torch._foreach_div_(grads, decay)
        return grads, ScaleByRssState(count, state.sum_of_squares)

    return GradientTransformation(init, update)
