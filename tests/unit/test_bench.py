"""Quick twins of the benchmark scripts: they run end to end on a small config (numbers not checked)."""
import math

import pytest


@pytest.mark.parametrize("system", ["plain", "zero2-offload-overlap", "zero3-nvme"])
def test_gpu_bench_runs_tiny(system, tmp_path):
    from bench.gpu import run_one

    r = run_one(system, tiny=True, warmup=1, steps=2, nvme_dir=str(tmp_path))
    assert r["system"] == system and r["s_per_step"] > 0 and r["tokens_per_s"] > 0
    assert math.isfinite(r["first_loss"]) and math.isfinite(r["last_loss"])
    if system != "plain":
        assert {"forward", "backward", "reduce", "apply"} <= r["phases_ms"].keys()
        if system == "zero3-nvme":
            assert r["swap"]["read"] > 0 and r["swap"]["written"] > 0 and list(tmp_path.iterdir()) == []
        else:
            assert r["speculated_kept"] + r["rolled_back"] > 0  # the overlapped host step was exercised


def test_nvme_io_bench_runs_tiny(tmp_path):
    from bench.nvme_io import main

    rows = main(["--dir", str(tmp_path), "--size", "4MiB", "--tensor-size", "1MiB", "--block-sizes", "256KiB",
                 "--queue-depths", "2", "--rounds", "1", "--no-fio"])
    kinds = {r["checksum"] for r in rows if r["system"] == "ours-checksum"}
    assert kinds == {"none", "sum64", "crc32"} and all(r["write"] > 0 and r["read"] > 0 for r in rows)
    assert list(tmp_path.iterdir()) == []   # the swap file went


def test_checkpoint_bench_runs_tiny(tmp_path):
    """bench.checkpoint's rank function on one process with gpt-nano (ours and torch.save rows)."""
    from bench.checkpoint import ours
    from framework.distributed import connect

    r = ours(connect("gloo"), "gpt-nano", str(tmp_path), 1)
    assert r["sync_total"] > 0 and r["load"] > 0 and r["async_blocked"] > 0 and r["torch_save"] > 0
    assert r["bytes_ours"] > 0 and r["bytes_torch"] > 0


def test_nvme_memory_gpt2_small_one_gb_below_cpu():
    """Issue 9's memory claim, measured as written: gpt2-small (124 M parameters), zero2, one rank,
    ``offload=nvme`` with its defaults peaks (ru_maxrss of each run's own process) at least 1 GB below
    ``offload=cpu``, with the same loss and no swap file left behind. The fp32 master + Adam moments
    are 1.49 GB; measured drop 1.13 GB on a quiet machine (BENCHMARKS.md). Two fresh processes at
    once, about 30-40 s."""
    from bench.nvme_memory import compare

    r = compare("gpt2-small")
    assert r["nvme"]["train_loss"] == r["cpu"]["train_loss"]
    assert r["drop_bytes"] >= 1e9, r
    assert r["nvme"]["run_dir_left"] == r["cpu"]["run_dir_left"], r   # the nvme folder went with its files
