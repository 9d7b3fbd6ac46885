"""The GPU equivalence matrix: every stage x offload target, fp32, bf16 and fp16, against a single-GPU
reference, shared by tests/gpu/test_matrix.py and bench/gpu_check.py.

References: fp32 runs are compared with plain PyTorch on one device (torch AdamW, clip_grad_norm_,
the same init and batches); bf16 and fp16 runs with our replicated stage (ddp) on one device, no
offload (16-bit working parameters, fp32 master, and for fp16 the dynamic loss scale with its skipped
steps: what sharding and offload must not change).

FRAMEWORK_GPU_DRY=1 runs the same code on the CPU (gloo instead of NCCL, the checking accelerator,
a shorter matrix): bench/gpu_check.sh --dry-run, part of the CPU suite. FRAMEWORK_GPU_REPORT=PATH
appends one JSON line per compared run there (the GPU check's table).
"""
from __future__ import annotations

import copy
import json
import os
from dataclasses import replace

import torch

import framework
from framework.models.gpt import gpt_loss
from framework.core.utils import to_device
from tests._helpers import build_gpt, plain_loop, tiny_config

DRY = os.environ.get("FRAMEWORK_GPU_DRY") == "1"
RUN = ["model.d_model=48", "model.n_head=3", "train.steps=6", "train.micro_batch=2", "train.grad_accum=2",
       "train.grad_clip=0.5"]
Z2 = ["+stage=zero2", "stage.reduce_bucket_size=1500", "stage.overlap_comm=true"]
Z3 = ["+stage=zero3", "stage.stage3_param_persistence_threshold=0"]
NVME = ["offload=nvme", "offload.sub_group_size=3000", "offload.buffer_count=2"]
CASES: dict[str, list[str]] = {
    "ddp": [],
    "zero1": ["+stage=zero1"],
    "zero2": Z2,
    "zero3": Z3,
    "zero1+cpu": ["+stage=zero1", "offload=cpu"],
    "zero2+cpu": [*Z2, "offload=cpu"],
    "zero2+cpu overlap_step": [*Z2, "offload=cpu", "offload.overlap_step=true"],
    "zero3+cpu": [*Z3, "offload=cpu"],
    "zero3+cpu params": [*Z3, "offload=cpu", "offload.params=cpu"],
    "zero1+nvme": ["+stage=zero1", *NVME],
    "zero2+nvme": [*Z2, *NVME],
    "zero3+nvme params": [*Z3, *NVME],
}
PRECISIONS = ("fp32", "bf16", "fp16")
if DRY:   # the code paths, not the whole matrix (the CPU suite covers that): its time is short
    CASES = {"zero3+cpu params": CASES["zero3+cpu params"]}
    PRECISIONS = ("fp32",)
LOSS_RTOL = {"fp32": 2e-5, "bf16": 2e-2, "fp16": 2e-2}      # per step, relative
PARAM_ATOL = {"fp32": 2e-5, "bf16": 3e-2, "fp16": 3e-2}  # final parameters, absolute (they are O(0.1))


def device_kind() -> str:
    return "cpu" if DRY else "cuda"


def config(name: str, precision: str, world: int = 1):
    """Case ``name``'s config; ``world`` > 1 on one rank: the same global batch in larger micro batches."""
    return tiny_config(*RUN, *CASES.get(name, []), f"precision={precision}", f"train.micro_batch={2 * world}")


def batches(cfg, rank: int, world: int, data, step: int):
    return data.train_batch(step, micro_batch=cfg.train.micro_batch, grad_accum=cfg.train.grad_accum,
                            rank=rank, world=world)


def run(dist, name: str, precision: str, world: int = 1) -> dict:
    """Train case ``name`` on ``dist`` (its device); losses, full final parameters (fp32, on the host).
    ``world``: the global batch of that many ranks (for a one-process reference of a larger run)."""
    cfg = config(name, precision, world if dist.world == 1 else 1)
    module, data = build_gpt(cfg)
    with framework.initialize(module, gpt_loss, cfg, dist) as engine:
        state, losses = engine.state, []
        for _ in range(cfg.train.steps):
            batch = batches(cfg, dist.rank, dist.world, data, state.data)
            state, m = engine.train_step(state, replace(batch, micro=to_device(batch.micro, dist.device)))
            losses.append(m["loss"])
        with framework.gathered(list(module.parameters())):
            full = torch.cat([p.detach().reshape(-1).float().cpu() for p in module.parameters()])
        devices = sorted({t.device.type for t in state.params})
        if dist.device.type == "cuda":
            torch.cuda.synchronize(dist.device)
        dist.acc.verify()
    return {"losses": losses, "params": full, "master_on": devices}


def run_all(dist, names, precision: str) -> dict[str, dict]:
    """Every case on one rank pool call (errors kept per case, so one failure does not hide the rest)."""
    out = {}
    for name in names:
        try:
            out[name] = run(dist, name, precision)
        except Exception as e:  # noqa: BLE001 - reported per case by the caller
            out[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
    return out


def reference(precision: str, dist, world: int = 1) -> dict:
    """The single-device reference of ``precision`` for runs on ``world`` ranks, on ``dist`` (one
    process, its device); see the module docstring."""
    if precision != "fp32":
        return run(dist, "ddp", precision, world)
    device = dist.device
    cfg = config("ddp", "fp32", world)
    module, data = build_gpt(cfg)
    model = copy.deepcopy(module).to(device)
    losses = plain_loop(cfg, model, data, gpt_loss, steps=cfg.train.steps, micro_batch=cfg.train.micro_batch,
                        device=device)
    return {"losses": losses, "params": torch.cat([p.detach().reshape(-1).float().cpu() for p in model.parameters()])}


def compare(got: dict, ref: dict, precision: str) -> dict:
    """Max relative loss difference and max absolute parameter difference, and whether both are in tolerance."""
    if "error" in got:
        return {"ok": False, "error": got["error"]}
    rel = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(got["losses"], ref["losses"]))
    par = float((got["params"] - ref["params"]).abs().max())
    finite = all(map(lambda x: x == x and abs(x) != float("inf"), got["losses"]))
    ok = finite and rel <= LOSS_RTOL[precision] and par <= PARAM_ATOL[precision] \
        and len(got["losses"]) == len(ref["losses"])
    return {"ok": ok, "max_rel_loss": rel, "max_abs_param": par}


def record(**row) -> None:
    path = os.environ.get("FRAMEWORK_GPU_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")
