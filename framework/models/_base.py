"""What a model component adds to a registry ``Component``: the loss the loop trains it with, the
weights to load into it once the stage has set it up, and its hidden size."""
from __future__ import annotations

from dataclasses import dataclass
import zlib
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from framework.core.errors import DataError
from framework.core.registry import Component
from framework.core.utils import dtype_name, replace_parameters


@dataclass(frozen=True)
class ModelComponent(Component):
    loss: Callable[[nn.Module, Any], Tensor]     # loss_fn(module, micro_batch) -> scalar
    # Weights (file or folder) loaded after the stage set the model up; None: its own initialisation.
    weights: Callable[[Any], str | None] = lambda cfg: None
    # The hidden size from the config, nothing built (DeepSpeed's "auto" bucket sizes); None: unknown.
    hidden_size: Callable[[Any], int | None] = lambda cfg: None
    # The vocabulary the model keeps whatever the data's (whose ids need only fit it), from the config, nothing
    # built; None: built at the data's.
    vocab_size: Callable[[Any], int | None] = lambda cfg: None
    # The loss the memory prediction traces on meta where ``loss`` cannot run there; None: ``loss``.
    trace_loss: Callable[[nn.Module, Any], Tensor] | None = None


def all_on_meta(module: nn.Module) -> nn.Module:
    """A module built on meta (some parameter is) with each parameter not on meta replaced by a meta one of its
    shape, dtype and ``requires_grad``: one per distinct parameter, in every module that holds it (a tie stays). For
    a model built from a config alone, whose constructors made some on a real device all the same (XLNet's
    ``nn.Parameter(torch.FloatTensor(n))``: the legacy constructors ignore the default device), holding whatever
    memory held: the model's init then writes them like the others. Built on a real device: left as it is."""
    if not any(p.is_meta for p in module.parameters()):
        return module
    replace_parameters(module, {id(p): nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
                                for p in module.parameters()
                                if not p.is_meta and not isinstance(p, nn.UninitializedParameter)})
    return module


def name_seed(seed: int, name: str) -> int:
    """The seed of tensor ``name``'s initialisation: independent of the order tensors are made in."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2 ** 63)


# The targets' dtypes cast to int64 for the loss: signed integers, each holding -100 (ignored); a float, bool or
# unsigned y would be truncated or wrap, so it is refused
TARGET_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64)


def next_token_loss(logits: Tensor, y: Tensor) -> Tensor:
    """Mean cross-entropy of logits [B, T, vocab] against targets [B, T], in fp32 (as both models train)."""
    if y.dtype not in TARGET_DTYPES:   # (metadata: no host sync)
        names = ", ".join(map(dtype_name, TARGET_DTYPES))
        raise DataError(f"next_token_loss: targets y of dtype {y.dtype}; y must be token ids of a signed integer "
                        f"dtype ({names}; cast them with .long())")
    # (int64 targets, on their own device: cross-entropy takes no other integer dtype; a no-op for the data's)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1).long())
