"""What materialises a module's meta tensors, one at a time, as a stage builds its layout: the module's own
``init_parameter``/``init_buffer`` (our GPT's), or a Hugging Face model's ``framework.models.hf.HFInit``
(``framework.zero_init`` builds a model on the meta device; ``engine/materialize.py``)."""
from __future__ import annotations

import torch
from torch import nn

from framework.core.errors import ConfigError
from framework.stages._flat import ParameterInit


class ModuleInit:
    """A module's own ``init_parameter`` (our GPT's) and ``init_buffer``; without one, fails naming the fix."""

    def __init__(self, module: nn.Module):
        self.module, self.kind = module, type(module).__name__

    def init_parameter(self, name: str, t: torch.Tensor) -> None:
        if isinstance(self.module, ParameterInit):
            return self.module.init_parameter(name, t)
        raise ConfigError(f"parameter {name!r} is on the meta device but {self.kind} has no "
                          f"init_parameter(name, tensor) method to initialise it; add that method (the training "
                          f"command always builds its model on the meta device) or, calling framework.initialize "
                          f"yourself, build the model on a real device")

    def init_buffer(self, name: str, t: torch.Tensor) -> None:
        own = getattr(self.module, "init_buffer", None)
        if callable(own):
            return own(name, t)
        raise ConfigError(f"buffer {name!r} of {self.kind} is on the meta device; add an init_buffer(name, tensor) "
                          f"method (the training command always builds its model on the meta device) or, calling "
                          f"framework.initialize yourself, build the model on a real device")


def initializer(module: nn.Module):
    """What materialises ``module``'s meta tensors (``init_parameter``, ``init_buffer``)."""
    from framework.models.hf import HFInit, is_hf_model

    if not isinstance(module, ParameterInit) and is_hf_model(module) and any(
            t.is_meta for t in (*module.parameters(), *module.buffers())):
        return HFInit(module, torch.initial_seed())
    return ModuleInit(module)
