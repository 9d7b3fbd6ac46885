"""A pool of N spawned ranks that join one gloo group once and then run many test cases.

Spawning ranks and forming a group costs seconds on this machine, so distributed tests share
one pool per world size for the whole session. Every call has a deadline: a hang fails the
test (and the pool is torn down) instead of blocking the suite. Starting the ranks (spawn, imports,
the group) has its own deadline, waited for before the first call's own starts: a call's timeout is
the time of its function only, whichever test happens to start the pool.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import time
import traceback

import torch.multiprocessing as mp


def _serve(rank: int, world: int, store: str, conn_list, backend: str = "gloo", device: str = "auto") -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      GLOO_SOCKET_IFNAME="lo")
    import torch

    from framework.comm.distributed import connect

    torch.set_num_threads(1)
    dist = connect(backend, timeout_s=60, store_path=store, device=device)
    import gc
    gc.collect()
    gc.freeze()   # the imports' objects: later full collections skip them (tests/conftest.py, _one_thread)
    conn = conn_list[rank]
    conn.send(("ready", None))
    while True:
        msg = conn.recv()
        if msg is None:
            break
        fn, args, kwargs = msg
        try:
            conn.send(("ok", fn(dist, *args, **kwargs)))
        except BaseException:  # noqa: BLE001 - report everything back to the test
            conn.send(("error", traceback.format_exc()))
    torch.distributed.destroy_process_group()


class RankPool:
    """``backend``/``device``: as ``framework.comm.distributed.connect`` takes them (the GPU tests use
    NCCL, or gloo with CUDA tensors on one GPU). ``start_timeout``: seconds the ranks may take to
    start and join the group (a loaded 2-core machine needs tens of seconds for 4 ranks)."""

    def __init__(self, world: int, backend: str = "gloo", device: str = "auto", start_timeout: float = 300):
        self.world = world
        self._start_timeout, self._ready, self._stopping = start_timeout, False, False
        self._dir = tempfile.mkdtemp(prefix="framework-pool-")
        ctx = mp.get_context("spawn")
        pipes = [ctx.Pipe() for _ in range(world)]
        self._conns = [p[0] for p in pipes]
        self._ctx = mp.start_processes(_serve, args=(world, os.path.join(self._dir, "store"), [p[1] for p in pipes],
                                                     backend, device),
                                       nprocs=world, join=False, start_method="spawn")

    def run(self, fn, *args, timeout: float = 120, **kwargs) -> list:
        """Run ``fn(dist, *args, **kwargs)`` on every rank; return the per-rank results."""
        if not self._ready:
            self._wait_ready()
        for c in self._conns:
            c.send((fn, args, kwargs))
        out = []
        for rank, c in enumerate(self._conns):
            if not c.poll(timeout):
                self.close(kill=True)
                raise TimeoutError(f"rank {rank} did not finish {fn.__name__} within {timeout}s (hang?)")
            status, value = c.recv()
            if status == "error":
                self.close(kill=True)
                raise RuntimeError(f"rank {rank} failed in {fn.__name__}:\n{value}")
            out.append(value)
        return out

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self._start_timeout
        for rank, c in enumerate(self._conns):
            while True:
                try:
                    if c.poll(1.0) and c.recv() == ("ready", None):
                        break
                except EOFError:   # the rank is gone
                    pass
                exited = [p.exitcode for p in self._ctx.processes]
                if any(e is not None for e in exited) or time.monotonic() > deadline:
                    self.close(kill=True)
                    raise RuntimeError(f"rank {rank} did not start and join the group (exit codes {exited}, None: "
                                       f"still running; start timeout {self._start_timeout}s)")
        self._ready = True

    def stop(self) -> None:
        """Ask every rank to leave its group and exit, without waiting (``close`` waits): pools stopped
        together wind down at once."""
        if self._ctx is not None and not self._stopping:
            self._stopping = True
            for c in self._conns:
                c.send(None)

    def close(self, kill: bool = False) -> None:
        if self._ctx is None:
            return
        if not kill:
            self.stop()
            self._ctx.join(timeout=30)
        for p in self._ctx.processes:
            if p.is_alive():
                p.kill()
        self._ctx = None
        shutil.rmtree(self._dir, ignore_errors=True)

    @property
    def alive(self) -> bool:
        return self._ctx is not None
