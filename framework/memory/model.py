"""The per-rank prediction for one composed config: model states laid out as the stages lay them out
(padded flat groups, bucket plans, zero3's gather units), activations traced on the meta device, the
zero3 live window and a stated allocator slack. ``tests/cli/test_estimate.py`` checks it against real runs."""
from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field, replace

import torch
from torch import nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import CheckpointError
# (private, with no public equal: a mode that sees each aten op and its outputs, as torch's memory tracker uses)
from torch.utils._python_dispatch import TorchDispatchMode

from framework.core.errors import ConfigError, FrameworkError, first_line
from framework.core.footprint import Footprint
from framework.core.registry import registry
from framework.core.units import MiB
from framework.core.utils import SQ_NORM_ROW, dtype_name, tensors_in, to_device
from framework.config import check_model_vocab
from framework.engine.build import component
from framework.memory.tables import count_module
from framework.stages import bucket_buffers, make_layout, param_groups, plan_units, unit_groups, whole_memory
from framework.stages.sharded import ShardedStage, Zero2Stage

# --- activations, traced on the meta device ---------------------------------------------------

class _LiveBytes(TorchDispatchMode):
    """Bytes of tensor storages alive during a traced pass, and their peak: each op output's storage is
    counted when it appears and uncounted when freed (a weak reference), following autograd's lifetimes.
    ``peak_kept``: the peak had the storages marked by ``drop`` (parameter gradients dropped once accumulated)
    lived to the end instead, as they do where nothing drops them: the same ops run either way, so at each
    output that pass holds exactly the bytes of this one plus those of the marked storages freed so far."""

    def __init__(self, preexisting: list[torch.Tensor]):
        super().__init__()
        self.live = self.peak = self.dropped = self.peak_kept = 0
        self._keep = [t.untyped_storage() for t in preexisting]   # parameters and inputs: not counted
        self.refs: dict[int, object] = {id(st): None for st in self._keep}
        self._marked: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tensors_in(out):
            if id(st := t.untyped_storage()) not in self.refs:
                key, n = id(st), st.nbytes()
                self.live += n
                self.peak = max(self.peak, self.live)
                self.peak_kept = max(self.peak_kept, self.live + self.dropped)
                self.refs[key] = weakref.ref(st, lambda _r, key=key, n=n: self._free(key, n))
        return out

    def drop(self, t: torch.Tensor) -> None:
        """Mark ``t``'s storage (when counted) as one the kept pass holds to the end."""
        if self.refs.get(key := id(t.untyped_storage())) is not None:
            self._marked.add(key)

    def _free(self, key: int, n: int) -> None:
        self.live -= n
        self.refs.pop(key, None)
        if key in self._marked:
            self._marked.discard(key)
            self.dropped += n


class _FusedAttentionKernel(torch.autograd.Function):
    """The memory of a fused attention kernel (CUDA's flash / memory-efficient, the CPU's flash): forward saves the
    output and an fp32 log-sum-exp per query row, backward an fp32 accumulator of the query's shape (CUDA's; the CPU's
    are per thread blocks, a little less); no sequence x sequence matrix, unlike the math path the meta device runs."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = q.new_empty((*q.shape[:-1], v.shape[-1]))
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, _, _ = ctx.saved_tensors
        accum = q.new_empty(q.shape, dtype=torch.float32)   # noqa: F841 - held while the gradients are made
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


class _FusedAttention(TorchFunctionMode):
    """Trace ``scaled_dot_product_attention`` as ``device``'s fused kernels hold memory (``_FusedAttentionKernel``).
    CUDA's take every call; the CPU's flash kernel every call without dropout (masks and every dtype included:
    checked with torch.profiler on torch 2.11 and 2.13), while one with ``dropout_p > 0`` runs the math path,
    traced as it is."""

    def __init__(self, device: str):
        super().__init__()
        self.dropout = device == "cuda"

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            q, k, v = args[:3] if len(args) >= 3 else (kwargs["query"], kwargs["key"], kwargs["value"])
            dropout_p = args[4] if len(args) > 4 else kwargs.get("dropout_p", 0.0)
            if self.dropout or not dropout_p:
                return _FusedAttentionKernel.apply(q, k, v)
        return func(*args, **kwargs)


@dataclass(frozen=True)
class ActivationTrace:
    saved: int      # bytes alive at the end of forward (what autograd keeps for backward, the loss path)
    peak: int       # peak bytes during forward + backward, parameter gradients excluded
    peak_kept: int = 0   # the peak with every parameter gradient held from its accumulation to the end


def trace_activations(module: nn.Module, loss_fn, batch, keep_grads: bool = False,
                      attention: str = "math") -> ActivationTrace:
    """Live bytes of ``loss_fn(module, batch)`` and its backward on the meta device. Parameter gradients are
    dropped once accumulated (the stages count them), unless ``keep_grads`` (zero2 when one bucket holds a
    whole group): ``peak`` is the one asked for, ``peak_kept`` the one with them kept (one pass gives both,
    ``_LiveBytes``). ``attention``: "math", the math path everywhere, or "cpu" / "cuda", as that device's fused
    kernels hold it where they run (``_FusedAttention``)."""
    params = list(module.parameters())
    inputs = tensors_in(batch)
    mode = _LiveBytes(params + list(module.buffers()) + inputs)

    def drop(p: torch.Tensor) -> None:
        mode.drop(p.grad)
        p.grad = None

    handles = [p.register_post_accumulate_grad_hook(drop) for p in params if p.requires_grad]
    fused = _FusedAttention(attention) if attention != "math" else contextlib.nullcontext()
    try:
        with mode, fused:
            loss = loss_fn(module, batch)
            saved = mode.live
            loss.backward()
        del loss
    except RuntimeError as e:
        if "meta tensor" not in str(e):
            raise
        raise ConfigError("memory prediction: the model reads a tensor's value in its forward, which the trace of "
                          "its activations on the meta device cannot (transformers' packed-sequence check does so "
                          "under activation checkpointing); predict it with model.activation_checkpointing=false"
                          ) from None
    finally:
        for h in handles:
            h.remove()
        for p in params:
            p.grad = None
    return ActivationTrace(saved, mode.peak_kept if keep_grads else mode.peak, mode.peak_kept)


# --- per-rank prediction for one of our configs --------------------------------------------

# Allocator slack beyond live tensors (glibc keeps freed blocks mapped and fragments; CUDA's caching
# allocator rounds and caches): 10% of the transient bytes on CUDA, plus 64 MiB for the cuBLAS/cuDNN
# workspaces and the context. On the host 20%: with attention traced as the CPU's flash kernel holds it,
# tests/cli/_memrun.py measured fp32/bf16 ddp peaks (gpt-nano and gpt-mini, context 128-512, micro batch
# 4-32) of 1.0-1.2x the live bytes on a 2-core machine (1.0-1.13x with MALLOC_MMAP_THRESHOLD_=131072).
SLACK_FRACTION = 0.10
HOST_SLACK_FRACTION = 0.20
CUDA_FIXED_SLACK = 64 * MiB
# On the host, activation checkpointing leaves glibc's heap more fragmented: each block recomputed in
# backward is allocated among the gradients made there. Measured with tests/cli/_memrun.py on a 2-core CPU
# machine (gpt-nano and gpt-mini, ddp/zero2/zero3, context 128-512, micro batch 4-16, dropout 0), the resident
# peak rose above the live bytes by 0.35-0.8 x the activations' peak more; with 0.5 (over the host's 20%)
# the prediction was 0.91-1.15 x those peaks (offload=nvme's, with none, 1.2 x). With dropout the math path's
# batch x heads x context^2 blocks, made again in every recomputed block, fragment it far more (below).
RECOMPUTE_SLACK_FRACTION = 0.5
# Transients of the CPU's kernels only (CUDA's cast as they read): the norm's upcast blocks (``_step_transients``),
# and ``grad_add_upcast``: an add_ of 16-bit gradients into wider ones (zero2/zero3's reduced ranges into their
# partitions, ddp/zero1's micro steps into their accumulator) first copies the largest range to the wider dtype.
HOST_ONLY = ("grad_norm_upcast", "grad_add_upcast")
# The stages ``predict`` models (a stage of one's own adds its case there; the planner leaves out the others).
STAGES = ("ddp", "zero1", "zero2", "zero3")


@dataclass
class Prediction(Footprint):
    """Bytes per rank: the footprint a built engine reports (``Engine.memory``), plus a step's transients and slack."""

    world: int
    params: int                      # P at logical size
    transient: dict[str, int] = field(default_factory=dict)          # fwd/bwd-phase peaks (device)
    lazy: set[str] = field(default_factory=set)   # items whose bytes appear at the first step, not at setup
    notes: list[str] = field(default_factory=list)
    # Host slack: none under offload=nvme, whose 1 MiB mmap threshold (offload/_disk.py) returns large blocks.
    host_slack_fraction: float = HOST_SLACK_FRACTION
    recompute_slack_fraction: float = 0.0   # of the activations, on the host (RECOMPUTE_SLACK_FRACTION)
    # The activations' peak with CUDA's fused attention; the "activations" transient is the CPU's (its flash
    # kernel, the math path for attention with dropout).
    cuda_activations: int | None = None

    MODEL_STATES = ("params", "frozen_params", "grads", "grad_accumulator", "master_params", "optimizer_state",
                    "host_grad_buffers", "host_staging", "overlap_undo", "nvme_optimizer_pool",
                    "nvme_grad_staging", "nvme_grad_read_back", "nvme_param_pool")

    @property
    def model_states(self) -> int:
        return sum(sum(self.items.get(n, (0, 0))) for n in self.MODEL_STATES)

    @property
    def at_setup(self) -> int:
        """What exists once the engine is built, before the first step touches lazy buffers."""
        return sum(d + h for k, (d, h) in self.items.items() if k not in self.lazy)

    @property
    def slack(self) -> int:
        """On a CPU run, where the transients are host memory."""
        return int(self.host_slack_fraction * sum(self.transient.values())
                   + self.recompute_slack_fraction * self.transient.get("activations", 0))

    @property
    def peak(self) -> int:
        return self.resident + sum(self.transient.values()) + self.slack

    def device_peak(self, cuda: bool) -> int:
        dev, transient = sum(d for d, _ in self.items.values()), sum(self.transient.values())
        if not cuda:
            return dev + transient + self.slack
        # The step's copy (``_step_transients``), made once backward freed the activations; none of HOST_ONLY.
        step = self.transient.get("step_grads_master", 0)
        transient -= step + sum(self.transient.get(k, 0) for k in HOST_ONLY)
        if self.cuda_activations is not None:   # attention as CUDA's fused kernels hold it
            transient += self.cuda_activations - self.transient.get("activations", 0)
        transient = max(transient, step)   # the caching allocator hands the step the activations' freed blocks
        return dev + transient + int(SLACK_FRACTION * transient) + CUDA_FIXED_SLACK   # the caching allocator's slack

    def host_total(self) -> int:
        return sum(h for _, h in self.items.values())

    def as_dict(self) -> dict:
        return {"world": self.world, "params": self.params,
                "items": {k: {"device": d, "host": h} for k, (d, h) in self.items.items()},
                "transient": dict(self.transient), "cuda_activations": self.cuda_activations,
                "lazy": sorted(self.lazy), "disk": dict(self.disk),
                "at_setup": self.at_setup, "slack": self.slack, "model_states": self.model_states,
                "resident": self.resident, "peak": self.peak, "notes": list(self.notes)}


def _opt_bytes_per_element(cfg, master: torch.dtype) -> list[int]:
    """Bytes per ``master``-dtype element of each optimizer-state tensor (Adam over fp32: [4, 4]), from its init
    on meta (the engine inits it over the precision policy's master copy)."""
    tx = component(cfg, "optimizer").build(cfg.optimizer, [True])
    probe = torch.empty(1024, dtype=master, device="meta")
    return [t.numel() * t.element_size() // 1024 for t in tensors_in(tx.init([probe])) if t.numel() >= 1024]


def state_bytes(cfg) -> tuple[int, int]:
    """(bytes of one working-precision parameter, optimizer-state bytes per master element) of ``cfg``."""
    policy = component(cfg, "precision").build(cfg.precision)
    return policy.param_dtype.itemsize, sum(_opt_bytes_per_element(cfg, policy.master_dtype))


def data_vocab(cfg, context: int | None = None) -> int:
    """The vocabulary training builds the model with: the configured data set's (it overrides the model's),
    built at ``context`` (default the model's); where the data cannot be built here, its config's ``vocab_size``
    when that states one, else refused."""
    try:
        data, context = component(cfg, "data"), context or cfg.model.context
        if data.vocab is not None:   # (e.g. text: its characters, not the whole file encoded)
            return data.vocab(cfg.data, seed=cfg.seed, context=context)
        return data.build(cfg.data, seed=cfg.seed, context=context).vocab_size
    except FrameworkError as e:   # e.g. a data file that is not here
        if (stated := getattr(cfg.data, "vocab_size", None)) is not None:
            return stated
        hint = "; or set data.vocab_size=N" if hasattr(cfg.data, "vocab_size") else ""
        raise ConfigError(f"memory prediction: the model is built at data={cfg.choices['data']}'s vocabulary, "
                          f"which needs its data here: {e}{hint}") from None


def predict(cfg, world: int | None = None, module: nn.Module | None = None,
            traces: dict | None = None, loss_fn=None, context: int | None = None,
            device: str | None = None, batch=None, rank: int = 0, policy=None, vocab: int | None = None) -> Prediction:
    """Per-rank memory of training ``cfg`` on ``world`` ranks. ``module``: a model built on meta, traced
    with ``loss_fn(module, batch)``: ``batch`` is one micro batch as ``loss_fn`` takes it (its tensors are
    moved to meta), by default token ids ``(x, x)`` of ``[train.micro_batch, context]``; ``traces``: reused
    activation traces (the planner's sweep); ``device``: trace attention only as "cpu" or "cuda" runs it
    (default: both); ``rank``: whose share (by default 0's, the largest: padding lies at the ends); ``policy``:
    ``cfg``'s precision, if built already (the planner's sweep); ``vocab``: ``data_vocab(cfg)``, if read already."""
    world = world or cfg.dist.nproc
    if not 0 <= rank < world:   # (else read as all padding, or all real: a wrong share, silently)
        raise ConfigError(f"predict: rank {rank} is not in 0..{world - 1} (world {world}); give a rank below the world")
    if (stage := cfg.choices["stage"]) not in STAGES:
        raise ConfigError(f"estimate: no memory model for stage {stage!r}; add its case (and its name to STAGES) "
                          f"in framework/memory/model.py, its checks to tests/dist/test_footprint.py")
    model = component(cfg, "model")
    # By default the configured model's loss, as training computes it (and its checkpointing key in force).
    own_loss, loss_fn = loss_fn is None, loss_fn or model.trace_loss or model.loss
    policy = policy or component(cfg, "precision").build(cfg.precision)
    notes = []
    if module is None:   # as training builds it: at the data's vocabulary (unless the model keeps its own)
        with torch.device("meta"):
            module = model.build(cfg.model, vocab_size=(vocab := data_vocab(cfg) if vocab is None else vocab))
        check_model_vocab(cfg, vocab)   # (training's refusal, before a prediction of a run it would not start)
        if model.vocab_size(cfg.model) is None:
            notes.append(f"model built at vocab {vocab} (from data={cfg.choices['data']}), as training builds it")
    placement = component(cfg, "offload").build(cfg.offload)   # no accelerator: it only cuts and sizes pieces
    keep_grads = False
    w, acc, red = policy.param_dtype.itemsize, policy.grad_accum_dtype.itemsize, policy.reduce_dtype.itemsize
    groups = [named for _, named in param_groups(module)]
    # The flat groups as the stage lays them out (ddp: unpartitioned; zero2 may lay them round-robin).
    layouts = [make_layout(Zero2Stage.layout_order(cfg.stage, named, world) if stage == "zero2" else named,
                           1 if stage == "ddp" else world) for named in groups]
    padded = [lay.padded for lay in layouts]
    pred = Prediction(world, count_module(module).params, notes=notes,
                      host_slack_fraction=0.0 if cfg.choices["offload"] == "nvme" else HOST_SLACK_FRACTION)
    # The longest piece the stage lets the tier cut (zero3: one per unit group already).
    chunk = ShardedStage.piece_size(cfg.stage, world) if stage in ("zero1", "zero2") else None
    # The tier's arguments (the optimizer's state is made over the policy's master dtype).
    cut = (chunk, policy.param_dtype, policy.master_dtype, _opt_bytes_per_element(cfg, policy.master_dtype))

    def full_grads(n: int, owned: int) -> None:
        """ddp and zero1: whole gradients, and an accumulator when it has another dtype; without one, a wider
        wire's sums land in that dtype over this rank's ``owned`` elements (``FlatGrads.owned``)."""
        pred.add("grads", device=w * n)
        if acc != w and (cfg.train.grad_accum > 1 or red != w and world > 1):
            pred.add("grad_accumulator", device=acc * (n if cfg.train.grad_accum > 1 else owned))
            pred.lazy.add("grad_accumulator")   # made by the first step
            if cfg.train.grad_accum > 1:   # each micro step's group gradients added into it (HOST_ONLY)
                pred.transient["grad_add_upcast"] = max(w, acc) * max(padded)

    if stage == "ddp":   # (its own master and state on the device: the device tier's bytes)
        shards = [sum(padded)]
        pred.add("params", device=w * sum(padded))
        full_grads(sum(padded), sum(padded))
        pred.lazy |= placement.predict(pred, shards, *cut)
        if red != w:   # a wire copy per bucket in flight
            pred.transient["reduce_wire"] = red * min(cfg.stage.reduce_bucket_size, max(padded)) * 2
    elif stage in ("zero1", "zero2"):
        shards = [lay.shard for lay in layouts]
        pred.add("params", device=w * sum(padded))
        pred.lazy |= placement.predict(pred, shards, *cut, real=[lay.real(rank) for lay in layouts])
        if stage == "zero1":
            full_grads(sum(padded), sum(shards))
        else:
            pred.add("grads", device=acc * sum(shards))
            # The bucket plan the stage makes, from its slots in registration order.
            by_name = [{s.name: s for s in lay.slots} for lay in layouts]
            slots = [(g, by_name[g][n]) for g, named in enumerate(groups) for n, _ in named]
            buckets = Zero2Stage.plan(cfg.stage, slots, dict(enumerate(shards)), world)
            n_buf, biggest = bucket_buffers(buckets, cfg.stage.overlap_comm, cfg.stage.contiguous_gradients)
            pred.add("bucket_buffers", device=red * n_buf * biggest)
            pred.lazy.add("bucket_buffers")   # torch.empty: pages appear when the first bucket is filled
            if red != acc:   # each reduced range's sums added into this rank's partition (HOST_ONLY): without
                by = None if cfg.stage.contiguous_gradients else slots   # contiguous gradients, piece by piece
                pred.transient["grad_add_upcast"] = max(red, acc) * Zero2Stage.largest_sum(buckets, layouts, rank, by)
            # Parameter .grad tensors live until their bucket is copied out: to the end of backward when one
            # bucket holds a whole group (traced); else the buckets in flight plus those filling (round
            # robin: one per partition).
            keep_grads = any(pd <= cfg.stage.reduce_bucket_size for pd in padded)
            if not keep_grads:
                filling = world if cfg.stage.round_robin_gradients else 1
                pred.transient["param_grads"] = w * min(max(lay.numel for lay in layouts), (n_buf + filling) * biggest)
    else:   # zero3
        shards = _zero3(cfg, module, policy, world, pred, placement, cut, rank)
    placement.predict_pool(pred, shards, *cut)
    whole_memory(pred, module, policy.param_dtype)   # frozen parameters and buffers, whole on every rank
    _step_transients(pred, policy, stage, shards, placement.swap_grads(policy.grad_accum_dtype, cfg.train.grad_accum))

    # Activations of one micro batch, traced on meta in the working dtype.
    ctx = context or cfg.model.context
    module = module.to(policy.param_dtype).train()
    if batch is None:
        x = torch.zeros(cfg.train.micro_batch, ctx, dtype=torch.long, device="meta")
        batch, shown = (x, x), f"micro_batch={cfg.train.micro_batch}, context={ctx}"
        fed = f"token ids (x, x) of [train.micro_batch, model.context] = [{cfg.train.micro_batch}, {ctx}]"
    else:
        batch = to_device(batch, torch.device("meta"))
        shown = fed = "batch " + ", ".join(f"{list(t.shape)} {dtype_name(t.dtype)}" for t in tensors_in(batch))
    ckpt = bool(getattr(cfg.model, "activation_checkpointing", False))
    # (not keep_grads: one trace gives the peaks with and without the gradients kept)
    key = (tuple((t.shape, t.dtype) for t in tensors_in(batch)), ckpt, policy.param_dtype)
    traces = {} if traces is None else traces

    def traced(attention: str) -> ActivationTrace:
        k = (*key, attention)
        if k not in traces:
            # Checkpointing recomputes blocks outside the tracing mode, so with it the fused peaks count the
            # math path's attention too (one block's matrices too many at most; the host's recompute slack was
            # fitted to that count); a model that checkpoints on its own shows as the recomputation's mismatch
            # (CheckpointError).
            try:
                traces[k] = traced("math") if attention != "math" and ckpt else trace_activations(
                    module, loss_fn, batch, attention=attention)
            except CheckpointError:
                traces[k] = traced("math")
            except FrameworkError:
                raise
            except Exception as e:   # a model that does not take this input: say what was fed (the cause kept:
                # its traceback points into the model)
                raise ConfigError(f"memory prediction: tracing the activations with loss_fn(module, batch) on the "
                                  f"meta device failed ({type(e).__name__}: {first_line(e)})"
                                  f"; the trace fed {fed}: give predict(..., batch=) one micro batch as your loss_fn takes "
                                  f"it (and loss_fn=)") from e
        return traces[k]

    # The host's attention as the CPU runs it: its flash kernel, or the math path for a call with dropout.
    tr, fused = traced(device or "cpu"), traced("cuda") if device != "cpu" else None
    if keep_grads:
        tr, fused = (replace(t, peak=t.peak_kept) if t else None for t in (tr, fused))
    pred.transient["activations"] = tr.peak
    if ckpt and pred.host_slack_fraction:   # (none under offload=nvme, whose heap returns large blocks)
        pred.recompute_slack_fraction = RECOMPUTE_SLACK_FRACTION
        if getattr(cfg.model, "dropout", 0):   # (not fitted: measured 1.7-1.95x, and no slack fraction covers it)
            pred.notes.append("with dropout the CPU runs attention's math path, and the batch x heads x context^2 "
                              "blocks made again in every block checkpointing recomputes fragment glibc's heap: "
                              "the host peak can reach twice this prediction; run with MALLOC_MMAP_THRESHOLD_=131072 "
                              "in the environment to hand such blocks back to the system (then below it)")
    pred.cuda_activations = fused.peak if fused else None
    pred.notes.append(f"activations traced on meta: {shown}, "
                      f"checkpointing={str(ckpt).lower() if own_loss else 'as the model is built'}, "
                      f"{tr.saved / MiB:.1f} MiB saved after forward, {tr.peak / MiB:.1f} MiB peak"
                      + (f" ({fused.peak / MiB:.1f} MiB with CUDA's fused attention)" if device is None else ""))
    return pred


def _step_transients(pred: Prediction, policy, stage: str, shards: list[int], swapped: bool) -> None:
    """The optimizer step's copies: the update reads the gradients in the master dtype, so a stage whose summed
    gradients are in another (16-bit working gradients with no wider accumulator) converts every piece the
    device tier updates (``.to(master)``, held through the update: as many elements as the device's master
    copy); the sharded stages' gradient norm then reads their 16-bit partitions, upcast on the host one block of
    ``SQ_NORM_ROW << 14`` elements at a time (``core.utils.sq_norm``; on an accelerator a fused norm copies none).
    On the host added to the activations' peak although made after backward has freed them: glibc keeps the
    activations' small blocks in its heap while these large copies are mapped anew (measured: the peak with
    them added 1.01-1.12x, with the larger phase alone 0.86-0.91x); on CUDA the larger phase (``device_peak``)."""
    accumulated = stage in ("zero2", "zero3") or pred.items.get("grad_accumulator", (0, 0))[0]
    summed = policy.grad_accum_dtype if accumulated else policy.param_dtype
    if summed == policy.master_dtype:
        return
    if on_device := pred.items.get("master_params", (0, 0))[0]:   # (host pieces: the offload tier's buffers)
        pred.transient["step_grads_master"] = on_device
    if stage != "ddp" and not swapped and summed not in (torch.float32, torch.float64):   # (ddp: the norm of the copy)
        pred.transient["grad_norm_upcast"] = 4 * min(SQ_NORM_ROW << 14, max(shards, default=0))


def nvme_pools(cfg, module: nn.Module, world: int, params: str, **keys) -> Footprint:
    """Per-rank pools of zero3 + offload=nvme (``offload.params=params``, other ``keys``) for the estimate's
    ZeRO-Infinity rows of any config (its own stage and offload keys where it chose them, else defaults)."""
    def chosen(group: str, name: str):
        return getattr(cfg, group) if cfg.choices[group] == name else registry(group).get(name).config()

    offload = replace(chosen("offload", "nvme"), params=params, **keys)
    z3 = replace(cfg, choices={**cfg.choices, "stage": "zero3", "offload": "nvme"},
                             stage=chosen("stage", "zero3"), offload=offload)
    policy = component(z3, "precision").build(z3.precision)
    placement = component(z3, "offload").build(z3.offload)
    pred = Prediction(world, 0)
    cut = (None, policy.param_dtype, policy.master_dtype, _opt_bytes_per_element(z3, policy.master_dtype))
    placement.predict_pool(pred, _zero3(z3, module, policy, world, pred, placement, cut), *cut)
    return pred


def _zero3(cfg, module, policy, world, pred: Prediction, placement, cut: tuple, rank: int = 0) -> list[int]:
    """zero3: shards of every unit group, persistent parameters gathered, the live window; returns the shards."""
    s = cfg.stage
    w, red, acc = policy.param_dtype.itemsize, policy.reduce_dtype.itemsize, policy.grad_accum_dtype.itemsize
    plans, persistent = plan_units(module, s.gather_unit, s.split_root, s.stage3_param_persistence_threshold)
    shards = []
    swap_grads = placement.swap_grads(policy.grad_accum_dtype, cfg.train.grad_accum)   # owned grads in the swap file
    in_place = world == 1 and not placement.shards.params_on_host   # a shard is its whole gathered buffer

    def group(named, gathered: bool) -> int:
        layout = make_layout(named, world)
        shards.append(layout.shard)
        pred.add("params", device=w * layout.shard)
        # (with the owned gradients in the swap file a partition exists only while it is reduced)
        if not swap_grads:
            pred.add("grads", device=acc * layout.shard)
        pred.lazy |= placement.predict(pred, [layout.shard], *cut, real=[layout.real(rank)])
        if gathered and not in_place:   # (in place: the persistent parameters are views of their shard)
            pred.add("gathered_persistent", device=w * layout.padded)
        return layout.padded

    sizes = [sum(group(named, False) for _, named in unit_groups(plan.named)) for plan in plans]
    sizes = [n for n in sizes if n]   # the gather units' elements (a plan of no groups gathers nothing)
    for _, named in unit_groups(persistent):
        group(named, True)
    pred.lazy.add("grads")   # each gradient partition is allocated at its first reduction
    placement.shards.predict(pred, shards, w)   # where the tier keeps the shards (offload.params)
    # Gathered units stay live up to max_live plus the unit in use (DeepSpeed's 1e9 defaults keep a model
    # under a billion parameters gathered from forward into backward); world 1 with device shards gathers in place.
    biggest = max(sizes, default=0)
    window = 0 if in_place else min(sum(sizes), s.stage3_max_live_parameters + biggest)
    pred.transient["zero3_live_window"] = w * window
    # Backward: the unit's full .grad tensors until reduced, and the reduction (world 1: one parameter's
    # gradient in the reduce dtype at a time; else a buffer per group, more rounds with overlap_comm).
    largest_param = max((p.numel() for plan in plans for _, p in plan.named), default=0)
    reduce = (red * largest_param if red != w else 0) if world == 1 else red * biggest * (3 if s.overlap_comm else 1)
    pred.transient["zero3_reduce"] = w * biggest + reduce
    if red != acc:   # sums added into the partitions (HOST_ONLY): a parameter's at world 1, else a group shard's
        pred.transient["grad_add_upcast"] = max(red, acc) * (largest_param if world == 1 else max(shards, default=0))
    if swap_grads:
        # The partition being reduced and the previous unit's, still being written (a third when the disk lags).
        pred.transient["zero3_grad_partitions"] = 2 * acc * max(shards, default=0)
        pred.notes.append("zero3 + offload=nvme: two gradient partitions in flight (a third when the disk is "
                          "slower than backward)")
    pred.notes.append(f"zero3: {len(sizes)} gather units (largest {biggest:,} elements), "
                      f"{sum(p.numel() for _, p in persistent):,} persistent elements, live window {window:,}")
    return shards
