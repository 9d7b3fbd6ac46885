"""Devices and communication: the accelerator (the compute device, its streams and events; CUDA, CPU and
the checking CPU accelerator), process groups (``distributed``) and bucketed collectives."""
