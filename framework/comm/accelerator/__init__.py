"""The compute device, its streams and events, behind one small interface.

    acc = accelerator.for_device(dist.device)        # CUDA, or CPU (plain, or checking under tests)
    copy = acc.new_stream("copy")
    produced = acc.event(); produced.record()        # after the producer, on the current stream
    with acc.stream(copy):
        produced.wait()                              # the copy stream waits for the producer
        acc.copy(host_buf, dev_values, non_blocking=True)   # into a pinned host buffer
        done = acc.event(); done.record()
    done.synchronize()                               # now the host may read host_buf

The same code runs on CUDA (``CudaAccelerator``), the plain CPU (``CpuAccelerator``: no streams,
events do nothing) and the checking CPU (``CheckingCpuAccelerator``: raises where CUDA would go
wrong and a CPU run would not notice). ``FRAMEWORK_ACCELERATOR`` picks the CPU one: ``check`` (the
test suite sets it) or ``plain`` (the default).
"""
from __future__ import annotations

import os

import torch

from framework.comm.accelerator._base import (Accelerator, CpuAccelerator, CudaAccelerator, DeviceMismatch, Event,
                                              HostSync, OrderError)
from framework.comm.accelerator._checking import CheckingCpuAccelerator, CheckingEvent, Clocked
from framework.core.errors import ConfigError

ENV = "FRAMEWORK_ACCELERATOR"


def for_device(device: torch.device, mode: str | None = None) -> Accelerator:
    """The accelerator of ``device``; ``mode`` (default: $FRAMEWORK_ACCELERATOR) picks the CPU one."""
    mode = mode or os.environ.get(ENV) or "plain"
    if mode not in ("plain", "check"):
        raise ConfigError(f"{ENV}={mode!r} is not one of plain, check")
    if device.type == "cuda":
        return CudaAccelerator(device)
    if device.type != "cpu":
        raise ConfigError(f"no accelerator for device {device}; use cuda or cpu")
    return CheckingCpuAccelerator() if mode == "check" else CpuAccelerator()


__all__ = ["ENV", "Accelerator", "CheckingCpuAccelerator", "CheckingEvent", "Clocked",
           "CpuAccelerator", "CudaAccelerator", "DeviceMismatch", "Event", "HostSync", "OrderError", "for_device"]
