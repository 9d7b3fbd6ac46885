"""The piece pipeline of CPU offload: gradient copy (D2H stream, queued by a worker thread once the
stage reports a piece final) -> host step -> copy back (H2D stream), per piece, ordered by events,
never by a device-wide synchronize. With ``offload.overlap_step`` a piece is stepped speculatively
during backward: kept when the step is neither clipped nor skipped, else rolled back from undo copies
(and not tried on the next step). The disk tier swaps tiles behind the same store calls; the ranks
agree on swap IO failure after backward and the step.
"""
from __future__ import annotations

import weakref
from bisect import bisect_left, bisect_right
from concurrent.futures import Future, ThreadPoolExecutor, wait as wait_all
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from framework import ops
from framework.comm.accelerator import Event
from framework.offload._store import Tier, recorded
from framework.offload.base import Placement
from framework.optimizers import GradientTransformation, group_state, step_groups
from framework.core.footprint import Footprint
from framework.core.utils import tensor_bytes


class PiecePipeline:
    """The ``Update`` of a stage with host pieces, and its gradient listener (via the offload target)."""

    def __init__(self, tx: GradientTransformation, target: Placement, gather: Callable[[], None]):
        self.tx, self.target, self.gather = tx, target, gather
        self.acc = target.acc
        self.info = target.pieces()           # in the optimizer's order
        self.host = {i.index for i in self.info if i.tier is not Tier.DEVICE}   # host memory or disk
        # per group, its host pieces by start: ``ready`` (in backward hooks) finds them by bisection
        self.by_group: dict[int, tuple[list[int], list[int]]] = {}
        for k in sorted(self.host):
            starts, ks = self.by_group.setdefault(self.info[k].group, ([], []))
            starts.append(self.info[k].start)
            ks.append(k)
        self.out16 = target.out16()
        if tx.fused is not None:   # only an optimizer with a fast path uses the kernels (not SGD)
            ops.cpu_optim()  # load (or build) them here, not racing from two threads later
        # The worker queues copies and pins memory: on this rank's device, not the thread default (GPU 0).
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="host-step", initializer=self.acc.bind_thread)
        # an engine dropped unclosed: the worker ends once this pipeline is collected (it holds no reference)
        weakref.finalize(self, self.pool.shutdown, wait=False, cancel_futures=True)
        self.undo: dict[int, list[Tensor]] = {}
        self.speculate = True   # cleared after a clipped or skipped step
        self.kept = self.rolled_back = 0   # speculatively stepped pieces, over the run
        self.early_copies = 0   # pieces whose gradient copy was queued during backward, over the run
        self.handles: dict[int, None] = {}        # pieces acquired from their store this step, in order
        self._new_step(1.0, None)

    def _new_step(self, scale: float, ctx: tuple | None) -> None:
        self.scale, self.ctx = scale, ctx   # ctx: (opt_state, params, lr, scale) while speculating
        self.grad_copies: dict[int, Future] = {}   # this step's host gradient copies: the copy's event
        self.final: set[int] = set()              # pieces the stage reported final this step
        # the device range each speculated piece's gradient came from: copied again if rolled back
        self.sources: dict[int, Tensor] = {}
        self.jobs: dict[int, Future] = {}
        self.undone: set[int] = set()   # pieces whose undo copies were taken this step
        self.covered = dict.fromkeys(self.host, 0)   # elements reported final, per host piece

    def init(self, params: Sequence[Tensor]) -> Any:
        return self.target.init_opt_state(self.tx, params)

    def arm(self, opt_state: Any, params: Sequence[Tensor], lr: float, scale: float) -> None:
        if self.target.grad_swap:   # backward writes gradient extents: no slot may hold a tile now
            self.target.stores[Tier.DISK].settle()
        self._new_step(scale, (opt_state, list(params), lr, scale) if self.target.overlap_step and self.speculate
                       else None)

    def ready(self, group: int, lo: int, hi: int, grad: Tensor) -> None:
        """Range [lo, hi) of ``group``'s reduced gradient is final, produced on the current stream."""
        self.acc.use(writes=[grad[lo:hi]])
        starts, ks = self.by_group.get(group, ((), ()))
        for k in ks[max(0, bisect_right(starts, lo) - 1):bisect_left(starts, hi)]:
            info = self.info[k]
            n = min(hi, info.end) - max(lo, info.start)
            if n <= 0:
                continue
            self.covered[k] += n
            if self.covered[k] != info.real:  # each element is reported once a step
                continue
            self.final.add(k)
            # recorded here, on the stage's stream; the worker queues the copy behind it
            self.grad_copies[k] = self.pool.submit(self.target.copy_grad, info, grad[info.start:info.end],
                                                   recorded(self.acc))
            if self.ctx is not None:
                self.sources[k] = grad[info.start:info.end]
                self.jobs[k] = self.pool.submit(self._speculate, k)

    def grads(self, parts: Sequence[Tensor]) -> list[Tensor]:
        """Every piece's gradient (host pieces: their host buffer, its copy queued if not yet)."""
        out = []
        for info in self.info:
            k, g = info.index, parts[info.group][info.start:info.end]
            # a swapped gradient is beside the tile, resident once the step acquires it: nothing to copy
            swapped = info.tier is Tier.DISK and self.target.grad_swap
            if info.tier is not Tier.DEVICE and k not in self.grad_copies:
                if not swapped and k not in self.final:  # final on the current stream since backward ended
                    self.acc.use(writes=[g])
                self.grad_copies[k] = _done(recorded(self.acc) if swapped else self.target.copy_grad(info, g))
            g = g if info.tier is Tier.DEVICE else info.grad
            out.append(g if swapped else g.to(info.master.dtype))
        return out

    def _acquire(self, k: int) -> None:
        store = self.target.stores[self.info[k].tier]
        if k not in self.handles:
            self.handles[store.acquire(k)] = None
        store.wait(k)

    def _speculate(self, k: int) -> Any:
        """``_step`` with the unclipped coefficient, after undo copies of what it changes."""
        opt_state, params, lr, scale = self.ctx
        pc = self.info[k]
        self._acquire(k)
        saved = [pc.master, *group_state(opt_state, len(params), k)]
        if k not in self.undo:   # (only the host touches them: not pinned)
            self.undo[k] = [self.acc.empty_host(t.shape, t.dtype, pinned=False) for t in saved]
        self.acc.host_use(reads=saved, writes=self.undo[k])
        # (torch._foreach_*: no public multi-tensor op; torch.optim's own steps use the same ones)
        torch._foreach_copy_(self.undo[k], saved)
        self.undone.add(k)
        return self._step(k, pc.grad, 1.0 / scale, opt_state, params, lr)

    def _step(self, k: int, grad: Tensor, coef: float, opt_state: Any, params: Sequence[Tensor], lr: float) -> Any:
        pc = self.info[k]
        self._acquire(k)
        self.grad_copies[k].result().synchronize()   # sync point: this piece's gradient copy only
        if grad.dtype != pc.master.dtype:   # a swapped gradient in a 16-bit accumulation dtype, resident now
            self.acc.on_host(grad, what="a swapped gradient")
            grad = grad.to(pc.master.dtype)
            self.acc.register_host(grad, what="a swapped gradient in the master dtype")   # (torch made it on the host)
        staging = [] if pc.staging is None else [pc.staging]
        self.acc.on_host(grad, pc.master, *staging, what="host step operands")
        self.acc.host_use(reads=[grad, pc.master], writes=[grad, pc.master, *staging])
        if coef != 1.0:
            grad.mul_(coef)
        return step_groups(self.tx, {k: grad}, opt_state, params, lr, self.out16)

    def _wait(self) -> None:
        for job in [*self.grad_copies.values(), *self.jobs.values()]:
            job.exception()  # wait only; result() raises in _settle or drain

    def drain(self) -> None:
        """Wait for the worker (a speculative piece's gradient is copied again only if rolled back)."""
        self._wait()
        for copy in self.grad_copies.values():
            copy.result()   # a failed copy raises here
        self.target.shards.read_errors()   # zero3 shards on disk: a failed read stops every rank here
        self.early_copies += len(self.grad_copies)

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
            saved = [self.info[k].master, *group_state(opt_state, len(params), k)]
            self.acc.host_use(reads=self.undo[k], writes=saved)
            torch._foreach_copy_(saved, self.undo[k])
        for k in jobs:   # its host gradient may be scaled: the original again, from the device
            self.grad_copies[k] = _done(self.target.copy_grad(self.info[k], self.sources[k]))
        self.rolled_back += len(self.undone)
        self.undone = set()
        return set(), None

    def abort(self) -> None:
        """The step failed after ``arm``: leave the optimizer as it was, and the stores whole whatever line an
        exception or Ctrl-C cut (``Placement.recover``, which raises a swap write that failed meanwhile)."""
        for store in self.target.stores.values():   # a worker waiting for a slot gives up
            store.interrupt()
        self.pool.submit(int).exception()   # (one thread: every job before it ended, one whose future was lost too)
        try:
            self._roll_back()
        finally:
            self.handles = {}
            self.target.recover()

    def skip(self) -> None:
        """A healthy skipped step (overflow): rolled back, the stores' writes left in flight (a failed one raises
        where it is waited for, as on any step). One that raises here is aborted by the step."""
        self._roll_back()
        self.speculate = False

    def _roll_back(self) -> None:
        if self.ctx is not None:   # (only then were jobs submitted: the copies are waited for below)
            self._settle(exact=False)
        for copy in self.grad_copies.values():  # the host may read the gradients now (overflow names)
            if copy.exception() is None:
                copy.result().synchronize()
        self.ctx = None
        self._release_all()   # (rolled back speculative pieces are written back)

    def _release_all(self) -> None:
        for k in self.handles:
            self.target.stores[self.info[k].tier].release(k, None)
        self.handles = {}

    def apply(self, grads: list[Tensor], coef: float, opt_state: Any, params: Sequence[Tensor],
              lr: float, applying: Callable[[], None] | None = None) -> Any:
        clean = coef == 1.0 / self.scale  # neither clipped nor (we are here) skipped
        copies: list[Event] = []
        jobs, new_state, failed, finished = [], None, None, False
        try:   # every failure below (a speculative job, a copy back's shard read) is agreed on after it
            done, new_state = self._settle(exact=clean) if self.ctx is not None else (set(), None)
            # until here abort restores the undo copies; from here on the pieces are stepped for good
            if applying is not None:
                applying()
            self.ctx, self.speculate = None, clean
            after = self.target.working_used()
            for store in self.target.stores.values():
                store.resume()
            for k in done:  # copy back while the worker steps the rest
                self._publish(k, after, copies)
            jobs = [(k, self.pool.submit(self._step, k, grads[k], coef, opt_state, params, lr))
                    for k in sorted(self.host - done)]   # (only host pieces are speculated)
            device_rest = [k for k in range(len(self.info)) if k not in self.host]
            if device_rest:  # (offload.ratio < 1) stepped here, on the compute stream, meanwhile
                if coef != 1.0:
                    torch._foreach_mul_([grads[k] for k in device_rest], coef)
                new_state = step_groups(self.tx, {k: grads[k] for k in device_rest}, opt_state, params, lr,
                                        self.out16)
                for k in device_rest:
                    self._publish(k, after, copies)
            for k, job in jobs:
                new_state = job.result()
                self._publish(k, after, copies)
            finished = True
        except Exception as e:   # noqa: BLE001 - raised below (with a disk tier, on every rank)
            failed = e
        finally:
            for _, job in jobs:  # never leave a job running into the next step
                job.cancel()
            for store in self.target.stores.values():   # a worker waiting for a slot gives up
                store.interrupt()
            wait_all([job for _, job in jobs])
            if not finished:   # (an error or Ctrl-C) what the compute stream does next (a load) follows the
                for ev in copies:   # copies back already queued, as it would after working_ready
                    ev.wait()
            try:
                self._release_all()
            except Exception as e:   # noqa: BLE001 - a swap write that failed
                failed = failed or e
        try:
            self.target.agree_io_error(failed, "stepping the optimizer")   # (swap files: every rank, before the gather)
            self.target.working_ready(copies)
        except BaseException:
            if finished:   # (a peer's failure, after this rank queued every copy back) as above
                for ev in copies:
                    ev.wait()
            raise
        self.gather()
        return new_state

    def _publish(self, k: int, after: Event, copies: list[Event]) -> None:
        ev = self.target.copy_back(self.info[k], after)
        if ev is not None:
            copies.append(ev)
        if k in self.handles:
            del self.handles[k]
            self.target.stores[self.info[k].tier].release(k, ev)

    def memory(self, fp: Footprint) -> None:
        fp.add("overlap_undo", host=tensor_bytes(t for ts in self.undo.values() for t in ts))

    def swap_stats(self) -> dict[str, float]:
        """Swap file bytes, bytes read and written and seconds blocked on IO so far (benchmarks)."""
        stores = [s for s in (self.target.stores.get(Tier.DISK), self.target.shards.store) if s is not None]
        return {"file": sum(sum(s.extents().values()) for s in stores), "read": sum(s.bytes_read for s in stores),
                "written": sum(s.bytes_written for s in stores), "wait_s": sum(s.wait_s for s in stores)}

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        self.target.close()


def _done(event: Event) -> Future:
    """A gradient copy queued on this thread, as the worker's are: a finished Future of its event."""
    f: Future = Future()
    f.set_result(event)
    return f
