"""Build components from a Config by registry name, and the library entry point.

    with framework.initialize(my_module, my_loss_fn, framework.compose(["optimizer=lion"])) as engine:
        state = engine.state                                    # the initial state
        for batch in batches:
            state, metrics = engine.train_step(state, batch)   # batch: grad_accum micro batches
        # engine.state is now the state the last train_step returned
"""
from __future__ import annotations

import atexit
import contextlib
import sys
import weakref
from dataclasses import replace
from functools import partial
from typing import Any, Iterator, Mapping, Sequence

import torch
from torch import nn

from framework.config import Config, check_batch_world, compose
from framework.core.batch import Batch
from framework.core.errors import ConfigError, DataError, FrameworkError, TrainingError
from framework.comm.distributed import Dist, agree, connect, disconnect, rank_and_world
from framework.engine._checks import (Owner, another_engine, check_arguments, check_optimizer, detached_error, in_step,
                                      owner, requires_grad_changed)
from framework.engine.materialize import materialize_buffers
from framework.models.hf import config_hidden_size
from framework.core.registry import registry
from framework.optimizers import copy_16bit, merge_scalars
from framework.engine.state import TrainState, capture_rng
from framework.engine.step import (Components, LossFn, build_train_step, call_loss, checked_loss, eval_mode,
                                   one_micro_batch, same_count)
from framework.core.footprint import Footprint
from framework.core.utils import counted, dtype_name, few, unwrapped
from framework.persist.layout import load_state_dict, state_dict
from framework.persist.weights import save_pretrained, whole_tensors


def component(cfg: Config, group: str):
    return registry(group).get(cfg.choices[group])


class Engine(contextlib.AbstractContextManager):
    """The built components, their step function and ``state`` (the last ``train_step``'s or load's). ``close()``
    (or the ``with`` block's end) removes the hooks and stops the offload worker. A step interrupted inside the
    optimizer update leaves the state half-updated, a ``load_weights`` that fails while writing leaves the weights
    partly loaded: stepping, evaluating and saving are refused until a load."""

    def __init__(self, components: Components, state: TrainState, config: Config | None = None, hooks=()):
        self.components, self._state, self.config = components, state, config   # (config: the one it was built from)
        self._hooks = list(hooks)   # its own on the module (fp16 auto_cast's), removed by close
        self._half_applied: int | None = None   # the step whose update did not finish, if any
        self._loading: str | None = None   # the load writing into the state (``start_load``) until ``finish_load``
        self._before: str | None = None    # the mark that load replaced (an earlier one that failed)
        self._stepping: str | None = None  # the step running user code (loss_fn), which close() must not end
        me = weakref.ref(self)   # (a strong one would be a cycle: a dropped engine kept alive until the GC runs)
        self._train_step = build_train_step(components, applying=lambda step: setattr(me(), "_half_applied", step))
        self.closed = False
        # The stage lays out the trainable parameters once, at setup: a requires_grad changed later would be
        # ignored (a frozen one still stepped, an unfrozen one never trained). Python bools: no tensor touched.
        self._trainable = [(name, p, p.requires_grad) for name, p in components.module.named_parameters()]
        self._built = frozenset(id(p) for _, p, _ in self._trainable)
        self._count = _count_known(components.module, self._built)
        components.stage.watch()   # (its version counters: an in-place edit of the weights is refused, ``check_unedited``)

    @property
    def state(self) -> TrainState:
        return self._state

    @property
    def device(self) -> torch.device:
        """Where the module's parameters and its forward are: micro batches go here (``loss_fn`` or before)."""
        return self.components.dist.device

    def train_step(self, state: TrainState, batch) -> tuple[TrainState, dict]:
        """``state, metrics = engine.train_step(state, batch)``; also remembered as ``engine.state``."""
        self._check_open(state, "train_step")
        if not torch.is_grad_enabled() or torch.is_inference_mode_enabled():   # (else loss_fn would be blamed)
            raise TrainingError("train_step: called under torch.no_grad() or torch.inference_mode(), where its "
                                "backward pass has no graph: call it outside those blocks")
        self.check_trainable("train_step")
        self.check_unedited("train_step")
        outer = self._stepping   # (an eval_step inside loss_fn restores it)
        try:   # (marked inside: an interrupt between the mark and the try would leave it set for good)
            self._stepping = "train_step"
            state, metrics = self._train_step(state, batch)
        finally:
            self._stepping = outer
            self.components.stage.settle()
        self._state = state
        self._half_applied = None   # (set once the update began: an exception before here keeps it)
        return state, metrics

    def _check_current(self, state: TrainState, what: str, superseded_ok: bool = False) -> None:
        """Refuse another engine's state, and one superseded by a later train_step or load (unless
        ``superseded_ok``: a load replaces it): its tensors were updated in place, so its counters no longer
        match them (the same step and params with other scalars, e.g. RNG, is current)."""
        cur = self._state
        if not isinstance(state, TrainState):
            raise FrameworkError(f"{what}: state must be a TrainState, got {type(state).__name__}; pass the state "
                                 f"train_step returned (engine.state)")
        if state.params is not cur.params and not any(p is q for p, q in zip(state.params, cur.params)):
            raise another_engine(what)
        if not superseded_ok and state is not cur and (state.step != cur.step or state.params is not cur.params):
            raise FrameworkError(f"{what}: this state (step {state.step}) is not the one the last train_step, "
                                 f"load_state_dict or resume returned (step {cur.step}); its tensors were updated "
                                 f"in place since: pass the state train_step returned (engine.state)")

    def eval_step(self, state: TrainState, batches: list) -> float:
        """Mean of the losses of every rank's batches (micro batches as ``loss_fn`` takes them), without grad: each
        batch counts once whatever its size; ranks may pass different numbers, none too, except under zero3."""
        self._check_open(state, "eval_step")
        self.check_unedited("eval_step")
        if (bare := one_micro_batch(batches, kinds=(tuple,))) is not None:   # (a list of tensors: tensor micro batches)
            raise DataError(f"eval_step: batches is one micro batch ({bare}), not micro batches: pass a list of "
                            f"them ([(x, y)] for one, [x] for one tensor x, list(t) for micro batches stacked in "
                            f"one tensor t)")
        batches = [batches] if isinstance(batches, Batch) else list(batches)   # a generator: read once, counted
        if any(isinstance(b, Batch) for b in batches):
            raise DataError("eval_step: pass a list of micro batches (each what loss_fn takes), not Batch objects")
        c = self.components
        if c.stage.forward_gathers:
            same_count(c.dist, len(batches))
        # [loss sum, batch count], all-reduced together: ranks with different numbers of batches agree on the mean
        total = torch.zeros(2, dtype=torch.float32, device=c.dist.device)
        total[1] = len(batches)   # (a fill: torch.tensor([...]) on a device blocks, copying from pageable memory)
        outer = self._stepping
        try:   # (marked inside, as in train_step)
            self._stepping = "eval_step"
            with eval_mode(c.module):   # (each module's own mode back after, a loss_fn that raises too)
                for b in batches:
                    with torch.no_grad(), c.stage.forward_pass(train=False):
                        total[0] += checked_loss(call_loss(c, b)).float()
        finally:
            self._stepping = outer
            c.stage.settle()
        c.stage.read_errors()   # a failed shard read gave zeros: every rank raises, none reports that loss
        c.dist.all_reduce(total, what="validation loss all-reduce")
        loss_sum, count = total.tolist()   # host sync: the result is a Python number
        if not count:   # after the collective: every rank stops here alike
            raise DataError("eval_step: no batches on any rank; pass a list of at least one batch")
        return loss_sum / count

    def _check_open(self, state: TrainState, what: str) -> None:
        if self.closed:
            raise FrameworkError("this engine is closed (engine.close() or its with block ended); "
                                 "build a new one with framework.initialize")
        self._check_whole()
        self._check_current(state, what)

    def check_trainable(self, what: str) -> None:
        """TrainingError (beginning with ``what``) when a parameter was added to or removed from the module, or a
        requires_grad differs from what it was at build: the stage trains that set, and the current flags would
        save or load parameters where its layout has none."""
        if _count_known(self.components.module, self._built) != self._count:
            self._check_same_parameters(what)
        changed = [(name, was) for name, p, was in self._trainable if p.requires_grad != was]
        if changed:
            raise requires_grad_changed(what, self.components.module, changed)

    def _check_same_parameters(self, what: str) -> None:
        """Refuse parameters added to or removed from the module since build (a LoRA layer injected after
        initialize: the stage never trains it, its .grad grows, no save holds it). One replaced under its own
        name (``load_state_dict(..., assign=True)``) is ``check_unedited``'s (a load puts the engine's back)."""
        now = dict(self.components.module.named_parameters())
        ids, names = {id(p) for p in now.values()}, {name for name, _, _ in self._trainable}
        added = [n for n, p in now.items() if n not in names and id(p) not in self._built]
        removed = [n for n, p, _ in self._trainable if n not in now and id(p) not in ids]
        if added or removed:
            parts = [f"{len(ns)} {kind} ({few(ns, 3, str)})" for kind, ns in (("added", added), ("removed", removed)) if ns]
            raise TrainingError(f"{what}: the module's parameters changed after initialize: {' and '.join(parts)}; "
                                f"the engine trains and saves the parameters the module had when it was built: add "
                                f"(or remove) them before framework.initialize, or undo the change; to train another "
                                f"set, build a new engine (close this one first)")

    def check_unedited(self, what: str) -> None:
        """TrainingError (beginning with ``what``) when trainable weights were written in place since initialize or
        the last load (``module.load_state_dict``, say): the next step would overwrite them from the masters, or
        keep them, depending on precision and offload; a save would not hold them."""
        stage = self.components.stage
        moved = stage.detached()
        edited, frozen = stage.edited(moved), stage.cast_frozen()
        if not edited and not frozen:
            return
        if moved or frozen:
            raise detached_error(what, moved, frozen)
        changed = (f"{what}: the weights of {counted(len(edited), 'trainable parameter')} ({few(edited, 3, str)}) "
                   f"were changed in place (or replaced) after framework.initialize (e.g. module.load_state_dict)")
        if kept := self._in_masters(self._state, edited):   # discard_edits would refuse: the edit is in the masters
            whose = "they are" if len(kept) == len(edited) else f"those of {few(kept, 3, str)} are"
            raise TrainingError(f"{changed}; here (fp32 without offload) {whose} the engine's master copies, so the "
                                f"edit is in the engine, but it is refused so that the same code behaves alike under "
                                f"every stage and precision: to keep it, load it into the engine "
                                f"(framework.load_weights(engine, path) of a saved module.state_dict(), or "
                                f"engine.load_state_dict); to drop it, load weights saved before it")
        raise TrainingError(f"{changed}, which the engine's master copies do not see: load weights before "
                            f"framework.initialize, or into the engine with framework.load_weights(engine, path) or "
                            f"engine.load_state_dict (under zero3 also framework.gathered(params, modifier_rank=0)); "
                            f"to drop the edit and go on from the engine's weights, call "
                            f"engine.discard_edits(engine.state)")

    def _check_whole(self) -> None:
        if self._loading is not None:
            raise FrameworkError(f"{self._loading} did not finish, which left the weights partly loaded: load good "
                                 f"weights again (framework.load_weights, engine.load_state_dict or resume), or close "
                                 f"this engine and build a new one from a freshly built model (this one's parameters "
                                 f"and buffers hold the partial load too)")
        if self._half_applied is not None:
            raise FrameworkError(f"step {self._half_applied} was interrupted during the optimizer update, which is "
                                 f"half-applied: load a checkpoint into this engine (engine.load_state_dict, or "
                                 f"resume), or close it and build a new engine from a freshly built model (this one's parameters "
                                 f"may hold the half-applied update)")

    def close(self) -> None:
        if in_step(self) is not None:
            raise FrameworkError(f"close() called inside {self._stepping}; close after it returns")
        if not self.closed:
            self.closed = True
            for _, p, trains in self._trainable:   # another initialize may take its parameters now
                if trains and owner(p) is self:
                    del p._framework_owner
            try:
                self.components.update.close()   # the offload worker thread, if any
            finally:   # (a swap read failure it raises leaves no hook behind)
                self.components.stage.close()    # hooks on the module
                for hook in self._hooks:
                    hook.remove()

    def __exit__(self, *exc) -> None:
        self.close()

    def consolidated_state_dict(self) -> dict | None:
        """On rank 0 (None elsewhere; collective): full working-dtype weights and persistent buffers under the
        names ``module.state_dict()`` gives them, what a fresh module's ``load_state_dict`` takes."""
        self._check_whole()   # (the half-updated weights are never handed out to be saved)
        self.check_unedited("consolidated_state_dict")
        out = self.components.stage.consolidated_state_dict()
        if out is not None:
            out.update(_buffer_copies(unwrapped(self.components.module)))
        return out

    def state_dict(self, state: TrainState) -> dict:
        """This rank's state as host fragments keyed by parameter name (``framework.persist.layout``);
        rank 0's also holds the module's buffers and frozen parameters (a load gives them to every rank)."""
        c = self.components
        with self.mapped_state(state) as (mapped, _):
            return state_dict(mapped, c.stage.piece_specs(), policy=c.policy, rank=c.dist.rank,
                              world=c.dist.world, whole=whole_tensors(c.module) if c.dist.is_main else None)

    @contextlib.contextmanager
    def mapped_state(self, state: TrainState, write: bool = False, *, agreed: str | None = None,
                     same_trainable: bool = True) -> Iterator[tuple[TrainState, Any]]:
        """(``state`` with every piece a tensor, the mapped swap file or None), between steps: under offload=nvme
        views of the mapped file; with ``write`` what is stored into them is the file's on exit (errors too).
        ``agreed``: the mapping is agreed on under that name (collective), so a rank that cannot map its file
        stops every rank. A read is refused after a requires_grad change unless ``same_trainable`` is False
        (``save_weights`` picks tensors by the stage's layout, not by the flags)."""
        offload = self._swapping()
        if write:   # (another engine's state: the same on every rank, no agreement needed)
            self._check_current(state, "load_state_dict or resume", superseded_ok=True)

        def usable() -> None:
            if not write:   # a half-updated or stale state is never saved (a load replaces it: allowed)
                self._check_whole()
                if same_trainable:
                    self.check_trainable("state_dict or checkpoint save")
                self.check_unedited("state_dict, save_weights or checkpoint save")
                self._check_current(state, "state_dict or checkpoint save")
            if offload is not None and self.closed:
                raise FrameworkError("this engine is closed and its swap files (offload=nvme) are gone: call "
                                     "state_dict, load_state_dict, save_weights or a checkpoint save before "
                                     "engine.close() (inside its with block)")

        if not write or offload is not None:
            agree(self.components.dist, usable, agreed) if agreed is not None else usable()
        if offload is None:
            yield state, None
            return

        mapped = partial(offload.mapped_state, state.params, state.opt_state, write=write)
        # (when another rank failed, this rank's map is dropped unwritten: file and checksums unchanged)
        params, opt_state, fmap = mapped() if agreed is None else agree(self.components.dist, mapped, agreed)
        try:
            yield replace(state, params=tuple(params), opt_state=opt_state), fmap
        finally:
            if write:
                offload.unmapped(fmap)

    def load_state_dict(self, state: TrainState, saved: Sequence[dict]) -> TrainState:
        """Load ``saved`` (every rank's ``state_dict`` of a run of any layout) into ``state``'s tensors in
        place and return the state to continue from. Collective, with the same ``saved`` on every rank."""
        c = self.components
        self.check_trainable("load_state_dict")
        names = [n for n, p in c.module.named_parameters() if p.requires_grad]  # what the stage trains
        with self.mapped_state(state, write=True, agreed="load_state_dict: swap file map") as (mapped, _):
            loaded = load_state_dict(mapped, c.stage.piece_specs(), saved, policy=c.policy, names=names,
                                     dist=c.dist, whole=whole_tensors(c.module),
                                     seed=self.config.seed if self.config is not None else 0, device=c.dist.device)
        return self.finish_load(state, loaded)

    def start_load(self, what: str) -> None:
        """Before a load (``what``) begins writing into the state in place: until its ``finish_load``, stepping,
        evaluating and saving are refused (one that fails half-way leaves the weights partly the source's)."""
        self._before, self._loading = self._loading, what

    def finish_load(self, state: TrainState, loaded: TrainState | None = None, *, every: bool = True) -> TrainState:
        """After a load into a ``mapped_state(write=True)`` view: ``state``'s tensors with ``loaded``'s scalars
        (None: its own), and the working parameters published from the masters as after a step. ``every``: False
        for a load that left some weights as they were (``load_weights(strict=False)``), which keeps the mark of
        an earlier load that failed. Collective."""
        if loaded is not None:
            state = replace(loaded, params=state.params,
                            opt_state=merge_scalars(state.opt_state, loaded.opt_state, len(state.params)))
        self._republish(state)
        self._state = state
        self._loading = None if every or loaded is not None else self._before
        if loaded is not None:   # every master, moment and scalar replaced: a half-applied step is gone
            self._half_applied = None
        return state

    def discard_edits(self, state: TrainState) -> TrainState:
        """Write ``state``'s weights back onto the module (the 16-bit working copies and parameters published from
        the masters, parameters replaced on the module put back), discarding in-place edits made outside
        ``framework.gathered`` since initialize or the last load, which ``check_unedited`` refuses to step or save
        over. Returns ``state``. Collective."""
        if self.closed:
            raise FrameworkError("discard_edits: this engine is closed (engine.close() or its with block ended); "
                                 "build a new one with framework.initialize")
        if in_step(self) is not None:
            raise FrameworkError(f"discard_edits called inside {self._stepping}; call it after it returns")
        self._check_current(state, "discard_edits")
        # (agreed: a rank that cannot discard stops every rank, none waits in the publish's collectives)
        agree(self.components.dist, partial(self._check_discardable, state), "discard_edits")
        self._republish(state)
        return state

    def _in_masters(self, state: TrainState, edited: Sequence[str]) -> list[str]:
        """The ``edited`` parameters whose weights are views of the masters' storage (fp32 without offload: ddp,
        zero1/2, zero3's persistent ones at one rank): an edit there is the masters' too and nothing holds the
        value it replaced. (Storage addresses only: no tensor read.)"""
        masters = {m.untyped_storage().data_ptr() for m in state.params if isinstance(m, torch.Tensor)} - {0}
        edited = set(edited)
        # (Tensor._version: no public in-place write counter; a Python int, read with no device access)
        return [n for n, p, v, _ in self.components.stage.watched if n in edited and p._version != v
                and p.untyped_storage().data_ptr() in masters]

    def _check_discardable(self, state: TrainState) -> None:
        if kept := self._in_masters(state, self.components.stage.edited()):
            raise TrainingError(f"discard_edits: the edit of {counted(len(kept), 'parameter')} ({few(kept, 3, str)}) "
                                f"cannot be discarded: these weights are the master copies themselves (fp32 without "
                                f"offload), so the edit is in them and the old values are gone: load weights saved "
                                f"before the edit (framework.load_weights or engine.load_state_dict), or keep the edit "
                                f"by saving module.state_dict() and loading it with "
                                f"framework.load_weights(engine, path)")

    def _republish(self, state: TrainState) -> None:
        """The working parameters published from ``state``'s masters as after a step, the stage's parameters back
        on the module, and their version counters taken again (collective)."""
        c = self.components
        out16 = c.stage.out16()
        if out16 is not None:
            offload = self._swapping()   # (a swapped piece's 16-bit copy is made when the publish reads it)
            skip = offload.swapped_indices() if offload is not None else set()
            copy_16bit([o for i, o in enumerate(out16) if i not in skip],
                       [p for i, p in enumerate(state.params) if i not in skip])
        c.stage.publish(list(state.params))
        c.stage.settle(rebind=True)   # the working weights are the masters' again

    def save_pretrained(self, out_dir, dtype: torch.dtype | None = None, *,
                        max_shard_size: int | str = "5GB") -> list:
        """``framework.persist.weights.save_pretrained`` of this engine (collective)."""
        return save_pretrained(self, out_dir, dtype=dtype, max_shard_size=max_shard_size)

    def _swapping(self):
        """The offload target when some state lives in swap files (offload=nvme), else None."""
        offload = getattr(self.components.stage, "offload", None)
        return offload if offload is not None and offload.swaps else None

    def memory(self, state: TrainState) -> Footprint:
        """This rank's model states and persistent buffers by item and place (as ``framework.memory.model.predict``)."""
        self._check_current(state, "memory")
        fp = self.components.stage.memory(state.opt_state)
        self.components.update.memory(fp)
        return fp


def _buffer_copies(module: nn.Module) -> dict[str, torch.Tensor]:
    """Host copies of the persistent buffers under every name ``module.state_dict()`` gives them (a shared one once)."""
    out, copies = {}, {}
    for path, sub in module.named_modules(remove_duplicate=False):
        for name, buf in sub._buffers.items():
            # (no public flag says whether a buffer is persistent, short of state_dict(), which a model may override)
            if buf is not None and name not in sub._non_persistent_buffers_set:
                if id(buf) not in copies:   # host sync: consolidation, between steps
                    copies[id(buf)] = buf.detach().to("cpu", copy=True)
                out[f"{path}.{name}" if path else name] = copies[id(buf)]
    return out


def _count_known(module: nn.Module, known: frozenset) -> int | None:
    """How many parameter slots ``module``'s tree holds (a tied one per slot), or None at the first parameter
    whose id is not in ``known``. Run before every step: a plain walk, about three times faster than
    ``module.parameters()``, which builds every name."""
    seen, stack, count = set(), [module], 0
    while stack:
        sub = stack.pop()
        if sub is None or id(sub) in seen:   # (a slot may hold None; a module reachable twice, or a cycle)
            continue
        seen.add(id(sub))
        for p in sub._parameters.values():
            if p is not None:
                if id(p) not in known:
                    return None
                count += 1
        stack += sub._modules.values()   # (no generator per module: this walk runs before every step)
    return count


def initialize(module: nn.Module, loss_fn: LossFn, cfg: Config | None = None, dist: Dist | None = None,
               position: int = 0, *, ds_config: str | Mapping | None = None, overrides: Sequence[str] = ()) -> Engine:
    """Shard ``module`` with the configured stage; ``loss_fn(module, micro_batch) -> scalar``. Without ``dist``
    the environment's process group is joined. Instead of ``cfg``, ``ds_config`` (a DeepSpeed JSON path or
    dict) with ``overrides`` composes one: our defaults < it < the overrides. The main rank prints the config's
    warnings and notes (``cfg.notices``) on stderr."""
    # Before any collective (every rank stops alike): one line instead of a traceback from inside.
    check_arguments(module, loss_fn, cfg, ds_config, overrides)
    if cfg is None:
        world = dist.world if dist is not None else rank_and_world()[1]
        cfg = compose(overrides, ds_config=ds_config, world=world, hidden_size=hidden_size_of(module),
                      hidden_from_model=False)
    if dist is None:
        joined = torch.distributed.is_initialized()
        dist = connect(cfg.dist.backend, cfg.dist.timeout_s)
        if not joined and torch.distributed.is_initialized():
            # Left at exit (a gloo group alive at interpreter shutdown may abort the process), not at close():
            # a later engine of this process reuses it (re-creating it hangs under torchrun).
            atexit.register(disconnect)
    if dist.is_main:   # the config's warnings and notes, however it was composed (the command line's too)
        notices = list(cfg.notices)
        if cfg.dist.nproc > 1 and cfg.dist.nproc != dist.world:   # (the command line spawns that many ranks)
            notices.append(f"note: initialize: dist.nproc={cfg.dist.nproc} is read by the command line only; this "
                           f"engine joined a world of {counted(dist.world, 'rank')}: launch the ranks yourself "
                           f"(torchrun --nproc-per-node {cfg.dist.nproc}) or drop dist.nproc")
        if notices:
            print("\n".join(notices), file=sys.stderr, flush=True)
    check_batch_world(cfg, dist.world)   # (every rank alike, before any collective of the engine)
    policy = component(cfg, "precision").build(cfg.precision)
    # Parameters (frozen ones too) are cast to the working dtype: fp32 ones under bf16/fp16 are the ordinary
    # case, any other dtype (float64, a 16-bit one in an fp32 run) is said once.
    cast = [(n, p.dtype, p.requires_grad) for n, p in module.named_parameters() if p.is_floating_point()
            and p.dtype not in (policy.param_dtype, torch.float32)]
    if cast and dist.is_main:
        names = few(cast, 5, lambda x: f"{x[0]} {dtype_name(x[1])}{'' if x[2] else ' (frozen)'}")
        print(f"note: initialize: parameters of another dtype ({names}) are cast to precision={policy.name}'s "
              f"working dtype {dtype_name(policy.param_dtype)} (forward sees them in it; trainable ones train in it)",
              file=sys.stderr, flush=True)
    offload = component(cfg, "offload").build(cfg.offload, accelerator=dist.acc)
    offload.connect(dist)
    stage = component(cfg, "stage").build(cfg.stage, dist=dist, offload=offload)
    if isinstance(module, torch.jit.ScriptModule) and (stage.forward_gathers or policy.auto_cast):
        raise ConfigError(f"initialize: the module is torch.jit.script'ed, and a ScriptModule takes no Python hooks, "
                          f"which {'stage=' + cfg.choices['stage'] if stage.forward_gathers else 'precision.auto_cast'} "
                          f"needs on the root: pass a plain nn.Module that holds it as a submodule and calls it in forward")
    # (config-only: refused before the module is touched)
    schedule = component(cfg, "scheduler").build(cfg.scheduler, base_lr=cfg.optimizer.lr, total_steps=cfg.train.steps)
    # Buffers whole on every rank; parameters move to dist.device as the stage lays them out.
    with dist.acc.building("initialize"):   # (checked: a buffer made on the host by name is host memory)
        materialize_buffers(module, dist.device, policy.param_dtype)
        setup = stage.setup(module, policy, grad_accum=cfg.train.grad_accum)
    # Until an engine owns them, an error closes the offload worker and the stage's hooks. (Sharded
    # parameters stay sharded: a retry on this module is refused in one line.)
    with contextlib.ExitStack() as unowned:
        unowned.callback(stage.close)
        decay_mask = [kind == "decay" or cfg.optimizer.decay_1d for kind in setup.kinds]
        update = stage.make_update(check_optimizer(component(cfg, "optimizer").build(cfg.optimizer, decay_mask),
                                                   cfg.choices["optimizer"], decay_mask, setup.master[0].device))
        unowned.callback(update.close)
        hooks = [module.register_forward_pre_hook(policy.cast_forward, with_kwargs=True)] if policy.auto_cast else []
        unowned.callback(lambda: [h.remove() for h in hooks])
        c = Components(module, loss_fn, stage, policy, schedule, cfg.train.grad_clip, dist, update,
                       on_nonfinite=cfg.train.on_nonfinite, grad_accum=cfg.train.grad_accum)
        state = TrainState(step=0, params=tuple(setup.master), opt_state=update.init(list(setup.master)),
                           precision=policy.init_state(), rng=capture_rng(dist.device), data=position)
        unowned.pop_all()
    engine = Engine(c, state, cfg, hooks)
    for _, p, trains in engine._trainable:
        if trains:
            p._framework_owner = Owner(engine)
    return engine


def hidden_size_of(module: nn.Module) -> int | None:
    """The hidden size for DeepSpeed's "auto" bucket sizes (a Hugging Face model's config, read as transformers
    reads it, or our GPT's), or None."""
    if (value := config_hidden_size(getattr(module, "config", None))) is not None:
        return value
    value = getattr(getattr(module, "cfg", None), "d_model", None)
    return value if isinstance(value, int) and not isinstance(value, bool) else None
