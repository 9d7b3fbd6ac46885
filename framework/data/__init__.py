"""Data sources (conf group ``data``): ``synthetic`` (default), ``text``, ``tokens``.

Each module's ``build(cfg, *, seed, context)`` returns a ``DataSource`` (see ``_base``):
``train_batch(position, ...)`` is a pure function of the position (``TrainState.data``), so a
run restarted from a position replays its data exactly (checkpoint save and load do not exist
yet) and any (ranks x micro batch) split of the same global batch sees the same rows. A source's ``vocab_size`` overrides the model's YAML default.
"""
from framework.data._base import Batch, DataSource, resolve_path, seeded

__all__ = ["Batch", "DataSource", "resolve_path", "seeded"]
