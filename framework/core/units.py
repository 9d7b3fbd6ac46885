"""Byte units, defined once.

Memory and file sizes are binary and labelled so (KiB, MiB, GiB, TiB: powers of 1024), as torch,
the kernel and nvidia-smi count them. Rates (bandwidths) are decimal and labelled GB/s (10^9
bytes a second), as disk and link speeds are quoted.
"""
from __future__ import annotations

KiB = 2 ** 10
MiB = 2 ** 20
GiB = 2 ** 30
TiB = 2 ** 40
GB = 10 ** 9   # decimal: only for rates printed as GB/s


def size(nbytes: int) -> str:
    """``nbytes`` for a message: GiB from 1 GiB on, else MiB, then the exact count."""
    unit, scale = ("GiB", GiB) if nbytes >= GiB else ("MiB", MiB)
    return f"{nbytes / scale:.2f} {unit} ({nbytes} bytes)"
