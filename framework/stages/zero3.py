"""zero3: parameters, gradients and optimizer state all partitioned; gathered per unit on demand (_gather.py). Meta
parameters are materialised one at a time keeping only the local shard, so a model larger than one rank can be built."""
from __future__ import annotations

import linecache
import operator
import re
import traceback
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

import torch
from torch import nn

from framework.comm.distributed import Dist
from framework.core.errors import ConfigError, FrameworkError, first_line, say, typed_line
from framework.precision import Policy
from framework.core.registry import Component
from framework.stages._flat import (bind_frozen, initial_values, initializer, make_layout, refuse_sparse_grads,
                                    unit_groups)
from framework.comm.collectives import Pending
from framework.stages._gather import Gatherer
from framework.stages._shards import ShardReads, ShardedParameter, Unit, UnitGroup, forward_of, read_hint, reader_of
from framework.stages._grads import backward_or_reset
from framework.stages._trace import check_orders, diverged, order_check_flags
from framework.stages._units import DEFAULT_GATHER_UNIT, all_persistent_note, plan_units, reuse_notes
from framework.offload.base import Placement
from framework.stages.base import PartitionedStage, Setup
from framework.core.footprint import Footprint
from framework.core.utils import replace_parameters, tensor_bytes


@dataclass(frozen=True, kw_only=True)
class Zero3Config:
    """DeepSpeed's stage-3 keys (same names and defaults) plus the gather unit."""

    overlap_comm: bool = True
    reduce_scatter: bool = True                          # False: all-reduce fallback
    stage3_prefetch_bucket_size: int = 50_000_000        # elements gathered ahead of need
    stage3_max_live_parameters: int = 1_000_000_000      # gathered elements kept at most
    stage3_max_reuse_distance: int = 1_000_000_000       # keep a unit reused within this many elements
    stage3_param_persistence_threshold: int = 100_000    # parameters smaller than this stay gathered
    stage3_gather_16bit_weights_on_model_save: bool = False
    gather_unit: list[str] = field(default_factory=lambda: list(DEFAULT_GATHER_UNIT))   # module class names
    # Every other module with parameters of its own (embeddings, final norm, head) is a unit of its own, so
    # the root's are not gathered through the whole forward (false: a parent reads a child's weights itself).
    split_root: bool = True
    check_order: bool = True   # each backward pass checks that all ranks used the same units in order


class Zero3Stage(PartitionedStage):
    """The partitions are the unit groups' shards, gathered per unit by the ``Gatherer``."""

    forward_gathers = True
    fixed_views = False   # (each gather and release re-points every sharded parameter's .data: ``detached`` below)

    def __init__(self, cfg: Zero3Config, dist: Dist, offload: Placement):
        # One piece per unit group already: the pipeline's unit (no chunking).
        super().__init__(cfg, dist, offload, chunk=None)
        self.groups: list[UnitGroup] = []
        self.gatherer: Gatherer | None = None
        self.unit_modules: dict[str, list[nn.Module]] = {}

    def setup(self, module: nn.Module, policy: Policy, *, grad_accum: int = 1) -> Setup:
        refuse_sparse_grads(module, "zero3")
        _refuse_compiled(module)
        self.module, self.policy = module, policy
        self._init = initializer(module)   # materialises meta parameters, one at a time
        plans, persistent_named = plan_units(module, self.cfg.gather_unit, self.cfg.split_root,
                                             self.cfg.stage3_param_persistence_threshold)
        names_of: dict[int, list[str]] = {}
        for name, p in module.named_parameters(remove_duplicate=False):
            names_of.setdefault(id(p), []).append(name)
        bind_frozen(module, policy.param_dtype, self.dist, self._init)   # whole on every rank, as under zero2
        all_named = list(module.named_parameters())  # before any parameter is replaced
        # Owned gradients in the optimizer's swap file (offload=nvme), read back on a step's later micro batches.
        self.grad_swap = self.offload.swap_grads(policy.grad_accum_dtype, grad_accum)
        owned = [make_layout(named, self.dist.world).shard   # this rank's partition of each unit group (``_make_group``)
                 for members in (*(plan.named for plan in plans), persistent_named) for _, named in unit_groups(members)]
        self.offload.expect(owned, policy.param_dtype, policy.master_dtype)
        # One reusable buffer for materialising meta parameters (the largest one).
        metas = [p for _, p in all_named if p.is_meta]
        self._scratch = torch.empty(max((p.numel() for p in metas), default=0), dtype=torch.float32,
                                    device=self.dist.device) if metas else None
        units = [self._make_unit(module, i, p.name, p.named, names_of, p.split) for i, p in enumerate(plans)]
        persistent = self._make_unit(module, len(units), "<persistent>", persistent_named, names_of) \
            if persistent_named else None
        self._scratch = self._init = None
        self.gatherer = Gatherer(self.dist, units, persistent, self.cfg, policy, self.offload, self._reduced,
                                 self.watch)
        if persistent is not None:
            self.gatherer.gather_now(persistent)  # stays gathered
            if not any(plan.named for plan in plans) and self.dist.is_main:   # (sizes only: no host sync)
                say(all_persistent_note(persistent_named, self.cfg.stage3_param_persistence_threshold))
        self.gatherer.attach(module, [plan.modules for plan in plans])
        self.unit_modules = {plan.name: plan.modules for plan in plans}   # (for the error line below)
        # close() removes these; the state_dict refusal below stays (the parameters remain empty).
        self.hook_handles = self.gatherer.hook_handles
        module.register_state_dict_pre_hook(_refuse_state_dict)
        return Setup(self.master, [self.groups[g].kind for g, _ in self.piece_index])

    def _make_unit(self, module: nn.Module, uid: int, name: str, named: list, names_of: dict, split=False) -> Unit:
        return Unit(uid, name, [self._make_group(module, kind, members, name, names_of)
                                for kind, members in unit_groups(named)], split=split)

    def _make_group(self, module: nn.Module, kind: str, named: list, unit_name: str, names_of: dict) -> UnitGroup:
        layout = make_layout(named, self.dist.world)
        lo, hi = layout.partition(self.dist.rank)
        policy, device = self.policy, self.dist.device
        shard = self.offload.shard_buffer(hi - lo, policy.param_dtype, device)
        params, new_of = [], {}
        for (pname, p), slot in zip(named, layout.slots):
            scratch = self._scratch if p.is_meta and p.dtype == torch.float32 else None
            values = initial_values(self._init, pname, p, device, scratch).to(policy.param_dtype).reshape(-1)
            # Rank 0's values everywhere, as the other stages: a model's init may draw from each rank's seed.
            self.dist.broadcast(values, what=f"initial values of {pname!r}")
            a = min(slot.numel, max(0, lo - slot.offset))   # this rank's elements of it: [a, b), maybe empty
            b = max(a, min(slot.numel, hi - slot.offset))
            if a < b:
                shard[slot.offset + a - lo:slot.offset + b - lo].copy_(values[a:b])
            sp = ShardedParameter(torch.empty(0, dtype=policy.param_dtype, device=device), p.requires_grad)
            sp.logical_shape, sp.unit_name, sp.shard_range = p.shape, unit_name, (a, b)
            sp.zero3_names = names_of[id(p)]   # every name it is registered under
            new_of[id(p)] = sp
            params.append(sp)
            del values
        replace_parameters(module, new_of)   # one walk over the modules for the whole group
        pieces = self._own(layout, shard, policy.master_dtype)
        if unit_name != "<persistent>":   # (gathered at the end of setup, from host memory)
            self.offload.shards.filled(shard)   # shards on disk: its values leave host memory now
        k = len(self.groups)
        load = (lambda: self.offload.load_grad(k)) if self.grad_swap else None
        group = UnitGroup(kind, k, layout, params, shard,
                          torch.empty(0, dtype=policy.grad_accum_dtype, device=device), pieces=pieces, load_grad=load)
        self.groups.append(group)
        return group

    @contextmanager
    def forward_pass(self, train: bool) -> Iterator[None]:
        self.gatherer.begin_pass(train)
        # Reads of released parameters refused (see ShardReads) in a pass that has no recorded trace to follow (the
        # first train_step and the first eval_step; a failed pass keeps the trace it followed), which makes every
        # read that the steps repeat; not in the passes that follow one, which pay no per-operation cost.
        reads = ShardReads() if self.gatherer.trace.cursor is None or self.dist.acc.checks else nullcontext()
        try:
            with reads:
                yield
        except BaseException as e:   # (Ctrl-C or SIGTERM: a gather still in flight is not waited for)
            # (Read before the abort releases every unit.)
            hint = _ungathered_call(e, self.cfg.split_root, self.unit_modules)
            try:
                self.gatherer.abort_pass(isinstance(e, Exception))
            except Exception as failed:   # the pass's error is the one to see, not its reset's
                e.add_note(f"zero3 could not put its units back after it: {type(failed).__name__}: {failed}")
            if hint is not None:
                raise FrameworkError(hint) from e
            if (timed_out := diverged(e)) is not None:
                raise timed_out from e
            raise
        if not train:   # train_step's pass ends with its backward
            self.gatherer.end_pass()

    def read_errors(self) -> None:
        self.offload.shards.read_errors()

    def backward(self, loss: torch.Tensor, *, sync: bool) -> None:
        self.gatherer.check_not_held()
        self.gatherer.final = sync   # units run their backward only while it is set
        scaled = loss / self.dist.world
        if scaled.requires_grad:   # the pass's end-of-backward work runs even if no unit's output is in it
            scaled.register_hook(self.dist.acc.hook(lambda _grad: self.gatherer.begin_backward(), "zero3's loss hook"))
        try:   # hooks gather, reduce and release per unit
            backward_or_reset(scaled.backward, self.gatherer.abort_backward, "zero3")
        except Exception as e:
            # Only autograd's complaint about a zero-size gradient is a read of an empty shard; any other error
            # is raised as it is, though the abort left saved parameters empty.
            read = _read_while_sharded(scaled) if _empty_size_error(e) else None
            if read is not None:   # (no frame to name: the read ran in the forward)
                raise FrameworkError(read_hint(read, f"{type(e).__name__}: {str(e).splitlines()[0]}")) from e
            if (timed_out := diverged(e)) is not None:
                raise timed_out from e
            raise
        finally:
            self.gatherer.final = None

    def _reduced(self, g: UnitGroup, final: bool) -> None:
        """On the last micro batch tell the offload target, which can copy the partition while backward goes on."""
        if self.grad_swap:   # to the swap file; the partition is not kept
            self.offload.save_grad(g.index, g.part_grad, final=final)
            g.part_grad = g.part_grad.new_empty(0)
            return
        real = g.layout.real(self.dist.rank)   # the padding is never reported
        if final and real:
            self.offload.grads_final(g.index, 0, real, g.grad())

    def step_flags(self) -> list[torch.Tensor]:   # one device value per pass since the last check (no host sync)
        return order_check_flags(self.dist, self.gatherer.order_checks)

    def check_flags(self, values: list[float]) -> None:   # before anything is stepped with mismatched gradients
        checks, self.gatherer.order_checks = self.gatherer.order_checks, []
        check_orders(self.dist, self.gatherer.units, checks, values)

    def _finish_grads(self) -> None:
        if self.grad_swap:   # on disk: the pipeline reads each with its tile
            self.offload.finish_grads()

    def _partition_grads(self) -> list[torch.Tensor]:
        return [g.part_grad if self.grad_swap else g.grad() for g in self.groups]   # swapped: not resident

    def zero_grads(self) -> None:
        for g in self.groups:
            if self.grad_swap:
                g.part_grad = g.part_grad.new_empty(0)
            else:
                g.grad().zero_()
        if self.grad_swap:
            self.offload.clear_grads()

    def publish_finish(self) -> None:
        self.gatherer.refresh()   # gathered copies are stale after the step or load

    def detached(self) -> list[str]:   # frozen ones are fixed views, as under the other stages; sharded ones:
        stray = {id(p) for p in self.gatherer.stray()}
        return [n for n, p, _, _ in self.watched if id(p) in stray]

    def rebind(self) -> None:
        super().rebind()
        self.gatherer.stray(repoint=True)

    def in_edit(self, p: torch.Tensor) -> bool:   # a framework.gathered block settles it at its exit
        return p.zero3_unit.held > 0

    def _memory(self, fp: Footprint, opt_state) -> None:   # (frozen parameters: whole, in no unit)
        persistent = self.gatherer.persistent
        self.offload.shards.memory(fp, [g.shard for g in self.groups])
        # (allocated at a group's first reduction; swapped out: only while it is reduced)
        fp.add("grads", device=tensor_bytes(g.part_grad for g in self.groups))
        self.offload.memory(fp, opt_state)
        if persistent is not None:
            fp.add("gathered_persistent", device=tensor_bytes(g.full for g in persistent.groups
                                                              if g.full is not None and g.full is not g.shard))

    def stats(self) -> dict:
        return self.gatherer.stats()

    def weights_on_save(self) -> bool:
        return self.cfg.stage3_gather_16bit_weights_on_model_save

    def consolidated_state_dict(self) -> dict | None:
        """Gathers one unit at a time (collective; each ``gathered`` checks its shard reads)."""
        frozen = [(n, p) for n, p in self.module.named_parameters(remove_duplicate=False)
                  if not isinstance(p, ShardedParameter)]   # whole on every rank
        out = {n: p.detach().to("cpu", copy=True) for n, p in frozen} if self.dist.is_main else {}  # host sync: as below
        for unit in self.gatherer.all_units:
            with gathered(unit.params):
                if self.dist.is_main:
                    for p in unit.params:
                        value = p.detach().to("cpu", copy=True)   # host sync: consolidation, between steps
                        out.update(dict.fromkeys(p.zero3_names, value))
        return out if self.dist.is_main else None


def _refuse_compiled(module: nn.Module) -> None:
    """Refuse a torch.compile'd module, root or child (its wrapper holds the original as ``_orig_mod``), before
    anything is sharded: the gather hooks would run against a graph compiled for whole parameters (torch's own
    errors, or wrong gradients)."""
    for name, sub in module.named_modules():
        if hasattr(sub, "_orig_mod"):
            raise FrameworkError(f"zero3: module {name or '<root>'!r} is torch.compile'd, and zero3 cannot train a "
                                 f"compiled module (its hooks gather parameters outside the compiled graph): pass "
                                 f"it uncompiled, or use ddp, zero1 or zero2")


def _modifier_rank(rank: Any, world: int) -> int:
    """``gathered``'s ``modifier_rank`` as an int: any integral value (a NumPy or torch integer too), not a bool
    (True would be rank 1); else a FrameworkError."""
    way = "pass the rank whose edits the block's exit writes (usually 0)"
    try:
        index = None if isinstance(rank, bool) else operator.index(rank)
    except TypeError:
        index = None
    if index is None:
        raise FrameworkError(f"framework.gathered(modifier_rank={rank!r}): modifier_rank must be an int rank, got "
                             f"{type(rank).__name__}; {way}")
    if not 0 <= index < world:
        raise FrameworkError(f"framework.gathered(modifier_rank={rank!r}): the ranks are 0..{world - 1}; {way}")
    return index


@contextmanager
def gathered(params, modifier_rank: int | None = None) -> Iterator[None]:
    """The full values of ``params`` on every rank inside the block (collective), like DeepSpeed's
    GatheredParameters: with ``modifier_rank`` that rank's values are broadcast on exit into every shard
    and master copy, and into the whole (frozen) parameters among them on every rank (given with a sharded one,
    through which the block reaches the engine's ranks). A train_step inside the block is refused."""
    params = [params] if isinstance(params, torch.Tensor) else list(params)
    sharded = [p for p in params if isinstance(p, ShardedParameter)]
    whole = [p for p in params if not isinstance(p, ShardedParameter)]   # frozen ones: the same on every rank
    if modifier_rank is not None and sharded:   # (every rank passes the same value: all refuse alike)
        world = sharded[0].zero3_unit.gatherer.dist.world
        # Before any collective: an invalid root fails the exit's broadcast at once, reported as a dead peer.
        modifier_rank = _modifier_rank(modifier_rank, world)
    for p in sharded:   # (before any collective: every rank of the pass is at the same point)
        g = p.zero3_unit.gatherer
        # (an always-gathered parameter is not released at the block's exit: its gradient arrives as usual)
        if g.driven and g.mode and torch.is_grad_enabled() and p.zero3_unit is not g.persistent:
            raise FrameworkError(
                f"zero3: framework.gathered({p.zero3_names[0]!r}) inside train_step's loss_fn with grad enabled: "
                f"the block releases it on exit, before the backward pass needs it and its gradient arrives; "
                f"read it in its own module's forward (call that module, or compute the term inside a module's "
                f"forward), or enter the block under torch.no_grad() for a value that is not trained")
    if modifier_rank is not None and whole and not sharded:   # (a whole parameter leads to no engine's ranks)
        raise FrameworkError("framework.gathered(modifier_rank=...) was given no ZeRO-3 sharded parameter (frozen "
                             "parameters under zero3, and every parameter under ddp, zero1 and zero2, are whole on "
                             "every rank), and without one it has no engine to broadcast the edits on: load weights "
                             "into the engine with framework.load_weights or engine.load_state_dict, or under zero3 "
                             "give frozen parameters together with a trainable one (say module.parameters())")
    units = list({id(p.zero3_unit): p.zero3_unit for p in sharded}.values())
    # Held: forwards inside the block (and nested blocks) leave the units gathered; a train_step is refused.
    held, written = [], False
    # (Tensor._version: no public in-place write counter; a Python int, read with no device access)
    entry = {id(p): p._version for p in sharded}   # (an edit made before the block stays an edit after it)
    try:
        for u in units:
            held.append((u, u.gatherer.hold(u, sharded)))
        # A shard read that failed on some rank gave it zeros: every rank raises before the block sees them.
        for gatherer in {id(u.gatherer): u.gatherer for u in units}.values():
            gatherer.offload.shards.read_errors()
        yield
        if modifier_rank is not None:
            wanted = {id(p) for p in sharded}
            for unit in units:
                for g in unit.groups:
                    if not any(id(p) in wanted for p in g.params):
                        continue
                    unit.gatherer.dist.broadcast(g.full, src=modifier_rank, what="framework.gathered broadcast")
                    lo, hi = g.layout.partition(unit.gatherer.dist.rank)
                    # Only the elements of the parameters asked for that differ from what the shard holds now
                    # (after a load inside the block too): the rest keeps its shard and (wider) master values,
                    # and an outer block's edit without modifier_rank stays discarded.
                    asked = torch.zeros(hi - lo, dtype=torch.bool, device=g.full.device)
                    for p, slot in zip(g.params, g.layout.slots):
                        a, b = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
                        if id(p) in wanted and a < b:
                            asked[a - lo:b - lo] = True
                    old = _shard_values(unit.gatherer, g)
                    changed = asked & (g.full[lo:hi] != old)
                    unit.gatherer.offload.write_partition(g.pieces, g.shard, torch.where(changed, g.full[lo:hi], old),
                                                          changed)
            for p in whole:   # (a load on modifier_rank alone would leave the ranks' frozen weights differing)
                units[0].gatherer.dist.broadcast(p.detach(), src=modifier_rank, what="framework.gathered broadcast")
            written = True
    finally:
        for unit, started in held:   # (after an error on this rank, no collective: its peers may be elsewhere)
            unit.gatherer.unhold(unit, started, written=written)
        for gatherer in {id(u.gatherer): u.gatherer for u, _ in held}.values():   # edits written or discarded
            gatherer.watch(sharded, entry if modifier_rank is None else None)   # (written: what it wrote)


def _shard_values(gatherer: Gatherer, g: UnitGroup) -> torch.Tensor:
    """This rank's partition of ``g`` as its shard holds it now, on the device (for modifier_rank exits)."""
    lo, hi = g.layout.partition(gatherer.dist.rank)
    out = torch.empty(hi - lo, dtype=gatherer.param_dtype, device=gatherer.dist.device)
    with gatherer.offload.shards.loading() as waits:
        gatherer.offload.shards.load(out, g.shard)
    gatherer.dist.comm.wait(Pending(after=waits), "zero3 shard read")
    return out


def _refuse_state_dict(module, prefix, keep_vars):
    # (also inside framework.gathered: its values would be views of gather buffers that are reused later)
    raise FrameworkError("state_dict() of a ZeRO-3 module may hold empty sharded parameters (refused inside "
                         "framework.gathered too): use engine.consolidated_state_dict(), or copy (clone) the "
                         "parameters you need inside framework.gathered(...)")


def check(node: Zero3Config, stage: str, nodes: Mapping[str, Any]) -> Zero3Config:
    for key in ("stage3_prefetch_bucket_size", "stage3_max_live_parameters", "stage3_max_reuse_distance",
                "stage3_param_persistence_threshold"):
        if getattr(node, key) < 0:
            raise ConfigError(f"stage.{key} must be >= 0")
    return node


COMPONENT = Component(config=Zero3Config, build=Zero3Stage, check=check, notes=reuse_notes)


def _empty_size_error(error: BaseException) -> bool:
    """Whether ``error`` is autograd's check of a gradient of shape [0] ("invalid gradient ... got [0]"), what a
    backward through a parameter read as an empty shard raises (not a kernel's size mismatch naming a 0)."""
    return isinstance(error, RuntimeError) and not isinstance(error, FrameworkError) \
        and re.search(r"invalid gradient.*got \[0\]", first_line(error)) is not None


def _read_while_sharded(loss: torch.Tensor) -> ShardedParameter | None:
    """The sharded parameter an operation of ``loss``'s graph read while empty (it saved a zero-size
    input or size), or None. Error path only."""
    seen, todo = set(), [loss.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for child, _ in node.next_functions:
            p = getattr(child, "variable", None)
            if isinstance(p, ShardedParameter) and p.logical_shape.numel() and _saved_empty(node):
                return p
            todo.append(child)
    return None


def _saved_empty(node) -> bool:
    for attr in dir(node):
        if attr.startswith("_saved_"):
            try:
                v = getattr(node, attr)
            except RuntimeError:   # freed by the backward that ran it
                continue
            if (isinstance(v, torch.Tensor) and v.numel() == 0) or (isinstance(v, tuple) and tuple(v) == (0,)):
                return True
    return False


def _read_in_line(error: BaseException) -> str | None:
    """For a sharded parameter, empty at the error, that the failing line reads through a module it names
    (``h @ m.wte.weight.T`` in loss_fn, ``F.linear(h, self.emb.weight)`` in a forward): ``read_hint``, or None."""
    found = None
    for frame, lineno in traceback.walk_tb(error.__traceback__):   # innermost last
        line = linecache.getline(frame.f_code.co_filename, lineno)
        for var, owner in frame.f_locals.items():
            if isinstance(owner, nn.Module) and f"{var}." in line:
                for name, p in owner.named_parameters():
                    if isinstance(p, ShardedParameter) and p.shape != p.logical_shape and f"{var}.{name}" in line:
                        found = read_hint(p, typed_line(error), reader_of([frame]))
    return found


def _python(path: str) -> str:
    """A module path as Python reaches it: a ModuleList's or Sequential's children by index (layers.1 -> layers[1])."""
    return re.sub(r"\.(\d+)(?=\.|$)", r"[\1]", path)


def _ungathered_call(error: BaseException, split_root: bool, unit_modules: dict[str, list[nn.Module]]) -> str | None:
    """For an error raised inside a module whose own parameters were empty shards (a part of a gather unit
    called directly), one line naming the fix; else None. Read from the traceback (error path only).
    ``unit_modules``: each unit's modules by its name."""
    if not isinstance(error, Exception) or isinstance(error, FrameworkError):
        return None
    found, running = None, []   # running: the module forwards seen so far, outermost first (the callers')
    called, bypassed = set(), {}   # ids of modules entered through __call__; modules whose forward ran without it
    for frame, _ in traceback.walk_tb(error.__traceback__):   # innermost last
        if frame.f_code.co_name == "_call_impl" and isinstance(module := frame.f_locals.get("self"), nn.Module):
            called.add(id(module))
        # Its own forward running (not a hook before it: a failed gather is its own error) on empty shards.
        if (owner := forward_of(frame)) is not None:
            if id(owner) not in called:
                bypassed[id(owner)] = (owner, running[-1] if running else None)
            idle = [p for p in owner.parameters(recurse=False)
                    if isinstance(p, ShardedParameter) and p.shape != p.logical_shape]
            if idle:
                found = (type(owner).__name__, idle[0].unit_name, list(running))
            running.append(owner)
    if found is None:
        return _read_in_line(error)
    cls, unit, callers = found
    # The caller is the innermost forward outside the unit: a part of it (loss_fn calling m.blk.inner, whose
    # forward runs m.blk.inner.lin) holds the module already, so only calling the unit itself fixes that.
    inside = {id(sub) for m in unit_modules.get(unit, ()) for sub in m.modules()}
    caller = next((type(m).__name__ for m in reversed(callers) if id(m) not in inside), None)
    # The unit's own module with its forward called directly (self.b.forward(x)): no hook ran to gather it.
    skipped = next((bypassed[id(m)] for m in unit_modules.get(unit, ()) if id(m) in bypassed), None)
    # (named by the module whose forward was called, not by a part that failed in it)
    named = cls if skipped is None else type(skipped[0]).__name__
    head = (f"zero3: {'loss_fn' if caller is None else caller + '.forward'} called a module ({named}) whose "
            f"parameters were not gathered ({typed_line(error)}): ")
    if skipped is not None:
        module, parent = skipped
        path = next((n for n, m in parent.named_modules() if m is module), "") if parent is not None else ""
        # (from loss_fn: the unit's path from the root; a merged unit's name, a+b, is no path)
        call = _python(f"self.{path}" if path else "the module" if "+" in unit or unit == "<root>" else
                       f"module.{unit}")
        return head + (f"its forward was called directly, which skips the module's hooks, where zero3 gathers "
                       f"its parameters: call {call}(...), not {call}.forward(...)")
    if unit != "<root>" and caller is not None:   # a model's module reaching into a unit it does not run
        return head + (f"it is part of gather unit {unit!r}, gathered only when that unit's own forward runs; "
                       f"register it as a submodule of {caller} too (a module that a unit and a module outside "
                       f"it both hold stays gathered), or call the unit itself")
    if unit != "<root>":   # (outermost units win: naming the part's class as a unit too changes nothing)
        return head + (f"it is part of gather unit {unit!r}, gathered only when that unit's own forward runs; "
                       f"call {_python(f'module.{unit}')}(...) (or the whole module) in loss_fn, not its parts")
    fixes = ["call the whole module in loss_fn", f"add {cls} to stage.gather_unit"]
    if not split_root:
        fixes.append("set stage.split_root=true (the root's children become units)")
    return head + f"it is part of the root module's unit, gathered only when the module itself is called; " \
                  f"{', or '.join(fixes)}"
