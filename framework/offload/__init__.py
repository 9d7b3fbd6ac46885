"""Offload targets (conf/offload): none, cpu."""
