"""ZeRO-3's trace of unit uses: recorded and followed per pass (a change of order logged); each backward
pass's record compared across ranks, without a host sync until the step's one read of the flags."""
from __future__ import annotations

import logging
import zlib
from typing import Iterator

import torch

from framework.comm.distributed import Dist
from framework.core.errors import DistributedError

log = logging.getLogger("framework.zero3")


class Trace:
    """The order of a pass's unit uses, ``(phase, uid)``: recorded, and followed by the next pass of its kind
    (``upcoming``) until a use departs from it. Kinds: per grad mode the steps' passes; per ("outside", grad
    mode) the root forwards outside them, while the steps have recorded none of that mode."""

    def __init__(self, units: list, is_main: bool):
        self.units, self.is_main = units, is_main
        self.traces: dict[bool | tuple[str, bool], list[tuple[str, int]]] = {}
        self.key: bool | tuple[str, bool] = True   # the open pass's kind
        self.recording: list[tuple[str, int]] | None = None
        self.cursor: int | None = None   # position in the trace being followed; None: on demand
        self.warned = False   # the module order changed in a pass: warned once

    def begin(self, grad_mode: bool, driven: bool) -> None:
        """Not ``driven`` (a root forward outside the steps): it follows the steps' trace without recording (the
        next steps follow it); without one it records and follows a trace of its own."""
        self.end()
        own = not driven and grad_mode not in self.traces
        self.key = ("outside", grad_mode) if own else grad_mode
        self.recording = [] if driven or own else None
        self.cursor = 0 if self.key in self.traces else None

    def end(self) -> None:
        if self.recording:
            self.traces[self.key] = self.recording
        self.recording = self.cursor = None

    def use(self, phase: str, unit) -> bool:
        """Record ``phase`` of ``unit``; False where the followed trace expected another use (followed no more)."""
        event = (phase, unit.uid)
        if self.recording is not None:
            self.recording.append(event)
        if self.cursor is None:   # (set only in a mode with a recorded trace)
            return True
        trace = self.traces[self.key]
        if self.cursor < len(trace) and trace[self.cursor] == event:
            self.cursor += 1
            return True
        if self.is_main:   # once a run: control flow that changes every step would log every step
            expected = (f"{trace[self.cursor][0]} of {self.units[trace[self.cursor][1]].name!r}"
                        if self.cursor < len(trace) else "the end of the pass")
            (log.debug if self.warned else log.warning)(
                "zero3: module order changed at use %d (expected %s, got %s of %r); prefetch off until the "
                "new order is recorded%s", self.cursor, expected, phase, unit.name,
                "" if self.warned else " (later changes are logged at debug level)")
            self.warned = True
        self.cursor = None
        return False

    def upcoming(self) -> Iterator:
        """The units the followed trace uses next, each once (none when not following one)."""
        if self.cursor is None:
            return
        trace, seen = self.traces[self.key], set()   # (lazy: the prefetch takes the next few only, not the rest)
        for i in range(self.cursor, len(trace)):   # (no slice: a copy of the rest of the trace per call)
            uid = trace[i][1]
            if uid not in seen:
                seen.add(uid)
                yield self.units[uid]


def warn_partial(name: str, missing: list[str]) -> None:
    """Unit ``name`` waited through the backward for the gradients of ``missing``, which never came."""
    log.warning("zero3: unit %r stayed gathered until the end of the backward pass (beyond "
                "stage3_max_live_parameters): %d of its parameters got no gradient (%s%s; counted as zero), so "
                "the end of its own backward could not be told. Parameters a pass does not train (run under "
                "torch.no_grad, an unused expert) are best in a unit of their own. Warned once a run.",
                name, len(missing), ", ".join(missing[:3]), ", ..." if len(missing) > 3 else "")


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
    try:
        dist.wait([work for work, _, _ in checks], "zero3 order check")
    except DistributedError as e:
        if (timed_out := diverged(e)) is not None:
            raise timed_out from e
        raise
    return [t.sum() for _, t, _ in checks]


def diverged(error: BaseException) -> DistributedError | None:
    """``error`` again with zero3's likely cause where it is a collective that timed out with no peer seen gone.
    The order check names the module on each rank only where the ranks' collectives stay alike until it is read:
    each rank gathers, prefetches and keeps units along the order it recorded itself, so ranks that use different
    modules after their first pass (or in another micro batch of it) issue different collectives and wait."""
    if not isinstance(error, DistributedError) or not error.waited:
        return None
    out = DistributedError(f"{error}; under zero3 the likely causes, where no rank died, are an exception on "
                           f"another rank (its loss_fn or forward raised: its own error says what; let it end every "
                           f"process, never catch and retry it on one rank) or data-dependent control "
                           f"flow: ranks that used different modules in a pass issue different gathers and wait on "
                           f"each other; make every rank call the same modules in the same order "
                           f"(TORCH_DISTRIBUTED_DEBUG=DETAIL in the launch environment names each rank's collective)",
                           waited=True)
    for note in getattr(error, "__notes__", ()):   # (what the abort after it could not undo)
        out.add_note(note)
    return out


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
