"""ddp over gloo on 2 and 4 ranks equals one process with the same global batch: every rank's
parameters bitwise equal, losses to 1e-6 and gradient norms to 1e-5 relative per step (the sums
run in another order), parameters to 1e-5 relative / 2e-6 absolute."""
import pytest
import torch

from tests._helpers import flat_params, run_engine, tiny_config

RTOL = 1e-6
NORM_RTOL = 1e-5   # (measured: up to 1.1e-6 in the SGD case at world 4)
GLOBAL_BATCH = 8


def _train(dist, overrides):
    cfg = tiny_config(*overrides, f"train.micro_batch={GLOBAL_BATCH // dist.world}")
    metrics = []
    losses, engine, _ = run_engine(cfg, dist, metrics=metrics)
    return losses, [m["grad_norm"] for m in metrics], flat_params(engine.components.module)


WARMUP = "scheduler.warmup_steps=2"   # (the lr peaks within the run)
CASES = [
    ["train.grad_clip=1.0", WARMUP],
    ["train.grad_accum=3", "train.grad_clip=0.05", "stage.reduce_bucket_size=500", WARMUP],   # many buckets, clipping active
    ["stage.overlap_comm=false", WARMUP],
    # Plain SGD at a constant lr, no clipping: a wrong gradient scale shows in the parameters (AdamW
    # and clipping cancel a constant factor).
    ["optimizer=sgd", "optimizer.lr=0.5", "scheduler=constant", "train.grad_clip=0", "train.grad_accum=2"],
]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("overrides", CASES)
def test_ddp_equals_single_process(pools, world, overrides):
    overrides = ["+stage=ddp", *overrides]
    cfg = tiny_config(*overrides, f"train.micro_batch={GLOBAL_BATCH}")
    metrics = []
    single, engine, _ = run_engine(cfg, metrics=metrics)
    results = pools(world).run(_train, overrides, timeout=180)
    # Replicas: every rank applies the same update to the same values.
    differ = [rank for rank, (_, _, params) in enumerate(results) if not torch.equal(params, results[0][2])]
    assert not differ, f"the parameters of ranks {differ} differ from rank 0's"
    for rank, (losses, norms, params) in enumerate(results):
        for i, (a, b) in enumerate(zip(losses, single, strict=True)):
            assert a == pytest.approx(b, rel=RTOL), f"rank {rank} step {i}: {a} vs {b} (rel {RTOL})"
        for i, (a, m) in enumerate(zip(norms, metrics, strict=True)):
            assert a == pytest.approx(m["grad_norm"], rel=NORM_RTOL), \
                f"rank {rank} step {i} grad norm: {a} vs {m['grad_norm']} (rel {NORM_RTOL})"
        torch.testing.assert_close(params, flat_params(engine.components.module), rtol=1e-5, atol=2e-6)


def _stall(dist):
    import datetime
    import time

    import torch.distributed as td

    from framework.comm.distributed import Dist, DistributedError

    from framework.persist.checkpoint._group import Group

    # A group of its own with a 3 s timeout (collective: both ranks create it first). The barrier lines the ranks
    # up first: on a loaded machine one may get the task seconds after the other, and the 3 s are for the stall.
    td.barrier()
    group = td.new_group(backend="gloo", timeout=datetime.timedelta(seconds=3))
    short = Dist(dist.rank, dist.world, dist.local_rank, dist.device, dist.backend, 3.0, dist.peers)
    # made within dist.timeout_s (here a generous one: not the stall), then waits checkpoint.timeout_s
    made = Group(Dist(dist.rank, dist.world, dist.local_rank, dist.device, dist.backend, 60.0, dist.peers), 1800)
    waits = made.pg._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    # (not closed before the peer has its side of the group: closed under it, the peer's connect fails)
    td.barrier()
    made.close()
    if dist.rank == 1:
        time.sleep(10)  # a stalled peer
        return "slept"
    out = [waits]
    for what, fn in (("checkpoint group", lambda: Group(short, 1800)),
                     ("all-reduce", lambda: short._run("test all-reduce", td.all_reduce, torch.ones(1), group=group))):
        try:
            fn()
            out.append(f"no error: {what}")
        except DistributedError as e:
            out.append(str(e))
    return out


def test_stalled_rank_fails_peers_with_message(pools):
    """Rank 1 stalls: rank 0's all-reduce, and its making of the checkpoint's group (whose own timeout,
    checkpoint.timeout_s, is far longer), fail after dist.timeout_s with one line."""
    # Runs last in its pool: a timed-out gloo group cannot be reused, so the pool is closed after.
    pool = pools(2)
    out = pool.run(_stall, timeout=60)
    pool.close(kill=True)
    waits, made, reduced = out[0]
    assert waits == 1800
    assert "checkpoint group creation failed after waiting up to 3s" in made and "dist.timeout_s" in made, made
    assert "test all-reduce failed after waiting up to 3s" in reduced and "peer rank died or stalled" in reduced
