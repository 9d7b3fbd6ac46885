"""Recipes as users run them (python -m framework.recipe NAME --quick) and sweep reports
(python -m framework.report DIR): the tiny twins of every recipe, their checks failing on
doctored results, and the report of a real multirun."""
from __future__ import annotations

import importlib.util
import io
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from framework.cli import recipe as recipes
from framework.cli import recipe_checks, report
from framework.core import files
from framework.core.errors import DataError
from tests._helpers import shakespeare

# A recipe run checks first that matplotlib (the report's plots, an optional extra) is there: without it the
# tests of what a run does or refuses after that skip (test_run_without_matplotlib_... checks that line).
needs_matplotlib = pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                                      reason="needs matplotlib: pip install -e '.[report]'")

ROOT = Path(__file__).resolve().parents[2]
SHAKESPEARE = shakespeare()   # without it the tests that need it skip
PNG = b"\x89PNG\r\n\x1a\n"


def run_quick(name: str, out: Path, *overrides: str) -> dict:
    log = io.StringIO()
    verdict = recipes.run(recipes.find(name), quick=True, overrides=list(overrides), out=out, stream=log)
    assert verdict["passed"], log.getvalue()[-4000:]
    return verdict


@pytest.fixture(scope="module")
def equivalence(tmp_path_factory) -> dict:
    pytest.importorskip("matplotlib")   # a run checks for the report's plots first
    return run_quick("zero_equivalence", tmp_path_factory.mktemp("zero_equivalence"))


def test_every_recipe_is_complete_and_composes():
    """Each recipe has its four files, both check sections, and every job of the full and the
    quick runs composes against the schemas (data files are not needed to compose). A quick run's
    jobs are composed by the test that runs them below (test_<name>_quick: a job that does not compose
    fails, and its ``jobs`` check fails unless as many finished as checks say): composed here only where
    that test skips (no tiny shakespeare, no transformers)."""
    import importlib.util

    names = recipes.available()
    assert {"shakespeare_char_cpu", "zero_equivalence", "memory_scaling", "shakespeare_char_gpu"} <= set(names)
    quick_runs = {"zero_equivalence", "memory_scaling"}
    if SHAKESPEARE.is_file():
        quick_runs |= {"shakespeare_char_cpu", "shakespeare_char_gpu"}
    if importlib.util.find_spec("transformers") is not None:
        quick_runs.add("hf_gpt2_zero3")
    for name in names:
        r = recipes.find(name)
        assert (r.dir / "README.md").is_file(), name
        for quick in (False,) if name in quick_runs else (False, True):
            assert "jobs" in r.checks(quick), (name, quick)
            n = sum(len(recipes.compose_jobs(r, run)) for run in r.runs(quick))
            assert n == r.checks(quick)["jobs"], (name, quick, n)


def test_zero_equivalence_quick(equivalence):
    assert next(c for c in equivalence["checks"] if c["check"] == "jobs")["finished"] == 4
    curves = [c for c in equivalence["checks"] if isinstance(c["check"], dict) and "curves_match" in c["check"]]
    assert len(curves) == 2 and all(c["passed"] for c in curves)
    configs = [j.summary["config"] for j in report.load_jobs(Path(equivalence["out"]))]
    assert ("zero2", "nvme") in [(c["stage"]["name"], c["offload"]["name"]) for c in configs]
    assert {c["train"]["grad_accum"] for c in configs} == {2}   # accumulation in every stage, as the full run
    out = Path(equivalence["out"])
    for png in ("loss.png", "throughput_memory.png", "deviation.png"):
        assert (out / png).read_bytes()[:8] == PNG, png
    assert json.loads((out / "checks.json").read_text())["passed"] is True


def test_curve_check_fails_on_a_perturbed_job(equivalence, tmp_path):
    """The equivalence check can fail: one job's loss at one step moved by 1e-4 is named, with the
    step and both values."""
    out = tmp_path / "doctored"
    shutil.copytree(equivalence["out"], out)
    job = next(d for d in sorted(out.glob("run*-job*")) if "zero2" in (d / ".hydra" / "overrides.yaml").read_text())
    lines = [json.loads(x) for x in (job / "metrics.jsonl").read_text().splitlines()]
    hit = next(r for r in lines if r.get("step") == 3 and "loss" in r)
    hit["loss"] += 1e-4
    (job / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    log = io.StringIO()
    verdict = recipes.finish(recipes.find("zero_equivalence"), out, quick=True, stream=log)
    assert not verdict["passed"]
    bad = [c for c in verdict["checks"] if not c["passed"]]
    assert len(bad) == 1 and "+stage=zero2" in bad[0]["message"] and "step 3" in bad[0]["message"]
    assert f"{hit['loss']:.8f}" in bad[0]["message"], bad[0]["message"]
    assert "FAIL" in log.getvalue()


def test_report_of_a_multirun(equivalence, tmp_path, forkrun):
    """python -m framework.report on a real sweep folder: one row per job with its own overrides,
    measured memory, PNG plots; a job without summary.json is listed, not dropped. (The command
    forked from the suite's fork server, tests/cli/_forkrun.py, as the README test runs it.)"""
    sweep = tmp_path / "sweep"
    shutil.copytree(equivalence["out"], sweep)
    broken = sweep / "run9-job0" / ".hydra"
    broken.mkdir(parents=True)
    (broken / "overrides.yaml").write_text("- +stage=zero1\n- offload=cpu\n")
    p = forkrun.run("framework.report", [str(sweep), "--out", str(tmp_path / "rep")], cwd=tmp_path, timeout=120)
    assert p.returncode == 0, p.stderr
    md = (tmp_path / "rep" / "report.md").read_text()
    rows = [line for line in md.splitlines() if line.startswith("| run")]
    assert len(rows) == 5, md
    assert "`+stage=zero3`" in md and "no summary.json" in rows[-1]
    assert "| train loss (mean of last log_every steps) |" in md, md
    jobs = report.load_jobs(sweep)
    done = [j for j in jobs if j.summary]
    for j, row in zip(done, rows):
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[4] == f"{j.summary['val_loss']:.4f}"
        assert int(cells[6].replace(",", "")) == round(j.peak() / 2**20)   # measured peak RSS, MiB
        assert all(r["rss_start_bytes"] <= r["peak_rss_bytes"] for r in j.summary["peak_memory_per_rank"])
    for png in ("loss.png", "throughput_memory.png"):
        assert (tmp_path / "rep" / png).read_bytes()[:8] == PNG
    p = forkrun.run("framework.report", [str(tmp_path / "nothing")], cwd=tmp_path, timeout=60)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1 and "multirun" in p.stderr


def test_report_of_a_wrong_folder_makes_nothing(tmp_path, capsys):
    """A missing folder, or one without jobs, is one line and exit 2 (a refused argument), with or without --out, and
    neither the folder nor --out is created."""
    (tmp_path / "empty").mkdir()
    for folder, says in (("nothing", "is not a folder"), ("empty", "no job under")):
        for extra in ([], ["--out", str(tmp_path / "rep")]):
            with pytest.raises(SystemExit) as e:
                report.main([str(tmp_path / folder), *extra])
            err = capsys.readouterr().err
            assert e.value.code == 2 and says in err and len(err.strip().splitlines()) == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"] and not any((tmp_path / "empty").iterdir())


def test_report_of_malformed_job_files_or_a_file_as_out_is_one_line(tmp_path, capsys):
    job = tmp_path / "0"
    job.mkdir()
    (job / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo')   # killed mid-write
    (job / "summary.json").write_text("{}")
    assert [r["step"] for r in report.load_jobs(tmp_path)[0].records] == [1]
    for name, text in (("summary.json", '{"steps": '), ("metrics.jsonl", "not json\n"),
                       ("metrics.jsonl", '{"loss": 2.0}\n'), ("metrics.jsonl", '{"step": "2", "loss": 2.0}\n')):
        (job / name).write_text(text)
        with pytest.raises(SystemExit) as e:
            report.main([str(tmp_path), "--out", str(tmp_path / "rep")])
        err = capsys.readouterr().err
        assert e.value.code == 2 and f"{job / name} is malformed" in err and len(err.strip().splitlines()) == 1, err
        (job / name).write_text("{}" if name == "summary.json" else "")
    assert not (tmp_path / "rep").exists()
    pytest.importorskip("matplotlib")   # (checked before the folder is made)
    (tmp_path / "rep").write_text("a file")   # --out naming a file
    with pytest.raises(SystemExit) as e:
        report.main([str(tmp_path), "--out", str(tmp_path / "rep")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "cannot make the output folder" in err and len(err.strip().splitlines()) == 1, err
    assert (tmp_path / "rep").read_text() == "a file"



def test_report_labels_a_job_by_the_overrides_its_summary_records(tmp_path):
    """A later run in the same folder rewrites .hydra/overrides.yaml before its checks fail; the
    row of the finished run keeps the overrides that made its summary.json (as the user spelled
    them where the folder's still say the same)."""
    def job(name, hydra_overrides, cli_keys, config, **more):
        d = tmp_path / name
        (d / ".hydra").mkdir(parents=True)
        (d / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in hydra_overrides))
        sources = {k: "YAML" for k in ("train.steps", "optimizer.lr", "stage.name")} | dict.fromkeys(cli_keys,
                                                                                                  "command line")
        (d / "summary.json").write_text(json.dumps({"steps": 2, "config": config, "config_sources": sources, **more}))

    config = {"train": {"steps": 2}, "optimizer": {"name": "adamw", "lr": 0.001}, "stage": {"name": "zero1"}}
    job("0", ["train.steps=2", "optimizer.lr=-1"], ["train.steps"], config)   # overwritten by a failed run
    job("1", ["train.steps=2", "optimizer.lr=1e-3", "+stage=zero1"], ["train.steps", "optimizer.lr", "stage.name"],
        config)
    # checkpoint.resume=latest is recorded as what it resolved to: the folder's own spelling stays
    resumed = {**config, "checkpoint": {"resume": "off"}}
    job("2", ["train.steps=2", "checkpoint.resume=latest"], ["train.steps", "checkpoint.resume"], resumed)
    # ... and where the row is rebuilt from the summary, it says latest as typed (not off, nor the folder it found)
    for name, led in (("3", "off"), ("4", "/runs/a/checkpoints")):
        job(name, ["optimizer.lr=-1"], ["train.steps", "checkpoint.resume"], {**config, "checkpoint": {"resume": led}},
            resume_given="latest")
    jobs = report.load_jobs(tmp_path)
    assert [j.overrides for j in jobs] == [["train.steps=2"], ["train.steps=2", "optimizer.lr=1e-3", "+stage=zero1"],
                                           *[["train.steps=2", "checkpoint.resume=latest"]] * 3]


@pytest.fixture(scope="module")
def shakespeare_tokens(tmp_path_factory) -> Path:
    """The prepare step as a user runs it: text -> uint16 tokens + tokens.meta.json, nanoGPT's split."""
    if not SHAKESPEARE.is_file():
        pytest.skip(f"{SHAKESPEARE} not available (tiny shakespeare; see recipes/shakespeare_char_cpu/README.md)")
    tokens = tmp_path_factory.mktemp("shakespeare") / "data" / "tokens.bin"
    rc = recipes.main(["shakespeare_char_cpu", "prepare", f"data.path={SHAKESPEARE}", "--out", str(tokens)])
    assert rc == 0
    return tokens


def test_prepare_chars(shakespeare_tokens):
    meta = json.loads((shakespeare_tokens.parent / "tokens.meta.json").read_text())
    assert (meta["vocab_size"], meta["train_tokens"], meta["val_tokens"]) == (65, 1_003_854, 111_540)
    assert meta["source_sha256"] == recipes.find("shakespeare_char_cpu").expected["data"]["source_sha256"]
    assert shakespeare_tokens.stat().st_size == 2 * 1_115_394
    assert meta["chars"][0] == "\n" and len(meta["chars"]) == 65


def test_prepare_writes_only_a_new_file_or_its_own_earlier_output(tmp_path, capsys):
    """The source text, a folder or another file as the output: one line, exit 2, nothing touched."""
    src = tmp_path / "in.txt"
    src.write_text("to be or not to be\n" * 40)   # (each split longer than the recipe's context)
    other = tmp_path / "other.bin"
    other.write_bytes(b"keep")
    (tmp_path / "outd").mkdir()

    def prepare(out: Path) -> int:
        return recipes.main(["shakespeare_char_cpu", "prepare", f"data.path={src}", "--out", str(out)])

    cases = [(src, "is the text file"), (tmp_path / "outd", "is a folder"), (other, "is not a token file prepare wrote"),
             (src / "tok.bin", f"--out {src / 'tok.bin'}: cannot make its folder")]
    if Path("/proc").is_dir():   # a folder nothing can be created in, even by root
        cases.append((Path("/proc/tok.bin"), "--out /proc/tok.bin: cannot write it in /proc"))
    for out, words in cases:
        capsys.readouterr()
        assert prepare(out) == 2
        err = capsys.readouterr().err
        assert words in err and len(err.strip().splitlines()) == 1, err
    assert src.read_text() == "to be or not to be\n" * 40 and other.read_bytes() == b"keep"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt", "other.bin", "outd"]
    assert not list((tmp_path / "outd").iterdir())
    assert prepare(tmp_path / "tok.bin") == 0 and prepare(tmp_path / "tok.bin") == 0   # its own output: rewritten
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.parametrize("given", [["data.path"], ["~data.path"], ["data.path="], ["seed=1"]])
def test_prepare_takes_only_data_path_with_a_file(given, tmp_path, capsys):
    assert recipes.main(["shakespeare_char_cpu", "prepare", *given, "--out", str(tmp_path / "t.bin")]) == 2
    err = capsys.readouterr().err
    assert "prepare takes only data.path=FILE" in err and len(err.strip().splitlines()) == 1, err
    assert not list(tmp_path.iterdir())


@needs_matplotlib
def test_shakespeare_char_cpu_quick(shakespeare_tokens, tmp_path):
    """The twin: ddp on 1 rank and zero3 on 2 ranks at the same global batch reach the same
    validation loss on the prepared data."""
    verdict = run_quick("shakespeare_char_cpu", tmp_path, f"data.path={shakespeare_tokens}")
    vals = next(c for c in verdict["checks"] if c["check"] != "jobs" and c["check"]["metric"] == "val_loss")["values"]
    assert len(vals) == 2
    a, b = vals.values()
    assert abs(a - b) < 1e-4, vals   # same global batch, fp32: ddp x1 and zero3 x2 agree


@needs_matplotlib
def test_shakespeare_char_gpu_quick(shakespeare_tokens, tmp_path):
    """The GPU recipe's CPU twin (bf16, dropout 0.2, the same data set)."""
    verdict = run_quick("shakespeare_char_gpu", tmp_path, f"data.path={shakespeare_tokens}")
    summary = report.load_jobs(Path(verdict["out"]))[0].summary
    assert summary["config"]["precision"]["name"] == "bf16" and summary["config"]["model"]["dropout"] == 0.2
    # The twin's checks ask that it learns: the same job whose val loss stays at ln 65 (a model that learned
    # nothing predicts the 65 characters uniformly) fails them.
    stuck = tmp_path / "stuck"
    shutil.copytree(verdict["out"], stuck)
    metrics = next(stuck.glob("run*-job*/metrics.jsonl"))
    lines = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert sum("val_loss" in r for r in lines) >= 2, lines
    metrics.write_text("".join(json.dumps({**r, "val_loss": math.log(65)} if "val_loss" in r else r) + "\n"
                               for r in lines))
    log = io.StringIO()
    verdict = recipes.finish(recipes.find("shakespeare_char_gpu"), stuck, quick=True, stream=log)
    failed = [c["check"]["metric"] for c in verdict["checks"] if not c["passed"]]
    assert not verdict["passed"] and failed == ["min:val_loss", "drop:val_loss"], log.getvalue()[-2000:]


@needs_matplotlib
def test_missing_data_names_the_prepare_step(tmp_path):
    with pytest.raises(DataError, match="framework.recipe shakespeare_char_cpu prepare data.path="):
        recipes.run(recipes.find("shakespeare_char_cpu"), quick=True, out=tmp_path,
                    overrides=[f"data.path={tmp_path / 'missing.bin'}"], stream=io.StringIO())
    assert not list(tmp_path.iterdir())   # nothing ran


def test_metric_check_reports_the_numbers(equivalence):
    jobs = report.load_jobs(Path(equivalence["out"]))
    res = recipes.evaluate(jobs, {"jobs": 4, "checks": [{"metric": "val_loss", "max": 1.0},
                                                        {"metric": "val_loss", "min": 1.0}]})
    assert [r["passed"] for r in res] == [True, False, True]
    worst = jobs[0].summary["val_loss"]
    assert "val_loss <= 1.0" in res[1]["message"] and f"{worst:.4f}" in res[1]["message"]
    res = recipes.evaluate(jobs, {"jobs": 5, "checks": [{"metric": "val_loss", "max": 9, "where": {"stage": "zero9"}}]})
    assert not res[0]["passed"] and "expected 5" in res[0]["message"]
    assert not res[1]["passed"] and "no job matches" in res[1]["message"]


@needs_matplotlib
def test_memory_scaling_quick(tmp_path):
    verdict = run_quick("memory_scaling", tmp_path)
    assert [c["check"] for c in verdict["checks"]][1:] == [{"memory_scaling": "ddp", "max_change": 0.25}]
    out = Path(verdict["out"])
    assert (out / "memory_scaling.png").read_bytes()[:8] == PNG
    jobs = [j for j in report.load_jobs(out) if j.summary]
    assert sorted((j.summary["config"]["stage"]["name"], j.summary["world"]) for j in jobs) == \
        [("ddp", 1), ("ddp", 2), ("zero3", 2)]
    for j in jobs:   # measured per rank, every rank
        assert len(j.summary["peak_memory_per_rank"]) == j.summary["world"]
        assert j.added() > 0 and j.peak() > j.added()


def test_zero_formula():
    """The ZeRO paper's counts: fp32 16 bytes/param replicated; mixed 2 + 2 + 12/N for zero1, etc."""
    f = recipe_checks.zero_model_state_bytes
    assert f("ddp", 10, 4) == 160 and f("zero3", 10, 4) == 40
    assert f("zero1", 10, 4) == 10 * (4 + 4 + 8 / 4) and f("zero2", 10, 4) == 10 * (4 + 12 / 4)
    assert f("zero1", 10, 4, "bf16") == 10 * (2 + 2 + 12 / 4) and f("zero2", 10, 2, "fp16") == 10 * (2 + 14 / 2)
    assert f("ddp", 10, 8, "bf16") == 160


def test_cli_unknown_recipe_one_line(tmp_path, forkrun):
    p = forkrun.run("framework.recipe", ["no_such_recipe"], cwd=tmp_path, timeout=60)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1
    assert "shakespeare_char_cpu" in p.stderr


def _job(stage: str, world: int, added_mib: float, params: int = 2**20) -> report.Job:
    summary = {"world": world, "params": params,
               "config": {"stage": {"name": stage}, "precision": {"name": "fp32"}},
               "peak_memory_per_rank": [{"peak_rss_bytes": int((300 + added_mib) * 2**20),
                                         "rss_start_bytes": 300 * 2**20}] * world}
    return report.Job(dir=Path(f"{stage}-{world}"), overrides=[], summary=summary, label=f"{stage} x{world}")


def test_memory_scaling_check_against_the_formula():
    """The memory check compares what a stage saves from world 1 to 4 with the formula's saving
    (zero3, fp32, 1 Mi params: 16 MiB -> 4 MiB, saving 12 MiB); it fails on too little saving and
    on a replicated stage whose memory moves."""
    want = [{"memory_scaling": "zero3", "min_ratio": 0.8, "max_ratio": 1.2},
            {"memory_scaling": "ddp", "max_change": 0.05}]
    good = [_job("zero3", 1, 116), _job("zero3", 4, 104), _job("ddp", 1, 116), _job("ddp", 4, 117)]
    res = recipes.evaluate(good, {"checks": want})
    assert [r["passed"] for r in res] == [True, True], [r["message"] for r in res]
    assert res[0]["ratio"] == pytest.approx(1.0) and "formula 12 MiB" in res[0]["message"]
    bad = [_job("zero3", 1, 116), _job("zero3", 4, 110), _job("ddp", 1, 116), _job("ddp", 4, 130)]
    res = recipes.evaluate(bad, {"checks": want})
    assert [r["passed"] for r in res] == [False, False]
    assert "measured 6 MiB" in res[0]["message"] and "measured/formula 0.50" in res[0]["message"]
    # "worlds": only those world sizes (zero3 from 2 to 4: 8 MiB -> 4 MiB, saving 4 MiB).
    jobs = [_job("zero3", 1, 100), _job("zero3", 2, 108), _job("zero3", 4, 104)]
    res = recipes.evaluate(jobs, {"checks": [{**want[0], "worlds": [2, 4]}, want[0]]})
    assert [r["passed"] for r in res] == [True, False], [r["message"] for r in res]
    assert "from world 2 to 4" in res[0]["message"] and res[0]["ratio"] == pytest.approx(1.0)
    # A replicated stage whose memory grew by under half a MiB saved 0 MiB (not "-0").
    [res] = recipes.evaluate([_job("ddp", 1, 116), _job("ddp", 4, 116.3)], {"checks": [want[1]]})
    assert "measured 0 MiB, ZeRO formula 0 MiB" in res["message"], res["message"]


@needs_matplotlib
def test_hf_gpt2_zero3_quick(tmp_path, capsys):
    """The guide's scenario end to end (estimate, ZeRO-3 + CPU offload JSON with "auto", train,
    export, from_pretrained, generate); needs the optional ``hf`` extra."""
    pytest.importorskip("transformers")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    verdict = run_quick("hf_gpt2_zero3", tmp_path)
    out = Path(verdict["out"])
    reload = json.loads((out / "reload.json").read_text())
    assert reload["val_loss_abs_diff"] <= 1e-4 and reload["generated_tokens"] == 16
    # A job whose validation loss was not finite (null in summary.json): a failing check, not a traceback.
    summary = next(out.glob("run*-job*/summary.json"))
    summary.write_text(json.dumps({**json.loads(summary.read_text()), "val_loss": None}))
    # (the script's main in this process: the recipe ran it as a command above)
    capsys.readouterr()
    _script(ROOT / "recipes" / "hf_gpt2_zero3" / "reload_generate.py").main(out)
    assert "vs the job's not finite" in capsys.readouterr().out
    check = {"file": "reload.json", "key": "val_loss_abs_diff", "max": 1e-4}
    assert not recipes.evaluate([], {"checks": [check]}, out=out)[0]["passed"]
    # Token 0 (the config's eos) is an ordinary symbol of the chain: generation goes on past it.
    # Weights doctored so that greedy decoding picks 0 at every position (a constant final norm).
    from safetensors.torch import load_file, save_file
    weights = next(summary.parent.glob("model_16bit/*.safetensors"))
    w = load_file(weights)
    w["transformer.ln_f.weight"].zero_()
    w["transformer.ln_f.bias"].fill_(1.0)
    for k in ("transformer.wte.weight", "lm_head.weight"):   # (tied: either may be saved)
        if k in w:
            w[k][0] = 1.0
    save_file(w, weights)
    _script(ROOT / "recipes" / "hf_gpt2_zero3" / "reload_generate.py").main(out)
    assert json.loads((out / "reload.json").read_text())["generated"] == [0] * 16


@pytest.mark.parametrize("model", ["gpt", "llama"])
def test_capacity_quick(model, tmp_path):
    """recipes/capacity's tiny twin: zero3 with parameters and optimizer on NVMe, a falling loss, and
    every number the full run records (peak RSS from the kernel, disk bytes, the disk floor)."""
    out = tmp_path / "out.json"
    run = subprocess.run([sys.executable, str(ROOT / "recipes" / "capacity" / "capacity.py"), model, "--quick",
                          "--nvme", str(tmp_path / "nvme"), "--steps", "5", "--out", str(out), "optimizer.lr=3e-3"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    # its parameters are gathered from disk (none stays gathered after the first step)
    assert "every trainable parameter stays gathered" not in run.stderr, run.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["losses"][-1] < r["losses"][0], r["losses"]
    held = r["held_out_losses"]   # before the first step and after each (lr 3e-3 overshoots it later)
    assert len(held) == 6 and min(held[1:]) < held[0], held
    assert r["peak_rss_bytes"] > 0 and r["vm_hwm_bytes"] > 0 and r["disk_bytes"] >= 16 * r["params"]
    assert all(s["floor_s"] > 0 and s["read_bytes"] > 0 and s["written_bytes"] > 0 for s in r["steps"])
    assert r["disk_aio"] == {"block_size": 1 << 20, "queue_depth": 8, "intra_op_parallelism": 1}, r["disk_aio"]
    # the estimator's prediction for the same configuration, beside the kernel's number (at this size the
    # runtime's fixed costs dominate; the full runs are compared in BENCHMARKS.md)
    assert r["runtime_rss_bytes"] < r["estimated_peak_bytes"] and 0.3 < r["estimate_vs_measured"] < 2, r
    assert os.listdir(tmp_path / "nvme" / "swap") == [] if (tmp_path / "nvme" / "swap").exists() else True


def _curve_job(stage: str, losses: list[float]) -> report.Job:
    return report.Job(dir=Path(stage), overrides=[], summary={"config": {"stage": {"name": stage}}},
                      records=[{"step": s, "loss": v} for s, v in enumerate(losses, 1)], label=stage)


def test_curve_check_fails_on_a_non_finite_loss():
    """A NaN or inf in a job's curve or in the reference's is a failure naming its first step (NaN
    compares false with every tolerance)."""
    want = {"checks": [{"curves_match": "loss", "reference": {"stage": "ddp"}, "atol": 1e-6}]}
    nan, inf = float("nan"), float("inf")
    for ref, other, step, who in (([3.0, 2.0, 1.0], [3.0, nan, nan], 2, "zero2"),
                                  ([3.0, 2.0, inf], [3.0, 2.0, 1.0], 3, "ddp"),
                                  ([nan, nan, nan], [nan, nan, nan], 1, "ddp")):
        res = recipes.evaluate([_curve_job("ddp", ref), _curve_job("zero2", other)], want)
        assert not res[0]["passed"], res[0]["message"]
        assert f"step {step}" in res[0]["message"] and who in res[0]["message"], res[0]["message"]
    res = recipes.evaluate([_curve_job("ddp", [3.0, 2.0]), _curve_job("zero2", [3.0, 2.0])], want)
    assert res[0]["passed"], res[0]["message"]


def _recipe_copy(tmp_path: Path, name: str = "zero_equivalence", **files_text: str) -> Path:
    """A copy of a recipe folder with some of its files replaced (file name with '.' as '_')."""
    d = tmp_path / f"my_{name}"
    shutil.copytree(ROOT / "recipes" / name, d)
    for f, text in files_text.items():
        (d / f.replace("_", ".")).write_text(text)
    return d


def _one_line_error(capsys, argv: list[str], says: str) -> str:
    capsys.readouterr()
    assert recipes.main(argv) == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1, err
    return err


@needs_matplotlib
def test_run_refuses_an_out_folder_holding_results(tmp_path, capsys):
    """A second run into the same --out would resume or overwrite the first one's jobs and count
    its leftovers: refused in one line before anything runs, nothing deleted."""
    for leftover in ("run3-job1", "checks.json"):
        out = tmp_path / leftover.replace(".", "_")
        (out / leftover).parent.mkdir(parents=True, exist_ok=True)
        (out / "run3-job1").mkdir() if leftover == "run3-job1" else (out / leftover).write_text("{}")
        _one_line_error(capsys, ["zero_equivalence", "--quick", "--out", str(out)], f"{out} already holds")
        assert [p.name for p in out.iterdir()] == [leftover]
    (tmp_path / "file").write_text("a file")   # --out naming a file
    _one_line_error(capsys, ["zero_equivalence", "--quick", "--out", str(tmp_path / "file")],
                    "cannot make the output folder")
    assert (tmp_path / "file").read_text() == "a file"


def test_run_without_matplotlib_refuses_before_anything_trains(tmp_path, capsys, monkeypatch):
    """matplotlib (the report's plots, an optional extra) is missing: one line naming the extra
    before any job trains or the output folder is made, not after every job."""
    for mod in ("matplotlib", "matplotlib.figure"):
        monkeypatch.setitem(sys.modules, mod, None)
    out = tmp_path / "out"
    _one_line_error(capsys, ["zero_equivalence", "--quick", "--out", str(out)], "pip install -e '.[report]'")
    assert not out.exists()


def test_expected_json_checks_are_validated_before_anything_runs(tmp_path, capsys):
    """A misspelled bound ("maximum") would make a check always pass, a check without a bound
    too; an unknown kind or a missing section: one line before the output folder is made."""
    jobs = [_curve_job("ddp", [3.0, 2.0])]
    for check, says in (({"metric": "val_loss", "maximum": 1.0}, "did you mean 'max'"),
                        ({"metric": "val_loss"}, "no bound"),
                        ({"file": "reload.json", "key": "x"}, "no bound"),
                        ({"file": "reload.json", "max": 1}, "'key'"),
                        ({"curves_match": "loss", "referenc": {"stage": "ddp"}}, "did you mean 'reference'"),
                        ({"memory_scaling": "zero3", "min_ration": 0.8}, "did you mean 'min_ratio'"),
                        ({"memory_scaling": "ddp"}, "no bound: give max_change"),
                        ({"memory_scaling": "ddp", "max_ratio": 1.2}, "no bound: give max_change"),
                        ({"memory_scaling": "zero3", "worlds": [2, 4]}, "no bound: give min_ratio or max_ratio"),
                        ({"metrik": "val_loss", "max": 1.0}, "unknown check")):
        with pytest.raises(recipes.RecipeError, match=says):
            recipes.evaluate(jobs, {"checks": [check]})
    good = json.loads((ROOT / "recipes" / "zero_equivalence" / "expected.json").read_text())
    for expected, says in (({**good, "quick": {"jobs": 4, "checks": [{"metric": "val_loss", "maximum": 1}]}},
                            "did you mean 'max'"),
                           ({k: v for k, v in good.items() if k != "quick"}, "no 'quick' section"),
                           ({**good, "quick": {"jobs": 3, "check": []}}, "did you mean 'checks'"),
                           ({**good, "quick": {"jobs": 3, "checks": [{"loss": 1}]}}, "unknown check")):
        d = _recipe_copy(tmp_path / str(len(says)) / says[:3], expected_json=json.dumps(expected))
        out = tmp_path / "out"
        _one_line_error(capsys, [str(d), "--quick", "--out", str(out)], says)
        assert not out.exists()


def test_malformed_recipe_files_are_one_line(tmp_path, capsys):
    for i, (files_text, says) in enumerate(((dict(recipe_yaml="runs: [[a\n  b: ]"), "recipe.yaml is not valid YAML"),
                                            (dict(recipe_yaml="- [a]\n"), "not a mapping"),
                                            (dict(recipe_yaml="runs: &a [" + ",".join(["[x]"] * 200) + "]\n"
                                                  + "".join(f"r{i}: &r{i} [*{'a' if i == 0 else f'r{i - 1}'}, "
                                                            f"*{'a' if i == 0 else f'r{i - 1}'}]\n" for i in range(8))),
                                             "recipe.yaml: its aliases expand to"),
                                            (dict(expected_json="[1]"), "not a JSON object"))):
        d = _recipe_copy(tmp_path / str(i), **files_text)
        _one_line_error(capsys, [str(d), "--quick", "--out", str(tmp_path / "out")], says)
    (tmp_path / "reload.json").write_text('{"val_loss_abs_diff": ')   # cut short
    res = recipes.evaluate([], {"checks": [{"file": "reload.json", "key": "val_loss_abs_diff", "max": 1e-4}]},
                           tmp_path)
    assert not res[0]["passed"] and "reload.json is malformed" in res[0]["message"], res[0]["message"]


@needs_matplotlib
def test_a_recipe_that_requires_cuda_refuses_a_full_run_without_one(tmp_path, capsys, monkeypatch):
    """shakespeare_char_gpu's full run on the CPU would go on for hours: one line before anything is
    made; its twin runs anywhere. requires: takes only what is checked, and unknown keys stay refused."""
    monkeypatch.setattr(recipes, "gpu_count", lambda: 0)   # (whatever this host has)
    out = tmp_path / "out"
    _one_line_error(capsys, ["shakespeare_char_gpu", "--out", str(out), f"data.path={tmp_path / 'none.bin'}"],
                    "needs a CUDA GPU")
    assert not out.exists()
    with pytest.raises(DataError, match="none.bin"):   # the twin goes on (to its missing data here)
        recipes.run(recipes.find("shakespeare_char_gpu"), quick=True, out=out, stream=io.StringIO(),
                    overrides=[f"data.path={tmp_path / 'none.bin'}"])
    spec = (ROOT / "recipes" / "shakespeare_char_gpu" / "recipe.yaml").read_text()
    assert "requires: cuda" in spec
    for i, (text, says) in enumerate(((spec.replace("requires: cuda", "requires: tpu"), "'tpu' is not one of cuda"),
                                      (spec.replace("requires: cuda", "require: cuda"), "unknown key(s) require"))):
        d = _recipe_copy(tmp_path / str(i), "shakespeare_char_gpu", recipe_yaml=text)
        _one_line_error(capsys, [str(d), "--quick", "--out", str(out)], says)
    assert not out.exists()


@needs_matplotlib
def test_run_refuses_data_unlike_the_reference(tmp_path, capsys):
    """A token file prepared from another text than tiny shakespeare would train for nothing and
    then fail on its token counts: its meta.json is compared with expected.json's data first."""
    src = tmp_path / "README.md"
    src.write_text("to be or not to be\n" * 200)
    tokens = tmp_path / "tokens.bin"
    assert recipes.main(["shakespeare_char_cpu", "prepare", f"data.path={src}", "--out", str(tokens)]) == 0
    out = tmp_path / "out"
    _one_line_error(capsys, ["shakespeare_char_cpu", "--quick", "--out", str(out), f"data.path={tokens}"],
                    "not the reference's")
    assert not out.exists()


def test_check_keeps_the_section_of_the_run(equivalence, tmp_path, capsys):
    """check DIR on a quick run's folder without --quick checks it against the quick section (its
    verdict is not overwritten with the full section's); --quick on a full run's folder is refused."""
    out = tmp_path / "quick_run"
    shutil.copytree(equivalence["out"], out)
    assert recipes.main(["zero_equivalence", "check", str(out)]) == 0
    assert json.loads((out / "checks.json").read_text())["quick"] is True
    verdict = json.loads((out / "checks.json").read_text())
    (out / "checks.json").write_text(json.dumps({**verdict, "quick": False}))
    _one_line_error(capsys, ["zero_equivalence", "check", str(out), "--quick"], "full run")
    assert json.loads((out / "checks.json").read_text())["quick"] is False
    for extra in (["train.steps=20"], [str(out), "x=1"]):   # would be ignored: refused, the verdict untouched
        _one_line_error(capsys, ["zero_equivalence", "check", str(out), *extra], f"not also {' '.join(extra)}")
    assert json.loads((out / "checks.json").read_text()) == {**verdict, "quick": False}
    # No checks.json (e.g. deleted): the full section by default, not recorded as the run's, so --quick still checks.
    (out / "checks.json").unlink()
    capsys.readouterr()
    assert recipes.main(["zero_equivalence", "check", str(out)]) == 1
    assert "records no section" in capsys.readouterr().out
    assert json.loads((out / "checks.json").read_text())["quick"] is None
    assert recipes.main(["zero_equivalence", "check", str(out), "--quick"]) == 0


def test_a_run_stopped_before_its_checks_records_its_section(equivalence, tmp_path, capsys, monkeypatch):
    """A run records its recipe and section when it starts: `check DIR` of one whose job failed
    (or was interrupted) checks the section it ran, with or without --quick."""
    def failed(cmd, log, stream):
        raise recipes.RecipeError(f"a run failed (exit 1); its log: {log}")
    monkeypatch.setattr(recipes, "_run_logged", failed)
    out = tmp_path / "stopped"
    _one_line_error(capsys, ["zero_equivalence", "--quick", "--out", str(out)], "a run failed")
    assert json.loads((out / "checks.json").read_text()) == {"recipe": "zero_equivalence", "quick": True,
                                                             "out": str(out), "passed": None}
    for job in Path(equivalence["out"]).glob(recipes.JOB_DIRS):   # (as if its jobs had finished)
        shutil.copytree(job, out / job.name)
    assert recipes.main(["zero_equivalence", "check", str(out)]) == 0
    assert json.loads((out / "checks.json").read_text())["quick"] is True
    _one_line_error(capsys, ["memory_scaling", "check", str(out)], "holds a run of recipe zero_equivalence")


def _crafted_job(d: Path, stage: str = "ddp", **summary) -> None:
    """A finished job folder as a run writes it (summary.json, metrics.jsonl), small and made up."""
    d.mkdir(parents=True)
    (d / "summary.json").write_text(json.dumps({"steps": 2, "val_loss": 2.0, "tokens_per_s": 10.0, "world": 1,
                                                "config": {"stage": {"name": stage}}, **summary}))
    (d / "metrics.jsonl").write_text('{"step": 1, "loss": 3.0}\n{"step": 2, "loss": 2.0, "val_loss": 2.0}\n')


def test_check_refuses_another_recipes_folder_and_keeps_elapsed(tmp_path, capsys):
    """check DIR under another recipe's name would overwrite the folder's verdict and report with
    that recipe's (failing) checks: one line, nothing written; a re-check keeps the run's elapsed_s."""
    pytest.importorskip("matplotlib")
    out = tmp_path / "q1"
    _crafted_job(out / "run0-job0")
    before = {"recipe": "zero_equivalence", "quick": True, "passed": True, "elapsed_s": 12.5}
    (out / "checks.json").write_text(json.dumps(before))
    _one_line_error(capsys, ["memory_scaling", "check", str(out)], "holds a run of recipe zero_equivalence")
    assert json.loads((out / "checks.json").read_text()) == before and not (out / "report.md").exists()
    assert recipes.main(["zero_equivalence", "check", str(out)]) == 1   # (its made-up job fails the checks)
    after = json.loads((out / "checks.json").read_text())
    assert after["recipe"] == "zero_equivalence" and after["quick"] is True and after["elapsed_s"] == 12.5


def test_finish_reads_only_its_own_job_folders(tmp_path):
    """An --out holding an earlier run one level down (outputs/recipes/NAME, the parent of the
    timestamped runs, or .): the report and the checks count only this run's run*-job* folders."""
    pytest.importorskip("matplotlib")
    out = tmp_path / "zero_equivalence"
    _crafted_job(out / "2026-01-01_00-00-00" / "run0-job0", "zero3")
    _crafted_job(out / "2026-01-01_00-00-00" / "run1-job0", "zero2")
    _crafted_job(out / "run0-job0")
    verdict = recipes.finish(recipes.find("zero_equivalence"), out, quick=True, stream=io.StringIO())
    assert verdict["checks"][0]["finished"] == 1, verdict["checks"][0]
    md = (out / "report.md").read_text()
    assert [r.split("|")[1].strip() for r in md.splitlines() if r.startswith("| run")] == ["run0-job0"], md
    assert len(report.load_jobs(out)) == 3   # (python -m framework.report DIR still reads every depth)


def test_report_of_one_unfinished_run_and_check_of_a_plain_sweep(tmp_path, capsys):
    """A single run's folder without summary.json (running, or failed) is its one row, not "no job";
    check DIR of a plain sweep (jobs 0/, 1/) says it reads only run*-job* folders."""
    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "overrides.yaml").write_text("- train.steps=2\n")
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 3.0}\n')
    [job] = report.load_jobs(run)
    assert (job.dir, job.summary, job.overrides, len(job.records)) == (run, None, ["train.steps=2"], 1)
    # Its row says why: running while a run holds run.lock, else failed with train.log's last error line.
    (run / "train.log").write_text("step 1 | loss 3.0\nerror: step 2: the loss is nan " + "x" * 100 + "\ndone?\n")
    fd = files.lock(run / "run.lock", lambda holder: "busy", "a second run")
    try:
        assert "| no summary.json (running) |" in report.markdown_table([job], run)
    finally:
        os.close(fd)
    assert f"| no summary.json (failed: step 2: the loss is nan {'x' * 53}...) |" in report.markdown_table([job], run)
    # Under dist.nproc>1 the launcher's line follows the rank's own: the row gives the cause, not that line; a run
    # a signal ended, its terminated line, unless the launcher's after it says a rank's exit ended the run.
    launcher = ("error: rank 1 of 2 exited with code 1 (anything it printed is above); "
                "the other ranks ended by themselves")
    killed = ("error: rank 1 of 2 was killed by SIGKILL (out of memory? see the system log); "
              "the other ranks were stopped")
    for log, says in ((f"error: step 2: the loss is nan\n{launcher}\n", "step 2: the loss is nan"),
                      ("step 1 | loss 3.0\nterminated (SIGTERM) at step 171\n", "terminated (SIGTERM) at step 171"),
                      (f"terminated (SIGTERM) at step 3\n{killed}\n", killed[7:][:77].rstrip() + "..."),
                      (f"terminated (SIGTERM) at step 3\n{launcher}\n",
                       "rank 1 of 2 exited with code 1; the other ranks ended by themselves")):
        (run / "train.log").write_text(log)
        assert f"| no summary.json (failed: {says}) |" in report.markdown_table([job], run), log
    _crafted_job(tmp_path / "sweep" / "0")
    _crafted_job(tmp_path / "sweep" / "1")
    _one_line_error(capsys, ["zero_equivalence", "check", str(tmp_path / "sweep")], "no job folder named run*-job*")


def test_report_plots_a_job_without_tokens_per_s(tmp_path, capsys):
    """summary.json's tokens_per_s null (the validator takes it): a '-' in the table and no bar, not a traceback."""
    pytest.importorskip("matplotlib")
    _crafted_job(tmp_path / "0", tokens_per_s=None)
    report.main([str(tmp_path)])
    assert (tmp_path / "throughput_memory.png").read_bytes()[:8] == PNG
    assert "| 2.0000 | - |" in capsys.readouterr().out
    assert f"`{tmp_path}`: 1 job (0 without a summary);" in (tmp_path / "report.md").read_text()


@needs_matplotlib
@pytest.mark.parametrize("given", ["hydra.sweep.dir=elsewhere", "hydra.sweep.subdir=x${hydra.job.num}"])
def test_run_refuses_hydra_sweep_overrides(given, tmp_path, capsys):
    """The recipe places its jobs in --out as run<i>-job<n> (finish reads those): a user's
    hydra.sweep.* would be dropped or hide the jobs; refused in one line naming --out."""
    out = tmp_path / "out"
    _one_line_error(capsys, ["zero_equivalence", "--quick", "--out", str(out), given], "use --out DIR")
    assert not out.exists()


def test_checks_refuse_keys_they_would_ignore():
    """A key a check does not read is refused (recipes/README.md): tol without equals, a ratio bound
    on ddp's memory check, max_change on a partitioning stage's, and bounds no value can meet."""
    jobs = [_curve_job("ddp", [3.0, 2.0])]
    for check, says in (({"metric": "val_loss", "max": 1.0, "tol": 0.1}, "'tol' without 'equals'"),
                        ({"file": "r.json", "key": "x", "min": 1, "tol": 0.1}, "'tol' without 'equals'"),
                        ({"memory_scaling": "ddp", "max_change": 0.05, "min_ratio": 0.8}, "'min_ratio' is not read"),
                        ({"memory_scaling": "zero1", "min_ratio": 0.8, "max_change": 0.05}, "'max_change' is not read"),
                        ({"metric": "val_loss", "min": 2.0, "max": 1.0}, "min 2.0 is above max 1.0"),
                        ({"memory_scaling": "zero3", "min_ratio": 1.2, "max_ratio": 0.8}, "min_ratio 1.2 is above")):
        with pytest.raises(recipes.RecipeError, match=says):
            recipes.evaluate(jobs, {"checks": [check]})
    assert recipes.evaluate(jobs, {"checks": [{"metric": "steps", "equals": 2, "tol": 0}]})


def _script(path: Path):
    """A recipe's script as a module (its ``if __name__ == "__main__"`` part not run)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _capacity():
    return _script(ROOT / "recipes" / "capacity" / "capacity.py")


@pytest.mark.parametrize("given, says", [(["train.steps=2"], "does not read train.steps; use --steps"),
                                         (["train.eval_every=1"], "does not read train.eval_every"),
                                         (["+checkpoint.every=1"], "does not read checkpoint.every"),
                                         (["dist.nproc=2"], "does not read dist.nproc"),
                                         (["hydra.run.dir=/tmp/x"], "does not read hydra.run.dir; it writes no run"),
                                         (["train.stepz=2"], "unknown key 'train.stepz'"),
                                         (["--steps", "0"], "--steps must be at least 1")])
def test_capacity_refuses_bad_input_in_one_line_before_the_disk_test(given, says, tmp_path, capsys):
    """An override the script composes but never reads (it trains --steps steps), a misspelled key or
    no steps: one line, exit 2, before the disk bandwidth test (which writes 4 GiB on a full run)."""
    nvme = tmp_path / "nv"
    assert _capacity().main(["gpt", "--nvme", str(nvme), "--quick", *given]) == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1, err
    assert not nvme.exists()


def test_capacity_disk_floor_moves_through_the_engine_at_the_runs_queue_depth(tmp_path, monkeypatch):
    """The disk floor's bandwidth is measured as the steps move their bytes: through the swap stores' IO
    engine with the run's offload.aio settings (was one 8 MiB request at a time while the engine keeps 8
    in flight: about half the read rate, so a step could beat its floor)."""
    from types import SimpleNamespace

    import framework.offload

    made = []

    class Spy(framework.offload.AsyncIO):
        def __init__(self, *args, **kw):
            made.append(args)
            super().__init__(*args, **kw)

    monkeypatch.setattr(framework.offload, "AsyncIO", Spy)   # (the name the script imports)
    aio = SimpleNamespace(block_size=256 << 10, queue_depth=3, intra_op_parallelism=2)
    write, read = _capacity().disk_bandwidth(str(tmp_path), 128 << 20, aio)
    assert made == [(256 << 10, 3, 2)] and write > 0 and read > 0
    assert list(tmp_path.iterdir()) == []   # the probe's swap file and manifest went


def test_before_and_after_commands_take_the_jobs_config(tmp_path):
    """hf_gpt2_zero3's estimate describes the job that trains: --quick's micro batch 2 and a user's
    overrides (its model and DeepSpeed JSON included) reach it through {cfg.KEY}, not recipe.yaml's
    hard-coded values; a key the config lacks is refused."""
    r = recipes.find("hf_gpt2_zero3")
    model, ds = tmp_path / "config.json", tmp_path / "ds.json"
    shutil.copy(r.dir / "gpt2_config.json", model)
    shutil.copy(r.dir / "ds_config.json", ds)
    run0 = [recipes._fill(o, {"recipe": str(r.dir)}) for o in recipes.merge_overrides(
        r.runs(True)[0], ["model.context=32", f"model.config={model}", f"ds_config={ds}"])]
    fill = recipes._config_fill(r, run0)
    (_, _, estimate), = recipes._commands(r, "before", fill)
    assert "train.micro_batch=2" in estimate and "context=32" in estimate and "dist.nproc=2" in estimate, estimate
    assert f"model={model}" in estimate and f"ds_config={ds}" in estimate, estimate
    bad = recipes.Recipe(r.name, r.dir, {**r.spec, "after": [["echo", "{cfg.train.stepz}", "${hydra.job.num}"]]},
                         r.expected)
    with pytest.raises(recipes.RecipeError, match=r"\{cfg.train.stepz\} names no key"):
        recipes._config_fill(bad, run0)
    # Keys as the YAML spells them (a group's choice, async), and values only: not a section, an
    # attribute that is no key, or a method.
    real = ["{cfg.optimizer.name}", "{cfg.stage.name}", "{cfg.checkpoint.async}"]
    ok = recipes.Recipe(r.name, r.dir, {**r.spec, "after": [["echo", *real]]}, r.expected)
    assert [recipes._config_fill(ok, run0)[k[1:-1]] for k in real] == ["adamw", "zero3", "false"]
    for key, why in [("cfg.model", "not one value"), ("cfg.choices", "names no key"), ("cfg.to_dict", "names no key")]:
        bad = recipes.Recipe(r.name, r.dir, {**r.spec, "after": [["echo", "{" + key + "}"]]}, r.expected)
        with pytest.raises(recipes.RecipeError, match=why):
            recipes._config_fill(bad, run0)
    assert recipes._fill("${hydra.job.num}-{out}", {"out": "o", "hydra.job.num": "x"}) == "${hydra.job.num}-o"


@needs_matplotlib
def test_a_run_refused_before_its_first_job_leaves_its_out_reusable(tmp_path, capsys, monkeypatch):
    """A run whose first job is refused before it makes its folder leaves only the start record: `check DIR`
    says so, and a rerun into the same --out is not refused as holding results."""
    def refused(cmd, log, stream):
        raise recipes.RecipeError(f"a run failed (exit 2); its log: {log}")
    monkeypatch.setattr(recipes, "_run_logged", refused)
    out = tmp_path / "refused"
    for _ in range(2):
        _one_line_error(capsys, ["zero_equivalence", "--quick", "--out", str(out)], "a run failed")
    _one_line_error(capsys, ["zero_equivalence", "check", str(out)], f"{out} holds no job folder")
    assert json.loads((out / "checks.json").read_text())["passed"] is None


@needs_matplotlib
def test_run_refuses_a_token_file_unlike_its_metadata_before_any_job(shakespeare_tokens, tmp_path, capsys):
    """A token file cut short after prepare is refused (as a run refuses it) before the output folder is made."""
    for f in ("tokens.bin", "tokens.meta.json"):
        shutil.copy(shakespeare_tokens.parent / f, tmp_path / f)
    os.truncate(tmp_path / "tokens.bin", 1000)
    out = tmp_path / "out"
    _one_line_error(capsys, ["shakespeare_char_cpu", "--quick", "--out", str(out),
                             f"data.path={tmp_path / 'tokens.bin'}"], "is not the token file")
    assert not out.exists()


def test_check_of_a_missing_folder_names_a_recipe_out(tmp_path, capsys):
    _one_line_error(capsys, ["zero_equivalence", "check", str(tmp_path / "none")],
                    f"check DIR: {tmp_path / 'none'} is not a folder; pass a recipe run's --out folder")


@pytest.mark.parametrize("given, name, what", [("capacity", "capacity", "a script"),
                                              ("capacity/", "capacity", "a script"),
                                              ("recipes/capacity", "capacity", "a script"),
                                              ("cluster", "cluster", "a config")])
def test_a_folder_of_recipes_without_recipe_yaml_says_how_it_runs(given, name, what, capsys, monkeypatch):
    # (a command made up here ran cluster's config without -m, so locally, and capacity's script without --nvme)
    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    err = _one_line_error(capsys, [given], f"recipes/{name} is not a recipe framework.recipe runs (it has no "
                                           f"recipe.yaml) but {what}")
    readme = recipes.RECIPES_DIR.resolve() / name / "README.md"
    assert err.rstrip().endswith(f"; its README says how to run it: {readme}"), err


def test_a_folder_of_recipes_given_from_home_says_how_it_runs(capsys, monkeypatch):
    # (find reads ~ as the home folder: the folder it did not find is named by the same path)
    monkeypatch.setenv("HOME", str(recipes.RECIPES_DIR.resolve().parent))
    _one_line_error(capsys, ["~/recipes/capacity"], "recipes/capacity is not a recipe framework.recipe runs (it has "
                                                    "no recipe.yaml) but a script")
