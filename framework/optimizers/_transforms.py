"""Functional, optax-style gradient transformations over lists of flat fp32 tensors.

An optimizer is a ``GradientTransformation``: ``init(params) -> state`` and
``update(grads, state, params, lr) -> (updates, new_state)``, then ``apply_updates`` (``p += u``).
A group may hold 100M+ elements, so everything works in place: updates are written into the
grads' storage, state tensors are updated in place and shared by the returned state (a state
passed to ``update`` must not be used again), and where one more buffer is needed (Lion,
Adagrad) it is a bounded chunked scratch buffer. Step counts are python ints: no device sync.

Fast paths (``fused``, built by ``fused_dispatch``): the C++ kernels of ``framework.ops`` on
contiguous CPU fp32 tensors, torch's fused Adam kernel, else the transforms; all keep the
transforms' state layout, so a run may switch paths.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import torch
from torch import Tensor

from framework import ops
from framework.core.errors import ConfigError

# Elements per chunk for the transforms that need a temporary: caps the scratch buffer at
# 16 MiB (fp32) whatever the group size, and keeps per-chunk launch overhead negligible.
_CHUNK = 1 << 22


class GradientTransformation(NamedTuple):
    init: Callable[[Sequence[Tensor]], Any]
    update: Callable[[list[Tensor], Any, Sequence[Tensor], float], tuple[list[Tensor], Any]]
    # Optional fast path: ``fused(grads, state, params, lr, out16=None) -> state`` updates params
    # in place and must equal ``update`` + ``apply_updates`` (tested); with ``out16`` it also
    # writes ``out16[i] = params[i].to(out16[i].dtype)``. One kernel pass over memory instead of
    # ~10 foreach passes: the optimizer step is memory-bound.
    fused: Callable[..., Any] | None = None


def step(tx: GradientTransformation, grads: list[Tensor], state: Any, params: Sequence[Tensor],
         lr: float, out16: Sequence[Tensor] | None = None) -> Any:
    """Apply one optimizer step in place on ``params``; return the new state. With ``out16``
    (bf16/fp16 tensors, one per group, same numel) also write the updated params' 16-bit copy."""
    if tx.fused is not None:
        return tx.fused(grads, state, params, lr, out16=out16)
    updates, state = tx.update(grads, state, params, lr)
    apply_updates(params, updates)
    if out16 is not None:
        copy_16bit(out16, params)
    return state


def copy_16bit(out16: Sequence[Tensor], params: Sequence[Tensor]) -> None:
    """``out16[i] = params[i]`` rounded to out16's dtype (as ``Tensor.to``), shapes aside."""
    for o, p in zip(out16, params, strict=True):
        o.view(-1).copy_(p.view(-1))


# A CPU fast path returns the new state, or None where its kernel cannot take these tensors.
CpuFused = Callable[[list[Tensor], Any, Sequence[Tensor], float, Sequence[Tensor] | None], Any]


def fused_dispatch(update: Callable, cpu: CpuFused | None = None, cuda: Callable | None = None) -> Callable:
    """``fused(grads, state, params, lr, out16=None)``: the C++ CPU kernel (``cpu``) where it takes
    the tensors, else torch's fused kernel (``cuda``; also on CPU tensors, about 4x faster than the
    foreach transforms), else ``update`` + apply. The C++ kernel is tried first: it was faster in
    every case timed (bench/cpu_adam.py, BENCHMARKS.md "CPU AdamW step"; Intel Xeon, not yet AMD)."""

    def fused(grads: list[Tensor], state: Any, params: Sequence[Tensor], lr: float,
              out16: Sequence[Tensor] | None = None) -> Any:
        if cpu is not None:
            new_state = cpu(grads, state, params, lr, out16)
            if new_state is not None:
                return new_state
        # torch's fused kernels assume contiguous tensors (on CPU, a strided param comes out wrong:
        # tests/unit/test_cpu_ops.py); those take the transforms.
        if cuda is not None and len(params) > 0 and all(
                p.device.type in ("cuda", "cpu") and p.is_contiguous() and g.is_contiguous()
                for p, g in zip(params, grads)):
            state = cuda(grads, state, params, lr)
        else:
            updates, state = update(grads, state, params, lr)
            apply_updates(params, updates)
        if out16 is not None:
            copy_16bit(out16, params)
        return state

    return fused


def cpu_fused(kernel: str, index: int, weight_decay: float, mask: Sequence[bool], **hyper: Any) -> CpuFused:
    """The C++ kernel ``ops.<kernel>`` for a chain whose kernel's state (Adam, Lion or Adagrad:
    step count, if any, then the state tensor lists) sits at ``index``.

    Python looks at the first param only (so that CUDA tensors never trigger a build and
    FRAMEWORK_OPS=0 applies); the kernel checks every tensor itself and declines
    (``strict=False``, nothing changed) where one does not fit: a per-tensor check here cost ~1 us
    per tensor and list, 0.1-0.5 ms per step over 100 groups."""

    def fused(grads: list[Tensor], state: tuple, params: Sequence[Tensor], lr: float,
              out16: Sequence[Tensor] | None) -> tuple | None:
        if not ops.usable(params[:1]):
            return None
        inner = state[index]
        counted = "count" in inner._fields   # Lion keeps no step count
        step = {"step": inner.count + 1} if counted else {}
        # The 16-bit copy is written in the kernel's pass when it is on the host (offload); a copy
        # that lives elsewhere (e.g. on the device) is written after the step.
        fused_out = out16 if out16 is not None and len(out16) > 0 and ops.usable(out16=out16[:1]) else None
        if not getattr(ops, kernel)(params, grads, *(inner[1:] if counted else inner), weight_decay=weight_decay,
                                    decay_mask=[bool(m) for m in mask], out16=fused_out, strict=False, lr=lr,
                                    **step, **hyper):
            return None
        if out16 is not None and fused_out is None:
            copy_16bit(out16, params)
        return state[:index] + (inner._replace(count=inner.count + 1),) + state[index + 1:] if counted else state

    return fused


def fused_adam(b1: float, b2: float, eps: float, weight_decay: float, mask: Sequence[bool],
               decoupled: bool, index: int) -> Callable | None:
    """torch's fused Adam(W) kernel over the flat groups, for a chain whose Adam state sits at
    ``index``; None where the kernel is missing (then the transforms run)."""
    kernel = getattr(torch, "_fused_adamw_" if decoupled else "_fused_adam_", None)
    if kernel is None:
        return None

    def fused(grads: list[Tensor], state: tuple, params: Sequence[Tensor], lr: float) -> tuple:
        adam: ScaleByAdamState = state[index]
        for decayed in (True, False):
            idx = [i for i, m in enumerate(mask) if bool(m) == decayed]
            if not idx:
                continue
            # The kernel reads the step (for bias correction) as given: torch.optim increments
            # it before the call, so pass the count this step will have.
            steps = [torch.full((), float(adam.count + 1), device=params[i].device) for i in idx]
            kernel([params[i] for i in idx], [grads[i] for i in idx], [adam.mu[i] for i in idx],
                   [adam.nu[i] for i in idx], [], steps, lr=lr, beta1=b1, beta2=b2,
                   weight_decay=weight_decay if decayed else 0.0, eps=eps, amsgrad=False, maximize=False)
        return state[:index] + (ScaleByAdamState(adam.count + 1, adam.mu, adam.nu),) + state[index + 1:]

    return fused


class EmptyState(NamedTuple):
    """State of a stateless transform."""


class ScaleByAdamState(NamedTuple):
    count: int
    mu: list[Tensor]
    nu: list[Tensor]


class ScaleByLionState(NamedTuple):
    mu: list[Tensor]


class TraceState(NamedTuple):
    count: int
    trace: list[Tensor]


class ScaleByRssState(NamedTuple):
    count: int
    sum_of_squares: list[Tensor]


def apply_updates(params: Sequence[Tensor], updates: Sequence[Tensor]) -> None:
    """``p += u`` for every group, in place."""
    torch._foreach_add_(list(params), list(updates))


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Compose transforms left to right; the state is the tuple of the inner states."""

    def init(params: Sequence[Tensor]) -> tuple[Any, ...]:
        return tuple(t.init(params) for t in transforms)

    def update(grads: list[Tensor], state: tuple[Any, ...], params: Sequence[Tensor],
               lr: float) -> tuple[list[Tensor], tuple[Any, ...]]:
        if len(state) != len(transforms):
            raise ValueError(f"chain of {len(transforms)} transforms got a state of {len(state)}")
        new_state = []
        for transform, inner in zip(transforms, state):
            grads, inner = transform.update(grads, inner, params, lr)
            new_state.append(inner)
        return grads, tuple(new_state)

    return GradientTransformation(init, update)


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
        return ScaleByAdamState(0, [torch.zeros_like(p) for p in params],
                                [torch.zeros_like(p) for p in params])

    def update(grads: list[Tensor], state: ScaleByAdamState, params: Sequence[Tensor],
               lr: float) -> tuple[list[Tensor], ScaleByAdamState]:
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


def add_decayed_weights(weight_decay: float, mask: Sequence[bool] | None = None) -> GradientTransformation:
    """``u += weight_decay * p`` for the groups whose mask entry is True (all if None): L2
    regularisation before the direction (Adam, SGD, Adagrad), decoupled decay ``p -= lr * wd * p``
    after it (AdamW, Lion)."""

    def init(params: Sequence[Tensor]) -> EmptyState:
        if mask is not None and len(mask) != len(params):
            raise ValueError(f"weight-decay mask has {len(mask)} entries for {len(params)} groups")
        return EmptyState()

    def update(grads: list[Tensor], state: EmptyState, params: Sequence[Tensor],
               lr: float) -> tuple[list[Tensor], EmptyState]:
        flags = [True] * len(grads) if mask is None else mask
        for u, p, decayed in zip(grads, params, flags):
            if decayed and weight_decay != 0:
                u.add_(p, alpha=weight_decay)
        return grads, state

    return GradientTransformation(init, update)


def scale_by_lr() -> GradientTransformation:
    """``u *= -lr``: the final step that turns a direction into a descent update."""

    def init(params: Sequence[Tensor]) -> EmptyState:
        return EmptyState()

    def update(grads: list[Tensor], state: EmptyState, params: Sequence[Tensor],
               lr: float) -> tuple[list[Tensor], EmptyState]:
        torch._foreach_mul_(grads, -lr)
        return grads, state

    return GradientTransformation(init, update)


def scale_by_lion(b1: float, b2: float) -> GradientTransformation:
    """Lion (Chen et al. 2023): ``u = sign(b1*m + (1-b1)*g)``, then ``m = b2*m + (1-b2)*g``."""

    def init(params: Sequence[Tensor]) -> ScaleByLionState:
        return ScaleByLionState([torch.zeros_like(p) for p in params])

    def update(grads: list[Tensor], state: ScaleByLionState, params: Sequence[Tensor],
               lr: float) -> tuple[list[Tensor], ScaleByLionState]:
        for g, m in zip(grads, state.mu):
            # Both outputs (u into g, new m into m) read both old g and old m, so one of
            # them must go through a temporary: chunked to bound its size.
            for tmp, g_c, m_c in _chunks(g, m):
                torch.mul(m_c, b1, out=tmp).add_(g_c, alpha=1 - b1)
                m_c.mul_(b2).add_(g_c, alpha=1 - b2)
                torch.sign(tmp, out=g_c)
        return grads, state

    return GradientTransformation(init, update)


def trace(momentum: float, dampening: float = 0.0, nesterov: bool = False) -> GradientTransformation:
    """SGD momentum as torch.optim.SGD: ``buf = g`` on the first step (no dampening),
    then ``buf = momentum*buf + (1-dampening)*g``; the update is ``buf``, or with
    Nesterov ``g + momentum*buf``."""

    def init(params: Sequence[Tensor]) -> TraceState:
        return TraceState(0, [torch.zeros_like(p) for p in params])

    def update(grads: list[Tensor], state: TraceState, params: Sequence[Tensor],
               lr: float) -> tuple[list[Tensor], TraceState]:
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

    return GradientTransformation(init, update)


def scale_by_rss(initial_accumulator_value: float = 0.0, eps: float = 1e-10,
                 lr_decay: float = 0.0) -> GradientTransformation:
    """Adagrad as torch.optim.Adagrad: ``s += g*g``; ``u = g / (sqrt(s) + eps)``; torch's step-size
    decay ``lr / (1 + (step-1)*lr_decay)`` divides the update, so ``scale_by_lr`` stays ``-lr``."""

    def init(params: Sequence[Tensor]) -> ScaleByRssState:
        return ScaleByRssState(0, [torch.full_like(p, initial_accumulator_value) for p in params])

    def update(grads: list[Tensor], state: ScaleByRssState, params: Sequence[Tensor],
               lr: float) -> tuple[list[Tensor], ScaleByRssState]:
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


# --- helpers shared by the registered optimizer modules -------------------------------

def require(ok: bool, message: str) -> None:
    """Raise a one-line ConfigError unless ``ok``."""
    if not ok:
        raise ConfigError(message)


def check_common(name: str, lr: float, weight_decay: float) -> None:
    require(math.isfinite(lr) and lr >= 0, f"optimizer.lr must be >= 0 for {name}, got {lr}")
    require(math.isfinite(weight_decay) and weight_decay >= 0,
            f"optimizer.weight_decay must be >= 0 for {name}, got {weight_decay}")


def check_beta(name: str, field: str, value: float) -> None:
    require(0 <= value < 1, f"optimizer.{field} must be in [0, 1) for {name}, got {value}")


def effective_mask(decay_mask: Sequence[bool], decay_1d: bool) -> list[bool]:
    """``decay_mask[i]`` is False for groups of 1-D params; ``decay_1d`` decays those too."""
    return [bool(decayed) or decay_1d for decayed in decay_mask]
