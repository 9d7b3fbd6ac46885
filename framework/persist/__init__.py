"""Persistence: one name-keyed view of the state (``layout``, with the state dict), sharded checkpoints
(``checkpoint``, DCP), weights in and out (``weights``, safetensors through ``tensorfiles``) and consolidating a
checkpoint into safetensors (``export``)."""
