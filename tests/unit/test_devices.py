"""Backend and device choice from the GPUs a host has, thread caps per rank, and the launcher's line
for a rank that a signal (NCCL's watchdog: SIGABRT) ended. GPU counts are simulated."""
import signal

import pytest
import torch

from framework import ConfigError
from framework.comm import distributed as d
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
    line = exit_message(1, 2, -signal.SIGABRT, "nccl", 300)
    assert line.startswith("rank 1 of 2 was aborted by NCCL's watchdog (SIGABRT)") and "dist.timeout_s=300s" in line
    assert "out of memory" in exit_message(0, 2, -signal.SIGKILL, "nccl", 300)
    assert exit_message(0, 2, -signal.SIGABRT, "gloo", 300) == "rank 0 of 2 was killed by SIGABRT; the other ranks were stopped"
    assert exit_message(1, 4, 1, "gloo", 300).startswith("rank 1 of 4 exited with code 1 (anything it printed is above)")
