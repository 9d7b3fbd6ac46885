"""Run a validated config on 1 process, on dist.nproc spawned local ranks, or under torchrun.

Spawned ranks rendezvous through a FileStore in a private temp folder (gloo on loopback: nothing listens on
the network). Under torchrun the group is created once per process and reused by every job of a multirun
(re-creating it per job hangs).
"""
from __future__ import annotations

import atexit
import contextlib
import json
import os
import pickle
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import replace
from multiprocessing.connection import wait
from pathlib import Path
from typing import Callable

import torch
import torch.multiprocessing as mp

from framework.persist import stepfolders
from framework.persist.checkpoint import checkpoint_root, identity, preflight, shared
from framework.config import Config, check_batch_world, check_ranks_agree
from framework.config.dsconfig import COMMAND_LINE
from framework.comm.distributed import (agree, backend_notice, check_env, connect, disconnect, env_int,
                                       local_world_size, process_state, resolve_backend, run_world, slurm_tasks_here)
from framework.core import files
from framework.core.units import GiB
from framework.core.utils import counted
from framework.offload import remove_stale
from framework.core.errors import ConfigError, DistributedError, FrameworkError, on_every_rank, say, typed_line
from framework.loggers import RunInfo, check_records
from framework.cli._rendezvous import (LOCK, PREFIX, all_alike, hold, mark_error, marked_alike, peer_lost_path,
                                      ready_path, remove_dead)
from framework.cli._signals import INTERRUPT, interrupted_line, signals_unwind, terminated_line
from framework.cli.loop import train


def launch(cfg: Config, run: RunInfo, on_point: Callable[[str], None] | None = None,
           on_owned: Callable[[Path], None] | None = None, on_ready: Callable[[Path], None] | None = None) -> dict:
    """Train and return rank 0's summary. ``on_point``: every rank's loop (fault tests); ``on_owned(run folder)``:
    once its lock is held; ``on_ready``: rank 0's loop (picklable)."""
    os.environ.update(slurm_task_env())
    try:   # (the same config and launcher variables on every rank: all raise alike)
        check_launch_env(cfg)
        check_saves(cfg)
        check_batch_world(cfg, run_world(cfg.dist.nproc))
    except FrameworkError as e:
        raise on_every_rank(e)
    # SIGTERM unwinds the run; the run and checkpoint folders' locks are held until the run (a multirun's job) ends
    with signals_unwind(), contextlib.ExitStack() as held:
        def own_and_preflight(cfg: Config, run: RunInfo) -> tuple[Config, RunInfo]:
            held.callback(os.close, own_run_folder(run))
            if on_owned is not None:   # (a refusal below removes the folder it made, run.lock and all)
                on_owned(run.run_dir)
            check_records(run.run_dir, "hydra.sweep.dir" if run.group else "hydra.run.dir")
            locks = []   # the checkpoint folder's lock file, which each save checks is still the folder's
            def own(root: Path) -> None:
                held.callback(os.close, fd := own_checkpoint_dir(root))
                locks.append(identity(fd))
            cfg = preflight(cfg, run.run_dir, run.job, run.sweep_dir, own=own, naming=run.naming)
            restart_notice(cfg, run)
            return cfg, replace(run, checkpoint_lock=locks[0] if locks else None)

        if env_int("WORLD_SIZE", 1) > 1:  # torchrun (or another launcher) made the ranks
            already = torch.distributed.is_initialized()
            cap_threads(local_world_size())
            dist = connect(cfg.dist.backend, cfg.dist.timeout_s)
            if dist.is_main and (line := backend_notice(cfg.dist.backend, local_world_size())):
                say(line)
            if not already:
                atexit.register(disconnect)
            # Ranks may resolve ${now:...} differently: rank 0's folder; this rank's removed if only Hydra wrote there.
            got = dist.all_gather_object((str(run.run_dir), cfg.to_dict()), what="run directory agreement")
            check_ranks_agree([c for _, c in got])   # (rank 0's config is trained: a rank's own would be dropped)
            dirs = [d for d, _ in got]
            if dirs[0] != dirs[dist.rank] and run.run_dir.is_dir() and (
                    {p.name for p in run.run_dir.iterdir()} <= {".hydra", "train.log"}):
                shutil.rmtree(run.run_dir, ignore_errors=True)
                _remove_stray_sweep(run.sweep_dir, Path(dirs[0]))
            run = replace(run, run_dir=Path(dirs[0]))
            # Rank 0 takes the folder, checks and resolves "latest" once; every rank stops with its error or trains it.
            mine = agree(dist, lambda: dist.is_main and own_and_preflight(cfg, run), "the checkpoint pre-flight")
            cfg = dist.all_gather_object(mine and mine[0], what="the checkpoint pre-flight")[0]
            run = mine[1] if mine else run   # (rank 0 checks the lock at each save)
            if cfg.checkpoint.every:   # ranks on other nodes may see another folder at the same path
                shared(dist, checkpoint_root(cfg, run.run_dir, run.job))
            try:
                return train(cfg, run, dist, on_point, on_ready if dist.is_main else None)
            except Exception as e:
                if not dist.is_main:
                    log_rank_error(run, dist.rank, dist.world, e)
                raise
        # Another model's checkpoint is refused before any rank starts; "latest" is resolved once for every rank.
        cfg, run = own_and_preflight(cfg, run)
        if cfg.dist.nproc == 1:
            return train(cfg, run, connect(cfg.dist.backend, cfg.dist.timeout_s), on_point, on_ready)
        # One line for an impossible request (NCCL with more local ranks than GPUs) before any rank starts.
        resolve_backend(cfg.dist.backend, cfg.dist.nproc)
        if line := backend_notice(cfg.dist.backend, cfg.dist.nproc):
            say(line)
        return _spawn(cfg, run, on_point, on_ready)


def error_line(rank: int, e: BaseException) -> str:
    """A rank's last line for its error, not prefixed where it names the rank already (a DistributedError's)."""
    return f"error: {e}" if str(e).startswith(f"rank {rank}/") else f"error: rank {rank}: {e}"


RUN_LOCK = "run.lock"
CHECKPOINT_LOCK = ".lock"   # (not a step-<N> name: scans, pruning and clean-up of a checkpoint folder pass it over)


def own_run_folder(run: RunInfo) -> int:
    """A descriptor locking the run folder's run.lock while open: two runs started in one second share its name."""
    key = "hydra.sweep.dir" if run.group else "hydra.run.dir"
    return _own(run.run_dir, RUN_LOCK, lambda holder: f"run folder {run.run_dir} is in use by another run (it holds "
                f"{RUN_LOCK}); give this run a folder of its own: {key}=PATH", "a second run into this folder")


def own_checkpoint_dir(root: Path) -> int:
    """A descriptor locking ``root``'s ``CHECKPOINT_LOCK`` while open: two runs saving there would overwrite steps."""
    return _own(root, CHECKPOINT_LOCK, lambda holder: f"checkpoint.dir {root} is in use by another run{holder}: "
                "wait for it to end or set checkpoint.dir to another folder", "a second run saving into this folder")


def _own(folder: Path, name: str, busy: Callable[[str], str], undetected: str) -> int:
    """``files.lock`` of ``name`` in ``folder`` (made if missing), a lock file it cannot open or write as one line."""
    files.make_dirs(folder)
    try:
        return files.lock(folder / name, busy, undetected)
    except OSError as e:   # a folder in its place, another user's lock file
        raise ConfigError(f"cannot open {folder / name} to lock its folder ({e.strerror or e}): remove it, or give "
                          "this run another folder") from None


def _remove_stray_sweep(sweep_dir: Path | None, rank0_run: Path) -> None:
    """Remove a sweep folder this rank's ${now} named apart from rank 0's, if it holds only multirun.yaml."""
    if sweep_dir is None or sweep_dir.resolve() in rank0_run.resolve().parents:
        return
    with contextlib.suppress(OSError):
        if [p.name for p in sweep_dir.iterdir()] == ["multirun.yaml"]:
            (sweep_dir / "multirun.yaml").unlink()
        sweep_dir.rmdir()   # (only if empty: anything else there is kept)


def check_launch_env(cfg: Config) -> None:
    """One line, before anything connects, for a launch environment ``connect`` refuses or an overruled dist.nproc."""
    check_env()
    world = env_int("WORLD_SIZE", 1)
    launched = world > 1 or "TORCHELASTIC_RUN_ID" in os.environ   # (torchrun's one worker: WORLD_SIZE=1)
    if launched and (cfg.dist.nproc > 1 or cfg.sources.get("dist.nproc") == COMMAND_LINE) and cfg.dist.nproc != world:
        raise ConfigError(f"dist.nproc={cfg.dist.nproc} differs from WORLD_SIZE={world} set by the launcher "
                          "(torchrun), which makes the ranks; drop dist.nproc or launch that many ranks")


def check_saves(cfg: Config) -> None:
    """checkpoint.async=true or a keep_last other than the default with checkpoint.every=0 is inert in the CLI's
    loop (compose accepts them for one's own loop), refused wherever it is set: the command line or a config file
    (the value, not where it came from, is what does nothing). (timeout_s is not: a resume's reads use it too.)"""
    c = cfg.checkpoint
    where = "from the command line or config file that sets it"
    if c.async_ and not c.every:
        raise ConfigError("config: checkpoint.async=true does nothing with checkpoint.every=0 (no saves); "
                          f"set checkpoint.every=N or remove checkpoint.async=true {where}")
    if c.keep_last != type(c).keep_last and not c.every:   # (the class attribute: the field's default)
        raise ConfigError(f"config: checkpoint.keep_last={c.keep_last} does nothing with checkpoint.every=0 (no "
                          f"saves, so none are pruned); set checkpoint.every=N or remove checkpoint.keep_last="
                          f"{c.keep_last} {where}")


def restart_notice(cfg: Config, run: RunInfo) -> None:
    """One line where a torchrun restart finds nothing to resume (a ${now} run folder is new each attempt)."""
    restarts = env_int("TORCHELASTIC_RESTART_COUNT", 0)
    if restarts < 1 or cfg.checkpoint.resume != "auto" or not cfg.checkpoint.every:
        return
    if not (root := checkpoint_root(cfg, run.run_dir, run.job)).is_dir() or not stepfolders.scan(root)[0]:
        say(f"torchrun restart {restarts}: no checkpoint in {root} to resume (a run folder named by ${{now}} is new on "
            f"each attempt); set hydra.run.dir (or checkpoint.dir) to a fixed folder to resume after a restart")


def cap_threads(local_world: int) -> None:
    """Give this rank its share of the host's cores for torch's threads; never raises a lower limit (torchrun's 1)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    share = max(1, cores // max(1, local_world))
    if torch.get_num_threads() > share:
        torch.set_num_threads(share)


PRINTED_ABOVE = " (anything it printed is above)"   # (on the console; a report's table has no "above")


def is_exit_line(line: str) -> bool:
    """Whether ``line`` is one of ``exit_message``'s (a report prefers the job's own error line to it)."""
    return re.match(r"rank \d+ of \d+ (exited with code|was killed by|was aborted by) ", line) is not None


def exit_message(rank: int, nproc: int, code: int, backend: str | None, timeout_s: float, stopped: bool) -> str:
    """One line for a rank that exited with ``code`` (negative: killed by that signal); ``stopped``: whether the
    launcher signalled a rank still running (else each ended by itself, as on an error every rank raised)."""
    others = "the other ranks were stopped" if stopped else "the other ranks ended by themselves"
    if code >= 0:
        return f"rank {rank} of {nproc} exited with code {code}{PRINTED_ABOVE}; {others}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    if name == "SIGABRT" and backend == "nccl":
        return (f"rank {rank} of {nproc} was aborted by NCCL's watchdog (SIGABRT): a collective waited longer than "
                f"dist.timeout_s={timeout_s:g}s because a peer rank died or stalled (the thread dump above shows "
                f"where each thread waited); {others}")
    why = " (out of memory? see the system log)" if name == "SIGKILL" else ""
    return f"rank {rank} of {nproc} was killed by {name}{why}; {others}"


def slurm_task_env() -> dict[str, str]:
    """The rank variables torchrun would set, for a task (one per rank) Hydra's submitit launcher started."""
    env, executor = os.environ, os.environ.get("SUBMITIT_EXECUTOR")
    tasks = {"slurm": "SLURM_NTASKS", "local": "SUBMITIT_LOCAL_NTASKS"}.get(executor)
    if "WORLD_SIZE" in env or tasks is None or env_int(tasks, 1) <= 1:
        return {}
    from submitit.helpers import TorchDistributedEnvironment  # present: submitit started this task

    t = TorchDistributedEnvironment()
    # (submitit's own local world is the tasks over the nodes, rounded down: wrong where Slurm's nodes differ)
    here = slurm_tasks_here() if executor == "slurm" else None
    return {"RANK": str(t.rank), "LOCAL_RANK": str(t.local_rank), "WORLD_SIZE": str(t.world_size),
            "LOCAL_WORLD_SIZE": str(here or t.local_world_size),
            "MASTER_ADDR": t.master_addr if executor == "slurm" else "127.0.0.1", "MASTER_PORT": str(t.master_port)}


STOP_GRACE_S = 30      # after Ctrl-C: the ranks' own time to clean up before they get SIGTERM
KILL_AFTER_S = 5       # after a second Ctrl-C or a failed rank's grace: time to end on SIGTERM before SIGKILL
REPORT_GRACE_S = 5     # after a rank failed: the others' time to end with their own error before they are stopped


def _spawn(cfg: Config, run: RunInfo, on_point: Callable[[str], None] | None,
           on_ready: Callable[[Path], None] | None = None) -> dict:
    remove_dead(tempfile.gettempdir())
    # the run folder's own swap files (each new run has a new folder: no later run would remove a killed rank's)
    swap = run.run_dir / "nvme" if cfg.choices["offload"] == "nvme" and cfg.offload.nvme_path is None else None
    store_dir = tempfile.mkdtemp(prefix=PREFIX)
    lock = hold(os.path.join(store_dir, LOCK), create=True)
    ranks = None
    try:
        # Ranks start with SIGINT ignored (a Ctrl-C during their imports: a traceback each); until ready, SIGTERM.
        interrupt = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            ranks = mp.start_processes(_worker, args=(cfg, run, store_dir, on_point, on_ready, os.getpid()),
                                       nprocs=cfg.dist.nproc, join=False, start_method="spawn")
        finally:
            signal.signal(signal.SIGINT, interrupt)
        try:
            failed, stopped, paused = _failed(ranks.processes, store_dir)
            lost = [rank for rank in failed if os.path.exists(peer_lost_path(store_dir, rank))]
        except (KeyboardInterrupt, SystemExit) as e:   # Ctrl-C, SIGTERM: the ranks clean up before we leave
            _stop(ranks.processes, signal.SIGINT if isinstance(e, KeyboardInterrupt) else signal.SIGTERM,
                  lambda rank: os.path.exists(ready_path(store_dir, rank)))
            raise
        finally:   # (once every rank ended, on either path)
            remove_killed_swap(swap, [p.exitcode for p in ranks.processes])
        if failed and stopped and len(lost) == len(failed):   # each lost a peer: the one still running is to blame
            stalled = stalled_message(stopped, sorted(lost), cfg.dist.nproc, cfg.dist.timeout_s, paused)
            raise _ended(run, FrameworkError(stalled))
        if failed:
            report_marked(store_dir, cfg.dist.nproc)
            first = failed[0]
            trace = _traceback(ranks.error_files[first])
            if not trace:   # (a rank's FrameworkError exits 1, a bug's leaves its traceback)
                backend = resolve_backend(cfg.dist.backend, cfg.dist.nproc)
                raise _ended(run, FrameworkError(exit_message(first, cfg.dist.nproc, ranks.processes[first].exitcode,
                                                              backend, cfg.dist.timeout_s, bool(stopped))))
            say(trace)
            raise _ended(run, FrameworkError(f"rank {first} of {cfg.dist.nproc} failed: {trace.splitlines()[-1]}"),
                         trace if first else "")   # (rank 0's console wrote its own to train.log)
    finally:
        for path in ranks.error_files if ranks is not None else ():   # (torch leaves them in the temporary folder)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        shutil.rmtree(store_dir, ignore_errors=True)
        os.close(lock)
    return json.loads((run.run_dir / "summary.json").read_text())


def report_marked(store_dir: str, nproc: int) -> None:
    """After a rank failed: the error every rank raised alike, raised once (not as rank K's exit); else each marked
    rank's own error, a line each (a rank that marked its error does not say it)."""
    if alike := all_alike(marked := marked_alike(store_dir, nproc), nproc):   # (rank 0's train.log ends with it)
        raise FrameworkError(alike)
    for rank, text in marked.items():
        say(error_line(rank, FrameworkError(text)))


def remove_killed_swap(folder: Path | None, codes: list[int | None]) -> None:
    """Once every rank ended: remove, with one line, the swap files a rank killed by a signal (SIGKILL: out of memory)
    left in the run's default swap ``folder`` (None: none, or ``offload.nvme_path``'s, which the next run there
    cleans)."""
    if folder is None or not any(code is not None and code < 0 for code in codes):
        return
    count, freed = remove_stale(folder)
    if count:
        say(f"nvme: removed {counted(count, 'swap file')} a killed rank left in {folder}, freeing {freed / GiB:.2f} "
            f"GiB ({freed} bytes)")
    with contextlib.suppress(OSError):   # (only if empty)
        folder.rmdir()


def log_rank_error(run: RunInfo, rank: int, world: int, e: Exception) -> None:
    """Under torchrun (train.log is rank 0's console): append a rank's own error (with a bug's traceback), as the
    spawn launcher does; not one raised alike (rank 0 logs it) nor a lost peer (rank 0's line names it)."""
    if isinstance(e, FrameworkError) and (e.every_rank or isinstance(e, DistributedError)):
        return
    trace = "" if isinstance(e, FrameworkError) else "".join(traceback.format_exception(e))
    append_log(run, f"{trace}error: rank {rank} of {world} failed: {typed_line(e)}\n")


def _traceback(error_file: str) -> str | None:
    """The traceback torch's spawn pickled for a rank that raised; None if none (it exited on its own) or cut short."""
    try:
        trace = pickle.loads(Path(error_file).read_bytes())
    except (OSError, EOFError, pickle.UnpicklingError):
        return None
    return trace.rstrip() if isinstance(trace, str) else None


def _ended(run: RunInfo, error: FrameworkError, trace: str = "") -> FrameworkError:
    """``error``, its line (after the rank's ``trace``) appended to train.log (rank 0's last: "terminated ...")."""
    append_log(run, (f"{trace}\n" if trace else "") + f"error: {error}\n")
    return error


def append_log(run: RunInfo, text: str) -> None:
    """Append ``text`` to the run's train.log; nothing where rank 0 never started one."""
    try:
        fd = files.open_nofollow(run.run_dir / "train.log", os.O_WRONLY | os.O_APPEND)
    except (OSError, FrameworkError):   # (none, or a link in its place: rank 0 refused it)
        return
    with contextlib.suppress(OSError), os.fdopen(fd, "a") as log:
        log.write(text)


def _failed(ranks: list, store_dir: str) -> tuple[list[int], list[int], list[int]]:
    """Wait for the ranks to end: those that failed (the one to name first), those that had to be stopped, and of
    them those stopped by SIGSTOP. Once one failed, the others have ``REPORT_GRACE_S`` to end with their own error
    (the first to fail may only have lost a silent peer); a lost peer's rank is named after any other's."""
    pending = {p.sentinel: rank for rank, p in enumerate(ranks)}
    failed, deadline = [], None
    while pending and (ready := wait(list(pending), None if deadline is None
                                     else max(0.0, deadline - time.monotonic()))):
        for rank in sorted(pending.pop(s) for s in ready):
            ranks[rank].join()
            if ranks[rank].exitcode != 0:
                failed.append(rank)
                deadline = deadline or time.monotonic() + REPORT_GRACE_S
    if not failed:
        return [], [], []
    stopped, paused = _end(ranks)
    return sorted(failed, key=lambda rank: os.path.exists(peer_lost_path(store_dir, rank))), stopped, paused


def stalled_message(stalled: list[int], lost: list[int], nproc: int, timeout_s: float,
                    paused: list[int] | tuple = ()) -> str:
    """One line for ranks the launcher stopped after every failed rank only lost a peer: those still running ended
    the run (a loop, a hung read, a slow step); those ``paused`` (SIGSTOP) ran nothing: no timeout would help."""
    def ranks(group: list[int]) -> str:
        return f"rank{'s' if len(group) > 1 else ''} {', '.join(map(str, group))}"
    running = [rank for rank in stalled if rank not in paused]
    it, was, its = ("they", "were", "their") if len(running) > 1 else ("it", "was", "its")
    lines = f"{ranks(lost)} failed waiting for a peer ({'their lines are' if len(lost) > 1 else 'its line is'} above)"
    held = f"{ranks(list(paused))} {'were' if len(paused) > 1 else 'was'} stopped (SIGSTOP), running nothing"
    if not running:
        return f"{ranks(stalled)} of {nproc} stalled: {held} when {lines}, so killed"
    return (f"{ranks(stalled)} of {nproc} stalled: {ranks(running) + ' ' if paused else ''}still running "
            f"{REPORT_GRACE_S:g}s after {lines}, so {it} {was} stopped{'; ' + held if paused else ''}; if {its} step "
            f"can take longer than dist.timeout_s={timeout_s:g}s, raise dist.timeout_s")


def _end(ranks: list) -> tuple[list[int], list[int]]:
    """Stop, with one line naming them, the ranks still running ``REPORT_GRACE_S`` after one failed: SIGTERM, SIGKILL
    ``KILL_AFTER_S`` later (a rank in C++ runs no handler; they had their time, so no ``STOP_GRACE_S``); a SIGSTOPped
    one would act on nothing before SIGCONT: SIGKILL at once. Returns the ranks stopped, and the SIGSTOPped ones."""
    alive = [(rank, p) for rank, p in enumerate(ranks) if p.is_alive()]
    if not alive:
        return [], []
    stopped = {rank for rank, p in alive if process_state(p.pid) == "T"}
    names = [f"rank {r} (pid {p.pid}{', stopped by SIGSTOP: SIGKILL now' if r in stopped else ''})" for r, p in alive]
    termed = f"; SIGTERM, then SIGKILL after {KILL_AFTER_S:g}s" if len(stopped) < len(alive) else ""
    say(f"stopping {', '.join(names)}: still there {REPORT_GRACE_S:g}s after a rank failed{termed}")
    for rank, p in alive:
        with contextlib.suppress(ProcessLookupError):   # (ended meanwhile)
            os.kill(p.pid, signal.SIGKILL if rank in stopped else signal.SIGTERM)
    _join(ranks, KILL_AFTER_S)
    for p in ranks:
        p.kill()   # (nothing for a rank that ended)
    _join(ranks, None)
    return [rank for rank, _ in alive], sorted(stopped)


def _stop(ranks: list, signum: int, ready: Callable[[int], bool] = lambda rank: True) -> None:
    """Pass the launcher's signal on (Ctrl-C as ``INTERRUPT``; SIGTERM to a rank not yet ``ready``), then after
    ``STOP_GRACE_S`` SIGTERM, and ``KILL_AFTER_S`` later SIGKILL (a Ctrl-C or SIGTERM meanwhile skips ahead)."""
    for rank, p in enumerate(ranks):
        if p.is_alive():
            with contextlib.suppress(ProcessLookupError):   # (ended meanwhile)
                os.kill(p.pid, signal.SIGTERM if signum != signal.SIGINT or not ready(rank) else INTERRUPT)
    _join(ranks, STOP_GRACE_S)
    for p in ranks:
        p.terminate()   # (nothing for a rank that ended; one ending on SIGTERM already ignores it)
    _join(ranks, KILL_AFTER_S)   # (Ctrl-C once more: SIGKILL at once)
    for p in ranks:
        p.kill()
    _join(ranks, None)


def _join(ranks: list, timeout_s: float | None) -> bool:
    """Wait ``timeout_s`` (None: no limit) for the ranks to end; False on Ctrl-C; else re-raised once they ended."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        for p in ranks:
            p.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
    except KeyboardInterrupt:
        return False
    except BaseException:
        for p in ranks:
            p.terminate()
        deadline = time.monotonic() + KILL_AFTER_S
        with contextlib.suppress(BaseException):
            for p in ranks:
                p.join(max(0.0, deadline - time.monotonic()))
        for p in ranks:   # all before any wait: one blocked in the kernel (a hung disk) ends only after its I/O
            p.kill()
        for p in ranks:
            while True:
                with contextlib.suppress(BaseException):   # (ends at once after SIGKILL)
                    p.join()
                    break
        raise
    return True


def rank_env(rank: int, nproc: int) -> None:
    """Local rank ``rank`` of ``nproc``'s launch variables, not an inherited Slurm task's (rank 0 would look one)."""
    for key in ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS", "SLURM_STEP_NUM_TASKS"):
        os.environ.pop(key, None)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


def _die_with(launcher: int) -> None:
    """End this rank as a Ctrl-C would once its ``launcher`` (parent) is gone (killed with -9 it cannot stop its
    ranks; ``interrupted_line`` says so); SIGKILL after the launcher's own grace, for a rank waiting in C++."""
    def watch() -> None:
        while os.getppid() == launcher:
            time.sleep(1.0)
        os.kill(os.getpid(), INTERRUPT)
        time.sleep(STOP_GRACE_S + KILL_AFTER_S)
        os.kill(os.getpid(), signal.SIGKILL)
    threading.Thread(target=watch, name="framework-launcher-watch", daemon=True).start()


def _worker(rank: int, cfg: Config, run: RunInfo, store_dir: str, on_point: Callable[[str], None] | None,
            on_ready: Callable[[Path], None] | None, launcher: int) -> None:
    _die_with(launcher)
    rank_env(rank, cfg.dist.nproc)
    cap_threads(cfg.dist.nproc)   # ranks share the host's cores, with CUDA too (the host optimizer step)
    # held until this process ends (however): the launcher's cleanup never removes a live run's folder
    lock = hold(os.path.join(store_dir, LOCK))  # noqa: F841
    try:
        with signals_unwind(rank=True):
            with contextlib.suppress(OSError):   # (without it the launcher ends this rank with SIGTERM)
                os.close(os.open(ready_path(store_dir, rank),
                                 os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600))
            dist = connect(cfg.dist.backend, cfg.dist.timeout_s, store_path=os.path.join(store_dir, "store"))
            train(cfg, run, dist, on_point, on_ready if rank == 0 else None)
            # Leave together: no rank closes its gloo connections while a peer still waits on one.
            dist.barrier("shutdown barrier")
    except FrameworkError as e:
        if not mark_error(store_dir, rank, e):   # (one raised alike: the launcher's line, once)
            say(error_line(rank, e))
        sys.exit(1)
    except KeyboardInterrupt as e:   # (torch's wrapper would exit 0, as if the rank had finished)
        say(line := interrupted_line(rank, e, launcher))
        if rank == 0 and line.endswith("(killed?)"):   # (train.log's "interrupted at step N" was no Ctrl-C)
            append_log(run, line + "\n")
        sys.exit(130)
    except SystemExit as e:   # SIGTERM: a line as for Ctrl-C, the exit status kept
        if (line := terminated_line(e)) is not None:
            say(f"rank {rank}: {line}")
        raise
    finally:
        disconnect()
