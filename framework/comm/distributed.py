"""The Dist value (rank, world size, device, its accelerator and collectives), made by ``connect``.

Collectives are no-ops at world size 1. Each names what it waits for, so a timeout (a dead or
stalled peer) ends the surviving ranks with one line naming it; on NCCL, whose ``wait`` only
orders the compute stream, the watchdog aborts a waiting rank after ``timeout_s`` (SIGABRT),
which the launcher names.
"""
from __future__ import annotations

import faulthandler
import os
import socket
from dataclasses import dataclass, replace
from datetime import timedelta
from functools import cached_property
from typing import Callable

import torch
import torch.distributed as tdist
# torch.distributed.nn.functional binds group.WORLD as default arguments when imported (torch._dynamo
# imports it lazily): after init_process_group that pins the group past destroy_process_group, and a
# gloo worker may then drop its last work during interpreter shutdown ("terminate called without an
# active exception"). Imported here, before any group exists, those defaults are None.
import torch.distributed.nn.functional  # noqa: F401  (import order matters, see above)

from framework.comm.accelerator import Accelerator, for_device
from framework.comm.collectives import CheckedWork, Collectives, collectives_for
from framework.core.errors import ConfigError, DistributedError, FrameworkError


@dataclass(frozen=True)
class Dist:
    rank: int
    world: int
    local_rank: int
    device: torch.device
    backend: str | None
    timeout_s: float
    # (host name, process id) of every rank: a survivor names the ranks on its host whose process is gone.
    peers: tuple[tuple[str, int], ...] = ()
    # One per Dist (default: ``for_device(device)``): the offload copies and the collectives share its streams.
    accelerator: Accelerator | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @cached_property
    def comm(self) -> Collectives:
        return collectives_for(self)

    @cached_property
    def acc(self) -> Accelerator:
        return self.accelerator if self.accelerator is not None else for_device(self.device)

    def _issue(self, what: str, fn, *args, async_op: bool = False, **kwargs):
        """Issue collective ``fn`` on the tensor ``args``; the accelerator sees it ordered as NCCL orders it."""
        token = self.acc.collective([a for a in args if isinstance(a, torch.Tensor)], what)
        work = self._run(what, fn, *args, async_op=async_op, **kwargs)
        if token is not None and not async_op:
            self.acc.collective_done(token)
        return CheckedWork(work, token, self.acc) if token is not None and async_op else work

    def _run(self, what: str, fn, *args, limit: tuple[float, str] | None = None, **kwargs):
        """``fn(*args, **kwargs)``; ``limit``: (timeout, the key setting it) of another group than the default."""
        try:
            return fn(*args, **kwargs)
        except RuntimeError as e:  # gloo/NCCL report timeouts and dead peers as RuntimeError
            timeout_s, key = limit or (self.timeout_s, "dist.timeout_s")
            raise DistributedError(
                f"rank {self.rank}/{self.world}: {what} failed after waiting up to {timeout_s:g}s "
                f"({self.who_failed()}; {key} sets the limit): {str(e).splitlines()[0]}"
            ) from e

    def who_failed(self) -> str:
        """The ranks on this host to blame for a failed collective: process gone, stopped or blocked in
        the kernel (a slow peer is not named)."""
        host, lost, stalled = socket.gethostname(), [], []
        for r, (h, pid) in enumerate(self.peers):
            if h == host and r != self.rank:
                if not _alive(pid):
                    lost.append(r)
                if (state := _state(pid)) in _STALLED:
                    stalled.append(f"rank {r} stalled (pid {pid} {_STALLED[state]})")
        parts = [f"rank{'s' if len(lost) > 1 else ''} {', '.join(map(str, lost))} lost (process gone)"] if lost else []
        return "; ".join(parts + stalled) or "a peer rank died or stalled"

    def all_reduce(self, t: torch.Tensor, op=tdist.ReduceOp.SUM, what: str = "all_reduce", async_op=False):
        if self.world == 1:
            return None
        return self._issue(what, tdist.all_reduce, t, op=op, async_op=async_op)

    def wait(self, works, what: str) -> None:
        """Wait for async collectives (None entries are the no-ops of world size 1)."""
        for w in works:
            if w is not None:
                self._run(what, w.wait)

    def all_gather_object(self, obj, what: str = "all_gather_object", group=None,
                          limit: tuple[float, str] | None = None) -> list:
        """``group``, ``limit``: a process group of its own and its (timeout, key), as ``_run``'s."""
        if self.world == 1:
            return [obj]
        out = [None] * self.world
        self._run(what, tdist.all_gather_object, out, obj, group=group, limit=limit)
        return out

    def broadcast(self, t: torch.Tensor, src: int = 0, what: str = "broadcast") -> None:
        if self.world > 1:
            self._issue(what, tdist.broadcast, t, src=src)

    def barrier(self, what: str = "barrier") -> None:
        if self.world > 1:
            # A tensor all-reduce rather than tdist.barrier: it honours the group timeout on gloo.
            self.all_reduce(torch.zeros(1, device=self.device), what=what)


_STALLED = {"T": "is stopped (SIGSTOP or SIGTSTP: send SIGCONT, or kill it)", "t": "is stopped by a debugger",
            "D": "is blocked in the kernel (uninterruptible sleep: a hung disk or network file system?)"}


def _state(pid: int) -> str | None:
    """The kernel's one-letter state of process ``pid`` (Linux /proc), None if unknown or gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return _state(pid) != "Z"   # a zombie (exited, not yet reaped by its parent) counts as gone


def gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def local_world_size() -> int:
    """Ranks on this host: LOCAL_WORLD_SIZE (torchrun, our spawner, Slurm), else WORLD_SIZE."""
    return int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("WORLD_SIZE") or "1")


def resolve_backend(backend: str, local_world: int | None = None) -> str:
    """gloo or nccl for ``backend`` (auto | gloo | nccl) with ``local_world`` ranks on this host.
    NCCL refuses two ranks on one GPU, so ``auto`` is NCCL only when there is a GPU per rank."""
    if backend not in ("auto", "gloo", "nccl"):
        raise ConfigError(f"dist.backend={backend!r} is not one of auto, gloo, nccl")
    local = local_world_size() if local_world is None else local_world
    gpus = gpu_count()
    if backend == "auto":
        return "nccl" if gpus and local <= gpus else "gloo"
    if backend == "nccl" and not gpus:
        raise ConfigError("dist.backend=nccl needs CUDA; use dist.backend=gloo (or auto) on CPU")
    if backend == "nccl" and local > gpus:
        raise ConfigError(f"dist.backend=nccl runs one rank per GPU: {local} ranks on this host but {gpus} "
                          f"GPU{'s' if gpus != 1 else ''}; use at most {gpus} rank{'s' if gpus != 1 else ''} per host "
                          f"(dist.nproc / --nproc-per-node) or dist.backend=gloo")
    return backend


def backend_notice(backend: str, local_world: int) -> str | None:
    """One line when ``auto`` falls back to gloo on the CPU although there is a GPU (else None)."""
    gpus = gpu_count()
    if backend == "auto" and gpus and local_world > gpus:
        return (f"dist.backend=auto: {local_world} ranks on this host but {gpus} GPU{'s' if gpus != 1 else ''}: "
                f"training on the CPU over gloo (NCCL needs one GPU per rank); use at most {gpus} "
                f"rank{'s' if gpus != 1 else ''} per host to train on the GPU{'s' if gpus != 1 else ''}")
    return None


def pick_device(backend: str, local_rank: int, device: str = "auto") -> torch.device:
    """The compute device of a rank: ``auto`` is cuda:LOCAL_RANK on NCCL and the CPU on gloo;
    ``cuda`` puts a gloo rank on GPU LOCAL_RANK % GPUs (ranks may share one: tests and checks)."""
    if device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"device={device!r} is not one of auto, cpu, cuda")
    if backend == "nccl":
        if device == "cpu":
            raise ConfigError("the nccl backend needs CUDA tensors; use gloo for a CPU device")
        return torch.device("cuda", local_rank)
    if device == "cuda":
        if not gpu_count():
            raise ConfigError("device=cuda needs a GPU; none is visible")
        return torch.device("cuda", local_rank % gpu_count())
    return torch.device("cpu")


def rank_and_world() -> tuple[int, int]:
    """(rank, world size) of the group this process joined, else of the environment (RANK, WORLD_SIZE;
    none: a single process). An environment that disagrees with the joined group is refused."""
    if not tdist.is_initialized():
        return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    group = tdist.get_rank(), tdist.get_world_size()
    wrong = [f"{k}={os.environ[k]}" for k, v in zip(("RANK", "WORLD_SIZE"), group)
             if os.environ.get(k, str(v)) != str(v)]
    if wrong:
        raise ConfigError(f"this process joined a process group as rank {group[0]} of {group[1]}, but the "
                          f"environment says {' '.join(wrong)}; unset it or make it match the group")
    return group


def connect(backend: str = "auto", timeout_s: float = 300.0, store_path: str | None = None,
            device: str = "auto") -> Dist:
    """Join the process group the environment describes (torchrun's or our spawner's RANK,
    WORLD_SIZE, ...; none: a single process), or the one this process already joined (the caller's
    own ``init_process_group``; its backend is taken for ``auto``). The group is made once per process
    and reused by later jobs of a multirun: re-creating it hangs under torchrun. ``store_path``:
    rendezvous through a FileStore there instead of MASTER_ADDR/MASTER_PORT."""
    rank, world = rank_and_world()
    local_rank = int(os.environ.get("LOCAL_RANK", str(rank)))
    name = tdist.get_backend() if backend == "auto" and tdist.is_initialized() else resolve_backend(backend)
    dev = pick_device(name, local_rank, device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)   # before init_process_group(device_id=...), and for this thread
    if world == 1:
        return Dist(rank, world, local_rank, dev, None, timeout_s)
    if name == "nccl" and not faulthandler.is_enabled():
        # NCCL's watchdog ends a rank whose collective timed out with SIGABRT: print where each
        # thread was (which collective the main thread waited behind) before the process goes.
        faulthandler.enable(all_threads=True)
    if not tdist.is_initialized():
        store = tdist.FileStore(store_path, world) if store_path else None
        tdist.init_process_group(name, rank=rank, world_size=world, store=store,
                                 timeout=timedelta(seconds=timeout_s),
                                 device_id=dev if name == "nccl" else None)
    if tdist.get_backend() != name:
        raise ConfigError(f"this process already joined a {tdist.get_backend()} group; dist.backend={name} "
                          f"cannot change within one process")
    dist = Dist(rank, world, local_rank, dev, name, timeout_s)
    peers = dist.all_gather_object((socket.gethostname(), os.getpid()), what="peer gather at connect")
    return replace(dist, peers=tuple(tuple(p) for p in peers))


def disconnect() -> None:
    if tdist.is_initialized():
        tdist.destroy_process_group()


def agree(dist, fn: Callable[[], object], what: str):
    """``fn()`` on every rank, outcomes exchanged with ``dist.all_gather_object`` under ``what`` (a
    ``Dist`` or the checkpoint's group; a barrier too): a rank that failed raises its own error, the
    others one naming it, instead of waiting on a peer that will never come to the next collective."""
    mine: BaseException | None = None
    try:
        result = fn()
    except Exception as e:  # noqa: BLE001 - re-raised below, after the peers have heard of it
        mine = e
    errs = dist.all_gather_object(None if mine is None else f"rank {dist.rank}: {str(mine).splitlines()[0]}",
                                  what=what)
    if mine is not None:
        raise mine
    failed = [e for e in errs if e]
    if failed:
        raise FrameworkError(f"{what} failed on another rank: {failed[0]}")
    return result
