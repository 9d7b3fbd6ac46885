"""Typed, strict configuration: Hydra composes YAML, these schemas validate it.

    cfg = compose(["+stage=zero2", "optimizer=adamw", "train.steps=100"])   # a frozen Config

Every node is checked against a dataclass: the top-level keys against ``RootSchema`` and each
group's node against the schema of the component chosen for that group. An unknown key, a
typo or a wrong type raises ConfigError with one line naming the bad key and the closest
valid one. The result is a frozen ``Config`` that is plain data (it pickles to spawned ranks).

Modules: ``schema`` (the dataclasses, ``Config``, ``COMPATIBLE``), ``checks`` (``validate``),
``composition`` (``compose``: Hydra or ``plainconf``, the DeepSpeed layer of ``dsconfig``,
provenance).
"""
from __future__ import annotations

from framework.config.checks import check_compatible, validate
from framework.config.composition import (CommandLine, Composer, app_composer, check_choices, compose, compose_layers,
                                          group_overrides_to_force, have_hydra, provenance, standalone_composer)
from framework.config.schema import (COMPATIBLE, DEFAULT_STAGE, ROOT_KEYS, CheckpointConfig, Config, DistConfig,
                                     RootSchema, TrainLoopConfig, flat)
from framework.core.registry import GROUPS

__all__ = ["COMPATIBLE", "DEFAULT_STAGE", "GROUPS", "ROOT_KEYS", "CheckpointConfig", "CommandLine", "Composer",
           "Config", "DistConfig", "RootSchema", "TrainLoopConfig", "app_composer", "check_choices",
           "check_compatible", "compose", "compose_layers", "flat", "group_overrides_to_force", "have_hydra",
           "provenance", "standalone_composer", "validate"]
