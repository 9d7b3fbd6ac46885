"""Persistence: sharded checkpoints (``checkpoint``, DCP), weights in and out (``weights``) and consolidating
a checkpoint into safetensors (``export``)."""
