"""python -m framework.train ds_config=...: precedence, provenance, --cfg job, errors."""
import json
from pathlib import Path

import yaml

from tests.cli.test_cli import SHORT, cli, error_lines

DS = Path(__file__).resolve().parents[1] / "config" / "ds"


def test_ds_config_multirun_records_provenance_in_summary_and_wandb(forkrun, tmp_path):
    p = cli(forkrun, tmp_path, "-m", f"ds_config={DS / 'hf_zero2_cpu_offload.json'}", *SHORT,
            "optimizer.lr=1e-3,3e-4", "logger=wandb")
    assert p.returncode == 0, p.stderr
    assert p.stderr.count("steps_per_print") == 2  # the inert keys, listed once per job
    for job, lr in ((0, 1e-3), (1, 3e-4)):
        summary = json.loads((tmp_path / "sweep" / str(job) / "summary.json").read_text())
        cfg, src = summary["config"], summary["config_sources"]
        assert cfg["stage"]["name"] == "zero2" and cfg["offload"]["name"] == "cpu"
        assert cfg["optimizer"]["lr"] == lr and src["optimizer.lr"] == "command line"
        assert cfg["scheduler"]["warmup_max_lr"] == lr and src["scheduler.warmup_max_lr"] == "auto"
        assert cfg["stage"]["reduce_bucket_size"] == 200_000_000 and src["stage.reduce_bucket_size"] == "DeepSpeed file"
        assert src["train.steps"] == "command line" and src["seed"] == "YAML"
        assert src["optimizer.decay_1d"] == "DeepSpeed default"
        # The W&B run's config carries the sources too (the offline record is a protobuf stream).
        record = next((tmp_path / "sweep" / str(job) / "wandb").glob("offline-run-*/run-*.wandb")).read_bytes()
        assert b"config_sources" in record and b"DeepSpeed default" in record


def test_cfg_job_shows_the_resolved_config(forkrun, tmp_path):
    p = cli(forkrun, tmp_path, "--cfg", "job", f"ds_config={DS / 'hf_zero3_cpu_offload.json'}", "model.d_model=64")
    assert p.returncode == 0, p.stderr
    shown = yaml.safe_load(p.stdout)
    assert shown["stage"]["stage3_prefetch_bucket_size"] == int(0.9 * 64 * 64)
    assert shown["stage"]["stage3_param_persistence_threshold"] == 640
    assert shown["optimizer"]["decay_1d"] is True and shown["train"]["grad_clip"] == 1.0
    # the chosen groups (the DeepSpeed file's too), which the sections do not name, as a comment line on top
    top = p.stdout.splitlines()[0]
    assert top.startswith("# stage=zero3 offload=cpu ") and " optimizer=adamw " in top and " scheduler=" in top, top
    assert not (tmp_path / "run").exists()
    # a DeepSpeed config named in the user's own YAML is shown resolved too
    (tmp_path / "ds.json").write_text(json.dumps({"zero_optimization": {"stage": 2}, "gradient_clipping": 0.25,
                                                  "my_knob": 1}))
    (tmp_path / "mine.yaml").write_text(f"defaults:\n  - train\n  - _self_\nds_config: {tmp_path / 'ds.json'}\n")
    p = cli(forkrun, tmp_path, "--cfg", "job", "--config-dir", str(tmp_path), "--config-name", "mine")
    assert p.returncode == 0, p.stderr
    assert "does not know" in p.stderr and "my_knob" in p.stderr and "my_knob" not in p.stdout   # as a run warns
    shown = yaml.safe_load(p.stdout)
    assert "reduce_scatter" in shown["stage"] and shown["train"]["grad_clip"] == 0.25   # the file's zero2
    # --package shows one section, as Hydra's own --cfg job --package does
    p = cli(forkrun, tmp_path, "--cfg", "job", "--package", "train", "--config-dir", str(tmp_path),
            "--config-name", "mine")
    assert p.returncode == 0 and yaml.safe_load(p.stdout)["grad_clip"] == 0.25, p.stdout + p.stderr
    # --resolve: the job's config with its interpolations resolved (Hydra's own section, which only a
    # running Hydra resolves, is not part of it); one it cannot resolve is one line
    p = cli(forkrun, tmp_path, "--cfg", "job", "--resolve", "train.steps=2", "checkpoint.dir=ck${train.steps}")
    assert p.returncode == 0 and yaml.safe_load(p.stdout)["checkpoint"]["dir"] == "ck2", p.stdout + p.stderr
    p = cli(forkrun, tmp_path, "--cfg", "job", "--resolve", "checkpoint.dir=${hydra.job.num}")
    assert p.returncode != 0 and len(error_lines(p)) == 1 and "hydra.job.num" in p.stderr, p.stderr
    # an override Hydra cannot parse: one line, as without --cfg
    p = cli(forkrun, tmp_path, "--cfg", "job", "train.steps")
    assert p.returncode != 0 and len(error_lines(p)) == 1 and "train.steps" in p.stderr, p.stderr


def test_bad_ds_config_is_one_line_and_nonzero(forkrun, tmp_path):
    bad = tmp_path / "ds.json"
    bad.write_text(json.dumps({"zero_optimization": {"stage": 2, "overlap_com": True}}))
    p = cli(forkrun, tmp_path, f"ds_config={bad}", *SHORT)
    assert p.returncode != 0
    lines = error_lines(p)
    assert len(lines) == 1 and "did you mean 'zero_optimization.overlap_comm'" in lines[0], p.stderr
    assert not (tmp_path / "run").exists()


def test_command_line_sets_keys_of_the_groups_the_file_chooses(forkrun, tmp_path):
    """Hydra's run composes the command line again, without the file: the file's group choices go
    to it too, so a key of the file's optimizer (stage, offload) set on the command line runs as
    ``--cfg job`` shows it; the records stay as given."""
    sgd = tmp_path / "sgd.json"
    sgd.write_text(json.dumps({"optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}}))
    p = cli(forkrun, tmp_path, f"ds_config={sgd}", "optimizer.momentum=0.5", *SHORT[:1], "train.eval_every=0")
    assert p.returncode == 0, p.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["config"]["optimizer"]["name"] == "sgd" and summary["config"]["optimizer"]["momentum"] == 0.5
    assert summary["config_sources"]["optimizer.momentum"] == "command line"
    assert summary["config_sources"]["optimizer.name"] == "DeepSpeed file"
    record = tmp_path / "run" / ".hydra"
    assert yaml.safe_load((record / "overrides.yaml").read_text())[:2] == [f"ds_config={sgd}", "optimizer.momentum=0.5"]
    # Hydra's config.yaml is its YAML layer (lr 1e-3, not the file's 0.1): its first line says where the run's is
    layer = (record / "config.yaml").read_text()
    assert layer.startswith("# Hydra's YAML layer") and "summary.json's \"config\"" in layer.splitlines()[0]
    assert yaml.safe_load(layer)["optimizer"]["lr"] != summary["config"]["optimizer"]["lr"] == 0.1
    assert not any(o.startswith("optimizer=") for o in yaml.safe_load((record / "overrides.yaml").read_text()))
    hydra_cfg = yaml.safe_load((record / "hydra.yaml").read_text())["hydra"]
    assert hydra_cfg["runtime"]["choices"]["optimizer"] == "sgd"
    assert hydra_cfg["job"]["config"]["override_dirname"]["exclude_keys"] == []
    assert "hydra.output_subdir=null" not in hydra_cfg["overrides"]["hydra"]
    assert not any("exclude_keys" in o for o in hydra_cfg["overrides"]["hydra"])
    # a sweep: the offload group and the stage the file chooses, set on the command line
    p = cli(forkrun, tmp_path, "-m", f"ds_config={DS / 'hf_zero2_cpu_offload.json'}", "offload.ratio=0.5,1.0",
            "stage.overlap_comm=false", *SHORT[:1], "train.eval_every=0")
    assert p.returncode == 0, p.stderr
    for job, ratio in ((0, 0.5), (1, 1.0)):
        summary = json.loads((tmp_path / "sweep" / str(job) / "summary.json").read_text())
        assert summary["config"]["offload"]["ratio"] == ratio and summary["config"]["stage"]["overlap_comm"] is False
        assert summary["config"]["stage"]["name"] == "zero2"
        overrides = yaml.safe_load((tmp_path / "sweep" / str(job) / ".hydra" / "overrides.yaml").read_text())
        assert not any(o.startswith(("offload=", "+stage=")) for o in overrides), overrides
    multirun = yaml.safe_load((tmp_path / "sweep" / "multirun.yaml").read_text())["hydra"]
    assert not any(o.startswith(("offload=", "+stage=")) for o in multirun["overrides"]["task"])
