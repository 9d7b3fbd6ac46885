"""Optimizers: functional gradient transformations (``_transforms``), one registered module each.

Each public module defines a config dataclass and ``build(cfg, decay_mask)`` returning a
``GradientTransformation`` over the flat groups; ``decay_mask[i]`` is False for groups of 1-D
params, decayed only with the config's ``decay_1d``. ``update`` takes the current absolute lr:
a config's ``lr`` is the schedule's base lr.
"""
from framework.optimizers._subset import (group_state, init_groups, merge_groups, merge_scalars, replace_groups,
                                          step_groups)
from framework.optimizers._transforms import GradientTransformation, apply_updates, copy_16bit, step

__all__ = ["GradientTransformation", "apply_updates", "copy_16bit", "group_state", "init_groups",
           "merge_groups", "merge_scalars", "replace_groups", "step", "step_groups"]
