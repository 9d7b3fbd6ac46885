"""Byte units, defined once.

Memory and file sizes are binary and labelled so (KiB, MiB, GiB, TiB: powers of 1024), as torch,
the kernel and nvidia-smi count them. Rates (bandwidths) are decimal and labelled GB/s (10^9
bytes a second), as disk and link speeds are quoted. Sizes given by a user follow the same rule
(``parse_size``): KB/MB/GB/TB are powers of 1000, KiB/MiB/GiB/TiB powers of 1024.
"""
from __future__ import annotations

import math
import re

MiB = 2 ** 20
GiB = 2 ** 30
GB = 10 ** 9   # decimal: only for rates printed as GB/s


def size(nbytes: int) -> str:
    """``nbytes`` for a message: GiB from 1 GiB on, else MiB, then the exact count."""
    unit, scale = ("GiB", GiB) if nbytes >= GiB else ("MiB", MiB)
    return f"{nbytes / scale:.2f} {unit} ({nbytes} bytes)"


_SIZE = re.compile(r"\s*([+-]?[0-9]+(?:\.[0-9]*)?(?:e[+-]?[0-9]+)?)\s*(?:([kmgt])(ib|b)?|b)?\s*", re.IGNORECASE)


def parse_size(text: str, bare: int | None = None) -> int:
    """Bytes from ``5GB`` (5 * 10^9), ``2GiB`` (2 * 2^30), ``100B`` or ``100``; ``bare``: the base of a
    prefix without B (``80G`` = 80 * bare^3), None: such a size is refused. Letters in either case (as
    Hugging Face reads ``max_shard_size``). A string of another form raises ValueError."""
    m = _SIZE.fullmatch(str(text))
    if not m or (m.group(2) and not m.group(3) and bare is None):
        raise ValueError(f"{text!r} is not a size")
    prefix, tail = m.group(2), (m.group(3) or "").lower()
    base = 1024 if tail == "ib" else 1000 if tail == "b" else bare
    value = float(m.group(1)) * (base ** ("kmgt".index(prefix.lower()) + 1) if prefix else 1)
    if not math.isfinite(value):   # 1e400 reads as infinity
        raise ValueError(f"{text!r} is not a size (too large)")
    return int(value)
