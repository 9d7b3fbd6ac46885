"""zero3's check that every rank used the same units in the same order in a backward pass.

Otherwise ranks would combine unrelated buffers or hang. Each pass starts a tiny asynchronous
all-reduce of a hash of its record (no host sync in autograd's callback); ``check`` reads them once a step.
"""
from __future__ import annotations

import zlib
from typing import Callable

import torch

from framework.comm.distributed import Dist
from framework.core.errors import DistributedError


class OrderCheck:
    def __init__(self, dist: Dist):
        self.dist = dist
        self.pending: list = []   # (work, tensor, pass hash, pass record) per backward pass

    def launch(self, record: list[tuple[str, int]]) -> None:
        """Start comparing one backward pass's (phase, unit id) record across ranks."""
        if self.dist.world == 1:
            return
        h = zlib.crc32(repr(record).encode())
        # Filled on the device: torch.tensor([h, -h], device=cuda) would be a host-to-device copy
        # from pageable memory, which blocks the host after every backward pass.
        t = torch.empty(2, dtype=torch.int64, device=self.dist.device)
        t[0].fill_(h)
        t[1].fill_(-h)
        work = self.dist.all_reduce(t, op=torch.distributed.ReduceOp.MAX, what="zero3 order check",
                                    async_op=True)
        self.pending.append((work, t, h, list(record)))

    def check(self, unit_name: Callable[[int], str]) -> None:
        """Raise if a pass since the last call differed across ranks (collective; one host sync a step)."""
        checks, self.pending = self.pending, []
        for work, t, h, record in checks:
            self.dist.wait([work], "zero3 order check")
            if int(t.sum()) == 0:   # host sync: once a step, before the optimizer step (max h == min h)
                continue
            records = self.dist.all_gather_object(record, what="zero3 gather-order records")
            at = next(i for i in range(max(map(len, records)) + 1)
                      if len({tuple(r[i]) if i < len(r) else None for r in records}) > 1)
            seen = ", ".join(f"rank {r} at " + (f"{unit_name(rec[at][1])!r} ({rec[at][0]})"
                                                 if at < len(rec) else "the end of the pass")
                             for r, rec in enumerate(records))
            raise DistributedError(f"zero3: ranks used different modules at use {at} of a pass "
                                   f"(data-dependent control flow?): {seen}")
