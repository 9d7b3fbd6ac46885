"""One optimizer step over some of the groups (pipelined host steps, one per piece: thousands a step with a
small bucket): the transformation's ``subset`` over those groups alone, or, without one, every other group
passed as an empty slice, which kernels and transforms skip (work that grows with the group count). State
tensors update in place, so disjoint subsets land in one state; only scalar leaves (step counts) come from
the returned state."""
from __future__ import annotations

import itertools
from typing import Any, Callable, Mapping, Sequence

from torch import Tensor

from framework.optimizers._transforms import GradientTransformation, step


def _zip_map(n: int, on_groups: Callable[..., Any], *states: Any,
             on_scalars: Callable[..., Any] = lambda *leaves: leaves[0]) -> Any:
    """States of one layout walked together: ``on_groups(*lists)`` at each list of ``n`` tensors,
    ``on_scalars(*leaves)`` (default: the first's) at other leaves, tuples rebuilt."""
    first = states[0]
    # (the first tensor only: a walk per call is run once per piece and step, with thousands of groups)
    if isinstance(first, list) and len(first) == n and (n == 0 or isinstance(first[0], Tensor)):
        return on_groups(*states)
    if isinstance(first, tuple):
        items = [_zip_map(n, on_groups, *parts, on_scalars=on_scalars) for parts in zip(*states, strict=True)]
        return type(first)(*items) if hasattr(first, "_fields") else tuple(items)
    return on_scalars(*states)


def merge_scalars(full: Any, new: Any, n: int) -> Any:
    """``full``'s per-group tensors (updated in place) with ``new``'s scalar leaves (step counts)."""
    return _zip_map(n, lambda f, s: f, full, new, on_scalars=lambda f, s: s)


def init_groups(tx: GradientTransformation, params: Sequence[Tensor], groups: set[int]) -> Any:
    """``tx.init`` of the groups in ``groups`` only: every other group's state is empty (no memory)."""
    return tx.init([p if i in groups else p.reshape(-1)[:0] for i, p in enumerate(params)])


def merge_groups(states: Sequence[Any], owner: Sequence[int]) -> Any:
    """One state from several over the same groups: group ``i``'s tensors from ``states[owner[i]]``,
    scalar leaves from the first (every ``init`` makes the same ones)."""
    return _zip_map(len(owner), lambda *lists: [lists[o][i] for i, o in enumerate(owner)], *states)


def replace_groups(state: Any, n: int, groups: Mapping[int, Sequence[Tensor]]) -> Any:
    """``state`` with the tensors of group ``i`` replaced by ``groups[i]`` (in ``group_state``'s order)."""
    lists = itertools.count()

    def swap(ts: list[Tensor]) -> list[Tensor]:
        j = next(lists)
        return [groups[i][j] if i in groups else t for i, t in enumerate(ts)]

    return _zip_map(n, swap, state)


def group_state(state: Any, n: int, i: int) -> list[Tensor]:
    """The state tensors of group ``i`` (e.g. Adam's two moments), in a fixed order."""
    out: list[Tensor] = []
    _zip_map(n, lambda ts: out.append(ts[i]), state)
    return out


def step_groups(tx: GradientTransformation, grads: Mapping[int, Tensor], state: Any,
                params: Sequence[Tensor], lr: float, out16: Sequence[Tensor] | None = None) -> Any:
    """``step`` on the groups in ``grads`` (index -> gradient) only, in place; returns the full new state
    (step counts advanced once). ``out16``: as for ``step``, one per group."""

    n = len(params)
    if tx.subset is not None:   # the groups stepped alone: a piece's step does not grow with the piece count
        groups = list(grads)
        picked = _zip_map(n, lambda ts: [ts[i] for i in groups], state)
        new = step(tx.subset(groups), [grads[i] for i in groups], picked, [params[i] for i in groups], lr,
                   None if out16 is None else [out16[i] for i in groups])
        return merge_scalars(state, new, n)

    def only(ts: Sequence[Tensor]) -> list[Tensor]:
        return [t if i in grads else t.reshape(-1)[:0] for i, t in enumerate(ts)]

    new = step(tx, [grads[i] if i in grads else params[i].reshape(-1)[:0] for i in range(n)],
               _zip_map(n, only, state), only(params), lr, None if out16 is None else only(out16))
    return merge_scalars(state, new, n)
