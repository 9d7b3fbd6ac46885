"""Typed, strict configuration: Hydra (or ``plainconf`` without it) composes the YAML, a DeepSpeed
config (``dsconfig``) layers under the command line, and the schemas (``schema``, ``checks``)
validate the result into a frozen, picklable ``Config``; a bad key is one line naming the closest.

    cfg = compose(["+stage=zero2", "optimizer=adamw", "train.steps=100"])
"""
from __future__ import annotations

from framework.config.checks import (check_batch_world, check_compatible, check_model_vocab, check_ranks_agree,
                                     leaf_key, validate)
from framework.config.composition import (app_composer, compose, compose_layers, have_hydra, parse_overrides,
                                           search_order, standalone_composer)
from framework.config.plainconf import choice_override, override_key
from framework.config.schema import COMPATIBLE, ROOT_KEYS, Config
from framework.core.registry import GROUPS

__all__ = ["COMPATIBLE", "GROUPS", "ROOT_KEYS", "Config", "app_composer", "check_batch_world", "check_compatible",
           "check_model_vocab", "check_ranks_agree", "choice_override", "compose", "compose_layers", "have_hydra", "leaf_key",
           "override_key", "parse_overrides", "search_order", "standalone_composer", "validate"]
