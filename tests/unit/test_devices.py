"""Backend and device choice from the GPUs a host has, thread caps per rank, and the launcher's line
for a rank that a signal (NCCL's watchdog: SIGABRT) ended. GPU counts are simulated."""
import contextlib
import os
import re
import signal
import time

import pytest
import torch

from framework import ConfigError, FrameworkError
from framework.comm import distributed as d, rendezvous
from framework.cli.launch import cap_threads, exit_message


@pytest.fixture
def gpus(monkeypatch):
    def set_(n):
        monkeypatch.setattr(d, "gpu_count", lambda: n)
    return set_


@pytest.mark.parametrize("n,local,backend", [(0, 1, "gloo"), (0, 4, "gloo"), (1, 1, "nccl"), (1, 2, "gloo"),
                                             (8, 8, "nccl"), (8, 9, "gloo")])
def test_auto_picks_nccl_only_with_a_gpu_per_local_rank(gpus, n, local, backend):
    gpus(n)
    assert d.resolve_backend("auto", local) == backend
    assert (d.backend_notice("auto", local) is not None) == (n > 0 and local > n)


def test_impossible_requests_are_one_line_errors(gpus):
    gpus(1)
    with pytest.raises(ConfigError, match=r"^dist.backend=nccl runs one rank per GPU: 2 ranks on this host but 1 GPU; "
                                          r"use at most 1 rank per host .* or dist.backend=gloo$"):
        d.resolve_backend("nccl", 2)
    assert d.resolve_backend("nccl", 1) == "nccl" and d.resolve_backend("gloo", 5) == "gloo"
    gpus(0)
    with pytest.raises(ConfigError, match="needs CUDA"):
        d.resolve_backend("nccl", 1)
    with pytest.raises(ConfigError, match="not one of auto, gloo, nccl"):
        d.resolve_backend("mpi", 1)


def test_local_world_comes_from_the_launcher(monkeypatch, gpus):
    gpus(2)
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert d.local_world_size() == 2 and d.resolve_backend("auto") == "nccl"
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert d.local_world_size() == 16 and d.resolve_backend("auto") == "gloo"


def test_devices(gpus):
    gpus(2)
    assert d.pick_device("nccl", 1) == torch.device("cuda", 1)
    assert d.pick_device("gloo", 3, "cuda") == torch.device("cuda", 1)   # ranks may share a GPU over gloo
    assert d.pick_device("gloo", 3) == torch.device("cpu")
    with pytest.raises(ConfigError, match="nccl backend needs CUDA tensors"):
        d.pick_device("nccl", 0, "cpu")
    gpus(0)
    with pytest.raises(ConfigError, match="device=cuda needs a GPU"):
        d.pick_device("gloo", 0, "cuda")


def test_threads_are_capped_to_the_ranks_share_and_never_raised(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.setattr("os.sched_getaffinity", lambda _pid: set(range(16)))
    try:
        torch.set_num_threads(16)
        cap_threads(4)
        assert torch.get_num_threads() == 4
        torch.set_num_threads(1)     # torchrun's OMP_NUM_THREADS=1, or the user's choice
        cap_threads(2)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_exit_lines_name_the_watchdog():
    line = exit_message(1, 2, -signal.SIGABRT, "nccl", 300, True)
    assert line.startswith("rank 1 of 2 was aborted by NCCL's watchdog (SIGABRT)") and "dist.timeout_s=300s" in line
    assert "out of memory" in exit_message(0, 2, -signal.SIGKILL, "nccl", 300, True)
    assert exit_message(0, 2, -signal.SIGABRT, "gloo", 300, True) == \
        "rank 0 of 2 was killed by SIGABRT; the other ranks were stopped"
    assert exit_message(1, 4, 1, "gloo", 300, True).startswith("rank 1 of 4 exited with code 1 (anything it printed")
    # (no rank was signalled: each ended by itself, as on an error every rank raised)
    assert exit_message(1, 2, 1, "gloo", 300, False).endswith("; the other ranks ended by themselves")


def test_a_launcher_stopped_by_a_signal_kills_every_rank_before_it_waits_on_one():
    """SIGTERM to the launcher (a SystemExit in its wait): every rank gets SIGKILL before the launcher waits on
    any, since a rank blocked in the kernel (a hung disk) ends only after its I/O and must not keep the rest alive."""
    from framework.cli.launch import _join
    log = []

    class Rank:
        def __init__(self, i):
            self.i = i

        def terminate(self):
            log.append(f"terminate {self.i}")

        def kill(self):
            log.append(f"kill {self.i}")

        def join(self, timeout=None):
            if not log:
                raise SystemExit(143)
            if timeout is None:   # (the bounded waits after terminate return at once here)
                log.append(f"joined {self.i}")

    with pytest.raises(SystemExit):
        _join([Rank(0), Rank(1)], None)
    assert log == ["terminate 0", "terminate 1", "kill 0", "kill 1", "joined 0", "joined 1"]

def _ignores_sigterm(ready) -> None:   # (a rank blocked in C++: no handler runs)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ready.set()
    time.sleep(60)


@pytest.mark.parametrize("peer", ["stopped", "ignores SIGTERM"])
def test_a_failed_ranks_peers_are_stopped_after_the_kill_grace_a_stopped_one_at_once(monkeypatch, capsys, peer):
    """Once a rank failed and its peers had their grace to end, the launcher stops those left with one line naming
    them: SIGTERM and SIGKILL after ``KILL_AFTER_S``, not the Ctrl-C clean-up's ``STOP_GRACE_S`` more (a job under a
    time limit held silent); a stopped rank (SIGSTOP), which would act on nothing, is killed at once."""
    import multiprocessing

    from framework.cli import launch
    monkeypatch.setattr(launch, "REPORT_GRACE_S", 0.2)
    monkeypatch.setattr(launch, "KILL_AFTER_S", 3.0)
    ctx = multiprocessing.get_context("fork")
    ready = ctx.Event()
    ranks = [ctx.Process(target=os._exit, args=(1,)),
             ctx.Process(target=time.sleep, args=(60,)) if peer == "stopped" else ctx.Process(target=_ignores_sigterm,
                                                                                                 args=(ready,))]
    ranks[1].start()
    try:
        if peer == "stopped":
            os.kill(ranks[1].pid, signal.SIGSTOP)
            while d.process_state(ranks[1].pid) != "T":
                time.sleep(0.01)
        else:
            assert ready.wait(30)
        ranks[0].start()
        start = time.monotonic()
        assert launch._failed(ranks, "/nonexistent") == ([0], [1], [1] if peer == "stopped" else [])
        took = time.monotonic() - start
    finally:
        for p in ranks[1:]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGKILL)
            p.join()
    assert ranks[1].exitcode == -signal.SIGKILL
    assert (took < 2.5) if peer == "stopped" else (3.0 <= took < 8), took   # (not 30 s more)
    how = ", stopped by SIGSTOP: SIGKILL now)" if peer == "stopped" else ")"
    how += ": still there 0.2s after a rank failed"
    how += "" if peer == "stopped" else "; SIGTERM, then SIGKILL after 3s"
    assert capsys.readouterr().err == f"stopping rank 1 (pid {ranks[1].pid}{how}\n"


def _raised(store_dir: str, rank: int, text: str, alike: bool) -> None:   # (a rank's FrameworkError, as _worker's)
    from framework.cli._rendezvous import mark_error
    from framework.core.errors import TrainingError, on_every_rank
    mark_error(store_dir, rank, on_every_rank(TrainingError(text), alike))
    os._exit(1)


def test_ranks_that_all_failed_by_themselves_are_not_said_stopped(capsys, tmp_path):
    """Every rank ended with its own error (a non-finite loss raised on every rank): none is signalled, and the
    launcher's line must not say the others were stopped. The error all raised alike is the launcher's last line,
    once, not "rank 1 of 2 exited with code 1" blaming whichever exited first; where a rank's own differs, the
    launcher says each rank's (the ranks do not)."""
    import multiprocessing

    from framework.cli import launch
    from framework.cli._rendezvous import marked_alike, raised_alike
    ctx = multiprocessing.get_context("fork")
    nan = "step 2: the loss is nan (non-finite from the micro batches of rank 1; rank 0 finite)"
    for i, (texts, alike, says) in enumerate((([nan, nan], True, nan), ([nan, nan], False, None),
                                              ([nan, "rank 1's own"], True, None))):
        store = tmp_path / str(i)
        store.mkdir()
        ranks = [ctx.Process(target=_raised, args=(str(store), r, text, alike)) for r, text in enumerate(texts)]
        for p in ranks:
            p.start()
        failed, stopped, paused = launch._failed(ranks, str(store))
        assert sorted(failed) == [0, 1] and stopped == paused == []   # (in the order they exited)
        assert raised_alike(str(store), 2) == says and raised_alike(str(store), 3) is None   # (rank 2 marked none)
        # (a rank that marked its error does not say it: the launcher says each one where they differ)
        assert marked_alike(str(store), 3) == (dict(enumerate(texts)) if alike else {})
        assert "stopping" not in capsys.readouterr().err
        with pytest.raises(FrameworkError, match=f"^{re.escape(nan)}$") if says else contextlib.nullcontext():
            launch.report_marked(str(store), 2)
        err = capsys.readouterr().err
        assert [line for line in err.splitlines() if line.startswith("error:")] == \
            ([f"error: rank {r}: {text}" for r, text in enumerate(texts)] if alike and not says else [])


def _lost_a_peer(marker: str) -> None:   # (a rank whose collective timed out: a DistributedError's marker)
    open(marker, "w").close()
    os._exit(1)


def test_a_rank_still_running_after_its_peers_lost_it_is_the_one_named(monkeypatch, capsys, tmp_path):
    """Ranks 0 and 2 fail only on waiting for a peer (their collective timed out) while rank 1 is still in its
    step: the launcher stops rank 1 and its last line names rank 1 as stalled, not a healthy rank that timed out."""
    import multiprocessing

    from framework.cli import launch
    from framework.cli._rendezvous import peer_lost_path
    monkeypatch.setattr(launch, "REPORT_GRACE_S", 1.0)   # (rank 2's own exit within it, on a loaded host too)
    ctx = multiprocessing.get_context("fork")
    ranks = [ctx.Process(target=_lost_a_peer, args=(peer_lost_path(str(tmp_path), 0),)),
             ctx.Process(target=time.sleep, args=(60,)),
             ctx.Process(target=_lost_a_peer, args=(peer_lost_path(str(tmp_path), 2),))]
    for p in ranks:
        p.start()
    assert launch._failed(ranks, str(tmp_path)) == ([0, 2], [1], [])
    assert ranks[1].exitcode == -signal.SIGTERM, capsys.readouterr().err
    assert launch.stalled_message([1], [0, 2], 3, 10) == (
        "rank 1 of 3 stalled: still running 1s after ranks 0, 2 failed waiting for a peer (their lines are above), "
        "so it was stopped; if its step can take longer than dist.timeout_s=10s, raise dist.timeout_s")


def test_a_rank_stopped_by_sigstop_is_not_said_to_be_still_running(monkeypatch):
    """A rank paused by SIGSTOP (``_failed`` names it: the test above) ran nothing: its line says so, with no
    timeout advice (a longer one would not have helped), and one lost rank's line is "its line"."""
    from framework.cli import launch
    monkeypatch.setattr(launch, "REPORT_GRACE_S", 1.0)
    assert launch.stalled_message([0], [1], 2, 10, [0]) == (
        "rank 0 of 2 stalled: rank 0 was stopped (SIGSTOP), running nothing when rank 1 failed waiting for a peer "
        "(its line is above), so killed")
    assert launch.stalled_message([0, 2], [1], 3, 10, [2]) == (
        "ranks 0, 2 of 3 stalled: rank 0 still running 1s after rank 1 failed waiting for a peer (its line is above), "
        "so it was stopped; rank 2 was stopped (SIGSTOP), running nothing; if its step can take longer than "
        "dist.timeout_s=10s, raise dist.timeout_s")


@pytest.mark.parametrize("spec,n,device,backend", [
    ("cpu:gloo", 0, "auto", "gloo"), ("cpu:gloo,cuda:nccl", 0, "auto", "gloo"),   # torch's default group
    ("cpu:gloo,cuda:nccl", 2, "auto", "nccl"), ("cpu:gloo,cuda:nccl", 1, "auto", "gloo"),   # 2 local ranks
    ("cpu:gloo,cuda:nccl", 2, "cpu", "gloo"), ("cpu:gloo,cuda:gloo", 2, "cuda", "gloo"), ("nccl", 2, "auto", "nccl"),
    ("cuda:nccl", 1, "auto", "nccl")])
def test_a_joined_groups_backend_spec_maps_to_gloo_or_nccl(gpus, spec, n, device, backend):
    """A group made without backend= (get_backend() is 'undefined') or with a per-device spec."""
    gpus(n)
    assert d.joined_backend("auto", device, 2, spec=spec) == backend
    assert d.joined_backend(backend, device, 2 if n != 1 else 1, spec=spec) == backend


@pytest.mark.parametrize("spec,n,backend,device", [("cpu:mpi", 0, "auto", "auto"), ("cuda:nccl", 2, "auto", "cpu"),
                                                   ("cpu:gloo", 2, "nccl", "auto"), ("cpu:gloo", 0, "gloo", "cuda")])
def test_a_joined_group_without_a_usable_backend_is_one_line(gpus, spec, n, backend, device):
    gpus(n)
    with pytest.raises(ConfigError, match=r"^this process joined a process group with backend") as e:
        d.joined_backend(backend, device, 1, spec=spec)
    assert "\n" not in str(e.value)


def test_local_rank_from_slurm_and_unknown_local_ranks_refused(monkeypatch, gpus):
    """srun with RANK/WORLD_SIZE/MASTER_* only: the local rank is not the global one (cuda:9 on an
    8-GPU node), nor are all 16 ranks on this host."""
    gpus(8)
    for k in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_STEP_TASKS_PER_NODE",
              "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_NODEID", "SLURM_STEP_NUM_TASKS"):
        monkeypatch.delenv(k, raising=False)
    for k, v in dict(RANK="9", WORLD_SIZE="16", MASTER_ADDR="127.0.0.1", MASTER_PORT="1", SLURM_NTASKS="16").items():
        monkeypatch.setenv(k, v)
    assert d.local_ranks(9, 16) == (None, None)
    with pytest.raises(ConfigError, match=r"^cannot tell which of this host's 8 GPUs rank 9 of 16 uses: set "
                                          r"LOCAL_RANK and LOCAL_WORLD_SIZE"):
        d.connect("auto", 10.0)
    # ...but a group the caller made with gloo alone trains on the CPU: no GPU to pick, nothing refused
    with monkeypatch.context() as m:
        m.setattr(d.tdist, "is_initialized", lambda: True)
        m.setattr(d.tdist, "get_backend_config", lambda: "gloo")
        m.setattr(d.tdist, "get_rank", lambda: 9)
        m.setattr(d.tdist, "get_world_size", lambda: 16)
        m.setattr(d, "_current_cuda_device", lambda: None)
        with pytest.raises(Exception) as joined:   # (past the check: the fake group cannot take a timeout)
            d.connect("auto", 10.0)
        assert "cannot tell" not in str(joined.value), joined.value
        m.setattr(d.tdist, "get_backend_config", lambda: "cpu:gloo,cuda:nccl")   # torch's default: has nccl
        with pytest.raises(ConfigError, match=r"^cannot tell which of this host's 8 GPUs"):
            d.connect("auto", 10.0)
    monkeypatch.setenv("SLURM_LOCALID", "1")
    monkeypatch.setenv("SLURM_NODEID", "1")
    monkeypatch.setenv("SLURM_STEP_TASKS_PER_NODE", "8(x2)")
    assert d.local_ranks(9, 16) == (None, None)   # Slurm's tasks are not the ranks (no SLURM_PROCID)
    monkeypatch.setenv("SLURM_PROCID", "9")
    assert d.local_ranks(9, 16) == (1, 8) and d.local_world_size() == 8 and d.resolve_backend("auto") == "nccl"
    monkeypatch.setenv("SLURM_STEP_TASKS_PER_NODE", "9,7")   # uneven: this node's entry
    assert d.local_ranks(9, 16) == (1, 7)
    for name, bad in (("SLURM_STEP_TASKS_PER_NODE", "8(xz)"), ("SLURM_LOCALID", "x")):   # named as it is
        with monkeypatch.context() as m:
            m.setenv(name, bad)
            with pytest.raises(ConfigError, match=rf"^{name}="):
                d.local_ranks(9, 16)
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert d.local_ranks(9, 16) == (3, 4)   # the launcher's own variables first


def test_a_device_the_caller_made_current_is_kept():
    assert d.device_index(3, None, 8) == 3                # connect makes the group: LOCAL_RANK
    assert d.device_index(None, 5, 8) == 5                # the caller's group, no LOCAL_RANK
    assert d.device_index(3, 5, 8) == 5                   # the caller set another device: theirs
    assert d.device_index(3, 0, 8) == 3                   # CUDA touched before any set_device: LOCAL_RANK
    assert d.device_index(3, 0, 1) == 0                   # one visible GPU per rank (CUDA_VISIBLE_DEVICES)


@pytest.mark.parametrize("env, says", [({"WORLD_SIZE": "2"}, "WORLD_SIZE=2 is set but RANK, MASTER_ADDR, MASTER_PORT are not"),
                                       ({"SLURM_NTASKS": "2", "SLURM_STEP_ID": "0"}, "srun started 2 tasks")])
def test_connect_refuses_a_launch_env_that_cannot_work(monkeypatch, env, says):
    """The library path (initialize) gets the CLI's one line too."""
    for k in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_NTASKS", "SLURM_STEP_NUM_TASKS",
              "SLURM_STEP_ID", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ConfigError) as e:
        d.connect("auto", 5.0)
    assert says in str(e.value) and "\n" not in str(e.value)


RANK_VARS = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID",
             "SLURM_NTASKS", "SLURM_STEP_NUM_TASKS", "SLURM_STEP_ID", "SLURM_LOCALID", "CUDA_VISIBLE_DEVICES",
             "TORCHELASTIC_RUN_ID")


def test_slurm_tasks_bound_to_a_gpu_each_train_on_it(monkeypatch, gpus):
    """srun --gpus-per-task=1 (or --gpu-bind): 4 tasks on a host, each sees only its own GPU (cuda:0)."""
    for k in RANK_VARS:
        monkeypatch.delenv(k, raising=False)
    for k, v in dict(RANK="3", WORLD_SIZE="4", LOCAL_RANK="3", LOCAL_WORLD_SIZE="4", SLURM_PROCID="3",
                     SLURM_STEP_NUM_TASKS="4", CUDA_VISIBLE_DEVICES="3").items():
        monkeypatch.setenv(k, v)
    gpus(1)
    assert d.resolve_backend("auto") == "nccl" and d.resolve_backend("nccl") == "nccl"
    assert d.backend_notice("auto", 4) is None
    assert d.pick_device("nccl", 3) == torch.device("cuda", 0)
    gpus(2)   # two GPUs per task (--gpus-per-task=2): the rank's own first
    assert d.resolve_backend("auto") == "nccl" and d.pick_device("nccl", 3) == torch.device("cuda", 1)
    # ranks that share the GPUs they see are refused or fall back to the CPU as before: no CUDA_VISIBLE_DEVICES,
    # or torchrun's ranks (not Slurm tasks: one CUDA_VISIBLE_DEVICES for all of them)
    gpus(1)
    for unset in ("CUDA_VISIBLE_DEVICES", "SLURM_PROCID"):
        with monkeypatch.context() as m:
            m.delenv(unset)
            assert d.resolve_backend("auto") == "gloo" and d.backend_notice("auto", 4) is not None
            with pytest.raises(ConfigError, match="4 ranks on this host but 1 GPU"):
                d.resolve_backend("nccl")


def test_nccls_duplicate_gpu_is_one_line_naming_the_binding(monkeypatch, tmp_path):
    def duplicate(*args, **kwargs):
        raise RuntimeError("NCCL error in: ProcessGroupNCCL.cpp:1, invalid usage, NCCL version 2.21.5\n"
                           "Last error:\nDuplicate GPU detected : rank 1 and rank 0 both on CUDA device 1a000")
    monkeypatch.setattr(d.tdist, "init_process_group", duplicate)
    monkeypatch.setattr(rendezvous, "_arrive", lambda *args, **kwargs: None)   # (no rank 0 to wait for)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with pytest.raises(d.DistributedError, match=r"rank 1/2: .*two ranks on one GPU .*CUDA_VISIBLE_DEVICES=0\): "
                                                 r"bind a GPU of its own") as e:
        rendezvous.join("nccl", 1, 2, 5.0, str(tmp_path / "store"), None)
    assert "\n" not in str(e.value)


def test_a_rendezvous_that_fails_is_one_line(monkeypatch, tmp_path):
    """The port taken by another job, or a peer that never joins (the FileStore of dist.nproc waits
    dist.timeout_s, not its own 300 s): DistributedError naming where and how long, no traceback."""
    import signal
    import socket
    import threading
    import time
    for k in RANK_VARS:
        monkeypatch.delenv(k, raising=False)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        for k, v in dict(WORLD_SIZE="2", RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)).items():
            monkeypatch.setenv(k, v)
        with pytest.raises(d.DistributedError, match=rf"^rank 0/2: rendezvous at 127.0.0.1:{port} .*failed: address "
                                                     r"already in use \(another job on MASTER_PORT\?"):
            d.connect("gloo", 2.0)
    # A MASTER_ADDR that does not resolve (a typo): said at once, not a rank that never joined after the timeout.
    # (.invalid never resolves, RFC 6761; a resolver that cannot be reached answers EAI_AGAIN, left to torch)
    try:
        socket.getaddrinfo("no-such-host.invalid", None)
    except socket.gaierror as unresolved:
        if unresolved.errno != socket.EAI_AGAIN:
            monkeypatch.setenv("MASTER_ADDR", "no-such-host.invalid")
            start = time.monotonic()
            with pytest.raises(ConfigError, match=r"^rank 0/2: MASTER_ADDR=no-such-host.invalid does not resolve "
                                                  r"\(.+\): set it to rank 0's host name or address") as e:
                d.connect("gloo", 30.0)
            assert time.monotonic() - start < 10 and "\n" not in str(e.value) and not d.tdist.is_initialized()
    monkeypatch.setenv("RANK", "1")
    start = time.monotonic()
    with pytest.raises(d.DistributedError, match=r"^rank 1/2: rendezvous at FileStore .*not every rank joined within "
                                                 r"dist.timeout_s=1s") as e:
        d.connect("gloo", 1.0, store_path=str(tmp_path / "store"))
    assert time.monotonic() - start < 60 and "\n" not in str(e.value) and not d.tdist.is_initialized()
    # Ctrl-C while waiting for that peer: raised at once (a wait in C++ would defer it dist.timeout_s).
    # (Python's own SIGINT handler, whatever an earlier test in this worker left installed)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        threading.Timer(0.5, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT)).start()
        start = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            d.connect("gloo", 30.0, store_path=str(tmp_path / "store2"))
    finally:
        signal.signal(signal.SIGINT, previous)
    assert time.monotonic() - start < 10 and not d.tdist.is_initialized()


def test_a_ranks_line_says_its_launcher_is_gone_not_interrupted():
    """A rank the launcher's kill -9 left behind ends as on Ctrl-C, but its line says why (nobody pressed Ctrl-C);
    one whose launcher passed on the group's Ctrl-C keeps the Ctrl-C line."""
    from framework.cli.launch import interrupted_line
    from framework.core.errors import Interrupted
    assert interrupted_line(1, Interrupted(4), os.getppid()) == "rank 1: interrupted at step 4"
    gone = os.getppid() + 1   # (not this process's parent)
    said = f"its launcher (pid {gone}) is gone (killed?)"
    assert interrupted_line(1, Interrupted(4), gone) == f"rank 1: stopped at step 4: {said}"
    assert interrupted_line(0, KeyboardInterrupt(), gone) == f"rank 0: stopped: {said}"


def _rank_of_a_killed_launcher() -> str:
    """Fork a stand-in launcher with threads whose child (the rank) has torch spawn's pdeathsig (SIGINT), kill -9
    the launcher, and return the rank's ``interrupted_line``."""
    import ctypes
    import threading
    from framework.cli.launch import interrupted_line
    r, w = os.pipe()
    launcher = os.fork()
    if launcher == 0:   # (nothing of pytest's runs here: every path ends in os._exit)
        try:
            signal.signal(signal.SIGINT, signal.default_int_handler)   # (as a spawned rank has it)
            for _ in range(8):
                threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
            if os.fork() == 0:
                ctypes.CDLL(None).prctl(1, signal.SIGINT)   # PR_SET_PDEATHSIG, as torch's spawn sets it
                parent, said = os.getppid(), []
                # Each of the launcher's threads sends the signal as it exits: the line is the first one's (a
                # KeyboardInterrupt raised again inside the except block would leave nothing written).
                signal.signal(signal.SIGINT, lambda *_: said or said.append(interrupted_line(0, KeyboardInterrupt(),
                                                                                              parent)))
                os.write(w, b"r")
                for _ in range(1000):
                    if said:
                        break
                    time.sleep(0.01)
                os.write(w, (said[0] if said else "slept").encode())
            else:
                time.sleep(60)
        finally:
            os._exit(0)
    os.close(w)
    try:
        assert os.read(r, 1) == b"r"
        os.kill(launcher, signal.SIGKILL)
        os.waitpid(launcher, 0)
        return b"".join(iter(lambda: os.read(r, 200), b"")).decode()
    finally:
        os.close(r)


def test_a_rank_whose_launcher_was_killed_says_so_not_interrupted():
    """The launcher's main thread dies first: pdeathsig's SIGINT reaches the rank while its other threads still
    exist, so the rank is still its child; the launcher (a zombie) is gone all the same."""
    for _ in range(5):   # (each try raced the old check: about half said "interrupted")
        assert _rank_of_a_killed_launcher().endswith("is gone (killed?)")


def test_a_killed_ranks_swap_files_in_the_run_folder_are_removed_by_the_launcher(tmp_path, capsys):
    """A rank killed by SIGKILL (out of memory) leaves its swap files in the run folder's nvme/, which no later
    run uses (each has a folder of its own): the launcher removes them once every rank ended, in one line."""
    from framework.cli.launch import remove_killed_swap
    folder = tmp_path / "nvme"
    folder.mkdir()
    (folder / "rank00001.optim.swap").write_bytes(b"x" * 8192)
    (folder / "rank00001.optim.swap.manifest.json").write_text("{}")
    remove_killed_swap(folder, [1, 143])   # (ranks that ended on their own removed their own)
    assert (folder / "rank00001.optim.swap").exists() and capsys.readouterr().err == ""
    remove_killed_swap(folder, [143, -signal.SIGKILL])
    assert not folder.exists()
    assert capsys.readouterr().err.startswith(f"nvme: removed 1 swap file a killed rank left in {folder}, freeing ")


def test_a_rank_that_lost_its_peer_is_no_marked_line(tmp_path):
    """A rank that lost its peer marks "" (it said its own line): the launcher's per-rank lines leave it out."""
    from framework.cli._rendezvous import alike_path, marked_alike, raised_alike
    for rank, text in enumerate(["", "step 2: the loss is nan"]):
        with open(alike_path(str(tmp_path), rank), "w", encoding="utf-8") as f:
            f.write(text)
    assert marked_alike(str(tmp_path), 2) == {1: "step 2: the loss is nan"}
    assert raised_alike(str(tmp_path), 2) is None
