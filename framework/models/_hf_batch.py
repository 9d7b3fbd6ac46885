"""The two batch conventions ``causal_lm_loss`` takes for a Hugging Face causal LM.

A tuple ``(x, y)`` is the framework's (what every data source yields): ``y`` is already the next tokens,
``y[:, t] == x[:, t + 1]``. A dict is transformers' (``DataCollatorForLanguageModeling``'s): ``input_ids``,
``labels`` not shifted (the model predicts ``labels[:, t + 1]`` at ``t``; -100 ignored; absent: the input ids) and
an optional ``attention_mask``, shifted here as transformers' own ``ForCausalLMLoss`` shifts them.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from framework.core.errors import DataError
from framework.core.utils import dtype_name
from framework.models._base import TARGET_DTYPES, next_token_loss

BATCH_KEYS = ("input_ids", "labels", "attention_mask")
IGNORE_INDEX = -100   # transformers' label of a token left out of the loss (padding, a prompt)
ID_DTYPES = (torch.int32, torch.int64)   # what an embedding takes


def _refuse(why: str) -> DataError:
    return DataError(f"causal_lm_loss: a dict batch {why}; give {{'input_ids': [B, T] ids, 'labels': [B, T] ids "
                     f"(unshifted, {IGNORE_INDEX} ignored; optional: the input ids), 'attention_mask': [B, T] "
                     f"(optional)}} as transformers takes it, or a tuple (x, y) with y the next tokens of x")


def checked(batch: Mapping[str, Any]) -> tuple[Tensor, Tensor, Tensor | None]:
    """(input_ids, labels, attention_mask or None) of a transformers dict batch; anything else refused in one
    line (shapes and dtypes only: no value is read, so no host sync)."""
    unknown = [k for k in batch if k not in BATCH_KEYS]
    if unknown or "input_ids" not in batch:
        raise _refuse(f"has key(s) {unknown!r} it does not take" if unknown else "has no 'input_ids'")
    ids = batch["input_ids"]
    labels, mask = batch.get("labels", ids), batch.get("attention_mask")
    for key, t in (("input_ids", ids), ("labels", labels), ("attention_mask", mask)):
        if t is None and key == "attention_mask":
            continue
        if not isinstance(t, Tensor) or t.dim() != 2 or t.shape != ids.shape:
            what = f"shape {list(t.shape)}" if isinstance(t, Tensor) else f"a {type(t).__name__}"
            raise _refuse(f"has {key} of {what} (input_ids: {list(getattr(ids, 'shape', []))}); each must be a "
                          f"[B, T] tensor of one shape")
        allowed = {"input_ids": ID_DTYPES, "labels": TARGET_DTYPES}.get(key, (t.dtype,))   # (labels: hold -100)
        if t.dtype not in allowed:
            names = ", ".join(map(dtype_name, allowed))
            why = f": each holds {IGNORE_INDEX}" if key == "labels" else ""
            raise _refuse(f"has {key} of dtype {t.dtype}; {key} must be token ids of a signed integer dtype "
                          f"({names}{why}; cast them with .long())")
    return ids, labels, mask


def shifted_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """transformers' causal LM loss (``ForCausalLMLoss``): fp32 cross-entropy of ``logits[:, t]`` against
    ``labels[:, t + 1]``, mean over the labels that are not ``IGNORE_INDEX``."""
    # (next_token_loss's cross-entropy leaves out its default ignore_index, -100: IGNORE_INDEX)
    # (next_token_loss casts the labels to int64: each signed dtype they may have holds the pad's IGNORE_INDEX)
    return next_token_loss(logits, F.pad(labels.to(logits.device), (0, 1), value=IGNORE_INDEX)[:, 1:])


def dict_forward(model: nn.Module, batch: Mapping[str, Any]) -> tuple[Any, Tensor]:
    """(the model's output, the loss) of a transformers dict batch."""
    ids, labels, mask = checked(batch)
    out = model(input_ids=ids, attention_mask=mask, use_cache=False)
    return out, shifted_loss(out.logits, labels)
