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
from torch.nn.modules.module import register_module_parameter_registration_hook
from torch.nn.parameter import UninitializedParameter

from framework.stages import buffer_dtypes, initializer


@contextmanager
def zero_init() -> Iterator[None]:
    """Models built inside this block live on the meta device until ``framework.initialize`` materialises them.
    So does every parameter registered in it: one a constructor makes on a real device all the same (XLNet's
    ``nn.Parameter(torch.FloatTensor(n))``: the legacy constructors ignore the default device) holds uninitialised
    memory, so it goes on meta too and is initialised as the others (a model's ``_init_weights`` or
    ``init_parameter``, which also decide its values in a construction on a real device)."""
    handle = register_module_parameter_registration_hook(_on_meta)
    try:
        with torch.device("meta"):
            yield
    finally:
        handle.remove()


def _on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> nn.Parameter | None:
    """A real parameter registered under ``zero_init`` replaced by a meta one of its shape, dtype and
    ``requires_grad`` (None: kept as it is)."""
    if param is None or param.is_meta or isinstance(param, UninitializedParameter):
        return None
    return nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=param.requires_grad)


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
