"""build_train_step: a fixed sequence of calls on stage, precision and optimizer.

    state, metrics = train_step(state, batch)   # one optimizer step over len(batch.micro) micro batches

Non-finite steps: fp16's loss scaling skips a step with non-finite gradients and lowers the scale, as
DeepSpeed does; any other non-finite step (without loss scaling, or a non-finite loss with finite gradients)
raises ``TrainingError``, or with ``train.on_nonfinite=warn`` is skipped and reported as
``metrics["nonfinite"]`` (never saved).
"""
from __future__ import annotations

import contextlib
import math
import re
import sys
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
from torch import nn

from framework.core.batch import Batch
from framework.comm.distributed import Dist
from framework.core.errors import DataError, TrainingError, on_every_rank
from framework.core.utils import counted, dtype_name, few
from framework.precision import Policy, next_scale
from framework.stages import Update
from framework.stages.base import BaseStage
from framework.engine.state import TrainState, capture_rng, restore_rng

LossFn = Callable[[nn.Module, Any], torch.Tensor]


@dataclass(frozen=True)
class Components:
    module: nn.Module
    loss_fn: LossFn
    stage: BaseStage
    policy: Policy
    schedule: Callable[[int], float]
    grad_clip: float              # 0 disables clipping
    dist: Dist
    update: Update                # optimizer step + publish (framework.stages.Update)
    on_nonfinite: str = "stop"    # a non-finite step loss scaling does not skip: stop | warn
    grad_accum: int = 1           # micro batches per step (train.grad_accum): the length of every Batch


def build_train_step(c: Components, applying: Callable[[int], None]
                     ) -> Callable[[TrainState, Batch], tuple[TrainState, dict]]:
    """``applying(step)``: the update of ``step`` now changes the state beyond what ``abort`` undoes (see
    ``framework.stages.Update``); after an exception (Ctrl-C included) the caller must not step from it."""
    warned = False   # about a float16 loss under loss scaling: once per engine

    def train_step(state: TrainState, batch: Batch | Sequence) -> tuple[TrainState, dict]:
        micro, position = (batch.micro, batch.position) if isinstance(batch, Batch) else (batch, None)
        # iterated, each of its tensors, keys or rows would be a micro batch (in a Batch: a tensor's rows, a dict's keys)
        if (bare := one_micro_batch(micro, () if isinstance(batch, Batch) else (tuple, list))) is not None:
            raise DataError(f"train_step: the batch is one micro batch ({bare}), not an iterable of micro batches: "
                            f"pass Batch(((x, y),)) for one (x, y) micro batch, Batch((x,)) for one tensor x "
                            f"(Batch((x1, x2)) when each tensor is a micro batch; Batch(tuple(t)) for micro batches "
                            f"stacked in one tensor t)")
        if not isinstance(batch, Batch) or not isinstance(micro, tuple):   # any iterable (a generator: read once)
            try:
                batch = Batch(tuple(micro), position)
            except TypeError:
                raise DataError(f"train_step: a batch is an iterable of micro batches (Batch(((x, y),)) for one "
                                f"(x, y) micro batch), got {type(micro).__name__}") from None
        if len(batch.micro) != c.grad_accum:   # before any collective: every rank stops here alike
            raise DataError(f"train_step: the batch has {counted(len(batch.micro), 'micro batch', 'micro batches')} "
                            f"but train.grad_accum="
                            f"{c.grad_accum}: a Batch is train.grad_accum micro batches, each one loss_fn call "
                            f"(one (x, y) micro batch is Batch(((x, y),)))")
        # The step draws (dropout, ...) from the state's generators; the caller's are put back after, also
        # on error. (A CUDA generator's state is a host value: saving and setting it syncs nothing.)
        with torch.random.fork_rng([c.dist.device] if c.dist.device.type == "cuda" else [], device_type="cuda"):
            restore_rng(state.rng, c.dist.device)
            return _step(state, batch)

    def _step(state: TrainState, batch: Batch) -> tuple[TrainState, dict]:
        nonlocal warned
        scale = state.precision.cur_scale
        n = len(batch.micro)
        lr = c.schedule(state.applied_steps)
        try:
            c.update.arm(state.opt_state, state.params, lr, scale)   # (inside: a cut arm is aborted too)
            # On the compute device: state.params live on the host under offload.
            loss_sum = torch.zeros((), dtype=torch.float32, device=c.dist.device)
            for k, micro in enumerate(batch.micro):
                with c.stage.forward_pass(train=True):
                    loss = checked_loss(call_loss(c, micro), train=True)
                if loss.dtype == torch.float16 and c.policy.scaler is not None and not warned:   # (metadata)
                    warned = _warn_fp16_loss(c, scale, n)
                with c.dist.acc.hot("the backward pass (its hooks)"):   # no host syncs (checked on the CPU)
                    c.stage.backward(loss * (scale / n), sync=k == n - 1)
                loss_sum += loss.detach().float()
            c.update.drain()
            grads = c.stage.reduce_grads()
            # One global norm serves clipping and overflow detection: inf/nan propagate through it, so
            # every rank reaches the same skip decision.
            sq_norm = c.stage.grad_sq_norm()
            # The mean loss over the global batch, known before the update: a non-finite one is never stepped on.
            # (this rank's own sum kept: a non-finite global one names the ranks whose micro batches made it)
            local_sum = loss_sum.clone() if c.dist.world > 1 else loss_sum   # (one rank: never read)
            c.dist.all_reduce(loss_sum, what="loss all-reduce")
            # Read in one wait with the stage's flags (float64 holds the fp32 loss and small integers exactly).
            flags = [f.to(sq_norm.device, torch.float64) for f in c.stage.step_flags()]
            both = torch.stack([sq_norm.double(), loss_sum.to(sq_norm.device, torch.float64), *flags])
            sq, total, *flags = both.tolist()   # host sync: once a step, decides clip/skip and logs the loss
            c.stage.check_flags(flags)   # (it may raise: nothing of this step is applied yet)
            norm = math.sqrt(sq) / scale
            mean_loss = total / (n * c.dist.world)
            # With loss scaling only non-finite gradients are an overflow, which the scaler skips and lowers the
            # scale for (DeepSpeed's rule); any other non-finite step, a non-finite loss with finite gradients
            # included, goes to train.on_nonfinite.
            overflow = not math.isfinite(norm)
            skip = overflow or not math.isfinite(mean_loss)
            nonfinite = skip and (c.policy.scaler is None or not overflow)
            if skip:   # (first: it waits for the gradients' copies to the host, which the names read)
                c.update.skip()
            if nonfinite:
                _nonfinite(c, state.step + 1, mean_loss, norm, c.stage.nonfinite_names(grads),
                           state.precision.skipped_steps + 1, local_sum)
            opt_state = state.opt_state
            precision = next_scale(c.policy.scaler, state.precision, overflow,
                                   culprits=lambda: c.stage.nonfinite_names(grads))
            if skip and not overflow:   # (warn) skipped for its loss alone: counted, the scale as for finite gradients
                precision = replace(precision, skipped_steps=precision.skipped_steps + 1)
            if not skip:   # (clipped as torch.nn.utils.clip_grad_norm_ does)
                coef = 1.0 / scale * (c.grad_clip / (norm + 1e-6) if 0 < c.grad_clip < norm else 1.0)
                opt_state = c.update.apply(grads, coef, opt_state, state.params, lr, partial(applying, state.step + 1))
        except BaseException:
            # A step that failed before the update leaves no trace (one that failed in it is half-applied:
            # ``applying`` told the caller).
            try:
                c.update.abort()   # (it may raise a swap write that failed: the step's error is its context)
            finally:
                c.stage.zero_grads()
                c.stage.unbind_grads()   # (a backward cut inside its own bookkeeping left its views bound)
            raise
        c.stage.zero_grads()
        metrics = {"loss": mean_loss, "lr": lr, "grad_norm": norm, "loss_scale": scale,
                   "skipped": skip, **({"nonfinite": True} if nonfinite else {}), **c.stage.stats()}
        return replace(state, step=state.step + 1, opt_state=opt_state, precision=precision,
                       rng=capture_rng(c.dist.device),
                       data=batch.position if batch.position is not None else state.data + 1), metrics

    return train_step


def one_micro_batch(batch: Any, kinds: tuple[type, ...] = (tuple, list)) -> str | None:
    """What ``batch`` is when it looks like one micro batch where micro batches go (a tensor, a dict, or one of
    ``kinds`` holding two or more tensors only), else None."""
    if isinstance(batch, torch.Tensor):
        return f"a tensor of shape {list(batch.shape)}"
    if isinstance(batch, Mapping):
        return "a dict"
    if isinstance(batch, kinds) and len(batch) > 1 and all(isinstance(t, torch.Tensor) for t in batch):
        return f"a {type(batch).__name__} of {len(batch)} tensors"
    return None


# torch's words for operands of two dtypes (matmul, linear, conv, addmm, index ops), one of them 16-bit (not a
# float target where a loss wants class indices: "expected scalar type Long but found Float")
_DTYPE_MISMATCH = re.compile(r"same dtype|expected scalar type|Input type \(.*\) and (weight|bias) type")
_SIXTEEN = re.compile(r"BFloat16|Half|bfloat16|float16")


@contextlib.contextmanager
def eval_mode(module: nn.Module) -> Iterator[None]:
    """``module`` and every submodule in eval mode inside; after (an exception too), each module's own training
    flag back: ``module.train(was)`` alone is recursive and would turn a submodule the user put in ``eval()`` (a
    BatchNorm frozen for fine-tuning, a dropout turned off) back to training. Each flag goes back through that
    module's own ``train()`` (not by assignment), so an override runs: one that drops eval-only state (an
    attention-bias cache filled from the weights of that eval) would otherwise serve it to the next eval.
    ``modules()`` is preorder: a parent's recursive ``train()`` runs first and its children are corrected after."""
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield
    finally:
        for m, was in modes:
            if m.training != was:
                m.train(was)


def same_count(dist: Dist, n: int) -> None:
    """DataError on every rank alike when the ranks pass different numbers of eval batches (``n``: this rank's):
    under zero3 every forward gathers with every rank, so uneven counts would hang. One small device all-reduce
    of ``[n, -n]`` (MAX: the most and the fewest) read once, no pickled object."""
    if dist.world == 1:
        return
    counts = torch.zeros(2, dtype=torch.int64, device=dist.device)
    counts[0], counts[1] = n, -n   # (fills: torch.tensor([...]) on a device blocks, copying from pageable memory)
    dist.all_reduce(counts, op=torch.distributed.ReduceOp.MAX, what="eval_step batch counts")
    most, fewest = counts.tolist()   # host sync: the counts decide whether the forwards run at all
    if most != -fewest:
        raise DataError(f"eval_step: the ranks passed different numbers of batches (from {-fewest} to {most}); "
                        f"under zero3 every forward gathers with every rank: give each rank the same number")


def call_loss(c: Components, micro: Any) -> Any:
    """``loss_fn(module, micro)``; under a 16-bit precision a dtype mismatch torch raises from deep in the model
    (a float32 input into bf16 weights) gets a note naming the setting. (Only the failing path reads anything.)"""
    try:
        return c.loss_fn(c.module, micro)
    except RuntimeError as e:
        if (c.policy.param_dtype != torch.float32 and _DTYPE_MISMATCH.search(str(e)) and _SIXTEEN.search(str(e))
                and not any(n.startswith("note: precision=") for n in getattr(e, "__notes__", ()))):   # (nested)
            dtype = dtype_name(c.policy.param_dtype)
            e.add_note(f"note: precision={c.policy.name}: the module's trainable parameters are {dtype}; cast float "
                       f"inputs to it in loss_fn (x.to({c.policy.param_dtype})) and return a float32 loss "
                       f"(docs/library.md)")
        raise


def checked_loss(loss: Any, train: bool = False) -> torch.Tensor:
    """``loss`` if it is a 0-dim floating tensor (``train``: requiring grad), else one line (no host sync)."""
    if isinstance(loss, torch.Tensor) and loss.dim() == 0 and loss.is_floating_point():
        if train and not loss.requires_grad:
            raise TrainingError("loss_fn returned a loss that does not require grad (detached, computed under "
                                "torch.no_grad(), or from no trained parameter): return the loss computed from the "
                                "module's output; for a micro batch that must add nothing, return (output * 0).sum()")
        return loss
    got = (f"a tensor of shape {list(loss.shape)} and dtype {loss.dtype}" if isinstance(loss, torch.Tensor)
           else f"a value of type {type(loss).__name__}")
    raise TrainingError(f"loss_fn must return the loss as a 0-dim floating tensor (e.g. reduce it with .mean()), got {got}")


def _warn_fp16_loss(c: Components, scale: float, n: int) -> bool:
    """Say once that a float16 loss makes the skipped steps depend on the world size and grad_accum."""
    if c.dist.rank == 0:
        print(f"warning: train_step: loss_fn returned a float16 loss: its backward starts from the gradient loss "
              f"scale / (micro batches x ranks) ({scale:g}/{n * c.dist.world} now) in float16, and every step where "
              f"that exceeds 65504 overflows and is skipped, so the skipped steps depend on the world size and "
              f"train.grad_accum; compute the loss in float32 (e.g. F.cross_entropy(logits.float(), y))",
              file=sys.stderr, flush=True)
    return True


def _nonfinite(c: Components, step: int, loss: float, norm: float, names: list[str], skipped: int,
               local_sum: torch.Tensor) -> None:
    """``names``: parameters with non-finite gradients; ``skipped``: the steps skipped so far, this one too;
    ``local_sum``: this rank's own loss sum (every rank calls this together: the decision is on global values)."""
    finite = math.isfinite(norm)
    grads = (f"the gradients are finite (global norm {norm:g})" if finite else
             f"the global gradient norm {norm:g} (non-finite; non-finite gradients in: {few(names, 8, str) or 'none'})")
    what = f"step {step}: the loss is {loss:g}{'' if math.isfinite(loss) else _loss_ranks(c, local_sum)} and {grads}"
    # A non-finite loss with finite gradients is no divergence a lower learning rate would cure: most often a
    # mean over no elements (nan, whose gradient is zero).
    hint = ("Lower the learning rate or check the data" if not finite else
            "check loss_fn and the data: a mean over no elements is nan (a micro batch whose targets are all "
            "ignore_index, or an empty micro batch); return loss.sum() / count.clamp(min=1), or the token-weighted "
            "loss of docs/library.md (Padded sequences)")
    if c.on_nonfinite != "warn":   # (decided on the all-reduced norm and loss: every rank stops here alike)
        raise on_every_rank(TrainingError(f"{what}; stopping before the update, nothing of this step is saved. "
                                          f"{hint[0].upper()}{hint[1:]}; train.on_nonfinite=warn skips such steps "
                                          f"instead"))
    if c.dist.rank == 0:
        print(f"warning: {what}; update skipped ({skipped} skipped step{'s' if skipped != 1 else ''} so far), "
              f"no checkpoint of this step (train.on_nonfinite=warn){'; ' + hint if finite else ''}",
              file=sys.stderr, flush=True)


def _loss_ranks(c: Components, local_sum: torch.Tensor) -> str:
    """" (non-finite from the micro batches of rank 2; ranks 0, 1 finite)": whose own loss made the global one
    non-finite ("" for one rank, or when each rank's was finite). One small collective, on this path alone."""
    if c.dist.world == 1:
        return ""
    mine = torch.arange(c.dist.world, device=local_sum.device) == c.dist.rank
    bad = (mine & ~torch.isfinite(local_sum)).to(torch.float32)
    c.dist.all_reduce(bad, what="non-finite loss all-reduce")
    flags = bad.tolist()   # host sync: on a non-finite loss alone, about to stop or skip the step
    worse, fine = [r for r, f in enumerate(flags) if f], [r for r, f in enumerate(flags) if not f]
    return f" (non-finite from the micro batches of {_ranks(worse)}{f'; {_ranks(fine)} finite' if fine else ''})" \
        if worse else ""


def _ranks(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
