"""Strict checks of a mapped swap file against the checksums its IO engine recorded.

    verify_extent(fmap, "3.1", what="optimizer piece 3 tensor 1")   # one extent
    verify_map(fmap, what="after the checkpoint's write")           # every extent

A byte without a recorded checksum is an error, not a pass: unverifiable state must never reach a
checkpoint (only an engine with ``checksum="none"`` records none and is not checked). A checkpoint
checks again after reading the pages and commits only if both passes agree.
"""
from __future__ import annotations

from framework.core.errors import SwapIOError
from framework.offload._aio import CHECKSUMS
from framework.offload._swapfile import padded


def verify_extent(fmap, name: str, what: str = "") -> None:
    """Check extent ``name`` of ``fmap`` piece by piece; SwapIOError naming the file, offset and tensor."""
    file = fmap.file
    extent = file.extents[name]
    lo, hi = extent.offset, extent.offset + padded(extent.nbytes)
    if hi == lo:
        return
    pieces = file.checksums(name)
    if not pieces and not any(file.checksums(n) for n in file.extents):
        return   # an engine built with checksum="none" records none anywhere: nothing to verify against
    memory = memoryview(fmap.padded(name).numpy())
    label = what or f"extent {name!r}"
    pos = lo
    for offset, nbytes, value, kind in pieces:
        if offset != pos:
            break
        fn = CHECKSUMS.get(kind)
        if fn is None:
            raise _error(file, offset, nbytes, label, f"unknown checksum kind {kind!r}", "cannot verify it")
        if fn(memory[offset - lo:offset - lo + nbytes], nbytes) != value:
            raise _error(file, offset, nbytes, label, "checksum mismatch",
                         "the swap file was changed or the disk returned bad data")
        pos = offset + nbytes
    if pos != hi:
        raise _error(file, pos, hi - pos, label, "no checksum recorded",
                     "these bytes were not written by the IO engine and cannot be verified")
    fmap.release(name=name)   # checked: its pages leave this process (the pass stays bounded)


def verify_map(fmap, what: str = "") -> None:
    """``verify_extent`` for every extent of the mapped file (nothing without a map)."""
    if fmap is None:
        return
    for name in fmap.file.extents:
        verify_extent(fmap, name, f"extent {name!r}{f' ({what})' if what else ''}")


def _error(file, offset: int, nbytes: int, what: str, reason: str, why: str) -> SwapIOError:
    return SwapIOError(f"swap file {file.path}: {reason} at offset {offset} ({nbytes} bytes, {what}): {why}",
                       path=str(file.path), offset=offset, what=what, errno=None)
