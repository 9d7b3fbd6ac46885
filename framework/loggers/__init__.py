"""Loggers (conf/logger): console, wandb, none. Rank 0 only."""
