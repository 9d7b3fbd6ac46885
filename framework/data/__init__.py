"""Data sources (conf group ``data``): ``synthetic`` (default), ``text``, ``tokens``.

Each module's ``build(cfg, *, seed, context)`` returns a ``DataSource`` (see ``_base``):
``train_batch(position, ...)`` is a pure function of the position, so a resumed run replays
its data exactly and any (ranks x micro batch) split of the same global batch sees the same
rows. A source's ``vocab_size`` overrides the model's YAML default.
"""
from framework.data._base import Batch, DataSource

__all__ = ["Batch", "DataSource"]
