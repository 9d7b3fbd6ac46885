"""ZeRO-3's parameter lifecycle: gather units, their state machine, hooks, trace and prefetch.

A unit is gathered with one collective per parameter group into one buffer per group; a release before its
backward resizes the storage to zero bytes, so autograd's saved views see the values gathered again for it. Each
pass records the order of unit uses; the next prefetches along it (``_trace`` checks ranks agree)."""
from __future__ import annotations

import weakref
from typing import Callable

import torch
from torch import nn

from framework.comm.collectives import Pending
from framework.comm.distributed import Dist
from framework.core.errors import TrainingError
from framework.core.utils import few, hidden_in, map_tensors, tensors_in
from framework.stages._grads import late_gradient, reduce_to_owners, sparse_gradient
from framework.stages._shards import Unit, UnitGroup, UnitState, read_hint
from framework.stages._trace import Trace, start_order_check, warn_partial


class Gatherer:
    """Runs the unit lifecycle for one model (``cfg``: a ``Zero3Config``). ``on_reduced(g, final)``: called
    once a reduction of group ``g`` was added into ``g.grad()``, at most once per group and backward pass."""

    def __init__(self, dist: Dist, units: list[Unit], persistent: Unit | None, cfg, policy, offload,
                 on_reduced: Callable[[UnitGroup, bool], None], watch: Callable[[list], None]):
        self.dist, self.units, self.persistent, self.cfg = dist, units, persistent, cfg
        self.watch = watch   # the stage's: framework.gathered's exit settled its parameters' in-place edits
        self.all_units = [*units, *([persistent] if persistent else [])]
        self.max_reductions = 2 * max(len(u.groups) for u in units)   # launched reductions before completing
        self.on_reduced = on_reduced
        self.offload = offload   # loads shards into gather buffers; framework.gathered writes shards and masters
        self.param_dtype, self.reduce_dtype = policy.param_dtype, policy.reduce_dtype
        self.prefetch = cfg.stage3_prefetch_bucket_size   # elements gathered ahead of need
        self.max_live = cfg.stage3_max_live_parameters    # gathered elements kept at most (plus the unit in use)
        self.reuse = cfg.stage3_max_reuse_distance        # keep a unit whose next use is this close
        self.empty = torch.empty(0, dtype=self.param_dtype, device=dist.device)
        self.trace = Trace(units, dist.is_main)
        self.mode = True   # the open pass's grad mode
        self.partial_warned = False   # a unit's backward ended without all its gradients: warned once
        self.entered: dict[int, dict[int, torch.Tensor]] = {}   # per held unit: the values its outermost exit puts back
        self.driven = False   # the open pass was begun by the stage (``begin_pass``), not by a root forward
        self.roots = 0   # root forwards running outside train_step and eval_step (one nested in another too)
        self.in_backward = False
        self.reductions: list = []            # in-flight gradient reductions
        self.abandoned: list | None = None    # those of an interrupted pass, not waited for
        self.dropped_gather: list = []   # (works, buffers) of each gather cut by Ctrl-C: not waited for, kept
        self.live = self.peak_live = 0        # gathered (or gathering) elements, persistent excluded
        self.demands = self.hits = 0
        self.in_step = False   # a train_step's passes are open: its statistics count from its first pass
        self.hook_handles: list = []
        self.order_checks: list = []   # (work, tensor, pass record) per backward pass (``_end_backward``)
        self.final: bool | None = None   # set by the stage's backward: whether the step's last; None outside it
        for unit in self.all_units:
            unit.gatherer = self
            for p in unit.params:
                p.zero3_unit = unit

    def attach(self, root: nn.Module, modules: list[list[nn.Module]]) -> None:
        """``modules``: each unit's modules, whose forward hooks gather it; every parameter gets a gradient hook."""
        hook = self.dist.acc.hook   # (checked on the CPU: no host syncs inside)
        for unit, subs in zip(self.units, modules, strict=True):
            for module in subs:
                # First of the module's pre-hooks: one registered earlier (by the user, another library) reads
                # the gathered parameters, as it would without zero3.
                self.hook_handles.append(module.register_forward_pre_hook(
                    hook(lambda _m, _a, u=unit: self._pre_forward(u, is_root=_m is root), "zero3's pre-forward hook"),
                    prepend=True))
                self.hook_handles.append(module.register_forward_hook(
                    hook(lambda _m, _a, out, u=unit: self._post_forward(u, out), "zero3's forward hook")))
        # After the root unit's own forward hook, and also when the root's forward raises.
        self.hook_handles.append(root.register_forward_hook(
            hook(lambda _m, _a, _out: self._root_returned(), "zero3's root forward hook"), always_call=True))
        me = weakref.ref(self)   # (a parameter's C++ side holds its hooks: a cycle through it is never collected)
        self.hook_handles += [p.register_post_accumulate_grad_hook(hook(lambda p: me()._grad_ready(p.zero3_unit, p),
                              "zero3's gradient hook")) for unit in self.all_units for p in unit.params]

    def _pre_forward(self, unit: Unit, is_root: bool) -> None:
        if is_root and not self.in_backward and not self.driven:   # a forward outside train_step and eval_step
            if not self.roots:   # (a root forward inside it is part of its pass)
                self.begin_pass(torch.is_grad_enabled(), driven=False)
            self.roots += 1
        if self.in_backward and not unit.in_backward and torch.is_grad_enabled():
            # Recomputed by reentrant checkpointing, whose first forward ran without grad: gradients follow.
            unit.in_backward = True
        self._demand(unit, "forward")
        if not self.in_backward:
            # (A recomputation inside backward is not: torch's early stop may skip its output hook.)
            unit.active += 1

    def _post_forward(self, unit: Unit, out):
        if self.in_backward:  # activation-checkpoint recomputation: still needed for backward
            return None
        unit.active -= 1
        own, found = {id(p) for p in unit.params}, tensors_in(out)
        if any(id(t) in own for t in found):
            # A parameter returned: a view instead (the release empties it; a hook on a leaf stays for good).
            out = map_tensors(out, lambda t: t.view_as(t) if id(t) in own else t)
            found = tensors_in(out)
        hooked = [t for t in found if t.requires_grad and not t.is_leaf] if torch.is_grad_enabled() else []
        for t in hooked:
            t.register_hook(self.dist.acc.hook(lambda _g, u=unit: self._pre_backward(u), "zero3's pre-backward hook"))
        # An object of its own in the output (one the hooks cannot look into) may carry the unit's parameters into
        # the graph: their backward would find them released (a raw size mismatch deep in autograd). Only visible
        # tensors that need no grad: a call that trained none of them (a frozen part of the unit, a branch skipped
        # this step), with no backward to announce.
        silent = torch.is_grad_enabled() and not hooked and any(p.requires_grad for p in unit.params)
        hidden = hidden_in(out) if silent else None
        unannounced = silent and (not found or hidden is not None)
        # An output sharing a gathered buffer's bytes is given that buffer at the release (no host sync).
        outputs = {t.untyped_storage().data_ptr() for t in found}
        for g in unit.groups:
            if g.full is not None and g.full is not g.shard and g.full.untyped_storage().data_ptr() in outputs:
                g.lent = True
        if unit.active == 0 and not unit.held and not self._keep(unit):
            self.release(unit)
        if unannounced:
            raise TrainingError(
                f"zero3: gather unit {unit.name!r} returned a {type(out).__name__}"
                f"{f' holding a {hidden.__name__}' if hidden not in (None, type(out)) else ''} in which no tensor "
                f"requiring grad can be seen (zero3 looks into tensors, tuples, lists, dicts and dataclasses), so "
                f"its backward cannot be announced: return its tensors in those, or call it under torch.no_grad() "
                f"where it is not trained")
        return out

    def _root_returned(self) -> None:
        """The root's forward returned or raised: the outermost one outside the steps ends its pass."""
        if self.driven or not self.roots:
            return
        self.roots -= 1
        if not self.roots:
            for unit in self.units:
                unit.active = 0   # (a forward that raised did not count itself out)
            self.end_pass()

    def begin_backward(self) -> None:
        """A backward pass starts (at the first unit output's gradient, or the loss's); queues its end once."""
        if self.final is None:   # outside the stage's backward
            raise TrainingError(
                "zero3: a backward pass ran outside train_step's (in loss_fn, or on the module's output between "
                "steps: loss.backward(), torch.autograd.backward or torch.autograd.grad, e.g. with "
                "create_graph=True), which zero3 does not support: loss_fn must only return the loss, train_step "
                "runs the one backward pass per micro batch, and no other may run on the module's output")
        if not self.in_backward:
            self.in_backward = True
            for u in self.all_units:
                u.arrived, u.reduced = set(), False
            # (private, with no public equal: a callback once the whole backward has run, as torch's FSDP registers it)
            torch.autograd.Variable._execution_engine.queue_callback(
                self.dist.acc.hook(self._end_backward, "zero3's end-of-backward callback"))

    def _pre_backward(self, unit: Unit) -> None:
        self.begin_backward()
        # Reduced already: done with in this pass. (An output's gradient can come after the unit's own: an input
        # it handed back that later units read too, or a call reading its weights only as ``w.detach()``, whose
        # nodes hold the bytes they read.)
        if not unit.in_backward and not unit.reduced:
            unit.in_backward = True
            self._demand(unit, "backward")

    def _grad_ready(self, unit: Unit, p: torch.Tensor) -> None:
        if p.grad.is_sparse:   # (metadata only)
            raise sparse_gradient("zero3", p.zero3_names[0])
        if p.grad.numel() != p.logical_shape.numel():   # (metadata only: no host sync)
            raise TrainingError(read_hint(p, f"its gradient has {p.grad.numel()} elements"))
        if id(p) in unit.arrived:
            raise late_gradient(f"zero3: {p.zero3_names[0]!r} (unit {unit.name!r})")
        unit.arrived.add(id(p))
        if unit is self.persistent:
            return  # reduced once at the end of backward
        # (counted per group: ``unit.params`` builds a list, once per gradient would be quadratic)
        if unit.in_backward and len(unit.arrived) == sum(len(g.params) for g in unit.groups):
            self._reduce(unit)
            self.release(unit)

    def _end_backward(self) -> None:
        for unit in self.units:
            unit.active = 0   # no forward runs across the end of a backward pass
            if unit.in_backward and not unit.reduced:  # some parameters got no gradient in this pass
                if not self.partial_warned and self.dist.is_main and (  # once a run (none: the root's empty unit)
                        missing := [p.zero3_names[0] for p in unit.params if id(p) not in unit.arrived]):
                    self.partial_warned = True
                    warn_partial(unit.name, missing)
                self._reduce(unit)
            if unit.state is not UnitState.SHARDED:
                self.release(unit)
        if self.persistent is not None:
            self._reduce(self.persistent)
        self._complete_reductions()
        self.in_backward = self.driven = False
        if self.cfg.check_order and self.trace.recording is not None and self.dist.world > 1:
            self.order_checks.append(start_order_check(self.dist, self.trace.recording))
        self.trace.end()

    def abort_backward(self, wait: bool) -> None:
        """As ``FlatGrads.abort_backward`` for the reductions in flight; then ``abort_pass``."""
        reductions, self.reductions = self.reductions, []
        self.abandoned = None if wait else reductions   # (their buffers must outlive the collectives)
        for _g, _buf, works in reductions if wait else ():
            self.dist.comm.wait(works, "zero3 gradient reduction")
        self.abort_pass(wait)

    def abort_pass(self, wait: bool) -> None:
        """A pass cut short: its units released (not one still gathering unless ``wait``), no gradient kept."""
        self.in_step = False   # (the next step's statistics start afresh)
        for unit in self.all_units:
            for p in unit.params:
                p.grad = None
            unit.arrived, unit.reduced, unit.in_backward, unit.active = set(), False, False, 0
            if unit is not self.persistent and unit.state is not UnitState.SHARDED and not unit.held \
                    and (wait or unit.state is not UnitState.GATHERING):   # (finishing a gather waits for it)
                self.release(unit)
        self.in_backward, self.driven, self.roots = False, False, 0
        self.trace.recording = self.trace.cursor = None   # a pass cut short is no trace to follow

    def begin_pass(self, grad_mode: bool, driven: bool = True) -> None:
        """One loss_fn call starts (``grad_mode``: train_step's, else eval_step's): one pass recorded, followed
        and checked as a whole (``driven``: by the stage, not by a root forward outside the steps)."""
        for unit in self.units:
            unit.active = 0   # no forward runs between loss_fn calls, or across a root forward's start
        if self.persistent is not None and self.persistent.state is UnitState.SHARDED:   # (a Ctrl-C cut its regather)
            self.gather_now(self.persistent)
        elif self.persistent is not None:   # views again, as every gather makes (module.half() or .to() since)
            for g in self.persistent.groups:
                if g.astray(self.empty, gathered=True):
                    self._point(g)
        self.trace.begin(grad_mode, driven)
        self.mode, self.driven = grad_mode, driven
        # stats() is the last step's: a train_step's first pass starts them afresh, so the gathers of an
        # eval_step, a forward or a framework.gathered block since the last step (and its peak) are not counted.
        if grad_mode and driven and not self.in_step:
            self._reset_stats(True)
        elif not (grad_mode and driven):
            self.in_step = False

    def end_pass(self) -> None:
        """An eval_step's loss_fn call (or a root forward outside the steps) returned: idle units released."""
        self.trace.end()
        self.driven = False
        self._release_idle()

    def _release_idle(self, keep: Unit | None = None) -> None:
        """Release the idle units (but ``keep``): gathered ahead of a use that may now never come."""
        for unit in self.units:
            if unit is not keep and unit.state is not UnitState.SHARDED and unit.idle:
                self.release(unit)

    def _demand(self, unit: Unit, phase: str) -> None:
        if not self.trace.use(phase, unit):
            self._release_idle(keep=unit)
        self.demands += 1
        self.hits += unit.state is not UnitState.SHARDED
        if unit.state is UnitState.SHARDED:
            self._make_room(unit.numel, exclude=unit)
            self._start_gather(unit)
        self._finish_gather(unit)
        self._prefetch()

    def _prefetch(self) -> None:
        """Start gathers for the next units within ``prefetch`` elements (each counted once) and ``max_live``."""
        budget = self.prefetch
        for unit in self.trace.upcoming():
            budget -= unit.numel
            if budget < 0 or (unit.state is UnitState.SHARDED and self.live + unit.numel > self.max_live):
                break
            if unit.state is UnitState.SHARDED:
                self._start_gather(unit)

    def _keep(self, unit: Unit) -> bool:
        """Whether the units used before ``unit``'s next use are within the reuse distance (or the prefetch's)."""
        near, between = max(self.reuse, self.prefetch - unit.numel), 0
        for u in self.trace.upcoming():
            if u is unit:
                return between <= near and self.live <= self.max_live
            between += u.numel
        return False

    def _make_room(self, need: int, exclude: Unit) -> None:
        """Release units kept only for reuse until ``need`` more elements fit under max_live."""
        for unit in self.units:
            if self.live + need <= self.max_live:
                return
            if unit is not exclude and unit.state is UnitState.GATHERED and unit.idle:
                self.release(unit)

    def _in_place(self, g: UnitGroup) -> bool:
        """Whether ``g``'s shard can serve as its gathered buffer (world size 1, on the device, working dtype)."""
        return (self.dist.world == 1 and not self.offload.shards.params_on_host and g.shard.device == self.dist.device
                and g.shard.dtype == self.param_dtype and g.shard.numel() == g.layout.padded)

    def _start_gather(self, unit: Unit, in_place: bool = True) -> None:
        """``in_place``: the hooks (and the persistent unit's ``gather_now``) use an ``_in_place`` group's shard;
        ``gather_now`` otherwise a copy (framework.gathered's edits discarded)."""
        try:   # (the mark inside: a Ctrl-C right after it is undone below too)
            unit.to(UnitState.GATHERING)   # (its works are empty: the last gather's finish cleared them)
            # Normal tensors even in a forward under torch.inference_mode: the buffers outlive it, and later
            # gathers fill them in place (an inference tensor refuses that outside inference mode).
            with torch.inference_mode(False):
                for g in unit.groups:
                    if in_place and self._in_place(g):
                        g.full = g.shard   # no copy, no collective (world size 1)
                        continue
                    if g.full is None or g.full is g.shard:   # first gather, or the last one was in place
                        g.full = torch.empty(g.layout.padded, dtype=self.param_dtype, device=self.dist.device)
                    else:   # its bytes again (released: zero bytes); the gather fills them
                        g.full.untyped_storage().resize_(g.layout.padded * g.full.element_size())
                    with self.offload.shards.loading() as waits:   # host shards: copy and gather off the compute stream
                        self.offload.shards.load(g.full[slice(*g.layout.partition(self.dist.rank))], g.shard)
                        unit.works.append(self.dist.comm.all_gather_into(g.full, g.layout.shard,
                                                                         f"zero3 gather of {unit.name!r}"))
                    unit.works.append(Pending(after=waits))
        except BaseException as e:   # sharded again: a later gather starts over, never finishes into unfilled buffers
            works, unit.works, unit.state = unit.works, [], UnitState.SHARDED
            started = [g for g in unit.groups if g.full is not None and g.full is not g.shard]
            if isinstance(e, Exception):   # (a refused shard read) the collectives started fill the buffers first
                self.dist.comm.wait(works, f"zero3 gather of {unit.name!r}")
                for g in started:
                    g.full.untyped_storage().resize_(0)
            else:   # Ctrl-C, SIGTERM: not waited for (a peer may never join); the buffers outlive the collectives
                self.dropped_gather.append((works, [g.full for g in started]))
                for g in started:
                    g.full = None
            raise
        if unit is not self.persistent:
            self.live += unit.numel
            self.peak_live = max(self.peak_live, self.live)

    def _finish_gather(self, unit: Unit) -> None:
        if unit.state is UnitState.GATHERED:
            return
        self.dist.comm.wait(unit.works, f"zero3 gather of {unit.name!r}")
        unit.works = []
        # The forward and backward read the gathered values on the compute stream from here on.
        self.dist.acc.use(reads=[g.full for g in unit.groups if g.full is not g.shard])
        for g in unit.groups:
            self._point(g)
        unit.to(UnitState.GATHERED)

    def stray(self, repoint: bool = False) -> list[torch.Tensor]:
        """Sharded parameters moved by module.half(), .to()... (``UnitGroup.astray``); ``repoint``: put back."""
        out = []
        for gathered, g in ((u.state is UnitState.GATHERED, g) for u in self.all_units for g in u.groups):
            out += (found := g.astray(self.empty, gathered))
            if repoint and found and gathered:   # views of the gathered buffer again, or the empty shard
                self._point(g)
            for p in found if repoint and not gathered else ():
                p.data = self.empty
        return out

    @staticmethod
    def _point(g: UnitGroup) -> None:   # each parameter a view of its slice of the gathered buffer
        for p, slot in zip(g.params, g.layout.slots):
            p.data = g.full[slot.offset:slot.offset + slot.numel].view(slot.shape)

    def release(self, unit: Unit) -> None:
        if unit.state is UnitState.SHARDED:   # (a gather cut by Ctrl-C left it so: a regather starts over)
            return
        if unit.state is UnitState.GATHERING:
            self._finish_gather(unit)
        unit.to(UnitState.SHARDED)
        done = unit.reduced and self.in_backward   # (a node still to run may read it, saved as ``w.detach()``)
        for g in unit.groups:
            for p in g.params:
                p.data = self.empty
            if g.full is g.shard:   # gathered in place: the shard keeps its values
                continue
            if g.lent or done or not g.full.untyped_storage().resizable():
                # Left to what still reads the bytes, freed with it: autograd's views (done), an output of the
                # forward (lent), a NumPy array (.numpy() in framework.gathered). The next gather takes a new buffer.
                g.full, g.lent = None, False
            else:   # views kept by autograd share this storage: they keep the tensor objects, not the bytes
                g.full.untyped_storage().resize_(0)
        if unit is not self.persistent:
            self.live -= unit.numel

    def _reduce(self, unit: Unit) -> None:
        """Reduce the unit's gradients to their owners (+= into each rank's partition)."""
        unit.in_backward, unit.reduced = False, True
        for g in unit.groups:
            if self.dist.world == 1 and all(p.grad is not None for p in g.params):
                # Added into the partition directly, no group buffer: the same sums element by element.
                self._complete_reductions()   # earlier groups' reductions first: on_reduced keeps its order
                part = g.grad()
                for p, slot in zip(g.params, g.layout.slots):
                    part[slot.offset:slot.offset + slot.numel].add_(p.grad.reshape(-1).to(self.reduce_dtype))
                    p.grad = None
                self.on_reduced(g, self.final)
                continue
            buf = torch.zeros(g.layout.padded, dtype=self.reduce_dtype, device=self.dist.device)
            for p, slot in zip(g.params, g.layout.slots):
                if p.grad is not None:
                    buf[slot.offset:slot.offset + slot.numel].copy_(p.grad.reshape(-1))
                    p.grad = None
            works = reduce_to_owners(self.dist.comm, buf, 0, g.layout.shard, self.cfg.reduce_scatter,
                                     f"zero3 gradient reduction of {unit.name!r}")
            self.reductions.append((g, buf, works))
        if not self.cfg.overlap_comm or len(self.reductions) > self.max_reductions:
            self._complete_reductions()

    def _complete_reductions(self) -> None:
        for g, buf, works in self.reductions:
            self.dist.comm.wait(works, "zero3 gradient reduction")
            g.grad().add_(buf[slice(*g.layout.partition(self.dist.rank))])
            self.on_reduced(g, self.final)
        self.reductions = []

    def gather_now(self, unit: Unit) -> bool:
        """Gather ``unit`` for use outside its forward (framework.gathered); True if it was sharded."""
        sharded = unit.state is UnitState.SHARDED
        if sharded:   # in place for the persistent unit where it can be (no second whole copy); others into a copy
            self._start_gather(unit, in_place=unit is self.persistent)
        self._finish_gather(unit)
        return sharded

    def hold(self, unit: Unit, params: list[torch.Tensor]) -> bool:
        """Gather ``unit`` and keep it until ``unhold`` (framework.gathered asking for ``params``); True if this
        call gathered it. Gathered already: the outermost exit puts back the asked values instead of releasing."""
        restore = not unit.held and unit.state is not UnitState.SHARDED
        started = self.gather_now(unit)
        saved = self.entered.setdefault(id(unit), {}) if restore or id(unit) in self.entered else None
        asked = {id(p) for p in params}
        for g in unit.groups:
            if not any(id(p) in asked for p in g.params):
                continue
            if g.full is g.shard:
                # Gathered in place (by the hooks, or the persistent unit by gather_now): the blocks edit a copy;
                # the outermost exit points back at the shard.
                with torch.inference_mode(False):   # (a normal tensor: a regather fills it in place)
                    g.full = g.shard.clone()
                self._point(g)
            elif saved is not None:
                for p, slot in zip(g.params, g.layout.slots):
                    if id(p) in asked and id(p) not in saved:
                        saved[id(p)] = g.full[slot.offset:slot.offset + slot.numel].clone()
        unit.held += 1
        return started

    def unhold(self, unit: Unit, started: bool, written: bool = False) -> None:
        """``written``: the block's exit wrote new values into the shards (framework.gathered's modifier_rank)."""
        unit.held -= 1
        if started and unit.idle:
            self.release(unit)
        elif id(unit) in self.entered:
            # At the outermost exit unwritten edits go locally (peers may be elsewhere after an error); written
            # shards are gathered again (collective, as the block's exit is).
            if written:
                self.regather(unit)
            if not unit.held:
                saved = self.entered.pop(id(unit))
                for g in unit.groups:
                    if self._in_place(g):   # as the hooks (or, persistent, gather_now) gathered it
                        g.full = g.shard
                        self._point(g)
                    elif not written:
                        for p in g.params:
                            if id(p) in saved:
                                p.data.copy_(saved[id(p)].view_as(p))

    def refresh(self) -> None:
        """The shards changed (a step, a load): persistent and held units gathered again, others released."""
        for unit in self.all_units:
            if unit is self.persistent or unit.held:
                self.regather(unit)
            elif unit.state is not UnitState.SHARDED:
                self.release(unit)

    def regather(self, unit: Unit) -> None:
        """``unit`` gathered again from its shards (collective): its gathered copy is stale."""
        self.release(unit)
        self.gather_now(unit)
        if id(unit) in self.entered:   # what the outermost framework.gathered exit puts back
            saved = self.entered[id(unit)]
            for p in unit.params:
                if id(p) in saved:
                    saved[id(p)] = p.detach().reshape(-1).clone()

    def check_not_held(self) -> None:
        """Refuse a backward while a framework.gathered block holds units (its exit could overwrite the step)."""
        if held := [u.name for u in self.all_units if u.held]:
            # This pass's backward will not run: no trace to follow, no units to keep for it.
            self.trace.recording, self.driven = None, False
            self._release_idle()
            raise TrainingError(f"zero3: train_step inside framework.gathered (which holds unit {few(held, 1)}): "
                                f"leave the with block before training; a forward alone is fine inside it")

    def stats(self) -> dict:
        """The prefetch hit rate and the peak of gathered elements: of the last train_step (see ``begin_pass``), or
        of the passes since the last call outside the steps."""
        out = {"prefetch_hit_rate": self.hits / self.demands if self.demands else 0.0,
               "peak_gathered_elements": self.peak_live}
        self._reset_stats(False)
        return out

    def _reset_stats(self, in_step: bool) -> None:
        self.demands = self.hits = 0
        self.peak_live, self.in_step = self.live, in_step
