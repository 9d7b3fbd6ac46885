"""The estimator's prediction equals, byte for byte, what a built engine reports it holds.

``Engine.memory`` adds up the bytes of the tensors the engine holds after a step (working
parameters, gradients, masters, optimizer state, host buffers, swap pools, swap files), by item
and by where they live; ``framework.memory.model.predict`` computes the same items from the model's
shapes with the functions the stages and tiers lay themselves out with (``make_layout``,
``plan_units``, ``Zero2Stage.plan``, ``Placement.ranges`` and ``Placement.predict``). Every
stage x offload x precision on one rank, the settings that change the layout (partial offload,
parameter offload, speculation, accumulation, small tiles and buckets), and the sharded
compositions on two ranks (zero3 on NVMe and zero2 on the host in every precision). Cases marked
``FROZEN`` add what every stage keeps whole on every rank: frozen parameters (in the working dtype
when floating) and buffers (their own dtype, or the working one beside parameters of theirs).
"""
from __future__ import annotations

import itertools

import torch
from torch import nn

import framework
from framework.engine.build import component
from framework.memory.model import data_vocab, predict
from framework.models.gpt import gpt_loss
from tests._helpers import build_gpt, no_collection, tiny_config

FROZEN = "frozen+buffers"   # not an override: the case's model gets frozen parameters and buffers (``_freeze``)

ONE_RANK = [(f"+stage={s}", f"offload={o}", f"precision={p}")
            for s, o, p in itertools.product(["zero1", "zero2", "zero3"], ["none", "cpu", "nvme"],
                                             ["fp32", "bf16", "fp16"])]
ONE_RANK += [("+stage=ddp", f"precision={p}") for p in ("fp32", "bf16", "fp16")]
ONE_RANK += [
    ("+stage=ddp", "precision=bf16", "train.grad_accum=2"),
    ("+stage=zero1", "precision=bf16", "train.grad_accum=2"),
    ("+stage=zero1", "offload=cpu", "offload.ratio=0.5", "precision=bf16"),
    ("+stage=zero2", "offload=cpu", "offload.overlap_step=true"),
    ("+stage=zero2", "offload=nvme", "offload.ratio=0.5", "precision=bf16"),
    ("+stage=zero2", "offload=nvme", "stage.reduce_bucket_size=1000", "precision=bf16"),
    ("+stage=zero3", "offload=cpu", "offload.params=cpu", "precision=bf16"),
    ("+stage=zero3", "offload=nvme", "offload.params=cpu"),
    ("+stage=zero3", "offload=nvme", "offload.optimizer=cpu"),
    ("+stage=zero3", "offload=nvme", "offload.params=none", "precision=bf16"),
    # owned gradients in the swap file, read back on the second micro batch (pinned landings)
    ("+stage=zero3", "offload=nvme", "offload.params=none", "precision=bf16", "train.grad_accum=2"),
    ("+stage=zero3", "offload=nvme", "offload.sub_group_size=1024", "offload.param_buffer_count=2"),
    ("+stage=zero3", "stage.stage3_param_persistence_threshold=0", "precision=bf16"),
    # (overrides spelled as a case above: its composition is reused)
    ("+stage=ddp", "precision=bf16", FROZEN),
    ("+stage=zero1", "offload=none", "precision=fp32", FROZEN),
    ("+stage=zero2", "offload=cpu", "precision=fp16", FROZEN),
    ("+stage=zero3", "offload=none", "precision=bf16", FROZEN),
    ("+stage=zero3", "offload=nvme", "precision=bf16", FROZEN),
]
TWO_RANKS = [(f"+stage={s}", f"offload={o}", "precision=bf16")
             for s, o in itertools.product(["zero1", "zero2", "zero3"], ["none", "cpu", "nvme"])]
# the other precisions where a rank's share differs most: swapped and host-stepped partitions
TWO_RANKS += [("+stage=zero3", "offload=nvme", f"precision={p}") for p in ("fp32", "fp16")]
TWO_RANKS += [("+stage=zero2", "offload=cpu", f"precision={p}") for p in ("fp32", "fp16")]
# a wider wire with no accumulator: the fp32 sums land in a buffer of their own (ddp: all, zero1: its partition)
TWO_RANKS += [(f"+stage={s}", "precision=bf16", "precision.reduce_fp32=true") for s in ("ddp", "zero1")]
TWO_RANKS += [("+stage=ddp",), ("+stage=zero3", "offload=nvme", "offload.sub_group_size=1024"),
              # round-robin buckets hold one partition's share each (a plain plan's would be twice as large)
              ("+stage=zero2", "stage.round_robin_gradients=true", "stage.reduce_bucket_size=3000",
               "stage.overlap_comm=true", "precision=bf16"),
              ("+stage=zero3", "offload=none", "precision=bf16", FROZEN),
              # rank 1 holds padding-only pieces: never speculated, so no undo copies
              ("+stage=zero3", "offload=cpu", "offload.overlap_step=true",
               "stage.stage3_param_persistence_threshold=0", "train.grad_accum=2")]


def _freeze(module: nn.Module) -> nn.Module:
    """A LoRA-style model: the position embedding frozen, a frozen integer parameter, and buffers of
    their own dtypes (one registered under two names, one non-persistent); the forward reads none of
    the additions. Built on the meta device (the estimator's) as on the host (the engine's)."""
    module.wpe.weight.requires_grad_(False)
    module.register_parameter("frozen_ids", nn.Parameter(torch.zeros(7, dtype=torch.int64), requires_grad=False))
    scale = torch.ones(5, 3, dtype=torch.float64)
    module.register_buffer("scale", scale)
    module.ln_f.register_buffer("scale_alias", scale)
    module.register_buffer("counts", torch.zeros(11, dtype=torch.int32), persistent=False)
    module.ln_f.register_buffer("stats", torch.ones(13))   # beside float32 parameters: kept in the working dtype
    return module


def _footprints(dist, cases, folder):
    """(case, what the engine holds, what the estimator predicts) after one step of each case."""
    # The activation traces, reused as the planner's sweep reuses them (keyed by the micro batch's shapes, the
    # dtype and checkpointing): they go into the prediction's transient peaks, not into the items compared
    # here. One set per model (the frozen cases' has parameters and buffers of its own).
    traces = {False: {}, True: {}}
    out = []
    for case in cases:
        frozen = FROZEN in case
        overrides = [*(o for o in case if o != FROZEN), "train.steps=1",
                     *([f"offload.nvme_path={folder}"] if "offload=nvme" in case else [])]
        cfg = tiny_config(*overrides)
        module, data = build_gpt(cfg)
        meta = None
        if frozen:
            _freeze(module)
            with torch.device("meta"):
                meta = _freeze(component(cfg, "model").build(cfg.model, vocab_size=data_vocab(cfg)))
        engine = framework.initialize(module, gpt_loss, cfg, dist)
        try:
            batch = data.train_batch(0, micro_batch=cfg.train.micro_batch, grad_accum=cfg.train.grad_accum,
                                     rank=dist.rank, world=dist.world)
            with no_collection():
                pinned = dist.acc.pinned_stats()["requested"]
                state, _ = engine.train_step(engine.state, batch)
                stepped = dist.acc.pinned_stats()["requested"]
            # every page-locked buffer is made at setup, where the report and the pre-flight see it
            # (and, on CUDA, not in a hook: page-locking waits for the device)
            assert stepped == pinned, (case, "a step pinned or freed host memory")
            held = engine.memory(state).nonzero()
            del state
            stage = engine.components.stage
            if "+stage=zero3" in case and stage.gatherer.persistent is not None:
                # One rank with shards on the device: a shard is its whole buffer, and the persistent
                # parameters are views of it (a second whole copy would hold them twice).
                in_place = dist.world == 1 and not stage.offload.shards.params_on_host
                assert all((g.full is g.shard) == in_place for g in stage.gatherer.persistent.groups), case
                assert ("gathered_persistent" in held[0]) != in_place, (case, held)   # (freed at the next case's step otherwise, where the check would see it)
        finally:
            engine.close()
        if frozen:
            assert {"frozen_params", "buffers"} <= set(held[0]), held   # (the case tests something)
        if "offload=nvme" in case and "+stage=zero3" in case and "offload.optimizer=cpu" not in case:
            # the swapped gradients' read-back buffers: only where a later micro batch reads a partition back
            assert ("nvme_grad_read_back" in held[0]) == (cfg.train.grad_accum > 1), (case, held)
        out.append((case, held, predict(cfg, dist.world, module=meta, traces=traces[frozen],
                                              rank=dist.rank).nonzero()))
    return out


def _check(results):
    wrong = [f"{' '.join(case)}:\n  engine    {held}\n  predicted {pred}" for case, held, pred in results
             if held != pred]
    assert not wrong, "\n".join(wrong)


def test_prediction_is_what_the_engine_holds_one_rank(tmp_path):
    from framework.comm.distributed import connect

    _check(_footprints(connect("gloo"), ONE_RANK, str(tmp_path)))


def test_prediction_is_what_the_engine_holds_two_ranks(pools, tmp_path):
    for rank_results in pools(2).run(_footprints, TWO_RANKS, str(tmp_path / "nvme"), timeout=300):
        _check(rank_results)


PURE_BF16 = '''
from dataclasses import dataclass

import torch

from framework.core.registry import Component
from framework.precision import Policy


@dataclass(frozen=True, kw_only=True)
class PureConfig:
    grad_accum_dtype: str = "fp32"   # (the node's key, read by the config checks; the Policy sums in bf16)


COMPONENT = Component(config=PureConfig, build=lambda cfg: Policy(
    "purebf16", torch.bfloat16, torch.bfloat16, torch.bfloat16, None, grad_accum_dtype=torch.bfloat16))
'''


def test_prediction_reads_the_policys_master_dtype(own_component, tmp_path):
    """A precision of one's own with a bf16 master: its optimizer state is bf16 too (made over the master), and
    the prediction counts it so, not as fp32."""
    from framework.comm.distributed import connect

    search = own_component("precision", "purebf16", PURE_BF16, "grad_accum_dtype: fp32\n")
    cases = [(s, *o, "precision=purebf16", search) for s, o in
             (("+stage=ddp", ()), ("+stage=zero2", ()), ("+stage=zero2", ("offload=cpu",)), ("+stage=zero3", ()))]
    results = _footprints(connect("gloo"), cases, str(tmp_path))
    _check(results)
    assert all(sum(held[0]["optimizer_state"]) for _, held, _ in results)   # (the cases hold some)
