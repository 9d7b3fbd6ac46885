"""Offload targets (conf/offload): none (later cpu, nvme)."""
