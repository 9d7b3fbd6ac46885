"""Joining the process group: the store the ranks meet at (a FileStore, or a TCPStore at MASTER_ADDR:MASTER_PORT)
and init_process_group on it.

Every wait before init_process_group is a Python loop of short sleeps: a signal's handler (Ctrl-C, SIGTERM) runs
meanwhile, where torch's own waits, in C++, defer it ``timeout_s``. Before a rank writes to a TCP store it checks
that the store is its own job's (rank 0 sets the job's identity there): a second job started on a port another
job's store holds would otherwise join that job's ranks.
"""
from __future__ import annotations

import os
import socket
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as tdist

from framework.core.errors import ConfigError, DistributedError, first_line, say

WAITING_NOTE_S = 5.0   # how long a rank waits in silence before it says what it waits for
_JOB = "framework/job"
_STARTED = "framework/started"


def job_identity() -> str:
    """What the ranks of one job share and another job's do not: the launcher's run id (torchrun), else the
    scheduler's job (Slurm's: not its step, as a batch script may start its ranks in separate sruns; PBS's, LSF's),
    "" where none is set (a second job's rank is then refused only once the first job's ranks started)."""
    env = os.environ
    if run := env.get("TORCHELASTIC_RUN_ID"):
        return f"torchrun {run}"
    for key, name in (("SLURM_JOB_ID", "Slurm"), ("PBS_JOBID", "PBS"), ("LSB_JOBID", "LSF")):
        if env.get(key):
            return f"{name} job {env[key]}"
    return ""


def restart_note(rank: int) -> str | None:
    """Rank 0's note where torchrun restarts ranks on several nodes sharing its store: the framework's attempt
    prefix counts one agent's restarts, and a node whose ranks did not fail keeps its count (a stale attempt)."""
    env = os.environ
    if rank != 0 or env.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "0") == "1":
        return None
    restarts, nodes = env.get("TORCHELASTIC_MAX_RESTARTS", ""), env.get("GROUP_WORLD_SIZE", "")
    if not (restarts.isdigit() and int(restarts) > 0 and nodes.isdigit() and int(nodes) > 1):
        return None
    return (f"note: torchrun --max-restarts={restarts} on {nodes} nodes: set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 "
            f"on every node (a node whose ranks did not fail keeps its restart count and would meet the failed "
            f"attempt's keys)")


def join(backend: str, rank: int, world: int, timeout_s: float, store_path: str | None,
         device_id: torch.device | None) -> None:
    """init_process_group via a FileStore at ``store_path`` (else MASTER_ADDR:MASTER_PORT); a failed
    rendezvous (the port taken, a peer that never joins, another job's store) is one line naming where and how long."""
    timeout, deadline = timedelta(seconds=timeout_s), time.monotonic() + timeout_s   # (one wait, however split)
    if note := restart_note(rank):
        say(note)
    where = f"FileStore {store_path}" if store_path else \
        f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')} (MASTER_ADDR:MASTER_PORT)"
    if not store_path and (host := os.environ.get("MASTER_ADDR")):   # a typo: said now, not a rank missing
        try:                                                          # after torch's retries until the timeout
            socket.getaddrinfo(host, None)
        except socket.gaierror as e:   # (a temporary failure, EAI_AGAIN, is left to those retries)
            if e.errno != socket.EAI_AGAIN:
                raise ConfigError(f"rank {rank}/{world}: MASTER_ADDR={host} does not resolve ({e.strerror}): set it "
                                  f"to rank 0's host name or address (torchrun --master-addr)") from None
    try:
        if store_path:
            store = tdist.FileStore(store_path, world)
            store.set_timeout(timeout)   # (its own default is 300 s, whatever the group's timeout)
        else:
            store = _tcp_store(rank, world, timeout_s, where, deadline)
        _arrive(store, rank, world, timeout_s, where, check_job=not store_path, deadline=deadline)
        tdist.init_process_group(backend, rank=rank, world_size=world, store=store, timeout=timeout,
                                 device_id=device_id)
    except (RuntimeError, ValueError) as e:   # torch's DistNetworkError and DistStoreError are RuntimeErrors
        text, why = str(e), first_line(e)
        if "Duplicate GPU" in text:   # NCCL's own check, at the eager init device_id asks for
            visible = os.environ.get("CUDA_VISIBLE_DEVICES", "(unset)")
            why = (f"two ranks on one GPU (NCCL: Duplicate GPU detected; this rank's CUDA_VISIBLE_DEVICES={visible}): "
                   f"bind a GPU of its own to each task (srun --gpus-per-task=1) or use dist.backend=gloo")
        elif "EADDRINUSE" in text or "address already in use" in text.lower():
            why = "address already in use (another job on MASTER_PORT? give each job a port of its own)"
        elif "something else listens there" in text:   # (_tcp_store's own line: no rank is to blame)
            pass
        elif "timed out" in text.lower() or "timeout" in text.lower():
            why = (f"not every rank joined within dist.timeout_s={timeout_s:g}s (a rank that never started, "
                   f"or another host's MASTER_ADDR/MASTER_PORT): {why}")
        raise DistributedError(f"rank {rank}/{world}: rendezvous at {where} failed: {why}") from e


def env_restarts() -> int:
    """torchrun's attempt (0 for the first, and without torchrun)."""
    return env_int("TORCHELASTIC_RESTART_COUNT", 0)


def env_int(name: str, default: int | None) -> int | None:
    """The environment variable ``name`` as an integer (``default`` if unset or empty); one line otherwise."""
    return launcher_int(name, text) if (text := os.environ.get(name, "")) else default


def launcher_int(name: str, text: str) -> int:
    """``text``, the launcher variable ``name``'s value, as an integer; one line saying how to fix it otherwise."""
    try:
        return int(text)
    except ValueError:
        how = "srun" if name.startswith("SLURM_") else "torchrun"
        raise ConfigError(f"{name}={text!r} is not an integer; unset it or launch with {how}") from None


def _tcp_store(rank: int, world: int, timeout_s: float, where: str, deadline: float):
    """The TCPStore at MASTER_ADDR:MASTER_PORT: rank 0 serves it (torchrun's agent does when it shares its own,
    TORCHELASTIC_USE_AGENT_STORE); the others connect once something listens there, polled in short sleeps."""
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    timeout = timedelta(seconds=timeout_s)
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    if rank == 0 and not agent:
        return tdist.TCPStore(host, port, world, True, timeout, wait_for_workers=False, multi_tenant=True)
    noted = time.monotonic() + WAITING_NOTE_S
    while True:
        try:
            socket.create_connection((host, port), timeout=1.0).close()
            break
        except OSError as e:
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out after {timeout_s:g}s: nothing listens there ({e})") from None
        if time.monotonic() > noted:
            say(f"rank {rank}/{world}: waiting for rank 0 to listen at {where} (up to dist.timeout_s={timeout_s:g}s)")
            noted = float("inf")
        time.sleep(0.2)
    store = _client(host, port, world, timeout, deadline,
                    f"what listens there did not answer as a torch store within dist.timeout_s={timeout_s:g}s "
                    f"(something else listens there? give the job a free MASTER_PORT)")
    # A store torchrun shares across its restarts holds the earlier attempts' keys: each attempt its own.
    return tdist.PrefixStore(f"framework/attempt_{env_restarts()}/", store) if agent else store


def _client(host: str, port: int, world: int, timeout: timedelta, deadline: float, late: str):
    """A TCPStore client, made in a daemon thread and waited for in short joins: torch's handshake, in C++, waits
    unbounded (its timeout does not cover it) on a listener that is not a store, and defers signals meanwhile. At
    ``deadline`` raise ``late``; the stuck thread is left behind (a daemon: it does not keep the process alive)."""
    made: dict = {}

    def make() -> None:
        try:
            made["store"] = tdist.TCPStore(host, port, world, False, timeout)
        except BaseException as e:   # re-raised in the joining thread
            made["error"] = e

    thread = threading.Thread(target=make, name="tcp-store-client", daemon=True)
    thread.start()
    while thread.is_alive():
        if time.monotonic() > deadline:
            raise RuntimeError(late)
        thread.join(0.05)
    if "error" in made:
        raise made["error"]
    return made["store"]


def _arrive(store, rank: int, world: int, timeout_s: float, where: str, check_job: bool,
            deadline: float) -> None:
    """Wait until every rank reached ``store``, in short sleeps. ``check_job`` (a TCP store): first make sure the
    store is this job's (rank 0 sets ``job_identity``; the others wait for it and compare), as a port's store may be
    another's, and say what is waited for after ``WAITING_NOTE_S``. ``deadline``: the join's (``time.monotonic()``)."""
    noted = time.monotonic() + WAITING_NOTE_S
    mine = job_identity()
    if check_job and rank == 0:
        store.set(_JOB, mine)
    elif check_job:
        while not store.check([_JOB]):
            if time.monotonic() > noted:
                say(f"rank {rank}/{world}: waiting for rank 0 of this job to mark the store at {where} (up to "
                    f"dist.timeout_s={timeout_s:g}s; another job's store on MASTER_PORT, or rank 0 never started)")
                noted = float("inf")
            _tick(rank, world, timeout_s, deadline, "waiting for rank 0 of this job to mark the store there "
                  "(another job's store on MASTER_PORT, or rank 0 never started)")
        if (theirs := store.get(_JOB).decode()) != mine or store.check([_STARTED]):
            raise DistributedError(
                f"rank {rank}/{world}: rendezvous at {where} failed: the store there is another job's "
                f"({'one whose ranks already started' if theirs == mine else repr(theirs or 'unnamed')}; this job: "
                f"{mine or 'unnamed'}): another job on MASTER_PORT; give each job a port of its own")
    store.set(f"framework/arrived/{rank}", "")
    keys = [f"framework/arrived/{r}" for r in range(world)]
    while not store.check(keys):
        if check_job and time.monotonic() > noted:   # (spawned ranks: their launcher names one that never came)
            missing = sum(not store.check([k]) for k in keys)
            say(f"rank {rank}/{world}: waiting for {missing} rank{'s' if missing > 1 else ''} at {where}"
                f" (up to dist.timeout_s={timeout_s:g}s)")
            noted = float("inf")
        _tick(rank, world, timeout_s, deadline, "waiting for the other ranks")
    if check_job and rank == 0:
        store.set(_STARTED, "")   # a rank of another job reaching this store later is refused, not let in


def _tick(rank: int, world: int, timeout_s: float, deadline: float, what: str) -> None:
    if time.monotonic() > deadline:
        raise RuntimeError(f"timed out after {timeout_s:g}s {what}")
    time.sleep(0.05)
