"""Real DeepSpeed configs from public repositories run unmodified, two steps on two gloo ranks.

``tests/config/ds/real/`` (sources in its SOURCES.md) and the three configs of Hugging Face's
DeepSpeed guide (``tests/config/ds/``): each composes with only a tiny model and two steps on
the command line, as a training script would add them, and trains on the shared two-rank pool.
The stage, offload and precision the file asks for are the ones that run, and the losses are
finite. The configs in ``real/refused/`` hold real mistakes and are refused with one line.
"""
import json
from pathlib import Path

import pytest
import torch

import framework
from tests._helpers import run_engine

HERE = Path(__file__).resolve().parents[1] / "config" / "ds"
REAL = sorted((HERE / "real").glob("*.json")) + sorted(HERE.glob("hf_*.json"))
TINY = ["model.n_layer=1", "model.n_head=2", "model.d_model=32", "model.context=16", "data.vocab_size=24",
        "train.steps=2", "logger=none"]
STAGES = {0: "ddp", 1: "zero1", 2: "zero2", 3: "zero3"}


def _expected(ds: dict) -> tuple[str, str]:
    z = ds.get("zero_optimization", {})
    devices = {z.get(k, {}).get("device", "none") for k in ("offload_optimizer", "offload_param")}
    offload = "nvme" if "nvme" in devices else "cpu" if "cpu" in devices or z.get("cpu_offload") else "none"
    return STAGES[z.get("stage", 0)], offload


def _train(dist, path: str, tmp: str) -> tuple[list[float], dict]:
    # Swap files where this machine has room (the file's /local_nvme does not exist here).
    nvme = _expected(json.loads(Path(path).read_text()))[1] == "nvme"
    overrides = [*TINY, f"offload.nvme_path={tmp}"] if nvme else TINY
    cfg = framework.compose(overrides, ds_config=path, world=dist.world)
    losses, engine, _ = run_engine(cfg, dist)
    engine.close()
    return losses, {"choices": dict(cfg.choices), "notices": list(cfg.notices)}


def test_at_least_twenty_real_configs():
    assert len(list((HERE / "real").glob("*.json"))) >= 20
    sources = (HERE / "real" / "SOURCES.md").read_text()
    for path in (HERE / "real").rglob("*.json"):   # each with its source
        assert f"| {path.relative_to(HERE / 'real')} | " in sources, path


@pytest.mark.parametrize("path", REAL, ids=[p.stem for p in REAL])
def test_real_config_runs_unmodified_on_two_ranks(pools, path, tmp_path):
    ds = json.loads(path.read_text())
    runs = pools(2).run(_train, str(path), str(tmp_path), timeout=180)
    stage, offload = _expected(ds)
    for losses, info in runs:
        assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses))), losses
        assert (info["choices"]["stage"], info["choices"]["offload"]) == (stage, offload), info
        assert all("\n" not in n for n in info["notices"])
        if ds.get("fp16", {}).get("enabled") is True:
            assert info["choices"]["precision"] == "fp16"
    assert runs[0][0] == runs[1][0]   # every rank reports the same (global) loss


REFUSED = {
    "dsexamples_megatron-zero3_ds_zero_stage_3_config": "did you mean 'zero_optimization.stage3_param_persistence",
    "dsexamples_megatron-zero3_ds_zero_stage_infinity_config": "did you mean 'zero_optimization.stage3_param_pers",
    "dsexamples_megatron_ds_zero-offload_config": "optimizer.type 'DeepSpeed_Adam' is not a DeepSpeed optimizer",
    "accelerate-tests_zero3_model_only": "train_batch_size=1 is not divisible by the world size 2",
    # DeepSpeed 0.19 rejects unknown keys in these sections (pydantic extra="forbid")
    "dsexamples_megatron_ds_zero-offload_1B_config": "did you mean 'zero_optimization.overlap_comm'",
    "dsexamples_cifar_ds_config": "bf16: unknown keys loss_scale, loss_scale_window, hysteresis",
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_real_mistakes_stay_one_line_errors(name):
    with pytest.raises(framework.ConfigError) as e:
        framework.compose(TINY, ds_config=HERE / "real" / "refused" / f"{name}.json", world=2)
    assert REFUSED[name] in str(e.value) and "\n" not in str(e.value), str(e.value)
