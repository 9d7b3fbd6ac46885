"""Optimizers: functional gradient transformations (``_transforms``), one registered module each.

Each public module defines a config dataclass and ``build(cfg, decay_mask)`` returning a
``GradientTransformation`` over the flat groups; ``decay_mask[i]`` is False for groups of 1-D
params, decayed only with the config's ``decay_1d``. ``update`` takes the current absolute lr:
a config's ``lr`` is the schedule's base lr. ``check_entry`` refuses a config without those two fields.
"""
from framework.core.registry import require_fields
from framework.optimizers._subset import (group_state, init_groups, merge_groups, merge_scalars, replace_groups,
                                          step_groups)
from framework.optimizers._transforms import GradientTransformation, apply_updates, copy_16bit, step

__all__ = ["GradientTransformation", "apply_updates", "copy_16bit", "group_state", "init_groups",
           "merge_groups", "merge_scalars", "replace_groups", "step", "step_groups"]

# The fields training reads from every optimizer's config (the rest are its own), as each is declared.
_REQUIRED = (("lr", "lr: float"), ("decay_1d", "decay_1d: bool = False"))


def check_entry(module_name: str, name: str, component) -> None:
    """What training needs of an optimizer's config: ``lr``, the base lr the schedule scales, and ``decay_1d``,
    whether the 1-D params (biases, norm weights) are decayed too (the ``decay_mask`` given to ``build``)."""
    require_fields("optimizer", module_name, name, component.config, _REQUIRED,
                   "training reads lr, the schedule's base learning rate, and decay_1d, whether 1-D params are "
                   "decayed too, from every optimizer's config")
