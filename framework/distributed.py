"""The Dist value: rank, world size, device, and the collectives object of its backend (``dist.comm``).

Collectives are no-ops at world size 1, so the same code runs on one process. Every
collective names what it waits for, so a timeout (a peer died or stalled) ends the
surviving ranks with one clear line instead of a hang or a bare gloo error.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass, replace
from datetime import timedelta
from functools import cached_property
from typing import Callable

import torch
import torch.distributed as tdist
# torch.distributed.nn.functional binds group.WORLD as default arguments when it is imported.
# torch imports it lazily (torch._dynamo does, e.g. on the first init of a meta-device tensor);
# imported after init_process_group, it pins the group, destroy_process_group cannot free it,
# and a gloo worker thread may then drop its last work (whose tensors need the GIL) during
# interpreter shutdown: "terminate called without an active exception". Imported here,
# before any group exists, those defaults are None.
import torch.distributed.nn.functional  # noqa: F401  (import order matters, see above)

from framework.collectives import Collectives, collectives_for
from framework.errors import ConfigError, DistributedError, FrameworkError


@dataclass(frozen=True)
class Dist:
    rank: int
    world: int
    local_rank: int
    device: torch.device
    backend: str | None
    timeout_s: float
    # (host name, process id) of every rank, gathered at connect: lets a survivor name the
    # ranks whose process is gone when a collective fails (on its own host; others are unknown).
    peers: tuple[tuple[str, int], ...] = ()

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @cached_property
    def comm(self) -> Collectives:
        """The collectives object of this backend (Local at world 1, Gloo, Nccl): what stages call."""
        return collectives_for(self)

    def _run(self, what: str, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except RuntimeError as e:  # gloo/NCCL report timeouts and dead peers as RuntimeError
            who = self.who_failed()
            raise DistributedError(
                f"rank {self.rank}/{self.world}: {what} failed after waiting up to {self.timeout_s:g}s "
                f"({who}; dist.timeout_s sets the limit): {str(e).splitlines()[0]}"
            ) from e

    def lost_ranks(self) -> list[int]:
        """Ranks on this host whose process no longer exists (a slow peer is not listed)."""
        host = socket.gethostname()
        return [r for r, (h, pid) in enumerate(self.peers) if h == host and r != self.rank and not _alive(pid)]

    def stalled_ranks(self) -> dict[int, str]:
        """Ranks on this host whose process exists but cannot run: stopped (SIGSTOP, a debugger)
        or blocked in the kernel (state D, e.g. a hung disk), with what the kernel says."""
        host = socket.gethostname()
        out = {}
        for r, (h, pid) in enumerate(self.peers):
            state = _state(pid) if h == host and r != self.rank else None
            if state in _STALLED:
                out[r] = f"pid {pid} {_STALLED[state]}"
        return out

    def who_failed(self) -> str:
        """The peers to blame for a failed collective, as far as this host can tell."""
        lost, stalled = self.lost_ranks(), self.stalled_ranks()
        parts = []
        if lost:
            parts.append(f"rank{'s' if len(lost) > 1 else ''} {', '.join(map(str, lost))} lost (process gone)")
        parts += [f"rank {r} stalled ({why})" for r, why in sorted(stalled.items())]
        return "; ".join(parts) or "a peer rank died or stalled"

    def all_reduce(self, t: torch.Tensor, op=tdist.ReduceOp.SUM, what: str = "all_reduce", async_op=False):
        if self.world == 1:
            return None
        return self._run(what, tdist.all_reduce, t, op=op, async_op=async_op)

    def wait(self, works, what: str) -> None:
        """Wait for async collectives (None entries are the no-ops of world size 1)."""
        for w in works:
            if w is not None:
                self._run(what, w.wait)

    def all_gather_object(self, obj, what: str = "all_gather_object") -> list:
        if self.world == 1:
            return [obj]
        out = [None] * self.world
        self._run(what, tdist.all_gather_object, out, obj)
        return out

    def broadcast(self, t: torch.Tensor, src: int = 0, what: str = "broadcast", async_op=False):
        if self.world == 1:
            return None
        return self._run(what, tdist.broadcast, t, src=src, async_op=async_op)

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
    # A zombie (exited, not yet reaped by its parent) counts as gone.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def resolve_backend(backend: str) -> str:
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ConfigError(f"dist.backend={backend!r} is not one of auto, gloo, nccl")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ConfigError("dist.backend=nccl needs CUDA; use dist.backend=gloo (or auto) on CPU")
    return backend


def connect(backend: str = "auto", timeout_s: float = 300.0, store_path: str | None = None) -> Dist:
    """Join (or reuse) the process group described by the environment.

    Under torchrun or our own spawner RANK/WORLD_SIZE/MASTER_ADDR are set; without them this
    is a single process and no group is created. The group is created once per process and
    reused by later jobs of a multirun: re-creating it per job hangs under torchrun.
    ``store_path``: rendezvous through a FileStore there (local spawned ranks) instead of
    the TCP store named by MASTER_ADDR/MASTER_PORT.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", str(rank)))
    name = resolve_backend(backend)
    device = torch.device("cuda", local_rank) if name == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world > 1 and not tdist.is_initialized():
        store = tdist.FileStore(store_path, world) if store_path else None
        tdist.init_process_group(name, rank=rank, world_size=world, store=store,
                                 timeout=timedelta(seconds=timeout_s),
                                 device_id=device if device.type == "cuda" else None)
    if world > 1 and tdist.get_backend() != name:
        raise ConfigError(f"this process already joined a {tdist.get_backend()} group; dist.backend={name} "
                          f"cannot change within one process")
    dist = Dist(rank, world, local_rank, device, name if world > 1 else None, timeout_s)
    if world > 1:
        peers = dist.all_gather_object((socket.gethostname(), os.getpid()), what="peer gather at connect")
        dist = replace(dist, peers=tuple(tuple(p) for p in peers))
    return dist


def disconnect() -> None:
    if tdist.is_initialized():
        tdist.destroy_process_group()


def agree(gather: Callable[[object], list], rank: int, fn: Callable[[], object], what: str) -> None:
    """Run ``fn`` on every rank, then exchange outcomes with ``gather`` (an all-gather of one object
    per rank; it doubles as a barrier): a rank that failed raises its own error, the others one
    naming it, instead of waiting on a peer that will never come to the next collective."""
    mine: BaseException | None = None
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - re-raised below, after the peers have heard of it
        mine = e
    errs = gather(None if mine is None else f"rank {rank}: {str(mine).splitlines()[0]}")
    if mine is not None:
        raise mine
    failed = [e for e in errs if e]
    if failed:
        raise FrameworkError(f"{what} failed on another rank: {failed[0]}")
