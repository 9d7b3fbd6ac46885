"""Ranks meeting at MASTER_ADDR:MASTER_PORT (an env launch: srun tasks, torchrun-less): another job's store on the
port is refused by every rank, and a rank waiting for a peer says so and stops at once on Ctrl-C."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from framework.comm.rendezvous import WAITING_NOTE_S

# One rank: connect, say so, then hold the group until stdin closes.
_RANK = """
import sys, time
from framework.comm.distributed import connect, disconnect
from framework.core.errors import FrameworkError
print("connecting", flush=True)
try:
    d = connect("gloo", float(sys.argv[1]))
except FrameworkError as e:
    print("error:", e, flush=True)
    sys.exit(1)
except KeyboardInterrupt:
    print("interrupted", flush=True)
    sys.exit(130)
print("joined", d.rank, flush=True)
sys.stdin.read()
disconnect()
"""
ROOT = str(Path(__file__).resolve().parents[2])


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, timeout_s: float, **env: str) -> subprocess.Popen:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    return subprocess.Popen([sys.executable, "-c", _RANK, str(timeout_s)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                            env={**clean, "WORLD_SIZE": "2", "RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
                                 "MASTER_PORT": str(port), "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1",
                                 "PYTHONPATH": ROOT, **env})


def _ended(p: subprocess.Popen, timeout: float) -> str:
    try:
        return p.communicate(timeout=timeout)[0]
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()


class _Lines:
    """A rank's output lines (stderr too: import-time warnings may come first), each with when it came; a thread
    reads them, so no wait on a line is longer than its own bound."""

    def __init__(self, p: subprocess.Popen):
        self.p, self.got = p, []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.p.stdout:
            self.got.append((time.monotonic(), line))

    def when(self, text: str, within: float) -> float | None:
        """When the first line holding `text` came, waiting up to `within` s for it (None: it did not)."""
        deadline = time.monotonic() + within
        while True:
            alive = self._reader.is_alive()
            found = [t for t, line in list(self.got) if text in line]
            if found or not alive or time.monotonic() > deadline:
                return found[0] if found else None
            time.sleep(0.05)

    def ended(self, within: float) -> str:
        """All it said, once it ended (killed after `within` s)."""
        try:
            self.p.wait(within)
        except subprocess.TimeoutExpired:
            pass
        finally:
            if self.p.poll() is None:
                self.p.kill()
                self.p.wait()
            self._reader.join(10)
        return "".join(line for _, line in self.got)


def test_a_second_jobs_rank_on_a_busy_port_is_refused_within_the_timeout():
    """Job A holds MASTER_PORT; job B's rank 1 reaches A's store: refused in one line naming the port, soon (not
    joined to A's group, not stuck in gloo's connect for minutes), whether the launcher names the jobs or not."""
    port, started = _port(), []
    try:
        a = [_Lines(_rank(r, port, 60, TORCHELASTIC_RUN_ID="job-a")) for r in range(2)]
        started += [r.p for r in a]
        for r in a:
            assert r.when("joined", 90) is not None, r.ended(10)
        # B named, B named as A, B unnamed: at once, each timed from its own "connecting" (imports not counted),
        # refused far sooner than its timeout (a rank stuck in gloo's connect would take all of it)
        named = ({"TORCHELASTIC_RUN_ID": "job-b"}, {"TORCHELASTIC_RUN_ID": "job-a"}, {})
        b = [_Lines(_rank(1, port, 120, **env)) for env in named]
        started += [r.p for r in b]
        refused = [(r.when("connecting", 90), r.when("error:", 90)) for r in b]
        for r, (connecting, error) in zip(b, refused):
            out = r.ended(10)
            assert connecting is not None and error is not None and error - connecting < 30, \
                f"connecting at {connecting}, error at {error}:\n{out}"
            assert f"error: rank 1/2: rendezvous at 127.0.0.1:{port} (MASTER_ADDR:MASTER_PORT) failed: the store " \
                   "there is another job's" in out and "give each job a port of its own" in out, out
        for r in a:   # A is unharmed: both ranks still hold the group and leave it cleanly
            r.p.stdin.close()
            assert r.p.wait(30) == 0, r.ended(10)
    finally:
        for p in started:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_a_rank_waiting_for_its_peer_says_so_and_stops_on_ctrl_c():
    """Rank 0 alone (rank 1 never started), and rank 1 alone (nothing listens yet): each says what it waits for
    after a few seconds, and Ctrl-C ends it at once, not after dist.timeout_s."""
    ranks = [_Lines(_rank(rank, _port(), 120)) for rank in (0, 1)]   # (two jobs of one rank each)
    try:
        for rank, r in enumerate(ranks):   # Ctrl-C once it says what it waits for (within the note's delay)
            connecting = r.when("connecting", 90)
            waiting = r.when(f"rank {rank}/2: waiting for ", WAITING_NOTE_S + 20)
            assert connecting is not None and waiting is not None and waiting - connecting < WAITING_NOTE_S + 10, \
                r.ended(0)
            r.p.send_signal(signal.SIGINT)
        sent = time.monotonic()
        outs = [r.ended(30) for r in ranks]   # at once: far sooner than dist.timeout_s (a loaded machine: seconds)
        assert time.monotonic() - sent < 20 and [r.p.returncode for r in ranks] == [130, 130], outs
    finally:
        for r in ranks:
            if r.p.poll() is None:
                r.p.kill()
                r.p.wait()
    for out in outs:
        assert "interrupted" in out, out


def test_a_torchrun_restart_meets_in_its_own_attempts_keys(monkeypatch):
    """torchrun shares its store with its ranks across restarts: the failed attempt's keys (its gloo addresses) are
    not the next attempt's, whether or not TORCH_DISABLE_SHARE_RDZV_TCP_STORE is set (the slow torchrun test runs
    it)."""
    from datetime import timedelta

    import torch.distributed as tdist

    from framework.comm import rendezvous

    port = _port()
    agent = tdist.TCPStore("127.0.0.1", port, 1, True, timedelta(seconds=5), wait_for_workers=False)
    for k, v in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True").items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", raising=False)
    stores = []
    for attempt in (0, 1):
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(attempt))
        # rank 0 too is a client of the agent's store
        stores.append(rendezvous._tcp_store(0, 2, 5.0, "here", time.monotonic() + 5.0))
    stores[0].set("default_pg/0//cpu//0", "attempt 0's address")
    assert stores[0].check(["default_pg/0//cpu//0"]) and not stores[1].check(["default_pg/0//cpu//0"])
    del stores, agent


def test_ranks_given_different_overrides_are_refused(tmp_path):
    """torchrun (here: its variables by hand) with another override on rank 1: rank 0's config would be trained by
    both, the override dropped without a word; instead every rank ends with one line naming the key and values."""
    port, tiny = _port(), ["train.steps=2", "model.n_layer=1", "model.d_model=32", "model.n_head=2",
                           "model.context=16", "dist.timeout_s=30", f"hydra.run.dir={tmp_path / 'run'}"]
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    procs = [subprocess.Popen([sys.executable, "-m", "framework.train", *tiny, *extra], cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={**clean, "WORLD_SIZE": "2", "RANK": str(r), "LOCAL_RANK": str(r),
                                   "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                                   "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT})
             for r, extra in enumerate((["optimizer.lr=0.02"], ["optimizer.lr=0.01"]))]
    outs = [_ended(p, 120) for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode not in (0, None), out
        assert "config: rank 1's config differs from rank 0's at optimizer.lr (0.01 vs 0.02): every rank must be " \
               "given the same config" in out, out


def test_ranks_of_one_slurm_job_in_separate_sruns_are_one_job(monkeypatch):
    """A batch script may start its ranks in separate srun steps: one job (the step is not the job's identity);
    another job id is another job."""
    from framework.comm.rendezvous import job_identity

    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    ids = []
    for job, step in (("4242", "0"), ("4242", "1"), ("4243", "0")):
        monkeypatch.setenv("SLURM_JOB_ID", job)
        monkeypatch.setenv("SLURM_STEP_ID", step)
        ids.append(job_identity())
    assert ids[0] == ids[1] != ids[2], ids
    monkeypatch.delenv("SLURM_JOB_ID")
    for key in ("PBS_JOBID", "LSB_JOBID"):   # (mpirun under PBS or LSF: their job's id)
        with monkeypatch.context() as m:
            m.setenv(key, "77")
            assert job_identity().endswith(" job 77"), key


def test_torchrun_restarts_on_several_nodes_name_the_store_variable(monkeypatch):
    """Restarts on several nodes sharing torchrun's store: rank 0 names TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (a
    healthy node keeps its restart count); not on one node, without restarts, once set, or on other ranks."""
    from framework.comm.rendezvous import restart_note

    monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", raising=False)
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in restart_note(0) and restart_note(1) is None
    for key, value in (("GROUP_WORLD_SIZE", "1"), ("TORCHELASTIC_MAX_RESTARTS", "0"),
                       ("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")):
        with monkeypatch.context() as m:
            m.setenv(key, value)
            assert restart_note(0) is None, (key, value)


def test_a_store_never_marked_is_said_and_bounded_by_one_timeout(monkeypatch, capsys):
    """Nothing listens for 3 s, then a store that is not this job's (never marked): rank 1 says what it waits for
    and fails within dist.timeout_s of its start (one deadline for the poll and the wait, not one each)."""
    import threading
    from datetime import timedelta

    import pytest
    import torch.distributed as tdist

    from framework.comm import rendezvous
    from framework.core.errors import DistributedError

    port, held = _port(), []
    for k, v in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)).items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    timer = threading.Timer(3.0, lambda: held.append(
        tdist.TCPStore("127.0.0.1", port, 1, True, timedelta(seconds=30), wait_for_workers=False)))
    timer.start()
    start = time.monotonic()
    try:
        with pytest.raises(DistributedError, match="not every rank joined within dist.timeout_s=9s"):
            rendezvous.join("gloo", 1, 2, 9.0, None, None)
        assert time.monotonic() - start < 10.5
    finally:
        timer.join()
        held.clear()
    assert "rank 1/2: waiting for rank 0 of this job to mark the store at 127.0.0.1" in capsys.readouterr().err


def test_a_listener_that_is_not_a_store_is_refused_within_the_timeout_and_ctrl_c_ends_the_wait():
    """Something else on MASTER_PORT (accepts, never answers): torch's client handshake would wait for ever,
    deaf to signals; rank 1 instead ends with one line naming the port within dist.timeout_s, and Ctrl-C during
    the wait ends it at once."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(16)
        port, held = server.getsockname()[1], []
        threading.Thread(target=lambda: [held.append(server.accept()[0]) for _ in range(16)], daemon=True).start()
        late, hit = _Lines(_rank(1, port, 4)), _Lines(_rank(1, port, 120))
        try:
            connecting, error = late.when("connecting", 90), late.when("error:", 60)
            out = late.ended(10)
            assert connecting is not None and error is not None and error - connecting < 10, out
            assert late.p.returncode == 1 and f"error: rank 1/2: rendezvous at 127.0.0.1:{port} " \
                   "(MASTER_ADDR:MASTER_PORT) failed: " in out and "something else listens there?" in out, out
            assert hit.when("connecting", 90) is not None, hit.ended(0)
            time.sleep(2)   # (past the connect: in the handshake's wait)
            hit.p.send_signal(signal.SIGINT)
            sent = time.monotonic()
            out = hit.ended(30)
            assert time.monotonic() - sent < 10 and hit.p.returncode == 130 and "interrupted" in out, out
        finally:
            for r in (late, hit):
                if r.p.poll() is None:
                    r.p.kill()
                    r.p.wait()
            for conn in held:
                conn.close()


def test_a_now_resolved_apart_on_two_ranks_is_refused_with_where_to_put_it():
    """${now:...} in a framework key resolves on each rank at its own instant: the refusal says to give it
    literally or put it in hydra.run.dir; a number that differs gets no such hint."""
    import pytest

    from framework.config.checks import check_ranks_agree
    from framework.core.errors import ConfigError

    ranks = [{"checkpoint": {"dir": f"/x/21-18-0{s}"}, "optimizer": {"lr": 0.01}} for s in (6, 7)]
    with pytest.raises(ConfigError, match=r"at checkpoint\.dir .*a \$\{now:\.\.\.\} in it resolves per rank: give the "
                       r"value literally, or put it in hydra\.run\.dir \(rank 0's is used\)"):
        check_ranks_agree(ranks)
    ranks[1] = {"checkpoint": ranks[0]["checkpoint"], "optimizer": {"lr": 0.02}}
    with pytest.raises(ConfigError, match=r"at optimizer\.lr") as e:
        check_ranks_agree(ranks)
    assert "now:" not in str(e.value)
