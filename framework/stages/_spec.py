"""Name-keyed layout of master pieces: which parameter elements each piece holds.

How many pieces there are depends on world size, stage, offload ratio and bucket sizes; a
``PieceSpec`` says what one holds by parameter name, so saved state re-slices into any other layout.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from framework.core.errors import FrameworkError
from framework.stages._flat import Layout


@dataclass(frozen=True)
class Span:
    """Elements ``param`` [lo, hi) of the flattened parameter ``name`` sit at ``piece`` [lo, hi)."""

    name: str
    shape: tuple[int, ...]    # the parameter's global shape
    param: tuple[int, int]
    piece: tuple[int, int]


@dataclass(frozen=True)
class PieceSpec:
    """One master piece: its length and the parameter spans it holds (padding holds none)."""

    numel: int
    spans: tuple[Span, ...]


def piece_spec(layout: Layout, start: int, end: int) -> PieceSpec:
    """The spec of a piece holding elements [start, end) of a flat buffer laid out by ``layout``."""
    if not 0 <= start <= end <= layout.padded:
        raise ValueError(f"piece [{start}, {end}) is outside the flat buffer [0, {layout.padded})")
    spans = []
    for s in layout.slots:  # slots are in offset order; a few hundred at most
        a, b = max(start, s.offset), min(end, s.offset + s.numel)
        if a < b:
            spans.append(Span(s.name, tuple(s.shape), (a - s.offset, b - s.offset), (a - start, b - start)))
    return PieceSpec(end - start, tuple(spans))


def cover(lo: int, hi: int, ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """Saved ranges covering [lo, hi), as ``(index, a, b)`` tiling it in order: [a, b) from
    ``ranges[index]``. Of overlapping ranges the one reaching furthest is taken (few copies);
    ``LookupError`` names the first element range that no saved range holds."""
    order = sorted(range(len(ranges)), key=lambda i: ranges[i][0])
    out: list[tuple[int, int, int]] = []
    pos, j, best = lo, 0, None
    while pos < hi:
        while j < len(order) and ranges[order[j]][0] <= pos:
            i = order[j]
            if best is None or ranges[i][1] > ranges[best][1]:
                best = i
            j += 1
        if best is None or ranges[best][1] <= pos:
            nxt = ranges[order[j]][0] if j < len(order) else hi
            raise LookupError(f"elements [{pos}, {min(nxt, hi)}) are in no saved fragment")
        b = min(hi, ranges[best][1])
        out.append((best, pos, b))
        pos = b
    return out


def check_shape(name: str, saved: Sequence[int], here: Sequence[int]) -> None:
    if tuple(saved) != tuple(here):
        raise FrameworkError(f"load_state_dict: parameter {name!r} has shape {tuple(saved)} in the saved state "
                             f"but {tuple(here)} in this model")
