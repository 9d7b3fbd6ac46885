"""Learning-rate schedules: pure functions ``lr_at(step) -> lr``.

``step`` counts applied optimizer updates from 0: the first update uses ``lr_at(0)``.
Each component is a config dataclass and ``build(cfg, base_lr, total_steps)`` that returns
the schedule; ``base_lr`` is the optimizer's configured lr and
``total_steps`` the number of optimizer updates the run will take.
"""
