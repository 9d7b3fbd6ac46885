"""Quick twins of the benchmark scripts: they run end to end on a small config (numbers not checked)."""
import math

import pytest


@pytest.mark.parametrize("system", ["plain", "zero2-offload-overlap"])
def test_gpu_bench_runs_tiny(system):
    from bench.gpu import run_one

    r = run_one(system, tiny=True, warmup=1, steps=2)
    assert r["system"] == system and r["s_per_step"] > 0 and r["tokens_per_s"] > 0
    assert math.isfinite(r["first_loss"]) and math.isfinite(r["last_loss"])
    if system != "plain":
        assert {"forward", "backward", "reduce", "apply"} <= r["phases_ms"].keys()
        assert r["speculated_kept"] + r["rolled_back"] > 0  # the overlapped host step was exercised
