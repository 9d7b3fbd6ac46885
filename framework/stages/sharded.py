"""zero1 and zero2: replicated working parameters, partitioned master and optimizer state, gathered back
into the working buffers after each step. zero1 accumulates gradients in full flat buffers, as ddp, and
reduces them on the last micro batch; zero2 reduces every micro batch into partitioned gradients."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch import nn

from framework.comm.collectives import Pending
from framework.comm.distributed import Dist, env_int, resolve_backend
from framework.core.errors import ConfigError
from framework.core.footprint import Footprint
from framework.core.registry import Component
from framework.core.utils import tensor_bytes
from framework.offload.base import Placement
from framework.precision import Policy
from framework.stages._flat import bind_groups, initializer, refuse_sparse_grads
from framework.stages._grads import (Arrivals, Bucket, FlatGrads, backward_or_reset, bucket_buffers, check_buckets,
                                     check_no_grads, expected_order, own_overlap, plan_buckets, plan_stripes,
                                     reduce_bucket, reduce_to_owners, sparse_gradient)
from framework.stages.base import PartitionedStage, Setup


@dataclass(frozen=True, kw_only=True)
class ZeroConfig:
    """DeepSpeed's zero_optimization keys (same names and defaults, so configs port over)."""

    reduce_bucket_size: int = 500_000_000      # elements per gradient reduction bucket
    allgather_bucket_size: int = 500_000_000   # elements per parameter all-gather chunk
    overlap_comm: bool = False                 # reduce buckets while backward still runs
    contiguous_gradients: bool = True          # zero2: copy gradients into a bucket buffer (zero1: always)
    reduce_scatter: bool = True                # False: all-reduce fallback (every rank gets all)
    # zero2: parameters laid out round-robin over the partitions (DeepSpeed's order), so every rank
    # copies its reduced buckets to the host while backward runs (zero1: no effect, a note)
    round_robin_gradients: bool = False


class ShardedStage(PartitionedStage):
    """Base of zero1/zero2; subclasses own the gradient path: ``_setup_grads(entries)`` ((param, (group,
    slot)) in registration order), ``_grad_memory(fp)`` and ``PartitionedStage``'s methods."""

    def __init__(self, cfg: ZeroConfig, dist: Dist, offload: Placement):
        super().__init__(cfg, dist, offload, chunk=self.piece_size(cfg, dist.world))

    def setup(self, module: nn.Module, policy: Policy, *, grad_accum: int = 1) -> Setup:
        self.module, self.policy, world = module, policy, self.dist.world
        # self.flats: the working parameters, replicated
        kinds, layouts, self.flats, entries = bind_groups(module, world, policy.param_dtype, self.dist, initializer(module),
                                                          lambda named: self.layout_order(self.cfg, named, world))
        for layout, flat in zip(layouts, self.flats):
            # fp32 without offload: the owned slice of the working buffer is the master (no copy).
            self._own(layout, flat[slice(*layout.partition(self.dist.rank))], policy.master_dtype)
        self._setup_grads(entries)
        return Setup(self.master, [kinds[g] for g, _ in self.piece_index])

    @staticmethod
    def piece_size(cfg: ZeroConfig, world: int) -> int:
        """Host pieces at most one rank's share of a bucket: the unit of the overlapped host step."""
        return -(-cfg.reduce_bucket_size // world)

    @staticmethod
    def layout_order(cfg: ZeroConfig, named: list, world: int) -> list:
        return named   # zero2 may lay them out round-robin

    def publish_finish(self) -> None:
        comm = self.dist.comm   # every rank's owned partition -> everywhere (gloo: in allgather_bucket_size calls)
        for flat, layout in zip(self.flats, self.layouts):
            comm.wait(comm.all_gather_into(flat, layout.shard, "parameter all-gather", self.cfg.allgather_bucket_size),
                      "parameter all-gather")

    def _memory(self, fp: Footprint, opt_state) -> None:
        fp.add("params", device=tensor_bytes(self.flats))
        self.offload.memory(fp, opt_state)
        self._grad_memory(fp)


def round_robin(named: list, world: int) -> list:
    """DeepSpeed's round-robin order: parameters adjacent in backward order lie in different partitions."""
    return [x for r in range(world) for x in named[r::world]]


class Zero1Stage(ShardedStage):
    def _setup_grads(self, entries: list) -> None:
        # Autograd accumulates straight into the flat buffer (contiguous_gradients inherently). During
        # backward: buckets in gradient order; after it every gradient is present, so stripes.
        plan = plan_buckets if self.cfg.overlap_comm else plan_stripes
        buckets = plan(expected_order([e[1] for e in entries]), self.cfg.reduce_bucket_size,
                       {g: layout.shard for g, layout in enumerate(self.layouts)}, self.dist.world)
        self.flat_grads = FlatGrads(entries, self.flats, self.layouts, self.bounds, buckets, self.dist, self.policy,
                                    reduce_scatter=self.cfg.reduce_scatter, overlap=self.cfg.overlap_comm,
                                    stage="zero1", what="gradient reduction")
        self.hook_handles = self.flat_grads.hook_handles

    def backward(self, loss: torch.Tensor, *, sync: bool) -> None:
        self.flat_grads.backward(loss, sync=sync)

    def _finish_grads(self) -> None:
        self.flat_grads.finish()

    def _partition_grads(self) -> list[torch.Tensor]:
        return self.flat_grads.owned()

    def zero_grads(self) -> None:
        self.flat_grads.zero()

    def _grad_memory(self, fp) -> None:
        self.flat_grads.memory(fp)


class Zero2Stage(ShardedStage):
    """A bucket's gradients, once arrived, are copied into a reusable buffer (``contiguous_gradients``), their
    .grad freed, and the buffer reduced to its owners, who add their share into their partition."""

    @staticmethod
    def layout_order(cfg: ZeroConfig, named: list, world: int) -> list:
        return round_robin(named, world) if cfg.round_robin_gradients else named

    def setup(self, module: nn.Module, policy: Policy, *, grad_accum: int = 1) -> Setup:
        refuse_sparse_grads(module, "zero2")
        setup = super().setup(module, policy, grad_accum=grad_accum)
        # The reduced sums are added into the partitions by torch ops declared to no accelerator call (a
        # declaration per bucket would cost every step): their placement is checked here, once.
        self.dist.acc.on_device(*self.part, *self.buffers, what="zero2 gradient partitions and bucket buffers")
        return setup

    @staticmethod
    def plan(cfg: ZeroConfig, slots: list, shards: dict[int, int], world: int) -> list[Bucket]:
        """The buckets from each parameter's (group, slot) in registration order (the memory model's too).
        Round-robin: buckets of at most ``bucket_size // world`` per partition, so owners take turns."""
        size = cfg.reduce_bucket_size
        cap = max(1, size // world) if cfg.round_robin_gradients else None
        return plan_buckets(expected_order(slots), size, shards, world, cap)

    @staticmethod
    def largest_sum(buckets: list[Bucket], layouts: list, rank: int, slots: list | None = None) -> int:
        """Elements of the largest reduced range ``rank`` adds into its partition (``_complete``), for the memory
        model: on the CPU an add of another dtype copies that range in the wider one first. ``slots`` (each
        parameter's (group, slot), given without contiguous_gradients): the adds are one parameter piece each."""
        best = 0
        for b in buckets:
            lo, hi = layouts[b.group].partition(rank)
            for start, end in b.ranges:
                cuts = [(start, end)] if slots is None else \
                    [(max(start, s.offset), min(end, s.offset + s.numel)) for s in (slots[p][1] for p in b.params)]
                for a, z in cuts:
                    if (own := own_overlap(a, z, lo, min(hi, layouts[b.group].numel))) is not None:
                        best = max(best, own[1] - own[0])
        return best

    def _setup_grads(self, entries: list) -> None:
        self.params = [p for p, _ in entries]
        self.slots = [gs for _, gs in entries]
        self.part = [torch.zeros(hi - lo, dtype=self.policy.grad_accum_dtype, device=self.dist.device)
                     for lo, hi in self.bounds]
        self.named = [(p, s.name) for p, (_, s) in entries]
        buckets = self.plan(self.cfg, self.slots, {g: layout.shard for g, layout in enumerate(self.layouts)},
                            self.dist.world)
        self.launcher = Arrivals(buckets, self._launch, [n for _, n in self.named], "zero2")
        self.spans = [self._spans(b) for b in buckets]   # (fixed with the layout: worked out once, not per step)
        self.unowned = [pid for pid in range(len(self.params)) if pid not in self.launcher.owners]   # 0 elements
        n, size = bucket_buffers(buckets, self.cfg.overlap_comm, self.cfg.contiguous_gradients)
        self.buffers = [torch.empty(size, dtype=self.policy.reduce_dtype, device=self.dist.device) for _ in range(n)]
        self.free = list(self.buffers)
        self.buffer_elems = n * size
        self.in_flight: deque = deque()
        self.abandoned: deque | None = None   # those of an interrupted pass, not waited for
        self.sync = True   # set by each backward: its pass is the step's last, so the ranges it completes are final
        self.hook_handles += self.launcher.attach(self.params, self.dist.acc)

    def _launch(self, i: int) -> None:
        b = self.launcher.buckets[i]
        shard, numel = self.layouts[b.group].shard, self.layouts[b.group].numel
        what = f"gradient reduction of bucket {i}"
        comm, rs = self.dist.comm, self.cfg.reduce_scatter
        if self.cfg.contiguous_gradients:
            while not self.free:  # bound the buffers in flight
                self._complete(self.in_flight.popleft())
            base = self.free.pop()
            buf = base[:b.numel]
            for lo, hi, part, off in self._pieces(i):
                dst = buf[off:off + hi - lo]
                dst.copy_(part) if part is not None else dst.zero_()
            chunks = buf.chunk(b.count)   # one per range
            for (start, end), t in zip(b.ranges, chunks):  # the padding at a group's end (in a whole-buffer bucket)
                if end > numel:
                    t[max(start, numel) - start:].zero_()
            wire = [buf] if b.contiguous else list(chunks)
            pieces = [(start, t) for (start, _), t in zip(b.ranges, chunks)]
            pending = reduce_bucket(comm, wire, b, shard, rs, what)
        else:  # reduce each gradient piece where it lies (no bucket buffer)
            base = None
            pieces = [(lo, part.to(self.policy.reduce_dtype) if part is not None
                       else torch.zeros(hi - lo, dtype=self.policy.reduce_dtype, device=self.dist.device))
                      for lo, hi, part, _ in self._pieces(i)]
            pending = Pending.of(reduce_to_owners(comm, t, lo, shard, rs, what) for lo, t in pieces)
        for pid in b.params:  # a parameter's .grad goes with the last bucket that reads it
            if self.launcher.owners[pid][-1] == i:
                self.params[pid].grad = None
        self.in_flight.append((b, pending, pieces, base))
        if not self.cfg.overlap_comm:
            self._complete(self.in_flight.popleft())

    def _spans(self, b) -> tuple:
        """(parameter id, flat lo, flat hi, their offsets in the parameter, offset in the buffer) of each piece in
        bucket ``b``, in buffer order."""
        out = []
        for k, (start, end) in enumerate(b.ranges):   # the ranges lie end to end in the buffer
            for pid in b.params:
                slot = self.slots[pid][1]
                lo, hi = max(start, slot.offset), min(end, slot.offset + slot.numel)
                if lo < hi:
                    out.append((pid, lo, hi, lo - slot.offset, hi - slot.offset, k * (b.end - b.start) + lo - start))
        return tuple(out)

    def _pieces(self, i: int):
        """(flat lo, flat hi, gradient values or None, offset in the buffer) of each piece in bucket ``i``."""
        for pid, lo, hi, a, z, off in self.spans[i]:
            g = self.params[pid].grad
            if g is not None and g.is_sparse:   # (metadata only)
                raise sparse_gradient("zero2", self.named[pid][1])
            yield lo, hi, None if g is None else g.reshape(-1)[a:z], off

    def _complete(self, item, add: bool = True) -> None:
        """Wait for a launched bucket; add this rank's sums into its partition (if ``add``); reuse its buffer."""
        b, pending, pieces, base = item
        self.dist.comm.wait(pending, "gradient reduction")
        lo, hi = self.bounds[b.group]
        real = min(hi, self.layouts[b.group].numel)   # a whole-buffer bucket's padding: zeros, never reported
        for start, t in pieces if add else ():   # (flat start, values) of each reduced range
            if (own := own_overlap(start, start + t.numel(), lo, real)) is None:   # this rank's sums
                continue
            a, z = own
            self.part[b.group][a - lo:z - lo] += t[a - start:z - start]
            if self.sync:  # tell the listener (the offload target)
                self.offload.grads_final(b.group, a - lo, z - lo, self.part[b.group])
        if base is not None:
            self.free.append(base)

    def backward(self, loss: torch.Tensor, *, sync: bool) -> None:
        self.sync = sync
        check_no_grads(self.named, "zero2")  # .grad are freed per bucket: any here came from a backward outside ours
        self.launcher.arm()

        def backward():
            try:
                (loss / self.dist.world).backward()
            finally:
                self.launcher.disarm()
            self.launcher.flush()  # buckets of parameters that got no gradient
            while self.in_flight:
                self._complete(self.in_flight.popleft())

        backward_or_reset(backward, self._abort_backward, "zero2")   # (a pass cut short in its last reductions too)
        for pid in self.unowned:   # no bucket frees these
            self.params[pid].grad = None

    def _abort_backward(self, wait: bool) -> None:
        """As ``FlatGrads.abort_backward``, nothing added into the partitions. Every bucket buffer is free again,
        except, unless ``wait``, those of collectives left running: kept with them, replaced by new ones."""
        self.launcher.reset()
        in_flight, self.in_flight = self.in_flight, deque()
        self.abandoned = None if wait else in_flight
        for item in in_flight if wait else ():
            self._complete(item, add=False)
        held = {id(base) for *_, base in self.abandoned or ()}
        self.buffers = [torch.empty_like(b) if id(b) in held else b for b in self.buffers]
        self.free = list(self.buffers)
        for p in self.params:
            p.grad = None

    def _finish_grads(self) -> None:
        pass   # each backward pass completed its own reductions

    def _partition_grads(self) -> list[torch.Tensor]:
        return self.part

    def zero_grads(self) -> None:
        for g in self.part:
            g.zero_()

    def _grad_memory(self, fp) -> None:
        fp.add("grads", device=tensor_bytes(self.part))
        fp.add("bucket_buffers", device=self.buffer_elems * self.policy.reduce_dtype.itemsize)


# DeepSpeed keys zero1 accepts (configs port over) whose other value would do nothing: refused, naming the
# fix, or, where zero1 already meets the reason a config sets them, one note.
def _check_zero1(node: ZeroConfig, stage: str, nodes: Mapping[str, Any]) -> ZeroConfig:
    check_buckets(node, stage, nodes)
    if not node.contiguous_gradients:
        raise ConfigError("config: stage.contiguous_gradients=false has no effect with stage=zero1 (its gradients "
                          "always accumulate in one contiguous flat buffer); remove it, or use +stage=zero2")
    if getattr(nodes.get("offload"), "overlap_step", False):   # zero1 reports no gradient range before backward ends
        raise ConfigError("config: offload.overlap_step=true has no effect with stage=zero1 (its gradients are "
                          "final only after backward, so no host step can start early); remove it, or use "
                          "+stage=zero2 or +stage=zero3")
    return node


# Elements: a bucket below it costs its collective's fixed latency, not its bytes (gloo, 2 ranks on a loaded
# 2-core host: about 2.4 ms an all-reduce of 10 elements), and with offload one host step per its share.
SMALL_BUCKET = 1000


def _bucket_notes(node: ZeroConfig, config) -> list[str]:
    # allgather_bucket_size bounds gloo's broadcasts alone (NCCL gathers in one in-place call): noted on gloo only
    backend, external = config.dist.backend, env_int("WORLD_SIZE", 1) > 1   # (torchrun's ranks here, or nproc)
    resolved = resolve_backend(backend, None if external else config.dist.nproc) if backend == "auto" else backend
    gloo = resolved == "gloo"
    keys = ("reduce_bucket_size", "allgather_bucket_size") if gloo else ("reduce_bucket_size",)
    small = [f"stage.{key}={getattr(node, key)}" for key in keys if getattr(node, key) < SMALL_BUCKET]
    inert = [] if gloo or node.allgather_bucket_size == ZeroConfig.allgather_bucket_size else [   # (its default)
        f"note: stage.allgather_bucket_size={node.allgather_bucket_size} changes nothing on {resolved}: NCCL gathers "
        "the partitions in one in-place call (the key bounds gloo's broadcasts only); drop it"]
    # the host step goes per reduce bucket share only: said where that bucket is small and a host step runs
    host = (" (with offload also one host step per reduce_bucket_size / world elements)"
            if node.reduce_bucket_size < SMALL_BUCKET and config.choices["offload"] != "none" else "")
    return inert + ([f"note: {' and '.join(small)} (elements): one collective per bucket of that many elements, each "
                     f"costing its fixed latency (about a millisecond on gloo) whatever its size: a model of N "
                     f"parameters makes about N / bucket size of them a micro batch{host}; DeepSpeed's default is "
                     f"500,000,000"] if small else [])


def _zero1_notes(node: ZeroConfig, config) -> list[str]:
    return _bucket_notes(node, config) + (
        ["note: stage.round_robin_gradients=true changes nothing with zero1: its gradients are reduced and "
         "copied to the host after backward, by every rank at once (DeepSpeed uses it to spread those copies "
         "across ranks)"] if node.round_robin_gradients else [])


def _zero2_notes(node: ZeroConfig, config) -> list[str]:
    return _bucket_notes(node, config) + (
        ["note: stage.round_robin_gradients=true without offload only reorders which rank owns which "
         "gradients (and caps each bucket's share per rank at reduce_bucket_size / world): the same numbers "
         "(DeepSpeed uses it to spread an offloaded step's host copies across ranks)"]
        if node.round_robin_gradients and config.choices["offload"] == "none" else [])


COMPONENTS = {"zero1": Component(config=ZeroConfig, build=Zero1Stage, check=_check_zero1, notes=_zero1_notes),
              "zero2": Component(config=ZeroConfig, build=Zero2Stage, check=check_buckets, notes=_zero2_notes)}
