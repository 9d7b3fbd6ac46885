"""The engine: ``TrainState``, the functional ``train_step`` (``step``) and ``materialize``.

``build`` (``initialize``, ``Engine``) assembles them one layer higher, above ``framework.persist``
(an engine saves its weights); see docs/architecture.md.
"""
