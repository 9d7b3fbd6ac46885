"""TrainState: everything that changes from step to step. Tensors inside may be updated in place
by ``train_step`` (like donated buffers in JAX): always continue from the state it returns.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from framework.precision import PrecisionState


@dataclass(frozen=True)
class TrainState:
    step: int                        # train_step calls so far (optimizer steps, skipped ones included)
    # Master parameters as the stage lays them out and the optimizer state. Under offload=nvme the pieces
    # in the swap file are placeholders between steps (reading zeros, writes lost): use engine.state_dict.
    params: tuple[torch.Tensor, ...]
    opt_state: Any
    precision: PrecisionState        # loss scale and skipped-step bookkeeping
    rng: tuple[torch.Tensor, ...]    # generator states after the last step: CPU, then the device's (dropout)
    data: int                        # data position: global batches consumed

    @property
    def applied_steps(self) -> int:
        """Optimizer updates actually applied; the LR schedule is indexed by this."""
        return self.step - self.precision.skipped_steps


def capture_rng(device: torch.device) -> tuple[torch.Tensor, ...]:
    if device.type == "cuda":
        return torch.get_rng_state(), torch.cuda.get_rng_state(device)
    return (torch.get_rng_state(),)


def restore_rng(rng: tuple[torch.Tensor, ...], device: torch.device) -> None:
    torch.set_rng_state(rng[0])
    if device.type == "cuda":
        torch.cuda.set_rng_state(rng[1], device)


# Of the name-keyed state dict (``framework.persist.layout``) and of a checkpoint's train_state.json ("state_format"):
# raise it whenever either's layout changes in a way this version's reader would misread or refuse as damage (a
# key renamed or retyped), so that an older version names a newer one's state rather than calling it damaged.
FORMAT = 1


def is_newer(version: Any, reads: int) -> bool:
    """Whether a saved file's ``version`` field is a number above ``reads``, the one this version reads."""
    return isinstance(version, int) and not isinstance(version, bool) and version > reads


def optimizer_leaves(opt_state: Any, params: Sequence[torch.Tensor]) -> tuple[dict[str, list], dict[str, Any]]:
    """An optimizer state's leaves by path (``'0.mu'``: chain index, then field name): (per-element
    leaves: tensor lists aligned with ``params``, scalar leaves: everything else)."""
    per, scalars = {}, {}
    _rebuild(opt_state, params, per.__setitem__, scalars.__setitem__)
    return per, scalars


def initial_scalars(tx: Any, params: Sequence[torch.Tensor]) -> dict[str, Any]:
    """The scalar leaves (step counts) of ``tx.init``'s state, by path as ``optimizer_leaves``: the init is made
    over empty tensors of the pieces' dtypes and devices, so it costs no memory (a swapped piece is not read)."""
    empty = [torch.empty(0, dtype=p.dtype, device=p.device) for p in params]
    return optimizer_leaves(tx.init(empty), empty)[1]


def with_scalars(opt_state: Any, params: Sequence[torch.Tensor], scalars: dict[str, Any]) -> Any:
    """``opt_state`` with its scalar leaves replaced by ``scalars`` (paths as ``optimizer_leaves``);
    per-element leaves are kept (same tensors), a tensor scalar is overwritten in place."""
    return _rebuild(opt_state, params, lambda path, leaf: leaf,
                    lambda path, leaf: leaf.copy_(scalars[path]) if isinstance(leaf, torch.Tensor) else scalars[path])


def _rebuild(tree: Any, params: Sequence[torch.Tensor], per: Callable, scalar: Callable, path: str = "") -> Any:
    """``tree`` with ``per(path, leaf)`` for each tensor list aligned with ``params`` and ``scalar(path, leaf)``
    for every other leaf; a NamedTuple is keyed by field name, a plain tuple (a chain) by index."""
    if isinstance(tree, list) and len(tree) == len(params) and all(
            isinstance(t, torch.Tensor) and t.numel() == p.numel() for t, p in zip(tree, params)):
        return per(path, tree)
    if isinstance(tree, tuple):
        keys = range(len(tree)) if type(tree) is tuple else type(tree)._fields
        items = [_rebuild(v, params, per, scalar, f"{path}.{k}" if path else str(k)) for k, v in zip(keys, tree)]
        return tuple(items) if type(tree) is tuple else type(tree)(*items)
    return scalar(path, tree)
