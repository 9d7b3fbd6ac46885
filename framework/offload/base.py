"""The OffloadTarget protocol: where optimizer state (and zero3 parameters) live between uses."""
from __future__ import annotations

from typing import Protocol

import torch


class OffloadTarget(Protocol):
    name: str

    def place(self, t: torch.Tensor) -> torch.Tensor:
        """Return the tensor stored where this target keeps optimizer inputs (a no-op for none)."""
