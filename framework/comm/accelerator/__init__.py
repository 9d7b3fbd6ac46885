"""The compute device, its streams and events, behind one small interface.

    acc = accelerator.for_device(dist.device)        # CUDA, or CPU (plain, or checking under tests)
    copy = acc.new_stream("copy")
    produced = acc.event(); produced.record()        # after the producer, on the current stream
    with acc.stream(copy):
        produced.wait()                              # the copy stream waits for the producer
        acc.copy(host_buf, dev_values, non_blocking=True)   # into a pinned host buffer
        done = acc.event(); done.record()
    done.synchronize()                               # now the host may read host_buf

Every device, stream and event decision of the offload path goes through this interface, so the
same code runs on three implementations:

* ``CudaAccelerator``: torch.cuda streams and events, pinned host memory. Events are blocking
  (``cudaEventBlockingSync``): a host that waits for one sleeps instead of spinning a core.
* ``CpuAccelerator``: one process, no streams; copies are plain ``copy_``, events do nothing.
* ``CheckingCpuAccelerator``: runs on the CPU like the plain one but *checks* what CUDA needs and a
  CPU run would not notice (the list of GPU bugs it must catch, each tested by injecting it into a
  real run, is ``framework/cli/mutations.py``):

  - placement: host buffers are the ones allocated with ``empty_host``; everything else counts as
    device memory, so a host buffer handed where device memory is expected (or the reverse)
    raises ``DeviceMismatch``, and so does a ``non_blocking`` copy with a pageable host side;
  - stream order, with vector clocks: each access made through the interface (``copy``, ``use``
    on a stream, ``host_use`` by host code, a collective) is recorded per byte range of its
    storage, and an access that conflicts with an earlier one made on another stream (or by the
    host) that it is not ordered after, through an event recorded after it and waited on (or
    synchronized by the host), raises ``OrderError`` naming both places. Work queued on a stream
    by the host is ordered after what the host did and knew before queueing it, as on CUDA;
  - NCCL's own stream: a collective (``collective``, called by ``Dist``) runs on a stream of its
    own that is ordered after the stream current when it is issued, and the stream current at
    ``collective_done`` (the work's ``wait``) is ordered after it; its tensors are kept alive until
    then, as torch.distributed does;
  - the caching allocator: device memory freed (its last tensor gone) while another stream than
    the compute stream may still use it, with neither the host nor the compute stream ordered
    after that use and no ``record_stream``, is the allocator handing the bytes to new compute
    work under a running copy: ``OrderError``, raised at the next checked call (and ``verify``),
    naming where it was freed;
  - per-thread devices: a thread other than the one that created the accelerator must call
    ``bind_thread`` (on CUDA: ``set_device``) before it queues device work or pins memory, or its
    CUDA context would land on GPU 0;
  - host syncs: inside ``hot(...)`` (the backward pass) and inside hooks registered through
    ``hook(...)``, a framework function that reads device memory on the host (``.item()``,
    ``.tolist()``, ``bool(t)``, ``.cpu()``, ``nonzero``, ...) raises ``HostSync``; user and model
    code is not ours to judge;
  - pinned memory as CUDA's caching host allocator holds it: each pinned buffer rounded up to a
    power of two, freed blocks kept for reuse (``pinned_stats``).

  All host threads count as one host: ordering between them (futures, locks) is their own
  business. Compute that runs outside ``copy`` (a stage's reduction, the gather) is declared with
  ``use`` by the code that hands its result across streams, and host code with ``host_use``.

``FRAMEWORK_ACCELERATOR`` picks the CPU implementation: ``check`` (the test suite sets it) or
``plain`` (the default). It has no effect on CUDA devices.

Modules: ``_base`` (the interface and its errors), ``_devices`` (CUDA, plain CPU), ``_checking``
(the checking CPU accelerator).
"""
from __future__ import annotations

import os

import torch

from framework.comm.accelerator._base import (Accelerator, AcceleratorError, DeviceMismatch, Event, HostSync,
                                              OrderError)
from framework.comm.accelerator._checking import CheckingCpuAccelerator, CheckingEvent, Clocked
from framework.comm.accelerator._devices import CpuAccelerator, CudaAccelerator
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


__all__ = ["ENV", "Accelerator", "AcceleratorError", "CheckingCpuAccelerator", "CheckingEvent", "Clocked",
           "CpuAccelerator", "CudaAccelerator", "DeviceMismatch", "Event", "HostSync", "OrderError", "for_device"]
