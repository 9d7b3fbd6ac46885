"""Data sources (conf group ``data``): ``synthetic`` (default), ``text``, ``tokens``; each component
builds a ``DataSource`` (``_base``) from ``(cfg, *, seed, context)`` whose ``vocab_size`` overrides the model's."""
from framework.data._base import Batch, DataSource, resolve_path, seeded

__all__ = ["Batch", "DataSource", "resolve_path", "seeded"]
