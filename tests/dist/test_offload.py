"""offload=cpu equals the same stage without offload (1e-6 per step) on 1 and 2 ranks (some cases on 4), with the
host step run by the C++ kernels and (1 and 2 ranks) by the pure-PyTorch fallback (FRAMEWORK_OPS=0); each offload
run is compared with a plain run that uses the same kernels. The C++ kernel and torch's fused
AdamW round differently in the last bit, and under bf16 one such bit can flip a working weight's
rounding, so a run is never compared against the other kernel's."""

import pytest
import torch

import framework
from framework.models.gpt import gpt_loss
from tests._helpers import OverflowAt, build_gpt, env_set, tiny_config

ODD = ["model.d_model=33", "model.n_head=3", "train.steps=6", "train.micro_batch=2", "train.grad_accum=2",
       "train.grad_clip=0.05"]
RTOL = 1e-6


def _full(engine):
    module = engine.components.module
    with framework.gathered(list(module.parameters())):
        return torch.cat([p.detach().reshape(-1).float() for p in module.parameters()])


def _train(dist, overrides):
    cfg = tiny_config(*ODD, *overrides)
    module, data = build_gpt(cfg)
    engine = framework.initialize(module, gpt_loss, cfg, dist)
    state, losses = engine.state, []
    for _ in range(cfg.train.steps):
        batch = data.train_batch(state.data, micro_batch=2, grad_accum=2, rank=dist.rank, world=dist.world)
        state, m = engine.train_step(state, batch)
        losses.append(m["loss"])
    devices = {t.device.type for t in state.params}
    return losses, _full(engine), engine.memory(state), devices


def _without_kernels(fn, *args):
    with env_set(FRAMEWORK_OPS="0"):
        return fn(*args)


def _pair(dist, stage, offloads, extra, fallback=True):
    """{path: (no offload, [offload=cpu with each of ``offloads``])} with the C++ kernels, and with the
    fallback if ``fallback``."""
    from framework import ops
    assert ops.available(), ops.status()  # the first runs below must exercise the kernels
    base = [f"+stage={stage}", *extra]
    if stage == "zero3":
        base.append("stage.stage3_param_persistence_threshold=0")
    offs = [[*base, "offload=cpu", *offload] for offload in offloads]

    def runs(train):
        return train(dist, base), [train(dist, off) for off in offs]
    out = {"C++ kernel": runs(_train)}
    if fallback:
        out["fallback"] = _without_kernels(runs, _train)
    return out


CASES = [  # (stage, offload=cpu variants compared with the one run without offload, extra overrides)
    ("zero1", [[]], []),
    ("zero2", [["offload.ratio=0.5"]], ["stage.overlap_comm=true", "stage.reduce_bucket_size=1500"]),
    ("zero3", [[], ["offload.params=cpu"]], []),   # optimizer state on the host, and parameter shards too
    ("zero2", [[]], ["precision=bf16"]),   # bf16 working params, fp32 master on the host
]


def _local():
    from framework.comm.distributed import connect
    return connect("gloo")


# Also on 4 ranks, where gloo reduces to each owner (2 ranks all-reduce): the bucketed zero2 and the
# host-sharded zero3 cases, with the C++ kernels only: which kernel steps the host pieces is arithmetic per
# element of this rank's pieces, whatever the world (2 ranks run the fallback on pieces cut at a partition
# boundary too).
RUNS = [(world, *case) for case in CASES for world in (1, 2)] + [(4, *CASES[1]), (4, "zero3", [["offload.params=cpu"]], [])]


def _id(world, stage, offloads, extra):
    return " ".join([stage, " + ".join(" ".join(["offload=cpu", *o]) for o in offloads), *extra, f"world={world}"])


@pytest.mark.parametrize("world,stage,offloads,extra", RUNS, ids=[_id(*run) for run in RUNS])
def test_offload_equals_no_offload(pools, world, stage, offloads, extra):
    from framework import ops
    if ops.unavailable_reason() == ops.OFF:   # (the first runs must exercise the kernels)
        pytest.skip("FRAMEWORK_OPS=0: the kernels are off; the fallback's equality runs in the suite with them on")
    fallback = world < 4
    results = [_pair(_local(), stage, offloads, extra)] if world == 1 else \
        pools(world).run(_pair, stage, offloads, extra, fallback, timeout=240)
    for rank, paths in enumerate(results):
        assert list(paths) == ["C++ kernel", "fallback"][:1 + fallback]
        for path, (ref, runs) in paths.items():
            for offload, run in zip(offloads, runs, strict=True):
                for i, (a, b) in enumerate(zip(run[0], ref[0])):
                    assert a == pytest.approx(b, rel=RTOL), \
                        f"{stage} {offload} rank {rank} step {i} ({path}): offload {a} vs {b} (rel 1e-6)"
                torch.testing.assert_close(run[1], ref[1], rtol=RTOL, atol=1e-7, msg=lambda m: f"{path} {offload}: {m}")
        plain, offs = paths["C++ kernel"]
        for offload, off in zip(offloads, offs):
            mem = off[2]   # Footprint: item -> (device, host) bytes
            host_master = mem.items["master_params"][1]
            assert host_master > 0 and plain[2].items.get("master_params", (0, 0))[1] == 0
            share = 0.5 if offload == ["offload.ratio=0.5"] else 1.0  # ratio 0.5: half stays on the device
            if stage != "zero3":  # zero1/2: params are the replicated working copy, 1/world of it owned
                elements = mem.items["params"][0] / (2 if "precision=bf16" in extra else 4)
                assert host_master == pytest.approx(share * 4 * elements / world, rel=0.01)


def test_parameter_offload_needs_zero3():
    with pytest.raises(framework.ConfigError, match="offload.params=cpu .* needs \\+stage=zero3"):
        framework.compose(["+stage=zero2", "offload=cpu", "offload.params=cpu"])
    with pytest.raises(framework.ConfigError, match="offload=cpu is not supported with stage=ddp"):
        framework.compose(["offload=cpu"])


@pytest.mark.parametrize("offload", [["offload=cpu", "offload.overlap_step=true"], ["offload=nvme"]])
def test_a_ratio_too_small_to_offload_anything_is_refused(offload, tmp_path):
    """offload.ratio>0 that rounds to no host element in every partition would train as offload=none
    (and drop overlap_step) without a word: refused, naming the smallest ratio that offloads."""
    cfg = tiny_config(*ODD, "+stage=zero2", *offload, "offload.ratio=1e-9",
                      *([f"offload.nvme_path={tmp_path}"] if "offload=nvme" in offload else []))
    module, _ = build_gpt(cfg)
    with pytest.raises(framework.ConfigError, match=r"offload.ratio=1e-09 moves no element of any partition off "
                       r"the device .*; set offload.ratio>=\S+ \(1/\d+\), or offload=none to step on the device$") as e:
        framework.initialize(module, gpt_loss, cfg, _local())
    assert "\n" not in str(e.value)


def test_an_engine_dropped_unclosed_ends_its_host_step_thread():
    """The host-step worker goes with the engine, closed or not (the stage's gradient hooks keep the
    offload placement alive through autograd, beyond gc's reach: it must not keep the pipeline)."""
    import gc
    import threading

    def workers():
        return [t for t in threading.enumerate() if t.name.startswith("host-step")]

    before = set(workers())
    cfg = tiny_config(*ODD, "+stage=zero2", "offload=cpu")
    module, data = build_gpt(cfg)
    engine = framework.initialize(module, gpt_loss, cfg, _local())
    state = engine.state
    batch = data.train_batch(state.data, micro_batch=2, grad_accum=2, rank=0, world=1)
    state, _ = engine.train_step(state, batch)
    started = [t for t in workers() if t not in before]
    assert started
    del engine, state, batch, module, data
    gc.collect()
    for t in started:
        t.join(timeout=5)
    assert not any(t.is_alive() for t in started), "an unclosed engine's host-step thread outlived it"


def _train_overlap(dist, overrides, inf_at=None):
    """offload=cpu training; returns (losses, full params, skipped flags, pieces kept, rolled back)."""
    cfg = tiny_config(*ODD, "offload=cpu", *overrides)
    module, data = build_gpt(cfg)
    loss_fn = OverflowAt(dist.rank, inf_at)

    engine = framework.initialize(module, loss_fn, cfg, dist)
    state, losses, skipped = engine.state, [], []
    for step in range(cfg.train.steps):
        loss_fn.step = step
        batch = data.train_batch(state.data, micro_batch=2, grad_accum=2, rank=dist.rank, world=dist.world)
        state, m = engine.train_step(state, batch)
        losses.append(m["loss"])
        skipped.append(m["skipped"])
    update = engine.components.update
    if "precision=bf16" in overrides:  # host pieces send back bf16 written by the optimizer step
        assert all(t.dtype == torch.bfloat16 for t in engine.components.stage.out16())
    return (losses, _full(engine), skipped, update.kept, update.rolled_back, engine.memory(state),
            update.early_copies)


def _overlap_pair(dist, overrides, inf_at):
    return (_train_overlap(dist, overrides, inf_at),
            _train_overlap(dist, [*overrides, "offload.overlap_step=true"], inf_at))


BUCKETS = ["stage.reduce_bucket_size=1500"]
OVERLAP_CASES = {  # name: (overrides, step whose loss is made infinite, expect kept, expect rolled back)
    "zero2 never clipped": (["+stage=zero2", *BUCKETS, "train.grad_clip=0"], None, True, False),
    "zero2 clipped": (["+stage=zero2", *BUCKETS, "stage.overlap_comm=true"], None, False, True),
    "zero2 fp16 skip": (["+stage=zero2", *BUCKETS, "precision=fp16", "train.grad_clip=0"], 4, True, True),
    "zero2 late buckets kept": (["+stage=zero2", *BUCKETS, "stage.overlap_comm=true", "train.grad_clip=0"],
                                None, True, False),
    "zero2 no bucket buffer": (["+stage=zero2", *BUCKETS, "stage.contiguous_gradients=false", "train.grad_clip=0"],
                               None, True, False),
    "zero2 all-reduce fallback": (["+stage=zero2", *BUCKETS, "stage.reduce_scatter=false", "train.grad_clip=0"],
                                  None, True, False),
    "zero2 bf16 staged": (["+stage=zero2", *BUCKETS, "precision=bf16", "train.grad_clip=0"], None, True, False),
    "zero2 ratio 0.5": (["+stage=zero2", *BUCKETS, "train.grad_clip=0", "offload.ratio=0.5"], None, True, False),
    # (zero1 reduces whole gradients at the end of backward: offload.overlap_step is refused there)
    # zero3 reports each unit group's partition final after its reduction on the last micro batch
    "zero3 params clipped": (["+stage=zero3", "offload.params=cpu",
                              "stage.stage3_param_persistence_threshold=0"], None, False, True),
    "zero3 never clipped": (["+stage=zero3", "train.grad_clip=0", "stage.stage3_param_persistence_threshold=0"],
                            None, True, False),
    "zero3 fp16 skip overlap_comm": (["+stage=zero3", "precision=fp16", "train.grad_clip=0", "stage.overlap_comm=true"],
                                     4, True, True),
}


# On one rank every collective is Local's no-op: reduce_scatter=false changes nothing there ("zero2 never
# clipped" is that run), so the all-reduce fallback runs on 2 ranks only.
OVERLAP_RUNS = [(case, world) for case in OVERLAP_CASES for world in (1, 2)
                if not (world == 1 and case == "zero2 all-reduce fallback")]


@pytest.mark.parametrize("case,world", OVERLAP_RUNS, ids=[f"{case}-{world}" for case, world in OVERLAP_RUNS])
def test_overlapped_host_step_is_identical(pools, world, case):
    """offload.overlap_step=true gives bit-identical results: speculative pieces are kept when the
    step is neither clipped nor skipped, rolled back otherwise; the rest is pipelined."""
    overrides, inf_at, expect_kept, expect_rolled = OVERLAP_CASES[case]
    results = [_overlap_pair(_local(), overrides, inf_at)] if world == 1 else \
        pools(world).run(_overlap_pair, overrides, inf_at, timeout=240)
    for rank, (plain, overlap) in enumerate(results):
        assert overlap[0] == plain[0], f"{case} rank {rank}: losses differ"
        assert torch.equal(overlap[1], plain[1]), f"{case} rank {rank}: parameters differ"
        assert overlap[2] == plain[2]
        if inf_at is not None:
            assert overlap[2][inf_at], "the injected overflow was not skipped"
        kept, rolled = overlap[3], overlap[4]
        if expect_kept is not None:
            assert (kept > 0) == expect_kept, (case, kept)
            assert (rolled > 0) == expect_rolled, (case, rolled)
        assert (overlap[5].items["overlap_undo"][1] > 0) == bool(kept or rolled)
        assert plain[5].items["overlap_undo"] == (0, 0) and plain[3] == plain[4] == 0  # no speculation
        assert plain[6] > 0   # gradients reached the host during backward (per bucket / unit)


def test_failed_overlapped_step_leaves_the_optimizer_untouched(monkeypatch):
    """An error after pieces were stepped speculatively (here: in the norm) rolls them back, so a
    caller that catches it and retries gets exactly the run without the failure."""
    from framework.core.utils import tensors_in

    overrides = ["+stage=zero2", *BUCKETS, "train.grad_clip=0", "offload=cpu", "offload.overlap_step=true"]
    cfg = tiny_config(*ODD, *overrides)
    runs = []
    for fail_at in (None, 2):
        module, data = build_gpt(cfg)
        engine = framework.initialize(module, gpt_loss, cfg, _local())
        stage, state, losses = engine.components.stage, engine.state, []
        for step in range(5):
            batch = data.train_batch(state.data, micro_batch=2, grad_accum=2, rank=0, world=1)
            if step == fail_at:
                before = [t.clone() for t in tensors_in((state.params, state.opt_state))]
                with monkeypatch.context() as m:
                    m.setattr(stage, "grad_sq_norm", lambda: (_ for _ in ()).throw(RuntimeError("boom")))
                    with pytest.raises(RuntimeError, match="boom"):
                        engine.train_step(state, batch)
                after = list(tensors_in((state.params, state.opt_state)))
                assert all(torch.equal(a, b) for a, b in zip(before, after)), "a failed step changed the optimizer"
                assert engine.components.update.rolled_back > 0  # pieces had been stepped, then undone
            state, metrics = engine.train_step(state, batch)
            losses.append(metrics["loss"])
        runs.append((losses, _full(engine)))
    assert runs[0][0] == runs[1][0] and torch.equal(runs[0][1], runs[1][1])


def test_offload_with_an_optimizer_without_kernels_loads_none(monkeypatch, tmp_path, capsys):
    """SGD has no C++ kernel: offloading it neither builds nor imports the kernels, nor warns about them."""
    from framework.ops import _loader

    monkeypatch.setenv("FRAMEWORK_OPS_BUILD", "0")
    monkeypatch.setenv("FRAMEWORK_OPS_CACHE", str(tmp_path))   # empty: a load would warn
    monkeypatch.delenv("FRAMEWORK_OPS", raising=False)
    _loader.status.cache_clear()
    try:
        cfg = tiny_config(*ODD, "optimizer=sgd", "+stage=zero2", *BUCKETS, "offload=cpu")
        module, data = build_gpt(cfg)
        engine = framework.initialize(module, gpt_loss, cfg, _local())
        state = engine.state
        batch = data.train_batch(state.data, micro_batch=2, grad_accum=2, rank=0, world=1)
        engine.train_step(state, batch)
        assert "framework.ops" not in capsys.readouterr().err
        assert _loader.status.cache_info().currsize == 0
    finally:
        _loader.status.cache_clear()
