"""ZeRO-3's trace bookkeeping: a change of the followed order logged; each backward pass's record of unit
uses compared across ranks, without a host sync until the step's one read of the flags."""
from __future__ import annotations

import logging
import zlib

import torch

from framework.comm.distributed import Dist
from framework.core.errors import DistributedError

log = logging.getLogger("framework.zero3")


def warn_order_changed(trace: list[tuple[str, int]], cursor: int, units: list, phase: str, unit,
                       warned: bool) -> None:
    """The followed ``trace`` expected another use at ``cursor`` than ``phase`` of ``unit``; after the first
    warning (``warned``) logged at debug level."""
    expected = (f"{trace[cursor][0]} of {units[trace[cursor][1]].name!r}"
                if cursor < len(trace) else "the end of the pass")
    (log.debug if warned else log.warning)(
        "zero3: module order changed at use %d (expected %s, got %s of %r); prefetch off until the "
        "new order is recorded%s", cursor, expected, phase, unit.name,
        "" if warned else " (later changes are logged at debug level)")


def start_order_check(dist: Dist, recording: list[tuple[str, int]]) -> tuple:
    """``(work, tensor, record)``: an async all-reduce of the record's hash, filled on the device
    (torch.tensor([h, -h], device=cuda) would copy from pageable memory, blocking the host)."""
    h = zlib.crc32(repr(recording).encode())
    t = torch.full((2,), h, dtype=torch.int64, device=dist.device)
    t[1].fill_(-h)
    work = dist.all_reduce(t, op=torch.distributed.ReduceOp.MAX, what="zero3 order check", async_op=True)
    return work, t, list(recording)


def order_check_flags(dist: Dist, checks: list) -> list[torch.Tensor]:
    """One device value per check: 0 where every rank used the same order (max h == min h)."""
    dist.wait([work for work, _, _ in checks], "zero3 order check")
    return [t.sum() for _, t, _ in checks]


def check_orders(dist: Dist, units: list, checks: list, flags: list[float]) -> None:
    """Raise (on every rank: collective then) if ranks used ``units`` (by uid) in different orders."""
    for (_, _, record), flag in zip(checks, flags, strict=True):
        if flag == 0:
            continue
        records = dist.all_gather_object(record, what="zero3 gather-order records")
        at = next(i for i in range(max(map(len, records)) + 1)
                  if len({tuple(r[i]) if i < len(r) else None for r in records}) > 1)
        seen = ", ".join(f"rank {r} at " + (f"{units[rec[at][1]].name!r} ({rec[at][0]})"
                                             if at < len(rec) else "the end of the pass")
                         for r, rec in enumerate(records))
        raise DistributedError(f"zero3: ranks used different modules at use {at} of a pass "
                               f"(data-dependent control flow?): {seen}")
