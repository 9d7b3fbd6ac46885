"""Shared builders for the Hugging Face tests: tiny GPT-2 and Llama configs, and a plain loop.

Models are built from small configs written by the tests themselves (nothing is downloaded).
The plain reference model is materialised by the same init path as the stages
(``framework.models.hf.materialize``: the model's own ``_init_weights``, seeded per tensor), since
transformers' eager construction draws in a different order (transformers 5).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")   # never reach the Hub, even by mistake

import framework  # noqa: E402
from framework.engine.build import component  # noqa: E402

# Dropout off so that ranks and the plain model see the same function (no per-rank streams).
CONFIGS = {
    "gpt2": dict(model_type="gpt2", n_layer=2, n_head=4, n_embd=32, vocab_size=96, n_positions=32,
                 bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    "llama": dict(model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=96, max_position_embeddings=32,
                  bos_token_id=0, eos_token_id=0, pad_token_id=None),
}
# Synthetic data with 64 token ids (fits the models' 96), 16-token sequences.
BASE = ["model=hf", "model.context=16", "data.vocab_size=64", "train.micro_batch=2", "logger=none",
        "train.log_every=1", "train.eval_every=0", "train.eval_batches=1"]
# Parameters under zero3 are gathered per unit (none stay persistent).
ZERO3 = ["stage.stage3_param_persistence_threshold=0"]


def write_config(arch: str, folder: Path, **overrides) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.json"
    path.write_text(json.dumps({**CONFIGS[arch], **overrides}))
    return path


def hf_cfg(path: Path, *overrides: str):
    return framework.compose([*BASE, f"model.config={path}", *overrides])


def build(cfg, meta: bool = True):
    """(model, data): the model on meta (as the loop builds it), or materialised whole (plain)."""
    from framework.models.hf import materialize

    torch.manual_seed(cfg.seed)
    data = component(cfg, "data").build(cfg.data, seed=cfg.seed, context=cfg.model.context)
    with framework.zero_init():
        model = component(cfg, "model").build(cfg.model, vocab_size=data.vocab_size)
    return (model if meta else materialize(model)), data


def plain_losses(cfg, world: int, norms: list | None = None):
    """The plain model trained by a plain PyTorch loop on one process over the same global batches:
    torch AdamW or SGD (no decay on 1-D tensors), clip_grad_norm_, our schedule; ``norms``: each
    step's gradient norm before clipping is appended to it."""
    from framework.models.hf import causal_lm_loss
    from tests._helpers import plain_loop

    model, data = build(cfg, meta=False)
    losses = plain_loop(cfg, model, data, causal_lm_loss, steps=cfg.train.steps,
                        micro_batch=cfg.train.micro_batch * world, norms=norms)
    return losses, model


def gathered_params(module) -> dict[str, torch.Tensor]:
    """Full values of every distinct parameter, by name (gathered under zero3)."""
    with framework.gathered(list(module.parameters())):
        return {n: p.detach().clone() for n, p in module.named_parameters()}
