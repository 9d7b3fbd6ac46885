"""The host optimizer step of CPU offload, overlapped with backward and with the copy back.

Without overlap the host sits idle through backward and the device waits for the whole host
step. Here a worker thread (torch's kernels and ours release the GIL) takes over the host
pieces of the master partition:

* during backward, as soon as the stage reports a piece's reduced gradient final (zero2 does
  so per bucket on the last micro batch), the worker copies it to the host; with
  ``offload.overlap_step`` it then *speculatively* steps that piece as if the step will be
  neither clipped nor skipped;
* after backward the global norm decides. If the step is in fact unclipped and finite, the
  speculative pieces are exactly what the plain step computes (same element-wise arithmetic,
  see ``optimizers._subset``) and are kept; otherwise they are rolled back from the copies
  taken just before (parameters and optimizer state of each piece) and stepped again;
* the remaining pieces are stepped one after another by the worker while the main thread
  copies each finished piece back into the working parameters, then the stage gathers.

So results are identical to the plain order in every case; what speculation costs is host
memory for the undo copies (master + optimizer state of the host pieces, reported in the
memory ledger) and, when a step is clipped or skipped, the redone work. Speculation is
skipped after a step that was clipped or skipped (it would most likely be wasted again).
"""
from __future__ import annotations

from bisect import bisect_left, bisect_right
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Sequence

import torch
from torch import Tensor

from framework import ops
from framework.optimizers import GradientTransformation
from framework.optimizers._subset import group_state, step_groups
from framework.utils import tensor_bytes


class OverlappedHostStep:
    """The ``Update`` of a sharded stage whose master partition has host pieces."""

    def __init__(self, tx: GradientTransformation, stage: Any, speculative: bool):
        self.tx, self.stage, self.speculative = tx, stage, speculative
        self.index = stage.all_pieces   # (group, Piece) in the optimizer's order
        self.host = {k for k, (_, pc) in enumerate(self.index) if pc.grad is not None}
        # Per group, its host pieces by start (they tile the partition's host part in order), so
        # a reported range finds its pieces by bisection: ``ready`` runs in backward hooks.
        self.by_group: dict[int, tuple[list[int], list[int]]] = {}
        # Elements the stage will report per host piece: the padding at a group's end is never
        # reduced, so a piece is complete when its real elements are.
        self.expected = {}
        for k in sorted(self.host):
            g, pc = self.index[k]
            starts, ks = self.by_group.setdefault(g, ([], []))
            starts.append(pc.start)
            ks.append(k)
            lo = stage.bounds[g][0]
            self.expected[k] = max(0, min(lo + pc.end, stage.layouts[g].numel) - (lo + pc.start))
        self.out16 = stage.out16()
        ops.cpu_optim()  # load (or build) the kernels here, not racing from two threads later
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="host-step")
        self.undo: dict[int, list[Tensor]] = {}
        self.speculate = True   # cleared after a clipped or skipped step
        self.kept = self.rolled_back = 0   # speculatively stepped pieces, over the run
        self.early_copies = 0   # pieces whose gradient reached the host during backward, over the run
        self.copies: dict[int, Future] = {}
        self.ctx: tuple | None = None   # (opt_state, params, lr, scale) while speculating
        self.scale = 1.0
        self.jobs: dict[int, Future] = {}
        self.undone: set[int] = set()   # pieces whose undo copies were taken this step
        self.covered: dict[int, int] = {}
        stage.on_grads_final = self.ready

    # --- during backward -------------------------------------------------------------------

    def arm(self, opt_state: Any, params: Sequence[Tensor], lr: float, scale: float) -> None:
        self.jobs, self.undone, self.covered, self.scale = {}, set(), dict.fromkeys(self.host, 0), scale
        self.copies, self.stage.host_grads_fresh = {}, frozenset()
        self.ctx = (opt_state, list(params), lr, scale) if self.speculative and self.speculate else None

    def ready(self, group: int, lo: int, hi: int, partition_grad: Tensor) -> None:
        """The stage's reduced gradient of partition range [lo, hi) of ``group`` is final."""
        starts, ks = self.by_group.get(group, ((), ()))
        for k in ks[max(0, bisect_right(starts, lo) - 1):bisect_left(starts, hi)]:
            pc = self.index[k][1]
            n = min(hi, pc.end) - max(lo, pc.start)
            if n <= 0:
                continue
            self.covered[k] += n
            if self.covered[k] != self.expected[k]:  # each element is reported once a step
                continue
            # The reduction was queued on this thread's stream: the worker waits for it.
            event = torch.cuda.Event() if partition_grad.is_cuda else None
            if event is not None:
                event.record()
            src = partition_grad[pc.start:pc.end]
            if self.ctx is not None:
                self.jobs[k] = self.pool.submit(self._speculate, k, src, event)
            else:
                self.copies[k] = self.pool.submit(self._copy, k, src, event)

    def _copy(self, k: int, src: Tensor, event) -> None:
        if event is not None:
            event.synchronize()
        self.index[k][1].grad.copy_(src)

    def _speculate(self, k: int, src: Tensor, event) -> Any:
        opt_state, params, lr, scale = self.ctx
        _, pc = self.index[k]
        if event is not None:
            event.synchronize()
        pc.grad.copy_(src)
        grad = pc.grad if pc.grad.dtype == pc.master.dtype else pc.grad.to(pc.master.dtype)
        if scale != 1.0:
            grad.mul_(1.0 / scale)  # what the plain step's unclipped coefficient does
        saved = [pc.master, *group_state(opt_state, len(params), k)]
        if k not in self.undo:
            self.undo[k] = [torch.empty_like(t) for t in saved]
        for dst, t in zip(self.undo[k], saved):
            dst.copy_(t)
        self.undone.add(k)
        return step_groups(self.tx, {k: grad}, opt_state, params, lr, self.out16)

    def _wait(self) -> None:
        for job in [*self.jobs.values(), *self.copies.values()]:
            job.exception()  # wait only; result() raises in _settle / drain

    def drain(self) -> None:
        """Wait for the worker; tell the stage which host gradients need no second copy (the
        speculative pieces' ones do: the step may have scaled or overwritten them)."""
        self._wait()
        for job in self.copies.values():
            job.result()
        self.early_copies += len(self.copies)
        self.stage.host_grads_fresh = frozenset(self.copies)

    # --- after the norm --------------------------------------------------------------------

    def _settle(self, exact: bool) -> tuple[set[int], Any]:
        """Keep (exact) or roll back the speculative pieces; (kept pieces, a state they returned)."""
        self._wait()
        jobs, self.jobs = self.jobs, {}
        if exact:
            results = {k: job.result() for k, job in jobs.items()}  # a failed job raises here
            self.kept += len(results)
            return set(results), next(iter(results.values()), None)
        # Every piece whose undo copy was taken is restored, whether its job finished or failed.
        opt_state, params = self.ctx[0], self.ctx[1]
        for k in self.undone:
            _, pc = self.index[k]
            for dst, t in zip([pc.master, *group_state(opt_state, len(params), k)], self.undo[k]):
                dst.copy_(t)
        self.rolled_back += len(self.undone)
        self.undone = set()
        return set(), None

    def abort(self) -> None:
        """The step failed after ``arm``: leave the optimizer as it was before the step."""
        self._wait()
        if self.ctx is not None:
            self._settle(exact=False)
        self.ctx, self.copies, self.stage.host_grads_fresh = None, {}, frozenset()

    def skip(self) -> None:
        self.abort()
        self.speculate = False

    def apply(self, grads: list[Tensor], coef: float, opt_state: Any, params: Sequence[Tensor],
              lr: float) -> Any:
        clean = coef == 1.0 / self.scale  # neither clipped nor (we are here) skipped
        done, new_state = self._settle(exact=clean) if self.ctx is not None else (set(), None)
        self.ctx, self.speculate = None, clean
        rest = [k for k in range(len(self.index)) if k not in done]
        if coef != 1.0 and rest:
            torch._foreach_mul_([grads[k] for k in rest], coef)
        for k in done:  # copy back while the worker steps the rest
            self.stage.publish_piece(k)
        host_rest = [k for k in rest if k in self.host]
        jobs = [(k, self.pool.submit(step_groups, self.tx, {k: grads[k]}, opt_state, params, lr, self.out16))
                for k in host_rest]
        device_rest = [k for k in rest if k not in self.host]
        if device_rest:  # (offload.ratio < 1) stepped here, on the device, meanwhile
            new_state = step_groups(self.tx, {k: grads[k] for k in device_rest}, opt_state, params, lr,
                                    self.out16)
            for k in device_rest:
                self.stage.publish_piece(k)
        try:
            for k, job in jobs:
                new_state = job.result()
                self.stage.publish_piece(k)
        finally:
            for _, job in jobs:  # never leave a job running into the next step
                job.exception()
        self.stage.publish_finish()
        return new_state

    def memory(self) -> dict[str, int]:
        return {"host_overlap_buffers": tensor_bytes(t for ts in self.undo.values() for t in ts)}
