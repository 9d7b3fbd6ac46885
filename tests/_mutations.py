"""The GPU bugs that the checking accelerator (``framework.comm.accelerator``, FRAMEWORK_ACCELERATOR=check)
must catch on a CPU, each as a mutation that injects it into a real training run.

``tests/unit/test_mutations.py`` runs every scenario once as it is (the check passes) and once per
mutation (the check must fail the run with the listed error, naming the place in the message).
A mutation changes no file: it swaps in an accelerator that forgets one kind of call (as code that
forgot it would behave) or wraps one framework function, so it applies to whatever code makes the
calls. Add a mutation here for every new class of GPU bug the checker learns to see.

| mutation | GPU bug class | injected by | caught where |
|---|---|---|---|
| missing-h2d-wait | compute uses a host-to-device copy without waiting for its event | stream waits on events after an H2D copy are dropped | the compute use of the copied-back working values |
| unwaited-side-gather | compute consumes a gather issued on a side stream without waiting for it | the compute stream's waits for side-stream events and side-issued collectives are dropped | the compute use of the gathered unit (zero3 host shards) |
| pinned-reuse | a pinned buffer reused before the copy reading it finished | host waits on events after an H2D copy are dropped | the swap read into a reused pool slot |
| unsynced-d2h | a non_blocking device-to-host result read on the host without a wait | host waits on events after a D2H copy are dropped | the host step reading the gradient |
| collective-side-stream | a collective issued on a side stream that is not ordered after its inputs | collectives issued from a fresh stream | the zero3 gather |
| freed-in-flight | a tensor crossing streams without record_stream or an event | gradient copies read a temporary that is freed at once | the free (caching allocator), reported at the next call |
| sync-in-hook | a host sync inside a backward hook | a zero2 bucket hook checks its partition with bool(tensor) | the hook (HostSync) |
| event-sync-in-hook | a host wait for an event inside a backward hook (no torch call: the mode does not see it) | a zero2 bucket hook synchronizes an event recorded on compute | the hook (HostSync) |
| unbound-thread | a worker thread that never set its device | the host-step thread's bind_thread is a no-op | the worker's first device work |
| pageable-async | a non_blocking copy from pageable host memory | host buffers are allocated unpinned | the copy |
| unwaited-fresh-buffer | a side stream writes device memory that compute's allocator just handed out (compute's queued work may still read those bytes) without waiting for compute | zero3 host shard loads stop making the H2D stream wait for compute | the load into the refilled gather buffer |
| blocking-h2d-in-hook | a blocking host-to-device copy inside a hook (torch waits for the stream after it) | zero3 host shard loads copy blocking | the hook (HostSync) |
| collective-on-host | a collective on host memory (NCCL takes device memory only) | zero3 gathers through a pinned host staging buffer | the gather's collective |
| host-made-device-buffer | a device buffer made on the host by name (``device="cpu"``): on CUDA the first add of a device tensor into it fails | zero2's gradient partitions are made with ``device="cpu"`` in setup | the stage's placement check at setup |
| state-in-device-compute | device compute on a host piece's optimizer state (made by ``zeros_like`` of a host master: host memory) | the host step declares its state as the compute stream's operands | the host step |
| unwaited-d2h-source | a device buffer overwritten by compute while a device-to-host copy may still read it | speculated pieces' gradients copied a second time, waited for by nobody | the next backward's write of the gradient |
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from functools import partial
from typing import Callable

import torch

import framework
from framework.comm.accelerator import (CheckingCpuAccelerator, CheckingEvent, Clocked, DeviceMismatch, HostSync,
                                        OrderError)

ZERO3_HOST_SHARDS = ("+stage=zero3", "stage.stage3_param_persistence_threshold=0", "offload=cpu",
                     "offload.params=cpu")
ZERO2_OFFLOAD = ("+stage=zero2", "stage.reduce_bucket_size=1500", "offload=cpu")
# Four optimizer tiles through two pool slots: a slot is reused within each step.
# Speculative host steps that are kept (no clipping): each piece's gradient copy is waited for once.
ZERO2_SPECULATIVE = (*ZERO2_OFFLOAD, "offload.overlap_step=true", "train.grad_clip=0")
ZERO2_NVME = ("+stage=zero2", "offload=nvme", "offload.sub_group_size=1024", "offload.buffer_count=2")


class _Forgetful(CheckingEvent):
    def wait(self, stream=None) -> None:
        if self.after_copy not in self.acc.drop_wait:
            super().wait(stream)

    def _reached(self) -> None:   # (synchronize and query)
        if self.after_copy not in self.acc.drop_sync:
            super()._reached()


class ForgetsWaits(CheckingCpuAccelerator):
    """Code that forgets the stream waits (``drop_wait``) or host waits (``drop_sync``) on the events
    recorded after copies of the given kinds."""

    def __init__(self, drop_wait=(), drop_sync=()):
        super().__init__()
        self.drop_wait, self.drop_sync = drop_wait, drop_sync

    def event(self):
        return _Forgetful(self)


class _IgnoredByCompute(CheckingEvent):
    def record(self, stream=None) -> None:
        super().record(stream)
        self.side = (stream or self.acc.current_stream()) is not self.acc._compute

    def wait(self, stream=None) -> None:
        if not (self.side and (stream or self.acc.current_stream()) is self.acc._compute):
            super().wait(stream)


class ComputeIgnoresSideStreams(CheckingCpuAccelerator):
    """The compute stream never waits for side-stream work: events recorded on a side stream and
    collectives issued from one order nothing for it (the gatherer forgetting to wait)."""

    def event(self):
        return _IgnoredByCompute(self)

    def collective(self, tensors, what):
        return super().collective(tensors, what), self.current_stream() is not self._compute

    def collective_done(self, token) -> None:
        token, side = token
        if not (side and self.current_stream() is self._compute):
            super().collective_done(token)


class CollectivesOnSideStream(CheckingCpuAccelerator):
    def _issuing_stream(self) -> Clocked:
        return self._queue(Clocked("side"))   # a stream that waited for nothing but the host


class TemporaryCopySource(CheckingCpuAccelerator):
    """Device-to-host copies on a side stream read a temporary (``src.to(dtype)`` style) that the
    caller drops at once. ``record=True`` is the fix: the temporary is recorded on the stream."""

    def __init__(self, record=False):
        super().__init__()
        self.record = record

    def copy(self, dst, src, non_blocking=False):
        if self.current_stream() is self._compute or self._is_host(src) or not self._is_host(dst):
            return super().copy(dst, src, non_blocking)
        tmp = src.clone()
        super().copy(dst, tmp, non_blocking)
        if self.record:
            self.record_stream(tmp, self.current_stream())
        del tmp   # the caching allocator may hand its bytes out now


class NoCollectiveTokens(CheckingCpuAccelerator):
    """World size 1 as on CUDA: no collective is issued at all, so waiting for one orders nothing
    (what orders the compute stream after a side-stream load must be an event of that stream)."""

    def collective(self, tensors, what):
        return None


class UnboundThreads(CheckingCpuAccelerator):
    def bind_thread(self) -> None:
        pass


class PageableHostBuffers(CheckingCpuAccelerator):
    def empty_host(self, shape, dtype, pinned=True):
        return super().empty_host(shape, dtype, pinned=False)


def _copy_speculated_twice(setattr_: Callable) -> None:
    from framework.offload import PiecePipeline

    drain = PiecePipeline.drain

    def drain_forgetting_speculated_copies(self):
        drain(self)
        for k in self.jobs:   # the bug: ``grads`` copies them again, and a kept speculation never waits
            self.grad_copies.pop(k, None)

    setattr_(PiecePipeline, "drain", drain_forgetting_speculated_copies)


def _sync_in_zero2_hook(setattr_: Callable) -> None:
    from framework.stages.sharded import Zero2Stage

    launch = Zero2Stage._launch

    def _launch_checking_partition(self, i):
        if not bool(torch.isfinite(self.part[0]).all()):   # the bug: the host waits inside the hook
            raise RuntimeError("non-finite gradient")
        return launch(self, i)

    # The checker judges only framework frames (tests and models may sync): the injected code poses
    # as a framework file, named for where it really is.
    posing = os.path.join(os.path.dirname(framework.__file__), "(mutation in tests/_mutations.py)")
    _launch_checking_partition.__code__ = _launch_checking_partition.__code__.replace(co_filename=posing)
    setattr_(Zero2Stage, "_launch", _launch_checking_partition)


def _event_sync_in_zero2_hook(setattr_: Callable) -> None:
    from framework.stages.sharded import Zero2Stage

    launch = Zero2Stage._launch

    def _launch_waiting_for_compute(self, i):
        done = self.dist.acc.event()
        done.record()
        done.synchronize()   # the bug: the host waits for the compute stream inside the hook
        return launch(self, i)

    posing = os.path.join(os.path.dirname(framework.__file__), "(mutation in tests/_mutations.py)")
    _launch_waiting_for_compute.__code__ = _launch_waiting_for_compute.__code__.replace(co_filename=posing)
    setattr_(Zero2Stage, "_launch", _launch_waiting_for_compute)


def _blocking_shard_loads(setattr_: Callable) -> None:
    from framework.offload.cpu import HostShards

    def _copy_in_blocking(self, dst, shard):
        self.p.acc.copy(dst, shard)   # the bug: blocking, inside the gather's hook
        return self.p.acc.event()

    posing = os.path.join(os.path.dirname(framework.__file__), "(mutation in tests/_mutations.py)")
    _copy_in_blocking.__code__ = _copy_in_blocking.__code__.replace(co_filename=posing)
    setattr_(HostShards, "_copy_in", _copy_in_blocking)


def _unwaited_fresh_gather_buffers(setattr_: Callable) -> None:
    from framework.offload.cpu import HostShards

    @contextlib.contextmanager
    def loading_without_waiting(self):
        acc, waits = self.p.acc, []
        with acc.stream(self.p.h2d_stream):   # the bug: no wait for compute, which refilled the gather buffer
            yield waits
            issued = acc.event()
            issued.record()
        waits.append(issued.wait)

    setattr_(HostShards, "loading", loading_without_waiting)


def _gather_through_host(setattr_: Callable) -> None:
    from framework.comm.collectives import Local

    gather = Local.all_gather_into

    def all_gather_via_host(self, full, shard, what, chunk=None):
        staging = self.dist.acc.empty_host(full.shape, full.dtype)   # the bug: the collective's buffer is host memory
        staging.copy_(full)
        pending = gather(self, staging, shard, what, chunk)
        pending.after.append(lambda: full.copy_(staging))
        return pending

    setattr_(Local, "all_gather_into", all_gather_via_host)


def _host_made_zero2_partitions(setattr_: Callable) -> None:
    from framework.stages.sharded import Zero2Stage

    setup_grads = Zero2Stage._setup_grads

    def _setup_grads_on_host(self, entries):
        setup_grads(self, entries)
        for g, p in enumerate(self.part):   # (a loop: a comprehension's frame would not pose)
            self.part[g] = torch.zeros(p.numel(), dtype=p.dtype, device="cpu")   # the bug

    posing = os.path.join(os.path.dirname(framework.__file__), "(mutation in tests/_mutations.py)")
    _setup_grads_on_host.__code__ = _setup_grads_on_host.__code__.replace(co_filename=posing)
    setattr_(Zero2Stage, "_setup_grads", _setup_grads_on_host)


def _state_in_device_compute(setattr_: Callable) -> None:
    from framework.offload import PiecePipeline
    from framework.optimizers import group_state

    step = PiecePipeline._step

    def step_on_device(self, k, grad, coef, opt_state, params, lr):
        # the bug: the state that torch made beside a host master is taken for device memory (a device kernel)
        self.acc.use(reads=group_state(opt_state, len(params), k))
        return step(self, k, grad, coef, opt_state, params, lr)

    # (in the host-step thread no framework frame calls it: it poses as one, as ``_sync_in_zero2_hook`` does)
    posing = os.path.join(os.path.dirname(framework.__file__), "(mutation in tests/_mutations.py)")
    step_on_device.__code__ = step_on_device.__code__.replace(co_filename=posing)
    setattr_(PiecePipeline, "_step", step_on_device)


@dataclass(frozen=True)
class Mutation:
    name: str                         # a row of the table above (its GPU bug class)
    scenario: tuple[str, ...]         # overrides of the tiny run it is injected into
    error: type                       # what the check raises
    place: str                        # a regex the message must match: where it shows
    accelerator: Callable = CheckingCpuAccelerator
    patch: Callable[[Callable], None] | None = field(default=None)   # given a setattr (pytest's monkeypatch)


MUTATIONS: tuple[Mutation, ...] = (
    Mutation("missing-h2d-wait", ZERO2_OFFLOAD, OrderError,
             r"compute on stream 'compute' reads .* at framework/offload/base\.py:\d+ in working_ready.*"
             r"stream 'offload h2d' wrote at framework/offload/_store\.py:\d+ in copy_on <- "
             r"framework/offload/base\.py:\d+ in copy_back",
             partial(ForgetsWaits, drop_wait=("h2d",))),
    Mutation("unwaited-side-gather", ZERO3_HOST_SHARDS, OrderError,
             r"compute on stream 'compute' reads .* at framework/stages/_gather\.py:\d+ in _finish_gather.*"
             r"stream 'collectives' wrote at .* in _start_gather", ComputeIgnoresSideStreams),
    Mutation("pinned-reuse", ZERO2_NVME, OrderError,
             r"host code on the host writes .* at framework/offload/_diskstore\.py:\d+ in _start_io <- "
             r"framework/offload/_diskstore\.py:\d+ in _read.*"
             r"stream 'offload h2d' read at framework/offload/_store\.py:\d+ in copy_on <- "
             r"framework/offload/base\.py:\d+ in copy_back",
             partial(ForgetsWaits, drop_sync=("h2d",))),
    Mutation("unsynced-d2h", ZERO2_OFFLOAD, OrderError,
             r"host code on the host reads .* at framework/offload/_pipeline\.py:\d+ in _step.*"
             r"stream 'offload d2h' wrote at framework/offload/_store\.py:\d+ in copy_on <- "
             r"framework/offload/base\.py:\d+ in copy_grad",
             partial(ForgetsWaits, drop_sync=("d2h",))),
    Mutation("collective-side-stream", ZERO3_HOST_SHARDS, OrderError,
             r"collective .* on stream 'collectives' (reads|writes) .* in _start_gather", CollectivesOnSideStream),
    Mutation("freed-in-flight", ZERO2_OFFLOAD, OrderError,
             r"used by stream 'offload d2h' at .*in copy_grad was freed at .*in copy_grad", TemporaryCopySource),
    Mutation("sync-in-hook", ("+stage=zero2", "stage.reduce_bucket_size=1500"), HostSync,
             r"host sync \(__bool__ .* inside the zero2 gradient hook, at .* in _launch_checking_partition <- "
             r"framework/stages/_grads\.py:\d+ in flush", patch=_sync_in_zero2_hook),
    Mutation("event-sync-in-hook", ("+stage=zero2", "stage.reduce_bucket_size=1500"), HostSync,
             r"host sync \(synchronize of an event waiting for stream 'compute'\) inside the zero2 gradient hook, at "
             r".* in _launch_waiting_for_compute <- framework/stages/_grads\.py:\d+ in flush",
             patch=_event_sync_in_zero2_hook),
    Mutation("unbound-thread", ZERO2_OFFLOAD, DeviceMismatch,
             r"thread 'host-step_0' .* at framework/offload/_store\.py:\d+ in copy_on <- "
             r"framework/offload/base\.py:\d+ in copy_grad", UnboundThreads),
    Mutation("unwaited-d2h-source", ZERO2_SPECULATIVE, OrderError,
             r"compute on stream 'compute' writes .* in ready .* stream 'offload d2h' read at "
             r"framework/offload/_store\.py:\d+ in copy_on <- "
             r"framework/offload/base\.py:\d+ in copy_grad <- framework/offload/_pipeline\.py:\d+ in grads",
             patch=_copy_speculated_twice),
    Mutation("collective-on-host", ZERO3_HOST_SHARDS, DeviceMismatch,
             r"collective .zero3 gather of .* \(NCCL takes device memory only\): expected device memory, got a "
             r"host buffer .* in _start_gather", patch=_gather_through_host),
    Mutation("host-made-device-buffer", ("+stage=zero2", "stage.reduce_bucket_size=1500"), DeviceMismatch,
             r"zero2 gradient partitions and bucket buffers: expected device memory, got a host buffer .* at "
             r"framework/stages/sharded\.py:\d+ in setup <- framework/engine/build\.py:\d+ in initialize",
             patch=_host_made_zero2_partitions),
    Mutation("state-in-device-compute", ZERO2_OFFLOAD, DeviceMismatch,
             r"compute on the device: expected device memory, got a host buffer .* in step_on_device",
             patch=_state_in_device_compute),
    Mutation("pageable-async", ZERO2_OFFLOAD, DeviceMismatch, r"needs a pinned host buffer .* in copy_grad",
             PageableHostBuffers),
    Mutation("unwaited-fresh-buffer", ZERO3_HOST_SHARDS, OrderError,
             r"copy on stream 'offload h2d' uses a .* device buffer that the compute stream's allocator handed out, "
             r"at framework/offload/cpu\.py:\d+ in _copy_in <- framework/offload/cpu\.py:\d+ in load",
             patch=_unwaited_fresh_gather_buffers),
    Mutation("blocking-h2d-in-hook", ZERO3_HOST_SHARDS, HostSync,
             r"host sync \(blocking copy_ of a .* host buffer into device memory\) inside zero3's pre-forward hook, "
             r"at .* in _copy_in_blocking <- framework/offload/cpu\.py:\d+ in load", patch=_blocking_shard_loads),
)

# Correct variants of mutations: the check must let them pass.
CORRECT: tuple[tuple[str, tuple[str, ...], Callable], ...] = (
    ("recorded-temporary", ZERO2_OFFLOAD, partial(TemporaryCopySource, record=True)),
    ("world-1-without-collectives", ZERO3_HOST_SHARDS, NoCollectiveTokens),
    # the shards the hooks load are pinned whatever offload.pin_memory says: their loads stay asynchronous
    ("unpinned-offload-shard-loads", (*ZERO3_HOST_SHARDS, "offload.pin_memory=false"), CheckingCpuAccelerator),
    ("unpinned-nvme-shard-loads", ("+stage=zero3", "stage.stage3_param_persistence_threshold=0", "offload=nvme",
                                   "offload.params=nvme", "offload.pin_memory=false"), CheckingCpuAccelerator),
)
