"""The Dist value (rank, world size, device, its accelerator and collectives), made by ``connect``.

Collectives are no-ops at world size 1. Each names what it waits for, so a timeout (a dead or stalled peer) ends the
surviving ranks with one line naming it; on NCCL, whose ``wait`` only orders the compute stream, the watchdog aborts
a waiting rank after ``timeout_s`` (SIGABRT), which the launcher names.
"""
from __future__ import annotations

import faulthandler
import os
import socket
import time
from dataclasses import dataclass, replace
from datetime import timedelta
from functools import cached_property
from typing import Callable

import torch
import torch.distributed as tdist
# torch.distributed.nn.functional binds group.WORLD as default arguments when imported (torch._dynamo imports it
# lazily): after init_process_group that pins the group past destroy_process_group, and a gloo worker may then drop
# its last work during interpreter shutdown ("terminate called without an active exception"). Imported here, before
# any group exists, those defaults are None.
import torch.distributed.nn.functional  # noqa: F401  (import order matters, see above)

from framework.comm.accelerator import Accelerator, for_device
from framework.comm.collectives import CheckedWork, Collectives, collectives_for
from framework.comm.rendezvous import env_int, join, launcher_int
from framework.core.errors import ConfigError, DistributedError, FrameworkError, first_line, on_every_rank
from framework.core.room import descriptors_in


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
            if (few_files := descriptors_in(e)) is not None:   # gloo's sockets hit the limit: no peer to blame
                raise DistributedError(f"rank {self.rank}/{self.world}: {what}: {few_files}") from e
            lost, stalled = self._blame()
            who = _blamed(lost, stalled)
            if lost:   # its closed connections failed the collective at once: no wait, nothing the backend adds
                raise DistributedError(f"rank {self.rank}/{self.world}: {who} during {what}") from e
            if not stalled and any(c in str(e) for c in _CLOSED):   # the same from a peer still unwinding its error
                peer = f"rank {1 - self.rank}" if self.world == 2 else "a peer rank"   # (or on another host)
                raise DistributedError(f"rank {self.rank}/{self.world}: {peer} closed its connection during {what} "
                                       f"(it failed or died: its own error is on its console or log)") from e
            timeout_s, key = limit or (self.timeout_s, "dist.timeout_s")
            raise DistributedError(f"rank {self.rank}/{self.world}: {what} failed after waiting up to {timeout_s:g}s ("
                                   f"{who}; {key} sets the limit): {str(e).splitlines()[0]}", waited=not stalled) from e

    def who_failed(self, settle_s: float | None = None) -> str:
        """The ranks on this host to blame for a failed collective (``_blame``), in words."""
        return _blamed(*self._blame(settle_s))

    def _blame(self, settle_s: float | None = None) -> tuple[list[int], list[str]]:
        """(the ranks on this host whose process is gone or exiting, one line per rank stopped or blocked in the
        kernel); a slow peer is not named. A crashed peer may still be exiting when its closed sockets fail our
        collective: while nobody is named, wait up to ``settle_s`` (default ``_SETTLE_S``)."""
        host = socket.gethostname()
        local = [(r, pid) for r, (h, pid) in enumerate(self.peers) if h == host and r != self.rank]
        deadline = time.monotonic() + (_SETTLE_S if settle_s is None else settle_s)
        while True:
            states = [(r, pid, process_state(pid)) for r, pid in local]
            lost = [r for r, _, s in states if s == "gone"]
            stalled = [f"rank {r} stalled (pid {pid} {_STALLED[s]})" for r, pid, s in states if s in _STALLED]
            if lost or stalled or not local or time.monotonic() >= deadline:
                return lost, stalled
            time.sleep(0.02)

    def all_reduce(self, t: torch.Tensor, op=tdist.ReduceOp.SUM, what: str = "all_reduce", async_op=False):
        return None if self.world == 1 else self._issue(what, tdist.all_reduce, t, op=op, async_op=async_op)

    def wait(self, works, what: str) -> None:
        """Wait for async collectives (None entries are the no-ops of world size 1)."""
        for w in (w for w in works if w is not None):
            self._run(what, w.wait)

    def all_gather_object(self, obj, what: str = "all_gather_object", group=None,
                          limit: tuple[float, str] | None = None) -> list:
        """``group``, ``limit``: another process group and its (timeout, key), as ``_run``'s."""
        if self.world == 1:
            return [obj]
        out = [None] * self.world
        self._run(what, tdist.all_gather_object, out, obj, group=group, limit=limit)
        return out

    def broadcast(self, t: torch.Tensor, src: int = 0, what: str = "broadcast") -> None:
        if self.world > 1:
            self._issue(what, tdist.broadcast, t, src=src)

    def gloo_group(self, timeout_s: float, what: str):
        """A new gloo group of every rank (None at world size 1) whose collectives wait up to ``timeout_s``. Making
        it is a collective of this Dist's: a peer that never arrives is waited for ``timeout_s`` of this Dist and
        named, as any collective's."""
        if self.world == 1:
            return None
        pg = self._run(what, tdist.new_group, backend="gloo", timeout=timedelta(seconds=self.timeout_s))
        pg.set_timeout(timedelta(seconds=timeout_s))
        return pg

    def barrier(self, what: str = "barrier") -> None:
        if self.world > 1:
            # A tensor all-reduce rather than tdist.barrier: it honours the group timeout on gloo.
            self.all_reduce(torch.zeros(1, device=self.device), what=what)


def _blamed(lost: list[int], stalled: list[str]) -> str:
    """``Dist._blame``'s answer in words."""
    parts = [f"rank{'s' if len(lost) > 1 else ''} {', '.join(map(str, lost))} lost (process gone)"] if lost else []
    return "; ".join(parts + stalled) or "a peer rank died or stalled"


_CLOSED = ("Connection closed by peer", "Connection reset by peer")   # gloo's words for a peer's closed socket
_STALLED = {"T": "is stopped (SIGSTOP or SIGTSTP: send SIGCONT, or kill it)", "t": "is stopped by a debugger",
            "D": "is blocked in the kernel (uninterruptible sleep: a hung disk or network file system?)"}
# How long ``who_failed`` waits for a local peer to be seen gone when none is yet: the kernel closes a dying
# process's sockets before it shows as a zombie, and a peer may close them itself while still exiting.
_SETTLE_S = 1.0
_PF_EXITING = 0x4   # the kernel's task flag for a process inside exit (``flags``, field 9 of /proc/<pid>/stat)


def parse_stat(text: str) -> tuple[str, int]:
    """(state letter, flags) from the text of /proc/<pid>/stat. The command name (field 2) may hold spaces
    and parentheses: the fields are counted after its last ')'."""
    fields = text.rsplit(")", 1)[1].split()
    return fields[0], int(fields[6])


def process_state(pid: int) -> str:
    """The kernel's one-letter state of process ``pid`` (Linux /proc; "" where unknown), or "gone"."""
    try:
        os.kill(pid, 0)
        ours = True
    except ProcessLookupError:
        return "gone"
    except PermissionError:   # another user's process: alive, whatever its state
        ours = False
    try:
        with open(f"/proc/{pid}/stat") as f:
            state, flags = parse_stat(f.read())
    except (OSError, IndexError, ValueError):
        return ""
    # A zombie (exited, not yet reaped by its parent) or a process inside exit counts as gone.
    return "gone" if ours and (state == "Z" or flags & _PF_EXITING) else state


def run_world(nproc: int) -> int:
    """The ranks a run has: an external launcher's WORLD_SIZE above 1 (torchrun, a Slurm task), else dist.nproc's."""
    return world if (world := env_int("WORLD_SIZE", 1)) > 1 else nproc


def _tasks_key() -> str:
    """The variable with the Slurm step's task count (an interactive step, salloc, has only the allocation's)."""
    return "SLURM_STEP_NUM_TASKS" if os.environ.get("SLURM_STEP_NUM_TASKS") else "SLURM_NTASKS"


def _slurm_task_is(rank: str | None, world: str | None) -> bool:
    """Whether srun started this process itself as task ``rank`` of a step of ``world`` tasks."""
    return None not in (rank, world) and os.environ.get("SLURM_PROCID") == rank \
        and os.environ.get(_tasks_key()) == world


def check_env_ints() -> None:
    """One line for a launcher variable (torchrun's, Slurm's) that is not an integer, or rank variables that
    disagree (a rank outside its world; Slurm tasks sharing one RANK): else the rendezvous times out."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_NTASKS", "SLURM_STEP_NUM_TASKS",
                 "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "TORCHELASTIC_RESTART_COUNT"):
        env_int(name, 0)
    env = os.environ
    for idx, size in (("RANK", "WORLD_SIZE"), ("LOCAL_RANK", "LOCAL_WORLD_SIZE")):
        if idx == "LOCAL_RANK" and not env.get(size):   # a LOCAL_RANK alone names a GPU: nothing to check
            continue
        n = env_int(size, 1)
        if n < 1:
            raise ConfigError(f"{size}={n}: a launch has at least 1 rank; unset {size} or launch with torchrun")
        if env.get(idx) and not 0 <= (i := env_int(idx, 0)) < n:
            raise ConfigError(f"{idx}={i} is not a rank of {f'{size}={n}' if env.get(size) else f'{size} unset (1)'} "
                              f"(0 to {n - 1}); set both per rank (torchrun does) or unset them")
    # srun starting a task per rank: a RANK exported once for the step is every task's (torchrun under
    # srun numbers its ranks itself).
    key = _tasks_key()
    if env.get("RANK") and env.get("SLURM_PROCID") and "TORCHELASTIC_RUN_ID" not in env \
            and env_int(key, 0) == env_int("WORLD_SIZE", 1) > 1 and env["RANK"] != env["SLURM_PROCID"]:
        raise ConfigError(f"RANK={env['RANK']} but SLURM_PROCID={env['SLURM_PROCID']} in a step of {env[key]} tasks: "
                          f"RANK must be set per task (unset RANK or export it per task: RANK=$SLURM_PROCID), or "
                          f"run torchrun under srun (recipes/cluster/sbatch_torchrun.sh)")


def gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def local_world_size() -> int:
    """Ranks on this host: the launcher's (``local_ranks``), else WORLD_SIZE (one host)."""
    return local_ranks(*rank_and_world())[1] or env_int("WORLD_SIZE", 1)


def local_ranks(rank: int, world: int) -> tuple[int | None, int | None]:
    """(this rank's index on its host, ranks on its host), None where the launcher does not say: LOCAL_RANK /
    LOCAL_WORLD_SIZE (torchrun, our spawner), else Slurm's for an srun task that is this rank."""
    index, count = env_int("LOCAL_RANK", None), env_int("LOCAL_WORLD_SIZE", None)
    if _slurm_task_is(str(rank), str(world)):
        count = slurm_tasks_here() if count is None else count
        index = env_int("SLURM_LOCALID", None) if index is None else index
    return index, count


def slurm_tasks_here() -> int | None:
    """This node's task count from Slurm's per-node list ("4(x2),3": 4 on each of the first two nodes), or None."""
    name = next((k for k in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
                 if os.environ.get(k)), None)
    if name is None:
        return None
    counts = []
    for part in os.environ[name].split(","):
        n, _, times = part.partition("(x")
        counts += [n] * launcher_int(name, times.rstrip(")") or "1")
    node = env_int("SLURM_NODEID", 0)
    here = counts[node] if node < len(counts) else counts[0] if len(set(counts)) == 1 else None
    return launcher_int(name, here) if here else None


def check_env(store_path: str | None = None) -> None:
    """One line, before connecting, for a launch environment that cannot work: a leftover WORLD_SIZE
    without the rest of torchrun's variables, or Slurm tasks nothing made into one group."""
    if tdist.is_initialized():
        return
    check_env_ints()
    env = os.environ
    world = env_int("WORLD_SIZE", 1)
    if world > 1:
        needed = ("RANK",) if store_path else ("RANK", "MASTER_ADDR", "MASTER_PORT")
        if missing := [k for k in needed if not env.get(k)]:
            raise ConfigError(f"WORLD_SIZE={world} is set but {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} "
                              f"not: launch with torchrun (or dist.nproc=N for local ranks), or unset WORLD_SIZE")
    key = _tasks_key()
    tasks = env_int(key, 1)
    if "WORLD_SIZE" not in env and tasks > 1 and "SLURM_STEP_ID" in env:
        raise ConfigError(f"{key}={tasks}: srun started {tasks} tasks, but nothing made them one group (each "
                          f"would train alone into one run folder); run torchrun under srun "
                          f"(recipes/cluster/sbatch_torchrun.sh) or Hydra's submitit launcher, or srun --ntasks=1")


def resolve_backend(backend: str, local_world: int | None = None) -> str:
    """gloo or nccl for ``backend`` (auto | gloo | nccl) with ``local_world`` ranks on this host. NCCL
    refuses two ranks on one GPU, so ``auto`` is NCCL only when there is a GPU per rank."""
    if backend not in ("auto", "gloo", "nccl"):
        raise ConfigError(f"dist.backend={backend!r} is not one of auto, gloo, nccl")
    local = local_world_size() if local_world is None else local_world
    gpus = gpu_count()
    env = os.environ
    # A Slurm task bound to GPUs of its own (srun --gpus-per-task: CUDA_VISIBLE_DEVICES per task) sees fewer
    # GPUs than its host has ranks although each rank has one; ranks sharing one CUDA_VISIBLE_DEVICES do not.
    if env.get("CUDA_VISIBLE_DEVICES") and 0 < gpus < local and _slurm_task_is(env.get("RANK"), env.get("WORLD_SIZE")):
        local = 1
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
    if backend != "auto" or not (gpus := gpu_count()) or resolve_backend("auto", local_world) == "nccl":
        return None
    s = "s" if gpus != 1 else ""
    return (f"dist.backend=auto: {local_world} ranks on this host but {gpus} GPU{s}: training on the CPU over "
            f"gloo (NCCL needs one GPU per rank); use at most {gpus} rank{s} per host to train on the GPU{s}")


def pick_device(backend: str, local_rank: int, device: str = "auto") -> torch.device:
    """A rank's compute device: ``auto`` is cuda:LOCAL_RANK on NCCL (modulo the GPUs a Slurm task sees)
    and the CPU on gloo; ``cuda`` puts a gloo rank on GPU LOCAL_RANK % GPUs (ranks may share one)."""
    if device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"device={device!r} is not one of auto, cpu, cuda")
    gpus = gpu_count()
    if backend == "nccl":
        if device == "cpu":
            raise ConfigError("the nccl backend needs CUDA tensors; use gloo for a CPU device")
        return torch.device("cuda", local_rank % gpus if 0 < gpus <= local_rank else local_rank)
    if device == "cuda":
        if not gpus:
            raise ConfigError("device=cuda needs a GPU; none is visible")
        return torch.device("cuda", local_rank % gpus)
    return torch.device("cpu")


def rank_and_world() -> tuple[int, int]:
    """(rank, world size) of the joined group (an environment disagreeing with it is refused), else of RANK and
    WORLD_SIZE (unset: a single process)."""
    if not tdist.is_initialized():
        return env_int("RANK", 0), env_int("WORLD_SIZE", 1)
    group = tdist.get_rank(), tdist.get_world_size()
    wrong = [f"{k}={os.environ[k]}" for k, v in zip(("RANK", "WORLD_SIZE"), group)
             if os.environ.get(k, str(v)) != str(v)]
    if wrong:
        raise ConfigError(f"this process joined a process group as rank {group[0]} of {group[1]}, but the "
                          f"environment says {' '.join(wrong)}; unset it or make it match the group")
    return group


def connect(backend: str = "auto", timeout_s: float = 300.0, store_path: str | None = None,
            device: str = "auto") -> Dist:
    """Join the process group the environment describes (RANK, WORLD_SIZE, ...; none: a single process), or
    reuse the one this process joined (the caller's, any backend spec: the part carrying this rank's tensors
    is used, ``timeout_s`` set on it, a current CUDA device kept; a multirun's later jobs reuse it, as
    re-creating it hangs under torchrun). ``store_path``: a FileStore rendezvous instead of MASTER_ADDR/PORT."""
    check_env(store_path)
    rank, world = rank_and_world()
    joined = tdist.is_initialized()
    gpus = gpu_count()
    local, local_world = local_ranks(rank, world)
    mine = _current_cuda_device() if joined else None   # the caller's choice, for the group they made
    # A group the caller made with gloo alone trains on the CPU (asked as if one rank per GPU).
    on_cpu = joined and device != "cuda" and joined_backend(backend, device, 1) == "gloo"
    if world > 1 and gpus and device != "cpu" and (backend != "gloo" or device == "cuda") and not on_cpu \
            and (local_world is None or (local is None and mine is None)) and world > gpus:
        raise ConfigError(f"cannot tell which of this host's {gpus} GPUs rank {rank} of {world} uses: set "
                          f"LOCAL_RANK and LOCAL_WORLD_SIZE (torchrun sets them; Slurm's SLURM_LOCALID is used "
                          f"where SLURM_PROCID is the rank), or dist.backend=gloo to train on the CPU")
    index = device_index(local, mine, gpus)
    local = rank if local is None else local
    local_world = world if local_world is None else local_world
    name = joined_backend(backend, device, local_world) if joined else resolve_backend(backend, local_world)
    dev = pick_device(name, local if index is None else index, device)
    if dev.type == "cuda" and dev.index != mine:
        torch.cuda.set_device(dev)   # before init_process_group(device_id=...), and for this thread
    if world == 1:
        return Dist(rank, world, local, dev, None, timeout_s)
    if name == "nccl" and not faulthandler.is_enabled():
        # NCCL's watchdog ends a timed-out rank with SIGABRT: print which collective each thread waited in.
        faulthandler.enable(all_threads=True)
    if joined:   # made with another timeout (the caller's, or an earlier job's of a multirun)
        tdist.group.WORLD.set_timeout(timedelta(seconds=timeout_s))
    else:
        join(name, rank, world, timeout_s, store_path, dev if name == "nccl" else None)
    dist = Dist(rank, world, local, dev, name, timeout_s)
    peers = dist.all_gather_object((socket.gethostname(), os.getpid()), what="peer gather at connect")
    return replace(dist, peers=tuple(tuple(p) for p in peers))


def device_index(local: int | None, mine: int | None, gpus: int) -> int | None:
    """A rank's GPU from LOCAL_RANK ``local`` and the one its caller made current, ``mine`` (None: unknown):
    the caller's wins, unless it is CUDA's default 0 while LOCAL_RANK names another visible GPU."""
    return mine if mine is not None and (mine != 0 or local is None or local >= gpus) else local


def _current_cuda_device() -> int | None:
    """The CUDA device this process made current, None where it has not touched CUDA."""
    return torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None


def joined_backend(backend: str, device: str = "auto", local_world: int = 1,
                   spec: str | None = None) -> str:
    """gloo or nccl: the backend of the joined group (``spec`` as get_backend_config gives it, e.g.
    "cpu:gloo,cuda:nccl") that carries this rank's tensors; ``auto`` prefers ``resolve_backend``'s pick."""
    spec = tdist.get_backend_config() if spec is None else spec
    per = dict(part.rpartition(":")[::2] for part in spec.replace(" ", "").split(","))
    usable = []
    if device != "cpu" and gpu_count() and per.get("cuda", per.get("")) == "nccl":
        usable.append("nccl")
    if per.get("cuda" if device == "cuda" else "cpu", per.get("")) == "gloo":
        usable.append("gloo")
    if backend == "auto":
        want = resolve_backend("auto", local_world) if device != "cpu" else "gloo"
        if usable:
            return want if want in usable else usable[0]
    elif resolve_backend(backend, local_world) in usable:
        return backend
    raise ConfigError(f"this process joined a process group with backend {spec!r}, which has no "
                      f"{'gloo or nccl' if backend == 'auto' else backend} backend for "
                      f"{'CUDA' if device == 'cuda' else 'CPU' if device == 'cpu' else 'this device'}'s tensors "
                      f"(dist.backend={backend}, device={device}); make it with backend='gloo' or 'nccl' "
                      f"(or 'cpu:gloo,cuda:nccl'), or match dist.backend and device to it")


def disconnect() -> None:
    if tdist.is_initialized():
        tdist.destroy_process_group()


def agree(dist, fn: Callable[[], object], what: str, shared: Callable[[object], object] | None = None):
    """``fn()`` on every rank, outcomes exchanged under ``what`` (``dist``: a ``Dist`` or the checkpoint's group):
    a failed rank raises its error, the others one naming it, rather than wait in the next collective. ``shared``:
    return (the result, every rank's ``shared(result)``, from the same collective: all compare the same values)."""
    mine: BaseException | None = None
    try:
        result = fn()
        share = None if shared is None else shared(result)
    except Exception as e:  # noqa: BLE001 - re-raised below, after the peers have heard of it
        mine, share = e, None
    # (each failure: its line, and whether a sweep's ranks may all go on after it)
    entry = mine and (f"rank {dist.rank}: {first_line(mine)}", isinstance(mine, FrameworkError)
                      and not isinstance(mine, DistributedError))
    got = dist.all_gather_object(entry if shared is None else (entry, share), what=what)
    failed = [e for e in (got if shared is None else [e for e, _ in got]) if e]
    every = all(ok for _, ok in failed)
    if mine is not None:
        raise on_every_rank(mine, every)
    if failed:
        raise on_every_rank(FrameworkError(f"{what} failed on another rank: {failed[0][0]}"), every)
    return result if shared is None else (result, [v for _, v in got])
