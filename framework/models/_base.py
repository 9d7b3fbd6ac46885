"""What a model component adds to a registry ``Component``: the loss the loop trains it with, the
weights to load into it once the stage has set it up, and its hidden size."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from torch import Tensor, nn

from framework.core.registry import Component


@dataclass(frozen=True)
class ModelComponent(Component):
    loss: Callable[[nn.Module, Any], Tensor]     # loss_fn(module, micro_batch) -> scalar
    # A weights source (file or folder, framework.persist.weights.load_weights) loaded after the stage set
    # the model up, or None: the model keeps its own initialisation.
    weights: Callable[[Any], str | None] = lambda cfg: None
    # The model's hidden size, read from its config without building it (DeepSpeed's "auto"
    # bucket sizes are computed from it), or None when unknown.
    hidden_size: Callable[[Any], int | None] = lambda cfg: None
