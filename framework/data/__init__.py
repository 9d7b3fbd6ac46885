"""Data sources (conf group ``data``): ``synthetic`` (default), ``text``, ``tokens``.

Each module's component builds a ``DataSource`` (see ``_base``) from ``(cfg, *, seed, context)``; its
``train_batch(position, ...)`` is a pure function of the position, the same rows for any split
of the global batch over ranks and micro batches. A source's ``vocab_size`` overrides the model's.
"""
from framework.data._base import Batch, DataSource, resolve_path, seeded

__all__ = ["Batch", "DataSource", "resolve_path", "seeded"]
