"""engine.state_dict() under one configuration, engine.load_state_dict() under another.

Each case trains K steps under configuration A (world size, stage, offload, ratio, buckets),
saves every rank's name-keyed state dict, loads it into a freshly initialised engine under
configuration B and trains N more steps. Checked:
* the full parameters and Adam moments assembled from B's state dicts after the load are
  bitwise equal (torch.equal) to A's, as are the module's working parameters (gathered);
* B's next losses equal A's uninterrupted ones: bitwise at the same world size (dropout on,
  so each rank's RNG must resume too), else to 1e-6 relative (fp32; see CONT_RTOL).
The global batch is the same under both (micro batch x world = 8 rows).
"""
import pytest
import torch

import framework
from framework.models.gpt import gpt_loss
from framework.persist.rng import derive
from tests._helpers import build_gpt, tiny_config

K, N = 3, 3
ROWS = 8
ODD = ["model.d_model=33", "model.n_head=3", "train.grad_clip=0.05"]
ZERO3_SHARDED = "stage.stage3_param_persistence_threshold=0"   # every unit sharded
# Different world sizes sum the loss and the gradients in a different order. Measured: fp32
# losses differ by at most 1 ulp (7.6e-8 relative), bf16 ones (gradients reduced in bf16) by
# 2.6e-6. A load that lost Adam's step count shows as 5e-4.
CONT_RTOL = {"fp32": 1e-6, "bf16": 5e-5}


def _engine(dist, overrides, seed=None):
    if not any(o.startswith("optimizer=") for o in overrides):
        overrides = ["optimizer=adamw", *overrides]
    cfg = tiny_config(*ODD, f"train.micro_batch={ROWS // dist.world}", *overrides)
    module, data = build_gpt(cfg, seed)
    return framework.initialize(module, gpt_loss, cfg, dist), data


def _steps(dist, engine, data, state, n):
    losses = []
    for _ in range(n):
        batch = data.train_batch(state.data, micro_batch=ROWS // dist.world, grad_accum=1, rank=dist.rank,
                                 world=dist.world)
        state, m = engine.train_step(state, batch)
        losses.append(m["loss"])
    return state, losses


def _working(engine):
    """The module's parameters as it computes with them (gathered under zero3)."""
    module = engine.components.module
    with framework.gathered(list(module.parameters())):
        return {n: p.detach().clone() for n, p in module.named_parameters()}


def _save(dist, overrides):
    """A: K steps, then every rank's state dict and working parameters, then N more losses."""
    engine, data = _engine(dist, overrides)
    state, _ = _steps(dist, engine, data, engine.state, K)
    saved, working = engine.state_dict(state), _working(engine)
    _, losses = _steps(dist, engine, data, state, N)
    return saved, working, losses, len(state.params)


def _load(dist, overrides, saved):
    """B: a differently initialised engine, loaded from A's state dicts, then N steps."""
    engine, data = _engine(dist, overrides, seed=1234)
    state = engine.load_state_dict(engine.state, saved)
    out = engine.state_dict(state), _working(engine), state.step, state.data
    _, losses = _steps(dist, engine, data, state, N)
    return (*out, losses, len(state.params))


def _local():
    from framework.comm.distributed import connect
    return connect("gloo")


def _on(pools, world, fn, *args):
    return [fn(_local(), *args)] if world == 1 else pools(world).run(fn, *args, timeout=240)


def assemble(saved: list[dict]) -> dict[str, torch.Tensor]:
    """Full tensors 'name' (master), 'name/0.mu', ... from every rank's fragments; each element
    must be given, and replicated copies must agree."""
    out, seen = {}, {}
    for sd in saved:
        for name, entry in sd["params"].items():
            numel = torch.Size(entry["shape"]).numel()
            for f in entry["fragments"]:
                lo, hi = f["range"]
                for key, t in [(name, f["master"]), *((f"{name}/{p}", v) for p, v in f["optim"].items())]:
                    full = out.setdefault(key, torch.full((numel,), float("nan")))
                    mask = seen.setdefault(key, torch.zeros(numel, dtype=torch.bool))
                    if mask[lo:hi].any():
                        assert torch.equal(full[lo:hi][mask[lo:hi]], t[mask[lo:hi]]), f"replicas of {key} differ"
                    full[lo:hi], mask[lo:hi] = t, True
    for key, mask in seen.items():
        assert mask.all(), f"{key}: {int((~mask).sum())} elements in no fragment"
    return out


# (world, overrides) of the saving run A -> of the loading run B
CASES = {
    "zero3-w4 -> zero1-w2-offload-ratio0.5": (
        (4, ["+stage=zero3", ZERO3_SHARDED]),
        (2, ["+stage=zero1", "offload=cpu", "offload.ratio=0.5"])),
    "zero2-w2-small-buckets -> ddp-w1": (
        (2, ["+stage=zero2", "stage.reduce_bucket_size=300", "stage.overlap_comm=true"]),
        (1, [])),
    # ddp ranks all save everything: the loader takes each element once.
    "ddp-w2 -> zero3-w4-offload-params": (
        (2, []),
        (4, ["+stage=zero3", "offload=cpu", "offload.params=cpu", "stage.stage3_param_persistence_threshold=200"])),
    "zero1-w4 -> zero2-w2-offload-small-buckets": (
        (4, ["+stage=zero1"]),
        (2, ["+stage=zero2", "offload=cpu", "stage.reduce_bucket_size=500"])),
    # Same world size: the continuation is bitwise, dropout included (each rank's RNG resumes).
    "zero2-w2 -> zero3-w2-offload-ratio0.5 (dropout)": (
        (2, ["+stage=zero2", "model.dropout=0.1"]),
        (2, ["+stage=zero3", ZERO3_SHARDED, "offload=cpu", "offload.ratio=0.5", "model.dropout=0.1"])),
    # bf16: the working copies are rounded masters; host pieces publish from staging buffers.
    "bf16 zero1-w1 -> zero2-w2-offload-small-buckets": (
        (1, ["+stage=zero1", "precision=bf16"]),
        (2, ["+stage=zero2", "precision=bf16", "offload=cpu", "stage.reduce_bucket_size=400"])),
}


@pytest.mark.parametrize("case", list(CASES))
def test_state_reloads_under_another_layout(pools, case):
    (wa, a), (wb, b) = CASES[case]
    saved_runs = _on(pools, wa, _save, a)
    saved = [r[0] for r in saved_runs]
    loaded = _on(pools, wb, _load, b, saved)
    src = assemble(saved)
    assert any(k.endswith("/0.mu") for k in src) and any(k.endswith("/0.nu") for k in src)
    for rank, (resaved, working, step, data, losses, n_pieces) in enumerate(loaded):
        assert (step, data) == (K, K)
        dst = assemble([r[0] for r in loaded])
        assert dst.keys() == src.keys()
        for key in src:
            assert torch.equal(dst[key], src[key]), f"{case}: {key} differs after the load"
        for name, value in saved_runs[0][1].items():
            assert torch.equal(working[name], value), f"{case} rank {rank}: working {name} differs after the load"
        ref = saved_runs[0][2]
        if wa != wb:   # no saved rank to match: each rank's generators derived as a checkpoint resume derives them
            want = derive(tiny_config().seed, K, rank, torch.device("cpu"))[0]
            assert all(torch.equal(a, b) for a, b in zip(resaved["rng"], want)), f"{case} rank {rank}: RNG not derived"
        if wa == wb:
            assert losses == ref, f"{case} rank {rank}: losses after the load {losses}, uninterrupted {ref}"
        rtol = CONT_RTOL["bf16" if "precision=bf16" in b else "fp32"]
        for i, (x, y) in enumerate(zip(losses, ref)):
            assert x == pytest.approx(y, rel=rtol), f"{case} rank {rank} step {K + i}: {x} vs {y}"


def _refused_loads(dist):
    """Loads every rank refuses alike, before writing anything, then the full list: each rank passing only its own
    state dict, a list whose gap only rank 1 needs (checked on rank 1 alone, agreed by all), and each rank a full
    list of another step (each valid alone)."""
    engine, data = _engine(dist, ["+stage=zero2"])
    state, _ = _steps(dist, engine, data, engine.state, 1)
    saved = dist.all_gather_object(engine.state_dict(state), what="saved states")
    gap = [{**sd, "params": dict(list(sd["params"].items())[1:])} if sd["rank"] == 1 else sd for sd in saved]
    mixed = [{**sd, "step": sd["step"] + dist.rank} for sd in saved]
    lines = []
    for wrong in ([saved[dist.rank]], gap, mixed):
        with pytest.raises(framework.FrameworkError) as e:
            engine.load_state_dict(state, wrong)
        lines.append(str(e.value))
    state = engine.load_state_dict(state, saved)
    state, _ = _steps(dist, engine, data, state, 1)
    engine.close()
    return lines, state.step


def test_a_load_not_of_every_rank_is_refused_on_every_rank(pools):
    results = pools(2).run(_refused_loads, timeout=60)
    assert [step for _, step in results] == [2, 2]   # the full list loaded after, and trained on
    (own0, gap0, mixed0), (own1, gap1, mixed1) = [lines for lines, _ in results]
    how = ("pass every rank's state dict (engine.state_dict on each rank), the same list on every rank (the dicts of "
           "all 2 ranks)")
    assert own0 == f"load_state_dict: got the state dicts of ranks [0] of a 2-rank run (1 rank missing (1)): {how}"
    assert own1 == f"load_state_dict: got the state dicts of ranks [1] of a 2-rank run (1 rank missing (0)): {how}"
    assert gap1.startswith("load_state_dict: parameter ") and "are in no saved fragment of the 2 saved ranks" in gap1
    assert gap0 == f"load_state_dict failed on another rank: rank 1: {gap1}"
    assert mixed0 == mixed1 == ("load_state_dict: rank 1 was given the 2 state dicts of step 2 (data position 1) of "
                                "a 2-rank run, rank 0 the 2 state dicts of step 1 (data position 1) of a 2-rank run: "
                                "pass the same list on every rank")


def test_load_into_another_model_fails_with_one_line():
    dist = _local()
    engine, data = _engine(dist, ["+stage=zero1"])
    saved = [engine.state_dict(engine.state)]
    other, _ = _engine(dist, ["+stage=zero2", "model.d_model=36"])
    before = [t.clone() for t in other.state.params]
    with pytest.raises(framework.FrameworkError,
                       match=r"^load_state_dict: parameter 'wte.weight' has shape \(24, 33\) in the saved state but "
                             r"\(24, 36\) in this model$"):
        other.load_state_dict(other.state, saved)
    assert all(torch.equal(a, b) for a, b in zip(before, other.state.params))


@pytest.mark.parametrize("opt", ["optimizer=lion", "optimizer=sgd optimizer.momentum=0.9 optimizer.lr=0.1",
                                 "optimizer=adagrad optimizer.lr=0.05"])
def test_every_optimizers_state_reloads(opt):
    """Per-element state found without per-optimizer code: world 1, zero2 with half of each
    partition offloaded in pieces of 700 elements -> zero3; bitwise state and bitwise continuation.
    Without clipping: the stages sum the gradient norm over different groupings, and Adagrad,
    unlike Adam and Lion, carries a 1-ulp change of the clipping factor into the loss (measured)."""
    dist = _local()
    a = [*opt.split(), "train.grad_clip=0", "+stage=zero2", "offload=cpu", "offload.ratio=0.5",
         "stage.reduce_bucket_size=700"]
    b = [*opt.split(), "train.grad_clip=0", "+stage=zero3", ZERO3_SHARDED]
    saved, working, ref, _ = _save(dist, a)
    resaved, working_b, step, _, losses, _ = _load(dist, b, [saved])
    src, dst = assemble([saved]), assemble([resaved])
    assert len(src) > len(working) and dst.keys() == src.keys()   # master + per-element optimizer state
    assert all(torch.equal(dst[k], src[k]) for k in src)
    assert all(torch.equal(working_b[n], v) for n, v in working.items())
    assert losses == ref


class _Norm(torch.nn.Module):
    """A BatchNorm (buffers that training changes) and a frozen layer."""

    def __init__(self):
        super().__init__()
        self.a, self.norm, self.f = torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1)
        self.f.requires_grad_(False)

    def forward(self, x):
        return self.f(self.norm(self.a(x)))


def test_state_dicts_hold_buffers_and_frozen_parameters():
    from framework.engine.step import Batch
    dist, cfg = _local(), framework.compose(["logger=none", "+stage=zero2"])
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(0)) * 3 + 1
    engines = []
    for seed, width in ((0, 8), (99, 8), (0, 9)):
        torch.manual_seed(seed)
        module = _Norm()
        if width != 8:
            module.norm.register_buffer("running_mean", torch.zeros(width))
        engines.append(framework.initialize(module, lambda m, b: m(b[0]).square().mean(), cfg, dist))
    a, b, wider = engines
    a.train_step(a.state, Batch(((x, None),)))
    saved = [a.state_dict(a.state)]
    b.load_state_dict(b.state, saved)
    ma, mb = a.components.module, b.components.module
    assert int(mb.norm.num_batches_tracked) == 1
    for k, t in ma.state_dict().items():
        assert torch.equal(t, mb.state_dict()[k]), k
    with pytest.raises(framework.FrameworkError, match=r"^load_state_dict: 'buffer.norm.running_mean' has shape "
                                                       r"\(8,\) in the saved state but \(9,\) in this model$"):
        wider.load_state_dict(wider.state, saved)
    for e in engines:
        e.close()
