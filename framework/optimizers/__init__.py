"""Optimizers: functional gradient transformations, one registered module per optimizer.

Each public module defines a config dataclass and ``build(cfg, decay_mask)`` that returns
a ``GradientTransformation`` over the flat parameter groups; ``decay_mask[i]`` is False
for groups of 1-D parameters (biases, norms), which get weight decay only when the
config's ``decay_1d`` is set. ``update`` takes the current absolute lr, so a config's
``lr`` is only the schedule's base lr (checked by ``build``, not baked into the transform).
The transforms themselves live in ``_transforms``.
"""
from framework.optimizers._subset import (group_state, init_groups, merge_groups, merge_scalars, replace_groups,
                                          step_groups)
from framework.optimizers._transforms import GradientTransformation, apply_updates, chain, copy_16bit, step

__all__ = ["GradientTransformation", "apply_updates", "chain", "copy_16bit", "group_state", "init_groups",
           "merge_groups", "merge_scalars", "replace_groups", "step", "step_groups"]
