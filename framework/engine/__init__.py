"""The engine: ``TrainState``, the functional ``train_step`` (``step``), how updates are applied and
published (``update``), materialising models built under ``zero_init`` (``materialize``); with the
sharding stages (``framework/stages/``) and offload tiers (``framework/offload/``) beside it.

``build`` (``initialize``, ``Engine``) assembles them and sits one layer higher, above
``framework.persist`` (an engine saves its weights); see docs/architecture.md.
"""
