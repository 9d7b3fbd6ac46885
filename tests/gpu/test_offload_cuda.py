"""CPU offload on a CUDA device (skipped without one): the copy stream, pinned buffers and events
of framework.comm.accelerator's CUDA implementation give the same training as no offload (fp32, 1e-6
per step), and the overlapped host step stays bit-identical."""
from dataclasses import replace

import pytest
import torch

import framework
from framework.models.gpt import gpt_loss
from framework.core.utils import to_device
from tests._helpers import build_gpt, tiny_config

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

ODD = ["model.d_model=33", "model.n_head=3", "train.steps=8", "train.micro_batch=2", "train.grad_accum=2",
       "train.grad_clip=0.05", "dist.backend=nccl"]


def _train(overrides):
    from framework.comm.distributed import connect
    cfg = tiny_config(*ODD, *overrides)
    module, data = build_gpt(cfg)
    dist = connect("nccl")   # world 1: no group, the device is cuda:0
    with framework.initialize(module, gpt_loss, cfg, dist) as engine:
        state, losses = engine.state, []
        for _ in range(cfg.train.steps):
            batch = data.train_batch(state.data, micro_batch=2, grad_accum=2, rank=0, world=1)
            state, m = engine.train_step(state, replace(batch, micro=to_device(batch.micro, dist.device)))
            losses.append(m["loss"])
        with framework.gathered(list(module.parameters())):
            full = torch.cat([p.detach().reshape(-1).float().cpu() for p in module.parameters()])
        host = {t.device.type for t in state.params}
    return losses, full, host


@pytest.mark.parametrize("stage,extra", [("zero2", ["stage.reduce_bucket_size=1500"]), ("zero3", []),
                                         ("zero3", ["offload.params=cpu"]), ("zero2", ["offload.ratio=0.5"])])
def test_cuda_offload_equals_no_offload(stage, extra):
    base = [f"+stage={stage}"] + (["stage.stage3_param_persistence_threshold=0"] if stage == "zero3" else [])
    plain = _train(base)
    off = _train([*base, "offload=cpu", *extra])
    assert "cpu" in off[2] and plain[2] == {"cuda"}
    for i, (a, b) in enumerate(zip(off[0], plain[0])):
        assert a == pytest.approx(b, rel=1e-6), f"step {i}: offload {a} vs {b}"
    torch.testing.assert_close(off[1], plain[1], rtol=1e-6, atol=1e-7)


def test_cuda_overlapped_host_step_is_bit_identical():
    base = ["+stage=zero2", "stage.reduce_bucket_size=1500", "stage.overlap_comm=true", "train.grad_clip=0",
            "offload=cpu"]
    plain, overlap = _train(base), _train([*base, "offload.overlap_step=true"])
    assert plain[0] == overlap[0] and torch.equal(plain[1], overlap[1])
