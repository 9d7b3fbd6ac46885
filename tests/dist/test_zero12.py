"""zero1 and zero2 equal the ddp stage on 1, 2 and 4 gloo ranks.

fp32: per-step losses and final parameters to 1e-6 relative; bf16/fp16: per-step losses and
gradient norms within what the wire's rounding explains (LOW_PRECISION_RTOL).
The model's no-decay group (LayerNorm weights, 5 x 33 = 165 elements) is not divisible by
the world size, so partitions are padded.
"""
import pytest
import torch
from torch import nn

import framework
from framework import Batch
from framework.models.gpt import gpt_loss
from tests._helpers import build_gpt, flat_params, tiny_config
from tests.unit.test_step import WithFrozen

ODD = ["model.d_model=33", "model.n_head=3", "train.steps=10", "train.micro_batch=2"]
FP32_RTOL = 1e-6


def _train(dist, stage, overrides, inf_at=None):
    if stage == "ddp":  # the ZeRO bucket options have no ddp counterpart
        overrides = [o for o in overrides if not o.startswith("stage.")]
    if stage == "zero1":  # always contiguous: the config refuses false
        overrides = [o for o in overrides if o != "stage.contiguous_gradients=false"]
    cfg = tiny_config(*ODD, f"+stage={stage}", *overrides)
    module, data = build_gpt(cfg)

    def loss_fn(m, micro):
        loss = gpt_loss(m, micro)
        return loss * float("inf") if step_no[0] == inf_at and dist.rank == 0 else loss

    step_no = [0]
    engine = framework.initialize(module, loss_fn, cfg, dist)
    state, losses, skipped, norms = engine.state, [], [], []
    for step in range(cfg.train.steps):
        step_no[0] = step
        batch = data.train_batch(state.data, micro_batch=cfg.train.micro_batch, grad_accum=cfg.train.grad_accum,
                                 rank=dist.rank, world=dist.world)
        state, m = engine.train_step(state, batch)
        losses.append(m["loss"])
        skipped.append(m["skipped"])
        norms.append(m["grad_norm"])
    return losses, flat_params(engine.components.module), skipped, engine.memory(state), norms


def _compare(dist, overrides, stages=("ddp", "zero1", "zero2"), inf_at=None):
    return {s: _train(dist, s, overrides, inf_at) for s in stages}


FP32_CASES = {
    "accum1-clip": ["train.grad_clip=0.05"],
    "accum3-clip-small-buckets-overlap": ["train.grad_accum=3", "train.grad_clip=0.05",
                                          "stage.reduce_bucket_size=700", "stage.allgather_bucket_size=900",
                                          "stage.overlap_comm=true"],
    "allreduce-fallback-noncontiguous": ["train.grad_accum=3", "stage.reduce_scatter=false",
                                         "stage.contiguous_gradients=false", "stage.reduce_bucket_size=2000"],
    # SGD is not scale-invariant like Adam: a gradient off by a factor shows in the losses.
    "sgd-momentum-accum2": ["optimizer=sgd", "optimizer.lr=0.5", "optimizer.momentum=0.9", "train.grad_accum=2",
                            "train.grad_clip=0", "stage.reduce_bucket_size=1500", "stage.overlap_comm=true"],
}


# On 4 ranks gloo reduces each bucket to its owners (2 ranks all-reduce it), and partitions sit between
# others: the cases whose options take that path. Two add nothing there, so they run on 1 and 2 ranks:
# "allreduce-fallback-noncontiguous" reduces with all_reduce at any world (reduce_scatter=false), its 2000-
# element buckets spanning at most two partitions at 2 ranks as at 4 (a partition is ~6,900 elements at 4),
# and non-contiguous gradients are a rank's own copies; "sgd-momentum-accum2" repeats the small-bucket
# overlap_comm reduction of "accum3-clip-small-buckets-overlap" with another optimizer, whose arithmetic is
# per element, and a gradient off by a factor that Adam's scale invariance would hide shows in the
# gradient norms every case compares.
WORLD_4 = ("accum1-clip", "accum3-clip-small-buckets-overlap")
FP32_RUNS = [(case, world) for case in FP32_CASES for world in (1, 2, 4) if world < 4 or case in WORLD_4]


# 6 steps of ODD's 10: every code path a step takes (first and later steps, buffers and state reused, momentum,
# clipping) runs from the second step on, and a wrong element shows at 1e-6 in the next loss or the norms.
FP32_STEPS = "train.steps=6"


@pytest.mark.parametrize("case,world", FP32_RUNS, ids=[f"{case}-{world}" for case, world in FP32_RUNS])
def test_fp32_equals_ddp(pools, world, case):
    overrides = [*FP32_CASES[case], FP32_STEPS]
    out = _compare(_local(), overrides) if world == 1 else pools(world).run(_compare, overrides, timeout=240)
    for rank, res in enumerate(out if world > 1 else [out]):
        ref_losses, ref_params = res["ddp"][:2]
        for stage in ("zero1", "zero2"):
            losses, params = res[stage][:2]
            for i, (a, b) in enumerate(zip(losses, ref_losses)):
                assert a == pytest.approx(b, rel=FP32_RTOL), f"{stage} rank {rank} step {i}: {a} vs ddp {b}"
            torch.testing.assert_close(params, ref_params, rtol=FP32_RTOL, atol=1e-7,
                                       msg=lambda m: f"{stage} rank {rank} final params vs ddp (rtol 1e-6): {m}")
            assert res[stage][4] == pytest.approx(res["ddp"][4], rel=FP32_RTOL), f"{stage} gradient norms"


# (loss, gradient norm) relative tolerances against ddp. Measured on world 2 over 10 steps at the constant
# lr: bf16 3.4e-5 and 4.2e-4, fp16 7.1e-6 and 4.8e-5 (zero1 is bitwise equal in the losses; zero2 rounds
# each micro batch's gradients on the wire). 3x-10x margin for another CPU's kernels; a rank whose
# gradients go missing halves the norm (1.36 -> 0.77) long before Adam shows it in a loss. The constant
# lr (not the warm-up's, <1e-4) moves the 16-bit LayerNorm weights, so a stage that never wrote them
# back would fail (bf16: loss 5e-4, norm 7e-3 off).
LOW_PRECISION_RTOL = {"bf16": (2e-4, 3e-3), "fp16": (2e-5, 5e-4)}


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_low_precision_close_to_ddp(pools, precision):
    res = pools(2).run(_compare, [f"precision={precision}", "train.grad_accum=2", "scheduler=constant"],
                       timeout=240)[0]
    loss_rtol, norm_rtol = LOW_PRECISION_RTOL[precision]
    for stage in ("zero1", "zero2"):
        for i, (a, b) in enumerate(zip(res[stage][4], res["ddp"][4])):
            assert a == pytest.approx(b, rel=norm_rtol), f"{precision} {stage} step {i}: grad_norm {a} vs ddp {b}"
        for i, (a, b) in enumerate(zip(res[stage][0], res["ddp"][0])):
            assert a == pytest.approx(b, rel=loss_rtol), f"{precision} {stage} step {i}: loss {a} vs ddp {b}"


# bf16 reduced in fp32 without accumulation: every stage's optimizer reads the wire's fp32 sums (ddp and
# zero1 land them in an fp32 buffer, zero2 adds them into its fp32 partition), so on two ranks (a sum of
# two has one order) they are bitwise equal; reduced in bf16, the sums are rounded to bf16 first.
WIRE = ["precision=bf16", "train.grad_clip=0", "train.steps=4"]


def _wire_widths(dist):
    out = _compare(dist, [*WIRE, "precision.reduce_fp32=true"])
    out["ddp bf16-wire"] = _train(dist, "ddp", WIRE)
    return out


def test_bf16_with_fp32_wire_is_the_same_on_every_stage(pools):
    for rank, res in enumerate(pools(2).run(_wire_widths, timeout=240)):
        losses, params = res["zero2"][:2]
        for stage in ("ddp", "zero1"):
            assert res[stage][0] == losses, f"rank {rank} {stage} losses {res[stage][0]} vs zero2 {losses}"
            assert torch.equal(res[stage][1], params), f"rank {rank} {stage} params differ from zero2's"
        assert not torch.equal(res["ddp bf16-wire"][1], params), "precision.reduce_fp32 changed nothing"


def test_fp16_overflow_skips_same_step_on_every_rank(pools):
    out = pools(2).run(_compare, ["precision=fp16", "train.steps=6"], ("zero1", "zero2"), 3, timeout=240)
    for stage in ("zero1", "zero2"):
        flags = [res[stage][2] for res in out]
        assert flags[0] == flags[1] == [False, False, False, True, False, False], flags
        torch.testing.assert_close(out[0][stage][1], out[1][stage][1], rtol=0, atol=0)


def _local():
    from framework.comm.distributed import connect
    return connect("gloo")


# --- a user's model with odd shapes and an unused branch -------------------------------

class Odd(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(7, 13)
        self.b = nn.Linear(13, 3)
        self.unused = nn.Linear(5, 5)      # never gets a gradient
        self.scale = nn.Parameter(torch.ones(3))
        # used, but of 0 elements: in no bucket, in either group
        self.empty = nn.Parameter(torch.zeros(0, 4))
        self.empty1 = nn.Parameter(torch.zeros(0))

    def forward(self, x):
        return self.b(torch.relu(self.a(x))) * self.scale + self.empty.sum() + self.empty1.sum()


def _odd(dist, stage):
    cfg = framework.compose([f"+stage={stage}", "optimizer=adamw", "optimizer.weight_decay=0.1",
                             "scheduler=constant", "train.steps=10", "train.micro_batch=4", "train.grad_accum=2",
                             "stage.reduce_bucket_size=40", "stage.overlap_comm=true"]
                            if stage != "ddp" else ["optimizer=adamw", "optimizer.weight_decay=0.1",
                                                    "scheduler=constant", "train.steps=10", "train.grad_accum=2"])
    torch.manual_seed(0)
    engine = framework.initialize(Odd(), lambda m, mb: nn.functional.mse_loss(m(mb[0]), mb[1]), cfg, dist)
    g = torch.Generator().manual_seed(5)
    state, losses = engine.state, []
    for _ in range(10):
        x = torch.randn(2, dist.world, 4, 7, generator=g)  # [accum, world, micro, features]
        micro = tuple((x[k, dist.rank], x[k, dist.rank, :, :3].sin()) for k in range(2))
        state, m = engine.train_step(state, Batch(micro))
        losses.append(m["loss"])
    module = engine.components.module
    return losses, flat_params(module), module.unused.weight.detach().clone()


def _odd_all(dist):
    return {s: _odd(dist, s) for s in ("ddp", "zero1", "zero2")}


@pytest.mark.parametrize("world", [1, 2])
def test_odd_shapes_and_unused_parameters(pools, world):
    out = [_odd_all(_local())] if world == 1 else pools(2).run(_odd_all, timeout=120)
    torch.manual_seed(0)
    initial_unused = Odd().unused.weight.detach()
    for res in out:
        for stage in ("zero1", "zero2"):
            assert res[stage][0] == pytest.approx(res["ddp"][0], rel=FP32_RTOL)
            torch.testing.assert_close(res[stage][1], res["ddp"][1], rtol=FP32_RTOL, atol=1e-7)
            # Without a gradient only weight decay moves it, exactly as under ddp.
            assert not torch.equal(res[stage][2], initial_unused)


class _WithBuffers(WithFrozen):
    """Buffers each rank initialises its own way: a random projection registered under two names (one
    tensor), an integer one (as BatchNorm's step count), a non-persistent one and an expanded view (its
    elements share memory: it cannot be written in place)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("proj", torch.randn(7, 7))
        self.a.register_buffer("proj", self.proj)
        self.register_buffer("count", torch.randint(0, 1000, (3,)))
        self.register_buffer("shift", torch.randn(7), persistent=False)
        self.register_buffer("bias", torch.randn(7).expand(4, 7), persistent=False)

    def forward(self, x):
        h = torch.tanh(self.a(x)) @ self.a.proj + self.shift + self.bias + self.count.sum() * 1e-4
        return self.b(torch.tanh(self.f(h)))


def _rank_seeded(dist, stage, seed):
    """A model built from ``seed`` (a frozen middle layer, buffers) trained 2 steps on the same batch on
    every rank: the losses, what the stage made of it and the rank's buffers."""
    from tests.unit.test_step import mse
    torch.manual_seed(seed)
    model = _WithBuffers()
    cfg = framework.compose(([f"+stage={stage}"] if stage != "ddp" else []) + ["train.steps=2"])
    with framework.initialize(model, mse, cfg, dist) as engine:
        x = torch.randn(4, 5, generator=torch.Generator().manual_seed(3))
        state, losses = engine.state, []
        for _ in range(2):
            state, m = engine.train_step(state, Batch(((x, x[:, :1]),)))
            losses.append(m["loss"])
        buffers = {n: b.detach().clone() for n, b in model.named_buffers(remove_duplicate=False)}
        return (losses, model.f.weight.detach().clone(), engine.consolidated_state_dict(), buffers,
                model.a.proj is model.proj)


def _frozen(dist):
    """Each rank builds the model from its own seed: what each stage made of it."""
    return {stage: _rank_seeded(dist, stage, 10 + dist.rank) for stage in ("ddp", "zero1", "zero2", "zero3")}


def test_frozen_parameters_and_buffers_take_rank_0s_values(pools):
    # As torch DDP and DeepSpeed: every parameter, frozen ones too, and every buffer start from rank 0's values.
    out = pools(2).run(_frozen, timeout=120)
    ref_losses, ref_frozen, ref_state, ref_buffers, _ = _rank_seeded(_local(), "ddp", 10)   # one rank, rank 0's model
    assert ref_buffers.keys() == {"proj", "a.proj", "count", "shift", "bias"}
    for stage in ("ddp", "zero1", "zero2", "zero3"):
        for res in out:
            losses, frozen, _, buffers, tied = res[stage]
            assert torch.equal(frozen, ref_frozen), stage
            assert buffers.keys() == ref_buffers.keys() and tied, stage
            for n in buffers:
                assert torch.equal(buffers[n], ref_buffers[n]), f"{stage}: buffer {n!r} is not rank 0's"
            assert losses == pytest.approx(ref_losses, rel=FP32_RTOL), stage
        state = out[0][stage][2]
        assert state.keys() == ref_state.keys(), stage
        # parameters and persistent buffers, under state_dict's names: a fresh module takes it strictly
        fresh = _WithBuffers()
        assert state.keys() == fresh.state_dict().keys(), stage
        fresh.load_state_dict(state)
        for n in state:
            torch.testing.assert_close(state[n], ref_state[n], rtol=FP32_RTOL, atol=1e-7, msg=f"{stage}: {n}")


# --- memory ledger against the ZeRO paper's model-state counts------------------------------------------------

def _ledger(dist, stage, bucket):
    cfg = tiny_config(*ODD, f"+stage={stage}", "precision=bf16", f"stage.reduce_bucket_size={bucket}",
                      "stage.overlap_comm=true")
    module, _ = build_gpt(cfg)
    n_params = sum(p.numel() for p in module.parameters())
    engine = framework.initialize(module, gpt_loss, cfg, dist)
    padded = sum(layout.padded for layout in engine.components.stage.layouts)
    return n_params, padded, engine.memory(engine.state)


@pytest.mark.parametrize("world", [2, 4])
def test_memory_ledger_matches_zero_formula(pools, world):
    bucket = 3000
    for stage in ("zero1", "zero2"):
        n_params, padded, mem = pools(world).run(_ledger, stage, bucket, timeout=120)[0]
        mem = {k: d + h for k, (d, h) in mem.items.items()}
        from framework.stages._flat import ALIGN
        assert padded - n_params < 2 * world * ALIGN  # padding: under one unit per group (2 groups)
        # Mixed precision (bf16 params, fp32 master + Adam m and v): K = 12 bytes, K*Psi/N per rank.
        assert mem["master_params"] == 4 * padded // world
        assert mem["optimizer_state"] == 8 * padded // world
        assert mem["params"] == 2 * padded                      # 16-bit working copy, replicated
        if stage == "zero1":
            # zero1 keeps whole 16-bit gradients (plus an fp32 sum once a step accumulates micro
            # batches, precision.grad_accum_dtype; none has run here)
            assert mem["grads"] == 2 * padded
        else:
            assert mem["grads"] == 4 * padded // world          # zero2: the owned partition, summed in fp32
            assert 0 < mem["bucket_buffers"] <= 2 * bucket * 2    # plus at most two bf16 buckets


def _round_robin(dist):
    """zero2 with offload=cpu, small buckets, round_robin_gradients off and on (fp32)."""
    # 3 steps: a gradient or master mapped to another parameter's place shows from the first
    common = ["offload=cpu", "stage.reduce_bucket_size=700", "stage.overlap_comm=true", "train.steps=3",
              "train.grad_accum=2"]
    out = {}
    for rr in ("false", "true"):
        losses, params, _, _, _ = _train(dist, "zero2", [*common, f"stage.round_robin_gradients={rr}"])
        out[rr] = (losses, params)
    return out


def test_round_robin_gradients_spreads_bucket_owners_and_changes_no_result(pools):
    """DeepSpeed's round_robin_gradients: parameters laid out round-robin over the partitions, so the
    buckets of backward (each reduced to, added and copied to the host by its owner) alternate
    between ranks instead of one rank's partition after another; the results are those of the
    plain layout (fp32, 1e-6 relative: only the grouping of the gradient norm's sums differs)."""
    from framework.stages._flat import make_layout
    from framework.stages.sharded import Zero2Stage, ZeroConfig, round_robin

    named = [(f"p{i}", torch.empty(100 + i)) for i in range(12)]
    for world in (2, 4):
        owners = {}
        for rr, placed in ((False, named), (True, round_robin(named, world))):
            layout = make_layout(placed, world)
            slots = {s.name: s for s in layout.slots}
            cfg = ZeroConfig(reduce_bucket_size=128 * world, round_robin_gradients=rr)
            buckets = Zero2Stage.plan(cfg, [(0, slots[n]) for n, _ in named], {0: layout.shard}, world)
            assert sum(b.numel for b in buckets) == layout.numel   # every gradient element, once
            owners[rr] = [b.start // layout.shard for b in buckets]
        plain, rr = owners[False], owners[True]

        def changes(seq):
            return sum(a != b for a, b in zip(seq, seq[1:]))
        # Plain: the last partition's owner alone, then the next... (world - 1 hand-overs in all);
        # round-robin: the owner changes from one parameter's bucket to the next.
        assert plain == sorted(plain, reverse=True) and changes(plain) == world - 1, plain
        assert changes(rr) >= len(named) // 2 > world - 1, rr
    runs = pools(2).run(_round_robin)
    for rank_out in runs:
        (l0, p0), (l1, p1) = rank_out["false"], rank_out["true"]
        torch.testing.assert_close(torch.tensor(l1), torch.tensor(l0), rtol=FP32_RTOL, atol=0)
        torch.testing.assert_close(p1, p0, rtol=FP32_RTOL, atol=1e-7)


def _overflow_names(dist):
    out = {}
    for stage in ("zero1", "zero2"):
        cfg = tiny_config(*ODD, f"+stage={stage}")
        with framework.initialize(build_gpt(cfg)[0], gpt_loss, cfg, dist) as engine:
            specs = engine.components.stage.piece_specs()
            grads = [torch.zeros(s.numel) for s in specs]
            marked = []
            for g, spec in zip(grads, specs):   # the last parameter of each piece this rank holds
                if spec.spans:
                    g[spec.spans[-1].piece[1] - 1] = float("nan")
                    marked.append(spec.spans[-1].name)
            out[stage] = (marked, engine.components.stage.nonfinite_names(grads))
    return out


def test_the_overflow_error_names_each_ranks_parameters_exactly(pools):
    """Rank 1's partitions start inside the flat buffers: the names its non-finite gradients map to
    count that offset, and every rank reports the union of all ranks' parameters, no more."""
    out = pools(2).run(_overflow_names, timeout=120)
    for stage in ("zero1", "zero2"):
        every = sorted({n for rank in out for n in rank[stage][0]})
        assert all(rank[stage][1] == every for rank in out), (stage, out)
        assert set(out[1][stage][0]) - set(out[0][stage][0]), (stage, out)   # rank 1 adds names of its own


# --- eval_step with uneven shares ------------------------------------------------------------------------------

def _eval_uneven(dist):
    """Rank r evaluates batches whose loss is (r + 1)^2, 1 + 3r of them, then none on rank 0."""
    model = nn.Linear(8, 8, bias=False)
    nn.init.zeros_(model.weight)
    loss_fn = lambda m, mb: torch.nn.functional.mse_loss(m(mb[0]), mb[1])   # noqa: E731
    batch = (torch.zeros(4, 8), torch.full((4, 8), float(dist.rank + 1)))
    with framework.initialize(model, loss_fn, framework.compose(["+stage=zero2", "scheduler=constant"]), dist) as e:
        out = (e.eval_step(e.state, [batch] * (1 + 3 * dist.rank)),
               e.eval_step(e.state, [batch] * (0 if dist.rank == 0 else 2)))
    # under zero3 each forward gathers with every rank: uneven counts are one line on every rank, not a hang
    cfg = framework.compose(["+stage=zero3", "stage.stage3_param_persistence_threshold=0", "scheduler=constant"])
    with framework.initialize(nn.Linear(8, 8, bias=False), loss_fn, cfg, dist) as e:
        try:
            e.eval_step(e.state, [batch] * (1 + dist.rank))
        except framework.FrameworkError as refused:
            return (*out, str(refused))
    return out


def test_eval_step_mean_is_over_every_ranks_batches(pools):
    # The mean over all batches, the same on every rank, whatever each rank's share (none too).
    out = pools(2).run(_eval_uneven, timeout=120)
    assert out[0] == out[1]
    assert out[0][:2] == (pytest.approx((1 * 1 + 4 * 4) / 5, rel=1e-6), pytest.approx(4.0, rel=1e-6))
    assert out[0][2] == out[1][2] == ("eval_step: the ranks passed different numbers of batches (from 1 to 2); under "
                                      "zero3 every forward gathers with every rank: give each rank the same number")


# --- weights edited in place after initialize --------------------------------------------------------------------

def _edited_in_place(dist, folder):
    """module.load_state_dict after initialize: the next publish would overwrite it from the masters (16-bit
    working weights, offloaded masters) or keep it (fp32 masters that are the weights): refused alike."""
    out = {}
    for stage, offload, precision in [("ddp", "none", "fp32"), ("zero1", "cpu", "fp32"), ("zero2", "none", "bf16"),
                                      ("zero3", "none", "bf16")]:   # (zero3: this model's parameters stay whole)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        loss_fn = lambda m, mb: nn.functional.mse_loss(m(mb[0].to(dtype)).float(), mb[1])   # noqa: E731
        cfg = framework.compose([f"+stage={stage}", f"offload={offload}", f"precision={precision}", "logger=none",
                                 "scheduler=constant", "optimizer.lr=1e-6"])
        micro = (torch.randn(4, 8), torch.randn(4, 4))
        halves = {k: torch.full(v.shape, 0.5) for k, v in nn.Sequential(nn.Linear(8, 16), nn.Tanh(),
                                                                          nn.Linear(16, 4)).state_dict().items()}
        with framework.initialize(model, loss_fn, cfg, dist) as engine:
            with framework.gathered(list(model.parameters())):
                before = [p.detach().clone() for p in model.parameters()]
            model.load_state_dict(halves)
            refused = []
            for call in (lambda: engine.train_step(engine.state, Batch((micro,))),
                         lambda: engine.eval_step(engine.state, [micro]), lambda: engine.state_dict(engine.state)):
                try:
                    call()
                except framework.TrainingError as e:
                    refused.append(str(e))
            try:   # the way out without a save: the masters' values back (refused where the edit is in them)
                engine.discard_edits(engine.state)
                with framework.gathered(list(model.parameters())):
                    discarded = all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
                engine.state_dict(engine.state)
            except framework.TrainingError as e:
                discarded = str(e)
            torch.save(halves, path := f"{folder}/halves{dist.rank}.pt")
            framework.load_weights(engine, path)   # the way in: the masters take them too
            engine.train_step(engine.state, Batch((micro,)))
            with framework.gathered(list(model.parameters())):
                off = max((p.float() - 0.5).abs().max().item() for p in model.parameters())
            try:   # no rank 2 at world size 2: every stage refuses on entry (ddp, zero1, zero2: any modifier_rank)
                with framework.gathered(list(model.parameters()), modifier_rank=dist.world):
                    refused.append("entered")
            except framework.FrameworkError as e:
                refused.append(str(e))
        out[stage] = refused, engine.state.step, off, discarded
    return out


def test_weights_changed_in_place_after_initialize_are_refused_in_every_composition(pools, tmp_path):
    for stage, (refused, step, off, discarded) in pools(2).run(_edited_in_place, str(tmp_path), timeout=180)[0].items():
        # discard_edits publishes the masters again, except where fp32 weights are the masters (ddp without offload)
        assert discarded is True if stage != "ddp" else discarded.startswith(
            "discard_edits: the edit of 4 parameters (0.weight, 0.bias, 2.weight and 1 more) cannot be discarded"), \
            (stage, discarded)
        # (discard_edits offered only where it works; where the edit is in the masters, the refusal says so)
        assert refused[0].endswith("call engine.discard_edits(engine.state)" if stage != "ddp" else
                                   "to drop it, load weights saved before it"), refused[0]
        assert ("they are the engine's master copies" in refused[0]) == (stage == "ddp"), refused[0]
        assert len(refused) == 4, (stage, refused)
        assert refused[3].startswith("framework.gathered(modifier_rank=2): the ranks are 0..1" if stage == "zero3" else
                                     "framework.gathered(modifier_rank=...) was given no ZeRO-3 sharded parameter"), \
            (stage, refused[3])
        assert refused[0].startswith("train_step: the weights of 4 trainable parameters (0.weight, 0.bias, 2.weight "
                                     "and 1 more) were changed in place (or replaced) after framework.initialize (e.g. "
                                     "module.load_state_dict)"), refused[0]
        assert "framework.load_weights(engine, path)" in refused[0]
        assert refused[1].startswith("eval_step: ") and refused[2].startswith("state_dict, save_weights or checkpoint")
        assert step == 1 and off < 1e-3, (stage, step, off)   # one step at lr 1e-6 after load_weights
