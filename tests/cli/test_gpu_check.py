"""bench/gpu_check.sh --dry-run: the GPU check's code paths on the CPU checking accelerator, run as the
GPU image would run them (no Hydra, OmegaConf or W&B importable), end to end: every check reports,
none fails, one Markdown table and one JSON file come out."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_dry_run_without_hydra(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(ROOT / "tests" / "without_hydra")}
    p = subprocess.run(["bash", "bench/gpu_check.sh", "--dry-run", "--out", str(tmp_path)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    rows = report["rows"]
    assert report["dry_run"] and report["failed"] == 0
    assert {r["check"] for r in rows} == {"environment", "kernels", "equivalence", "memory", "sync", "timing"}
    assert not [r for r in rows if r["ok"] is False], [r for r in rows if r["ok"] is False]
    imports = {r["item"]: r["value"] for r in rows if r["item"].startswith("import ")}
    assert imports["import hydra"] == imports["import omegaconf"] == imports["import wandb"] == "not installed"
    compared = [r for r in rows if r["check"] == "equivalence" and "world" in r["item"]]
    assert {("world 1" in r["item"], "world 2" in r["item"]) for r in compared} == {(True, False), (False, True)}
    assert all(r["ok"] for r in compared)
    timing = {r["item"]: r for r in rows if r["check"] == "timing"}
    assert timing["fsdp2"]["ok"], timing   # the peer's code path (ours runs in memory and sync)
    table = (tmp_path / "gpu_check.md").read_text()
    assert table.count("\n| ") >= len(rows) and "Not verifiable on one GPU" in table
