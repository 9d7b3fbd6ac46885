"""Leaving a gloo group frees it: no gloo worker thread outlives destroy_process_group.

A group that stays alive after disconnect() keeps worker threads that may release their last
work during interpreter shutdown and abort the process ("terminate called without an active
exception"). The case below is the path that once pinned the group: a model built on the meta
device after the group exists (torch then imports torch._dynamo and, with it, modules that bind
the default group at import time).
"""
import os
import tempfile

import pytest
import torch.multiprocessing as mp

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="thread names come from /proc")


def _gloo_threads() -> list[str]:
    names = (open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task"))
    return sorted(n for n in names if "gloo" in n)


def _rank(rank: int, store: str, out) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", GLOO_SOCKET_IFNAME="lo")
    import torch

    from framework.config import compose
    from framework.engine.build import component, initialize
    from framework.comm.distributed import connect, disconnect
    from framework.models.gpt import gpt_loss

    torch.set_num_threads(1)
    dist = connect("gloo", timeout_s=60, store_path=store)
    cfg = compose(["+stage=zero2", "model.n_layer=1", "model.d_model=32", "model.n_head=2", "model.context=16"])
    with torch.device("meta"):
        module = component(cfg, "model").build(cfg.model, vocab_size=64)
    engine = initialize(module, gpt_loss, cfg, dist)
    during = _gloo_threads()
    del engine, module
    disconnect()
    out.put((rank, during, _gloo_threads()))


def test_disconnect_frees_the_gloo_group():
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as d:
        procs = [ctx.Process(target=_rank, args=(r, os.path.join(d, "store"), out)) for r in range(2)]
        for p in procs:
            p.start()
        results = sorted(out.get(timeout=120) for _ in procs)
        for p in procs:
            p.join(timeout=60)
    assert [p.exitcode for p in procs] == [0, 0]
    for rank, during, after in results:
        assert any("runloop" in n for n in during), during  # the check can see the threads
        assert after == [], f"rank {rank}: gloo threads alive after disconnect: {after}"


class _Interrupt(__import__("torch").autograd.Function):
    """Ctrl-C landing during backward, as on the CPU, where the gradient hooks run on the main thread."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise KeyboardInterrupt


def _interrupted_at_different_points(dist, over):
    """Rank 0 is interrupted after its last layer's gradient bucket went out, rank 1 before any did."""
    import time

    import torch
    from torch import nn

    import framework
    from framework.engine.step import Batch

    cfg = framework.compose([*over, "train.micro_batch=4", "optimizer=sgd"])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 13), nn.ReLU(), nn.Linear(13, 3))

    def loss_fn(m, micro):
        x, y = micro
        h = m[1](m[0](x))
        h = _Interrupt.apply(h) if dist.rank == 0 else h
        out = m[2](h)
        out = _Interrupt.apply(out) if dist.rank == 1 else out
        return nn.functional.mse_loss(out, y)

    engine = framework.initialize(model, loss_fn, cfg, dist)
    start = time.monotonic()
    try:
        engine.train_step(engine.state, Batch(((torch.randn(4, 7), torch.randn(4, 3)),)))
    except KeyboardInterrupt as e:
        return time.monotonic() - start, getattr(e, "__notes__", None)
    return None


# (zero3 is not here: its backward itself gathers, so rank 0 waits for rank 1 in the pass, not in the reset)
@pytest.mark.parametrize("over", [["stage.reduce_bucket_size=3"],
                                  ["+stage=zero2", "stage.reduce_bucket_size=3", "stage.overlap_comm=true"]])
def test_an_interrupted_backward_does_not_wait_for_reductions_a_peer_never_joins(over):
    """Ctrl-C (or SIGTERM) reaches the ranks at different points of a backward pass: a rank that launched
    a reduction its peer never will leaves at once (the process is ending), instead of waiting out the
    collective timeout and then blaming a dead peer. Its own pool: the group is left inconsistent."""
    from tests._pool import RankPool

    pool = RankPool(2)
    try:
        results = pool.run(_interrupted_at_different_points, over, timeout=120)
    finally:
        pool.close(kill=True)
    for rank, r in enumerate(results):
        assert r is not None and r[0] < 15 and r[1] is None, (rank, r)


_EXITING = """
import atexit, torch, torch.distributed, framework
from framework import Batch
# atexit runs last in, first out: this one runs after any handler initialize registers
atexit.register(lambda: print("group at exit:", torch.distributed.is_initialized(), flush=True))
m = torch.nn.Linear(8, 8)
loss_fn = lambda m, mb: torch.nn.functional.mse_loss(m(mb[0]), mb[1])
with framework.initialize(m, loss_fn, framework.compose(["+stage=zero2", "scheduler=constant"])) as e:
    e.train_step(e.state, Batch(((torch.randn(4, 8), torch.randn(4, 8)),)))
"""


def test_a_group_initialize_made_is_left_at_exit():
    # As torchrun starts a user's script: initialize makes the group, and nothing else ever leaves it.
    import socket
    import subprocess
    import sys
    for attempt in range(2):
        # A free port now may be taken by another process before rank 0 listens on it: once, take another.
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = {**os.environ, "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
        procs = [subprocess.Popen([sys.executable, "-c", _EXITING], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
        try:
            outs = [procs[0].communicate(timeout=120)[0]]
            if attempt == 0 and procs[0].returncode != 0 and "address already in use" in outs[0].lower():
                continue   # rank 1 is killed below
            outs.append(procs[1].communicate(timeout=120)[0])
            break
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.communicate()
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out
        assert "group at exit: False" in out, out


def test_a_jobs_buffers_are_freed_before_the_next_job_of_the_process_starts(tmp_path):
    """A sweep runs its jobs in one process: the previous job's engine, which sits in reference cycles
    once closed, is gone (its device and pinned buffers with it) when the next job starts, whenever
    Python's own collection would have run."""
    import gc
    import weakref

    from framework.cli.loop import train
    from framework.comm.distributed import connect
    from framework.loggers import RunInfo
    from framework.stages.base import BaseStage
    from tests._helpers import tiny_config

    dist = connect("gloo")
    cfg = tiny_config("+stage=zero2", "offload=cpu", "train.steps=1", "train.eval_every=0")
    def stages():   # (an earlier test of this worker may keep its own alive: only the first job's count)
        return [o for o in gc.get_objects() if issubclass(type(o), BaseStage)]

    gc.collect()
    before = {id(o) for o in stages()}
    gc.disable()
    try:
        train(cfg, RunInfo(tmp_path / "a", None, None), dist)
        left = [weakref.ref(o) for o in stages() if id(o) not in before]
        assert left, "the first job's stage was freed without a collection: the one before each job may go"
        alive: list = []
        train(cfg, RunInfo(tmp_path / "b", None, None), dist,
              on_ready=lambda _: alive.extend(r for r in left if r() is not None))
    finally:
        gc.enable()
    assert not alive, "the first job's stage (and its buffers) outlived the start of the next job"


def _wandb_unreachable(dist, run_dir: str):
    """The CLI's loop with W&B online and no network (a stand-in wandb on rank 0, slow to fail): each rank's error."""
    import sys
    from dataclasses import replace
    from pathlib import Path

    from framework.cli.loop import train
    from framework.core.errors import FrameworkError
    from framework.loggers import RunInfo
    from framework.loggers.wandb import WandbConfig
    from tests._helpers import fake_wandb, tiny_config

    cfg = tiny_config("train.steps=1", "train.eval_every=0")
    cfg = replace(cfg, logger=WandbConfig(mode="online", live=False), choices={**cfg.choices, "logger": "wandb"})
    asked: dict = {}
    saved = sys.modules.get("wandb")
    sys.modules["wandb"] = fake_wandb(asked, wait_s=1.0)
    try:
        train(cfg, RunInfo(Path(run_dir), None, None), dist)
    except FrameworkError as e:
        return str(e), e.every_rank, getattr(asked.get("settings"), "init_timeout", None)
    finally:   # (the pool's ranks run later tests)
        if saved is None:
            sys.modules.pop("wandb", None)
        else:
            sys.modules["wandb"] = saved
    return None


def test_a_logger_rank_0_cannot_start_stops_every_rank_with_its_line(pools, tmp_path):
    """Rank 0's W&B failing to reach its server (after a while): the other ranks wait for its outcome rather than
    time out in the first step's collectives blaming a peer, and all end with W&B's line; W&B is given half the
    ranks' dist.timeout_s (the pool's 60 s), so its error comes before their wait ends."""
    (r0, every0, bound), (r1, every1, _) = pools(2).run(_wandb_unreachable, str(tmp_path / "run"), timeout=50)
    assert r0.startswith("logger=wandb: could not reach the W&B server within 30s (0.5 of dist.timeout_s"), r0
    assert r1 == f"the logger's start failed on another rank: rank 0: {r0}", r1
    assert every0 and every1 and 25.0 < bound <= 30.0, bound
