"""Build components from a Config by registry name, and the library entry point.

    with framework.initialize(my_module, my_loss_fn, framework.compose(["optimizer=lion"])) as engine:
        state = engine.state                                    # the initial state
        for batch in batches:
            state, metrics = engine.train_step(state, batch)   # batch: grad_accum micro batches
        # engine.state is now the state the last train_step returned
"""
from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
from torch import nn

from framework.config import Config, compose
from framework.core.errors import ConfigError, FrameworkError
from framework.comm.distributed import Dist, connect
from framework.engine.materialize import materialize_buffers
from framework.core.registry import registry
from framework.optimizers import copy_16bit, merge_scalars
from framework.engine.state import TrainState
from framework.engine.step import Components, LossFn, build_train_step, init_state
from framework.core.footprint import Footprint
from framework.persist.layout import load_state_dict, state_dict
from framework.persist.weights import save_pretrained


def component(cfg: Config, group: str):
    """The registered component chosen for ``group`` in this config."""
    return registry(group).get(cfg.choices[group])


@dataclass(frozen=True)
class StateView:
    """A train state whose pieces can be read (or written) as tensors (``Engine.mapped_state``)."""

    state: TrainState
    fmap: Any   # the mapped swap file (``offload._swapfile.FileMap``), or None

    def own(self, t: torch.Tensor) -> torch.Tensor | None:
        """``t``'s bytes as a tensor whose storage is exactly them, when ``t`` views the mapped swap
        file (a writer then writes it from the file's pages without copying it); else None."""
        return self.fmap.own(t) if self.fmap is not None else None

    def maps(self, t: torch.Tensor) -> bool:
        """Whether ``t`` views the mapped swap file."""
        return self.fmap is not None and self.fmap.contains(t)


class Engine:
    """The built components, their step functions and the latest state.

    ``engine.state`` is the state the last ``engine.train_step`` (or ``load_state_dict``) returned,
    the initial state before, never a stale one. ``close()`` (or leaving a ``with`` block) removes the hooks
    the stage registered and stops the offload worker thread; the engine cannot step afterwards.
    """

    def __init__(self, components: Components, state: TrainState, train_step: Callable,
                 eval_step: Callable[[TrainState, list], float], config: Config | None = None):
        self.components = components
        self._state = state
        self._train_step = train_step
        self._eval_step = eval_step
        self.closed = False
        self.config = config   # the config it was built from

    @property
    def state(self) -> TrainState:
        return self._state

    def train_step(self, state: TrainState, batch) -> tuple[TrainState, dict]:
        """``state, metrics = engine.train_step(state, batch)``; also remembered as ``engine.state``."""
        self._check_open()
        state, metrics = self._train_step(state, batch)
        self._state = state
        return state, metrics

    def eval_step(self, state: TrainState, batches: list) -> float:
        self._check_open()
        return self._eval_step(state, batches)

    def _check_open(self) -> None:
        if self.closed:
            raise FrameworkError("this engine is closed (engine.close() or its with block ended); "
                                 "build a new one with framework.initialize")

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.components.update.close()   # the offload worker thread, if any
            self.components.stage.close()    # hooks on the module

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def consolidated_state_dict(self) -> dict | None:
        """Full working-dtype weights under every parameter name, on rank 0 (collective)."""
        return self.components.stage.consolidated_state_dict()

    def state_dict(self, state: TrainState) -> dict:
        """This rank's master parameters and optimizer state as fragments keyed by parameter name
        (host copies), with the step, data position, precision and RNG state; see
        ``framework.persist.layout.state_dict`` for the format. Not collective."""
        c = self.components
        with self.mapped_state(state) as view:
            return state_dict(view.state, c.stage.piece_specs(), policy=c.policy, rank=c.dist.rank,
                              world=c.dist.world)

    @contextlib.contextmanager
    def mapped_state(self, state: TrainState, write: bool = False) -> Iterator["StateView"]:
        """``state`` with every master piece and optimizer state addressable as a host or device
        tensor, for the length of the block: the state itself, or under offload=nvme with the
        swapped pieces as views of the swap file mapped into memory (no host copy of them: the
        kernel's page cache backs them). Read-only unless ``write``; with ``write``, values stored
        into the views are the swap file's on exit (synced, checksums refreshed, also after an
        error). Only between steps, and no step or publish inside the block."""
        offload = self._swapping()
        if offload is None:
            yield StateView(state, None)
            return
        params, opt_state, fmap = offload.mapped_state(state.params, state.opt_state, write=write)
        try:
            yield StateView(replace(state, params=tuple(params), opt_state=opt_state), fmap)
        finally:
            if write:
                offload.unmapped(fmap)

    def load_state_dict(self, state: TrainState, saved: Sequence[dict]) -> TrainState:
        """Load ``saved``, the ``state_dict`` of every rank of a run with any world size, stage,
        offload ratio or bucket size, into ``state``'s tensors (in place) and return the state to
        continue from. The working parameters are rebuilt from the loaded master values.
        Collective: every rank calls it with the same ``saved`` list. Under offload=nvme the
        swapped pieces are written straight into the swap file (``mapped_state``)."""
        c = self.components
        names = [n for n, p in c.module.named_parameters() if p.requires_grad]  # what the stage trains
        with self.mapped_state(state, write=True) as view:
            loaded = load_state_dict(view.state, c.stage.piece_specs(), saved, policy=c.policy, names=names,
                                     rank=c.dist.rank, world=c.dist.world)
        return self.finish_load(state, loaded)

    def finish_load(self, state: TrainState, loaded: TrainState) -> TrainState:
        """After a load into a ``mapped_state(write=True)`` view, its block closed: the state to
        continue from (``state``'s own tensors, ``loaded``'s values and scalars), with the working
        parameters rebuilt from the loaded masters (collective)."""
        # The state keeps its own tensors (under offload=nvme, the parked ones of the swapped pieces).
        state = replace(loaded, params=state.params,
                        opt_state=merge_scalars(state.opt_state, loaded.opt_state, len(state.params)))
        self.sync_working(state)
        self._state = state
        return state

    def sync_working(self, state: TrainState) -> None:
        """Rebuild the working parameters from the master values in ``state.params`` after they
        were written directly (a state or weights load). Collective.

        As after an optimizer step: 16-bit copies the publish sends (host staging buffers) are
        written first, then the stage publishes (zero1/2 gather the partitions, zero3 refreshes
        its shards and persistent unit, ddp copies a separate master)."""
        c = self.components
        out16 = c.stage.out16()
        if out16 is not None:
            offload = self._swapping()   # (a swapped piece's 16-bit copy is made when the publish reads it)
            skip = offload.swapped_indices() if offload is not None else set()
            copy_16bit([o for i, o in enumerate(out16) if i not in skip],
                       [p for i, p in enumerate(state.params) if i not in skip])
        c.stage.publish(list(state.params))

    def save_pretrained(self, out_dir, dtype: torch.dtype | None = None, *,
                        max_shard_size: int | str = "5GB") -> list:
        """Consolidated safetensors of the current weights in ``out_dir`` (``framework.persist.weights.
        save_weights``: ``dtype`` None keeps the fp32 masters' values) plus ``config.json`` when
        the model is a Hugging Face one, so ``from_pretrained(out_dir)`` loads it. Collective;
        no rank gathers the model. Returns the written paths."""
        return save_pretrained(self, out_dir, dtype=dtype, max_shard_size=max_shard_size)

    def _swapping(self):
        """The offload target when some state lives in swap files (offload=nvme), else None."""
        offload = getattr(self.components.stage, "offload", None)
        return offload if offload is not None and offload.swaps() else None

    def memory(self, state: TrainState) -> Footprint:
        """This rank's model states and persistent buffers: the bytes of the tensors it holds, by
        item and by where they live (``framework.memory.predict`` predicts the same items)."""
        fp = self.components.stage.memory(state.opt_state)
        self.components.update.memory(fp)
        return fp


def initialize(module: nn.Module, loss_fn: LossFn, cfg: Config | None = None, dist: Dist | None = None,
               position: int = 0, *, ds_config: str | Mapping | None = None, overrides: Sequence[str] = ()) -> Engine:
    """Shard ``module`` with the configured stage and return the initial state and step functions.

    ``loss_fn(module, micro_batch) -> scalar`` is called once per micro batch. Without ``dist``
    the process group described by the environment is joined (none at world size 1). Instead of
    ``cfg``, ``ds_config`` (a DeepSpeed JSON path or dict) with optional ``overrides`` composes
    one: our defaults < the DeepSpeed config < the overrides; its "auto" bucket sizes use the
    module's hidden size (``module.config.hidden_size`` or ``n_embd`` as Hugging Face models
    have, or our GPT's ``cfg.d_model``). ``engine.config`` is the config used.
    """
    if cfg is not None and (ds_config is not None or overrides):
        raise ConfigError("initialize: pass either cfg or ds_config/overrides, not both")
    if cfg is None:
        world = dist.world if dist is not None else int(os.environ.get("WORLD_SIZE", "1"))
        cfg = compose(list(overrides), ds_config=ds_config, world=world, hidden_size=hidden_size_of(module),
                      hidden_from_model=False)
        if (dist is None or dist.is_main) and cfg.notices:
            print("\n".join(cfg.notices), file=sys.stderr, flush=True)
    dist = dist or connect(cfg.dist.backend, cfg.dist.timeout_s)
    policy = component(cfg, "precision").build(cfg.precision)
    # Every device, stream and event decision of the offload path goes through the accelerator.
    offload = component(cfg, "offload").build(cfg.offload, accelerator=dist.acc)
    offload.connect(dist)
    stage = component(cfg, "stage").build(cfg.stage, dist=dist, offload=offload)
    # Buffers whole on every rank (a meta buffer is initialised by the model's initialiser first);
    # parameters move to dist.device as the stage lays them out (materialised if on meta).
    materialize_buffers(module, dist.device)
    setup = stage.setup(module, policy)
    decay_mask = [kind == "decay" or cfg.optimizer.decay_1d for kind in setup.kinds]
    optimizer = component(cfg, "optimizer").build(cfg.optimizer, decay_mask)
    schedule = component(cfg, "scheduler").build(cfg.scheduler, base_lr=cfg.optimizer.lr,
                                                 total_steps=cfg.train.steps)
    c = Components(module, loss_fn, stage, policy, optimizer, schedule, cfg.train.grad_clip, dist,
                   stage.make_update(optimizer), on_nonfinite=cfg.train.on_nonfinite)
    return Engine(c, init_state(c, setup.master, position), build_train_step(c), build_eval_step(c), cfg)


def hidden_size_of(module: nn.Module) -> int | None:
    """The model's hidden size for DeepSpeed's "auto" bucket sizes: a Hugging Face model's
    ``config.hidden_size`` (or GPT-2's ``n_embd``), our GPT's ``cfg.d_model``; None if unknown."""
    for holder, names in ((getattr(module, "config", None), ("hidden_size", "n_embd", "d_model")),
                          (getattr(module, "cfg", None), ("d_model",))):
        for name in names:
            value = getattr(holder, name, None) if holder is not None else None
            if isinstance(value, int) and not isinstance(value, bool):
                return value
    return None


def build_eval_step(c: Components) -> Callable[[TrainState, list], float]:
    """Mean loss over this rank's share of fixed batches, averaged over ranks (no grad)."""

    def eval_step(state: TrainState, batches: list[Any]) -> float:
        was_training = c.module.training
        c.module.eval()
        with torch.no_grad():
            total = sum(c.loss_fn(c.module, b).float() for b in batches)
        c.module.train(was_training)
        total = torch.as_tensor(total, dtype=torch.float32, device=c.dist.device).reshape(1)
        c.dist.all_reduce(total, what="validation loss all-reduce")
        return total.item() / (len(batches) * c.dist.world)

    return eval_step
