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
