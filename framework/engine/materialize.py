"""Building a model without materialising it, and materialising it one tensor at a time.

    with framework.zero_init():                          # parameters and buffers on the meta device
        model = AutoModelForCausalLM.from_config(config)  # (or GPT(cfg): a module with init_parameter)
    engine = framework.initialize(model, loss_fn, cfg)   # under zero3: only this rank's shards exist

Our ``deepspeed.zero.Init``, with nothing patched: each parameter is initialised whole, one at a time,
by the model's ``init_parameter`` (a Hugging Face model's: ``framework.models.hf.HFInit``), and under
zero3 only this rank's part is kept. A module with neither is refused in one line.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

from framework.stages import buffer_dtypes, initializer


@contextmanager
def zero_init() -> Iterator[None]:
    """Models built inside this block live on the meta device until ``framework.initialize`` materialises them.
    A real parameter (values put there, a legacy ``torch.FloatTensor(n)``) is kept by intent (the user's values)."""
    with torch.device("meta"):
        yield


def materialize_buffers(module: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Every buffer, whole, on ``device`` in the dtype ``buffer_dtypes`` gives it for working ``dtype`` (a meta
    one initialised first, in its own dtype)."""
    init = initializer(module) if any(b.is_meta for b in module.buffers()) else None
    kept = buffer_dtypes(module, dtype)
    done: dict[int, torch.Tensor] = {}   # a buffer registered under several names stays one tensor
    for name, buf in list(module.named_buffers(remove_duplicate=False)):
        path, _, key = name.rpartition(".")
        if id(buf) not in done:
            if buf.is_meta:
                value = torch.empty(buf.shape, dtype=buf.dtype, device=device)
                init.init_buffer(name, value)
                value = value.to(kept[id(buf)])
            else:
                value = buf.to(device, kept[id(buf)])
            done[id(buf)] = value
        # (the slot itself: it keeps the buffer's persistence, and no registration hook runs for a swap)
        module.get_submodule(path)._buffers[key] = done[id(buf)]
