"""Learning-rate schedules: ``build(cfg, base_lr, total_steps)`` returns ``lr_at(step)``, ``step`` counting
applied optimizer updates from 0; ``base_lr`` is the optimizer's lr, ``total_steps`` the run's updates."""
