"""Sharding stages (conf/stage): ddp (replicated), later zero1, zero2, zero3."""
