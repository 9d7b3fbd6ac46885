"""The stage interface: how parameters, gradients and optimizer inputs are laid out and moved.
``train_step`` never asks which stage it drives; stages never know which optimizer runs."""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Protocol, Sequence

import torch
from torch import nn

from framework.comm.distributed import Dist
from framework.core.footprint import Footprint
from framework.core.utils import sq_norm, unwrapped
from framework.offload.base import Piece, Placement
from framework.optimizers import GradientTransformation, step as optimizer_step
from framework.stages._flat import Layout, PieceSpec, piece_spec, whole_memory


@dataclass(frozen=True)
class Setup:
    master: list[torch.Tensor]   # what the optimizer updates
    kinds: list[str]          # 'decay' or 'no_decay', aligned with ``master``


class Update(Protocol):
    """How a train step turns reduced gradients into published parameters. ``train_step`` calls ``arm``,
    ``drain`` after the backward passes, then ``apply`` (scale, step, publish) or ``skip``; ``abort`` if anything
    raised. ``apply`` calls ``applying`` just before its first change that ``abort`` cannot undo.
    ``offload._pipeline`` is a pipelined one that must give ``PlainUpdate``'s results."""

    tx: GradientTransformation   # the optimizer (a resume starts the state a checkpoint lacks from its init)
    def init(self, params: Sequence[torch.Tensor]) -> Any: ...   # the optimizer state of ``params``
    def arm(self, opt_state: Any, params: Sequence[torch.Tensor], lr: float, scale: float) -> None: ...
    def drain(self) -> None: ...
    def apply(self, grads: list[torch.Tensor], coef: float, opt_state: Any, params: Sequence[torch.Tensor],
              lr: float, applying: Callable[[], None] | None = None) -> Any: ...
    def skip(self) -> None: ...
    def abort(self) -> None: ...
    def memory(self, fp: Footprint) -> None: ...   # its own buffers, added to ``fp``
    def close(self) -> None: ...


class PlainUpdate(Update):
    """Steps and publishes in one go (its other calls are the protocol's no-ops)."""

    def __init__(self, tx: GradientTransformation, stage: Any):
        self.tx, self.stage = tx, stage

    def init(self, params: Sequence[torch.Tensor]) -> Any:
        return self.tx.init(list(params))

    def apply(self, grads: list[torch.Tensor], coef: float, opt_state: Any, params: Sequence[torch.Tensor],
              lr: float, applying: Callable[[], None] | None = None) -> Any:
        if applying is not None:
            applying()
        if coef != 1.0:
            # (torch._foreach_*: no public multi-tensor op; torch.optim's own steps use the same ones)
            torch._foreach_mul_(grads, coef)
        opt_state = optimizer_step(self.tx, grads, opt_state, params, lr, self.stage.out16())
        self.stage.publish(list(params))
        return opt_state


class BaseStage:
    """The stage interface ``train_step`` drives, with defaults for working parameters whole on every rank.
    Each stage also provides:

    - ``setup(module, policy, *, grad_accum) -> Setup``: own the module's parameters (flatten, shard, bind);
    - ``backward(loss, *, sync)``: one micro batch; ``sync`` marks the accumulation boundary;
    - ``reduce_grads()``: finish the reduction; the gradients aligned with ``Setup.master`` (master dtype);
    - ``grad_sq_norm()``: their global squared L2 norm (non-finite if any element is);
    - ``nonfinite_names(grads)``: parameters with non-finite gradients on any rank (slow path, for errors);
    - ``publish(master)``: copy updated master values into the working parameters;
    - ``piece_specs()``: what each master piece holds by parameter name (behind ``TrainState.params``);
    - ``zero_grads()``; ``_memory(fp, opt_state)``: add its model states to ``memory``'s footprint."""

    module: nn.Module
    dist: Dist
    hook_handles: list   # removed by close()
    forward_gathers = False   # whether each forward runs collectives with every rank (zero3's gathers)
    watched: tuple = ()   # (name, parameter, version counter, its (module, attribute) owners) per trainable one
    # Whether the trainable parameters stay views of the stage's own buffers from setup on (zero3 re-points each
    # at every gather and release instead, and checks them against its gatherer: its ``detached``).
    fixed_views = True
    bound: tuple = ()   # (parameter, the view of the stage's buffer it holds): every one with fixed_views, else frozen
    bound_buffers: tuple = ()   # (module, name, buffer) as at initialize
    frozen: tuple = ()   # (name, parameter, its (module, attribute) owners) per frozen one
    views: dict   # id(parameter) -> its view in ``bound`` (set with it)
    fixed: tuple = ()   # (name, parameter, its view) per trainable one in ``bound``, in ``watched``'s order

    def close(self) -> None:   # remove the hooks this stage registered on the module
        for h in self.hook_handles:
            h.remove()
        self.hook_handles.clear()

    def stats(self) -> dict:   # stage metrics for the last step (e.g. zero3's prefetch hit rate)
        return {}

    def watch(self, params: Iterable[torch.Tensor] | None = None, entry: dict[int, int] | None = None) -> None:
        """Take the trainable parameters' version counters as they are now (``params``: only theirs; ``entry``:
        their counters when a block began, so one edited before it stays edited): the stages write working values
        through their flat buffers and shards, never through the parameters, so a counter that moves later is an
        in-place edit (``edited``), which the next publish from the masters would undo."""
        if params is None:
            owners: dict = {}   # every module attribute that holds each parameter (tied ones: several)
            for m in self.module.modules():
                # (_parameters, _version: no public view of a module's own slots, with tied ones under each name,
                # nor of a tensor's in-place write counter, a Python int read with no device access)
                for a, p in m._parameters.items():
                    owners.setdefault(id(p), []).append((m, a))
            named = list(self.module.named_parameters())
            self.watched = tuple((n, p, p._version, tuple(owners[id(p)])) for n, p in named if p.requires_grad)
            self.frozen = tuple((n, p, tuple(owners[id(p)])) for n, p in named if not p.requires_grad)
            # (an alias of each view: the stage's buffers, which live as long as the stage, hold no more memory;
            # frozen parameters and the module's buffers too, so that a discard puts back all that module.half()
            # or .to() cast, not only what is checked)
            self.bound = tuple((p, p.data) for _, p in named if self.fixed_views or not p.requires_grad)
            self.views = {id(p): view for p, view in self.bound}
            self.fixed = tuple((n, p, self.views[id(p)]) for n, p, _, _ in self.watched if id(p) in self.views)
            self.bound_buffers = tuple((m, a, t) for m in self.module.modules() for a, t in m._buffers.items()
                                       if t is not None)
            return
        ids = {id(p) for p in params}
        self.watched = tuple((n, p, p._version if id(p) in ids and (entry is None or entry.get(id(p)) == v) else v,
                              owners) for n, p, v, owners in self.watched)

    def unbind_grads(self) -> None:
        """After a step cut short: no trainable parameter keeps a ``.grad`` (a view a backward pass bound), which
        the retry's backward would refuse as a user's backward pass."""
        for _, p, _, _ in self.watched:
            p.grad = None

    def settle(self, rebind: bool = False) -> None:
        """After a step: edits its forwards made (``nn.Embedding(max_norm=...)`` renormalises in place) are no
        user's edit (but those of a parameter inside an open block). After a load (``rebind``): parameters replaced
        on the module (``load_state_dict(..., assign=True)``) are the stage's again, which hold the loaded values."""
        if rebind:
            self.rebind()
        self.watched = tuple((n, p, v if self.in_edit(p) else p._version, owners)
                             for n, p, v, owners in self.watched)

    def rebind(self) -> None:
        """The stage's parameters back on every module attribute that held them (a load's targets)."""
        for _, p, _, owners in self.watched:
            for m, a in owners:
                m._parameters[a] = p
        for p, view in self.bound:   # its storage replaced (module.half(), .to(...)): the stage's view again
            if _moved(p, view):
                p.data = view
        for _, p, owners in self.frozen:   # replaced by a move (module.to("meta")); one of its kind: the user's own
            for m, a in owners:
                if _recast(m._parameters[a] if a in m._parameters else None, self.views[id(p)]):
                    m._parameters[a] = p
        for m, a, t in self.bound_buffers:   # a buffer cast or moved with it (one the model replaced is its own)
            now = m._buffers.get(a)
            if now is not None and (now.dtype != t.dtype or now.device != t.device):
                m._buffers[a] = t

    def edited(self, moved: list[str] | None = None) -> list[str]:
        """The trainable parameters written in place, or replaced on their module (``load_state_dict(...,
        assign=True)``), or whose storage was replaced (``detached``; ``moved``: its result, if taken already),
        since ``watch`` (Python ints, identities and addresses compared: no tensor read)."""
        moved = set(self.detached() if moved is None else moved)
        # (one pass over every owner, no generator per parameter: this runs before every step)
        replaced = {id(p) for _, p, _, owners in self.watched for m, a in owners   # (a ScriptModule's
                    if a not in m._parameters or m._parameters[a] is not p}        # _parameters has no .get)
        return [n for n, p, v, _ in self.watched
                if (n in moved or p._version != v or id(p) in replaced) and not self.in_edit(p)]

    def detached(self) -> list[str]:
        """The trainable parameters no longer views of the stage's buffers: ``module.to()``, ``.half()``,
        ``.float()``, ``.cuda()``... (``nn.Module._apply``) gave them new storage under the same Parameter and
        version counter, so from then on the forward would read stale weights and no update would reach them.
        (Dtype, device and data address compared: host metadata, no tensor read.)"""
        return [n for n, p, view in self.fixed   # (_moved inlined: this runs before every step)
                if p.dtype != view.dtype or p.device != view.device or p.data_ptr() != view.data_ptr()]

    def cast_frozen(self) -> list[str]:
        """The frozen parameters a move or cast (``nn.Module._apply``) gave other storage, or replaced on their
        module by one of another dtype or device (``module.to("meta")``): the forward would mix dtypes or devices,
        and a save would write them so. (Metadata compared, as ``detached``: no tensor read.)"""
        return [n for n, p, owners in self.frozen if _moved(p, self.views[id(p)]) or any(
                _recast(m._parameters[a] if a in m._parameters else None, self.views[id(p)]) for m, a in owners)]

    def in_edit(self, p: torch.Tensor) -> bool:   # whether a block that settles p's edits at its exit is open
        return False

    @contextmanager
    def forward_pass(self, train: bool) -> Iterator[None]:
        """Around one loss_fn call of train_step (``train``: its backward follows) or eval_step (zero3's pass)."""
        yield

    def make_update(self, tx: GradientTransformation) -> Update:
        return PlainUpdate(tx, self)

    def step_flags(self) -> list[torch.Tensor]:
        """0-dim device integers ``train_step`` reads with its one host read after ``reduce_grads``; their
        values, the same on every rank, go to ``check_flags`` before anything is updated."""
        return []

    def check_flags(self, values: list[float]) -> None:
        """Raise (on every rank alike) if ``step_flags``' values say the step must not be applied."""

    def read_errors(self) -> None:
        """zero3 with offload.params=nvme (collective): every rank raises SwapIOError if some rank's shard read
        failed since the last check (that rank gathered zeros)."""

    def out16(self) -> list[torch.Tensor] | None:
        """Where the optimizer step also writes the updated values in the working dtype, or None."""
        return None  # publish converts the master values itself

    def weights_on_save(self) -> bool:
        """Whether each save also writes consolidated working-dtype weights (zero3's option)."""
        return False  # no such key: the plain module's own state_dict already holds full weights

    def consolidated_state_dict(self) -> dict | None:
        """Full working-dtype weights under every parameter name, on rank 0 (None elsewhere). Collective."""
        if not self.dist.is_main:
            return None
        # host sync: consolidation, between steps
        return {n: p.detach().to("cpu", copy=True)   # (a torch.compile'd module's: the names of the one it wraps)
                for n, p in unwrapped(self.module).named_parameters(remove_duplicate=False)}

    def memory(self, opt_state) -> Footprint:
        """This rank's model states and buffers by item and where they live (``opt_state``: the pieces')."""
        fp = Footprint()
        self._memory(fp, opt_state)
        whole_memory(fp, self.module, self.policy.param_dtype)
        return fp


def _moved(p: torch.Tensor, view: torch.Tensor) -> bool:   # p no longer holds ``view`` (metadata only)
    return p.dtype != view.dtype or p.device != view.device or p.data_ptr() != view.data_ptr()


def _recast(now: torch.Tensor | None, view: torch.Tensor) -> bool:   # a dtype or device other than ``view``'s
    return now is not None and (now.dtype != view.dtype or now.device != view.device)


class PartitionedStage(BaseStage):
    """zero1, zero2, zero3: each rank owns, per group, its partition [lo, hi) of a padded flat layout and
    the master pieces the offload target cuts it into. Subclasses supply ``_finish_grads()`` (after the
    step's last backward), ``_partition_grads()`` (each group's reduced partition on the device, read
    only) and ``publish_finish()`` (make the working parameters current after the pieces are published)."""

    def __init__(self, cfg, dist: Dist, offload: Placement, chunk: int | None):
        """``chunk``: the longest master piece the offload target may cut (None: one per partition)."""
        self.cfg, self.dist, self.offload, self.chunk = cfg, dist, offload, chunk
        self.layouts: list[Layout] = []
        self.bounds: list[tuple[int, int]] = []     # owned [lo, hi) per group
        self.pieces: list[list[Piece]] = []         # from the offload target, in the optimizer's order
        self.hook_handles: list = []
        self.grad_swap = False   # zero3 under offload=nvme: the owned gradients live in the swap file

    def _own(self, layout: Layout, owned: torch.Tensor, master_dtype: torch.dtype) -> list[Piece]:
        """Own ``owned`` (this rank's partition of ``layout``, working values) and place its master."""
        pieces = self.offload.place(owned, master_dtype, self.chunk, real=layout.real(self.dist.rank))
        self.layouts.append(layout)
        self.bounds.append(layout.partition(self.dist.rank))
        self.pieces.append(pieces)
        return pieces

    @property
    def master(self) -> list[torch.Tensor]:
        return [p.master for pieces in self.pieces for p in pieces]

    @property
    def piece_index(self) -> list[tuple[int, int]]:
        """(group, start within the partition) of each master piece."""
        return [(g, p.start) for g, pieces in enumerate(self.pieces) for p in pieces]

    def piece_specs(self) -> list[PieceSpec]:
        return [piece_spec(self.layouts[g], self.bounds[g][0] + p.start, self.bounds[g][0] + p.end)
                for g, pieces in enumerate(self.pieces) for p in pieces]

    def reduce_grads(self) -> list[torch.Tensor]:
        self._finish_grads()
        return self.offload.grads(self._partition_grads())

    def grad_sq_norm(self) -> torch.Tensor:
        # Over the partitions, not the pieces, so how they are cut (offload, overlap) cannot change the
        # norm's rounding within a stage. The partitions are a stage's own: zero3 cuts them elsewhere than
        # zero1/zero2, so its norm (and clip factor) differs from theirs in the last bits (docs/stages.md).
        # (Swapped out: the offload target kept each partition's as it wrote it.)
        local = (self.offload.grad_sq_norm_local() if self.grad_swap
                 else sq_norm(self._partition_grads(), self.dist.device))
        # Partitions are disjoint: the global squared norm is the sum over ranks.
        self.dist.all_reduce(local, what="gradient norm all-reduce")
        return local

    def nonfinite_names(self, grads: list[torch.Tensor]) -> list[str]:
        mine = set()   # (zero3's gradients in the swap file are read one piece at a time)
        for g, (group, start) in zip(self.offload.readable_grads(grads), self.piece_index):
            self.dist.acc.host_use(reads=[g])   # (offload: a host buffer the D2H stream fills; read once done)
            # host sync: slow path, after an overflow
            mine.update(self.layouts[group].nonfinite_names(g, self.bounds[group][0] + start))
        return sorted(set().union(*self.dist.all_gather_object(sorted(mine), what="overflow names gather")))

    def publish(self, master: list[torch.Tensor]) -> None:
        # ``master`` is the state's list: the same tensors as the pieces, updated in place.
        self.offload.publish()
        self.publish_finish()

    def out16(self) -> list[torch.Tensor] | None:
        return self.offload.out16()

    def make_update(self, tx: GradientTransformation) -> Update:
        pipeline = self.offload.make_update(tx, gather=self.publish_finish)   # host pieces: it steps and publishes
        return pipeline if pipeline is not None else PlainUpdate(tx, self)
