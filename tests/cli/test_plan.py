"""python -m framework.plan: fitting, ordering, and the predicted order against measured step times."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from framework.config import compose
from framework.memory.planner import Candidate, Hardware, parse_bytes, plan, step_time

ROOT = Path(__file__).resolve().parents[2]

# A machine of made-up but plausible bandwidths (bytes/s, params/s, seconds), so the ordering logic
# is tested without probing.
PROBE = {"matmul_flops": 50e9, "device_copy_bytes_s": 10e9, "op_dispatch_s": 3e-6, "step_fixed_s": 1e-3,
         "micro_fixed_s": 2e-3, "micro_per_layer_s": 3e-3, "h2d_bytes_s": 5e9, "d2h_bytes_s": 5e9,
         "host_optimizer_params_s": 3e8, "disk_write_bytes_s": 1e9, "disk_read_bytes_s": 1e9,
         "allreduce_bytes_s": 1e9}
BASE = ["model=gpt-mini", "train.micro_batch=8"]


def test_sizes_parse():
    assert parse_bytes("80G") == parse_bytes("80GiB") == 80 * 2 ** 30
    assert parse_bytes("512M") == 2 ** 29 and parse_bytes("2T") == 2 * 2 ** 40 and parse_bytes("1000") == 1000
    with pytest.raises(Exception, match="not a size"):
        parse_bytes("big")
    # B is decimal (framework.core.units), iB binary, a bare letter binary (as documented: 80G = 80 GiB).
    assert parse_bytes("80GB") == 80 * 10 ** 9 and parse_bytes("2TB") == 2 * 10 ** 12 and parse_bytes("512MiB") == 2 ** 29
    for bad in ("80IB", "80iB", "80 GBB", "80X", "G"):
        with pytest.raises(Exception, match="not a size"):
            parse_bytes(bad)


def test_fits_and_order_follow_memory_and_time():
    cfg = compose(BASE)
    own = {"micro_batches": "8,1", "stages": "ddp,zero3", "offloads": "none,cpu,cpu+params"}
    roomy = plan(cfg, BASE, Hardware(torch.device("cuda", 0), 64 * 2 ** 30, 64 * 2 ** 30, 2 ** 40, 1), own, PROBE)
    assert all(p.fits for p in roomy)
    times = [p.time["total"] for p in roomy]
    assert times == sorted(times)
    # Equal predicted times keep the guide's order: ddp (and zero1) before zero2 before zero3 offload.
    ranks = [(round(p.time["total"], 9), p.cand.guide_rank) for p in roomy]
    assert ranks == sorted(ranks)
    # Checkpointing recomputes the forward: never faster at equal micro batch.
    t = {(p.cand.stage, p.cand.offload, p.cand.micro_batch, p.cand.checkpointing): p.time["total"] for p in roomy}
    assert all(t[k[:3] + (True,)] > v for k, v in t.items() if not k[3])
    # A device too small for the activations of micro batch 8 without checkpointing: those setups
    # drop out (and are listed after every fitting one).
    small = min(p.device_peak for p in roomy if p.cand.micro_batch == 8 and not p.cand.checkpointing)
    tight = plan(cfg, BASE, Hardware(torch.device("cuda", 0), small - 1, 64 * 2 ** 30, 2 ** 40, 1), own, PROBE)
    fitting = [p for p in tight if p.fits]
    assert fitting and all(p.device_peak < small for p in fitting)
    assert not any(p.fits for p in tight[len(fitting):])


def test_unbuildable_offload_is_listed_not_planned():
    # offload=nvme composes (its keys are checked) but its disk tier may not be built in this tree:
    # then its setups are listed as unavailable, after every fitting one, never verified.
    cfg = compose(BASE)
    out = plan(cfg, BASE, Hardware(torch.device("cuda", 0), 2 ** 36, 2 ** 36, 2 ** 40, 1),
               {"micro_batches": "8", "stages": "zero3", "checkpointing": "false"}, PROBE)
    nvme = [p for p in out if p.cand.offload == "nvme"]
    assert nvme and all(p.fits or p.why.startswith("unavailable: ") for p in nvme)
    assert [p.fits for p in out] == sorted((p.fits for p in out), reverse=True)


def test_offload_and_ranks_cost_what_they_move():
    cfg = compose(BASE)
    hw1 = Hardware(torch.device("cuda", 0), 2 ** 36, 2 ** 36, 2 ** 40, 1)
    hw8 = Hardware(torch.device("cuda", 0), 2 ** 36, 2 ** 36, 2 ** 40, 8)
    plain = step_time(cfg, Candidate("zero2", "none", 8, 1, False), hw1, PROBE, 10_000_000)
    off = step_time(cfg, Candidate("zero2", "cpu", 8, 1, False), hw1, PROBE, 10_000_000)
    assert off["copies"] > 0 and plain["copies"] == 0 and plain["comm"] == 0
    z3 = step_time(cfg, Candidate("zero3", "none", 8, 1, False), hw8, PROBE, 10_000_000)
    z2 = step_time(cfg, Candidate("zero2", "none", 8, 1, False), hw8, PROBE, 10_000_000)
    assert z3["comm"] > z2["comm"] > 0   # zero3 also gathers parameters for forward and backward


def test_verify_top3_runs_each_and_reports_measured_times(tmp_path, monkeypatch):
    # --verify K trains the first K setups of the ranking for steps= steps each and reports their
    # measured time next to the predicted one. Whether the measured order agrees is a timing claim: on
    # a shared 2-core machine it is noise, so it is not asserted here (house rule: no timed unit tests).
    # A fresh cache folder for the probe; the C++ kernels stay where they were built (compiling them
    # again would take most of this test's time).
    from framework.ops._loader import cache_root
    # A fresh process, as a user runs it: the probe measures its own process's resident set (a child forked
    # from the suite's fork server holds what the server imported).
    env = {**os.environ, "OMP_NUM_THREADS": "1", "XDG_CACHE_HOME": str(tmp_path / "cache"),
           "FRAMEWORK_OPS_CACHE": str(cache_root()),
           "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    # The command line's train.micro_batch (the global batch) and model.activation_checkpointing (which
    # restricts the search as checkpointing= would) do not replace the candidates' own values in the runs.
    args = ["model=gpt-nano", "model.context=16", "train.micro_batch=8", "micro_batches=8,2,1", "stages=ddp",
            "model.activation_checkpointing=true", "steps=3", "--verify", "3", "--json"]
    run = subprocess.run([sys.executable, "-m", "framework.plan", *args], capture_output=True, text=True,
                         cwd=tmp_path, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "probe (measured now" in run.stdout and (tmp_path / "cache" / "framework").is_dir()
    assert "note: planned only with model.activation_checkpointing=true (the command line)" in run.stdout
    rows = json.loads(run.stdout.strip().splitlines()[-1])
    assert [r["candidate"]["micro_batch"] for r in rows] == [8, 2, 1]
    assert [r["ran"] for r in rows] == [{k: r["candidate"][k] for k in ("micro_batch", "grad_accum", "checkpointing")}
                                        for r in rows] and all(r["ran"]["checkpointing"] for r in rows), rows
    predicted = [r["predicted_s"] for r in rows]
    assert predicted == sorted(predicted)
    assert all(0 < r["measured_s"] < 60 for r in rows), rows
    # The first job's peak is all of a checkpointing framework.train process (later jobs of the multirun share
    # it): the probe's baseline is such a process's, what checkpointing's first call loads included.
    first = rows[0]
    assert 0.95 * first["measured_peak"] <= first["predicted_peak"] <= 1.25 * first["measured_peak"], first
    # A later call reads the cache instead of probing again (the key includes the thread count).
    from framework.memory import probe
    threads = torch.get_num_threads()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    try:
        torch.set_num_threads(1)
        cached = probe.load(torch.device("cpu"), tmp_path, collectives=False)
        written = json.loads(probe.cache_path(torch.device("cpu"), tmp_path).read_text())
    finally:
        torch.set_num_threads(threads)
    assert "measured_now" not in cached and {k: cached[k] for k in written} == written


def test_verify_runs_with_a_ds_config_files_stage_and_offload(forkrun, tmp_path, monkeypatch):
    """The DeepSpeed file chooses the stage and offload in each verified job too (the plan is restricted to
    its choice): the candidates' plan files do not choose them a second time (a duplicate in Hydra's
    defaults list). The one end-to-end run of a multirun composed with a DeepSpeed file: 1 job, 2 steps;
    a cached probe of made-up bandwidths, as the probe itself is tested above."""
    from framework.memory import probe
    from framework.ops._loader import cache_root
    ops = str(cache_root())   # where the C++ kernels were built (before the cache folder moves)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        cached = probe.cache_path(torch.device("cpu"), tmp_path)
    finally:
        torch.set_num_threads(threads)
    cached.parent.mkdir(parents=True)
    cached.write_text(json.dumps({**PROBE, "version": probe.VERSION, "process_rss_bytes": 0}))
    env = {"OMP_NUM_THREADS": "1", "XDG_CACHE_HOME": str(tmp_path / "cache"), "FRAMEWORK_OPS_CACHE": ops}
    # The file also fixes the micro batch (2; the accumulation stays "auto"): every candidate has it, and
    # the job runs it (the file's value is set under the command line only, over the candidate's own).
    ds = json.loads((ROOT / "tests/config/ds/hf_zero2_cpu_offload.json").read_text())
    (tmp_path / "ds.json").write_text(json.dumps({**ds, "train_micro_batch_size_per_gpu": 2}))
    args = ["model=gpt-nano", "model.n_layer=2", "model.d_model=32", "model.n_head=2", "model.context=16",
            "data.vocab_size=24", "train.grad_accum=2", f"ds_config={tmp_path}/ds.json", "checkpointing=false",
            "steps=2", "--verify", "1", "--json"]
    run = forkrun.run("framework.plan", args, cwd=tmp_path, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "probe (cached" in run.stdout, run.stdout
    assert "note: planned only with train.micro_batch=2 x train.grad_accum=2 (ds_config=" in run.stdout, run.stdout
    table = [line for line in run.stdout.splitlines() if " micro " in line]
    assert table and all("micro   2 x accum   2" in line for line in table), run.stdout
    rows = json.loads(run.stdout.strip().splitlines()[-1])
    assert [(r["candidate"]["stage"], r["candidate"]["offload"], r["candidate"]["micro_batch"], r["ran"]["micro_batch"],
             r["ran"]["grad_accum"]) for r in rows] == [("zero2", "cpu", 2, 2, 2)], rows


@pytest.mark.parametrize("args,setups,note", [
    # train_batch_size 16 and micro 8: DeepSpeed's accumulation is 2
    ([], {(8, 2)}, "train.micro_batch=8 x train.grad_accum=2 (ds_config="),
    # the command line's micro batch overrides the file's: it fixes the search, and stays in verify's jobs
    (["train.micro_batch=4"], {(4, 4)}, "x train.grad_accum=4 (ds_config="),
])
def test_a_ds_configs_fixed_batch_restricts_the_search(capsys, monkeypatch, args, setups, note):
    """A DeepSpeed file's fixed micro batch and accumulation are set in each run under the command line
    only, so plan tries only them (with a note) and verify runs exactly them; "auto" leaves the search free."""
    cli = _quiet_probe(monkeypatch)
    ds = f"ds_config={ROOT}/tests/config/ds/dschat_zero2_offload.json"
    assert cli.main(["model=gpt-nano", "checkpointing=false", "ranks=1", "--json", ds, *args]) == 0, \
        capsys.readouterr().err
    out = capsys.readouterr().out
    rows = json.loads(out.strip().splitlines()[-1])
    assert {(r["micro_batch"], r["grad_accum"]) for r in rows} == setups and note in out, out
    ran = []
    monkeypatch.setattr(cli.subprocess, "run", lambda cmd, **k: ran.append(cmd) or subprocess.CompletedProcess(
        cmd, 1, "", "boom\n"))
    assert cli.main(["model=gpt-nano", "checkpointing=false", "ranks=1", ds, *args, "--verify", "1"]) == 2
    assert [o for o in ran[0] if o.startswith("train.micro_batch")] == args, ran
    capsys.readouterr()
    assert cli.main(["model=gpt-nano", "checkpointing=false", "ranks=1", ds, "micro_batches=2"]) == 2
    assert "dschat_zero2_offload.json fixes train.micro_batch=8 (with train.grad_accum=2), but micro_batches=2" \
        in capsys.readouterr().err
    auto = f"ds_config={ROOT}/tests/config/ds/hf_zero2_cpu_offload.json"
    assert cli.main(["model=gpt-nano", "checkpointing=false", "ranks=1", "--json", auto]) == 0
    out = capsys.readouterr().out
    assert len({r["micro_batch"] for r in json.loads(out.strip().splitlines()[-1])}) > 1 and "micro_batch=" not in out


def test_a_ds_files_global_batch_is_resolved_for_the_planned_ranks(capsys, monkeypatch):
    """train_batch_size 16 with micro 8 is accumulation 2 on one rank, 1 on two: the table says what a job of
    ranks=2 composes; a verified job that ran another batch than its row's is said, not measured silently."""
    cli = _quiet_probe(monkeypatch)
    ds = f"ds_config={ROOT}/tests/config/ds/dschat_zero2_offload.json"
    assert cli.main(["model=gpt-nano", "checkpointing=false", "ranks=2", "--json", ds]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    rows = json.loads(out.strip().splitlines()[-1])
    assert {(r["micro_batch"], r["grad_accum"]) for r in rows} == {(8, 1)}, out
    assert "train.micro_batch=8 x train.grad_accum=1 (ds_config=" in out, out

    def ran_other(planned, *a, **k):
        p = planned[0]
        return [{"candidate": p.cand, "ran": {"micro_batch": p.cand.micro_batch, "grad_accum": 2,
                                              "checkpointing": p.cand.checkpointing},
                 "predicted_s": 1.0, "measured_s": 1.0, "predicted_peak": 0, "measured_peak": 0,
                 "measured_kind": "peak_rss_bytes"}]
    monkeypatch.setattr(cli, "verify", ran_other)
    assert cli.main(["model=gpt-nano", "checkpointing=false", "ranks=2", ds, "--verify", "1"]) == 0
    assert ("warning: this job ran micro 8 x accum 2 without activation checkpointing, not the planned micro 8 x "
            "accum 1 without activation checkpointing: its measurement is of another setup") in capsys.readouterr().out


def test_probe_reads_its_resident_set_without_its_test_tensors(monkeypatch, tmp_path):
    """process_rss_bytes is the process's own baseline: the probe's matmul and copy tensors are gone
    when it is read (each measurement stubbed: only what is alive matters here)."""
    import weakref

    from framework.memory import probe

    alive = []

    def best(fn, device, reps=3):
        alive.extend(weakref.ref(c.cell_contents) for c in fn.__closure__ or ()
                     if isinstance(c.cell_contents, torch.Tensor))
        return 1.0

    monkeypatch.setattr(probe, "_best", best)
    monkeypatch.setattr(probe, "_tiny_gpt", lambda *a, **k: 1.0)
    monkeypatch.setattr(probe, "_host_optimizer", lambda: 1.0)
    monkeypatch.setattr(probe, "_disk", lambda folder: (1.0, 1.0))
    monkeypatch.setattr(probe, "rss_now", lambda: [r for r in alive if r() is not None] and pytest.fail("alive") or 1)
    measured = probe.measure(torch.device("cpu"), tmp_path, collectives=False)
    assert measured["process_rss_bytes"] == 1 and measured["checkpointing_rss_bytes"] == 0
    assert len(alive) == 4   # a, b, src, dst


def test_a_hugging_face_model_is_refused_on_one_line(capsys, tmp_path):
    from framework.cli.plan import main
    cfg = ROOT / "recipes" / "hf_gpt2_zero3" / "gpt2_config.json"
    (tmp_path / "config.json").write_text(cfg.read_text())
    assert main(["model=hf", f"model.config={cfg}", "gpu_mem=80G"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: plan: Hugging Face models (model=hf) are not planned") and "\n" not in err, err
    # a config.json or its folder as estimate takes them: the same line (the shared one pointed to model=hf)
    for model in (cfg, tmp_path):
        assert main([f"model={model}", "gpu_mem=80G"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"error: plan: Hugging Face models (model={model}) are not planned"), err
    names = "gpt-1b, gpt-mini, gpt-nano, gpt2-medium, gpt2-small"
    yaml = ROOT / "conf" / "model" / "gpt-nano.yaml"
    assert main([f"model={yaml}", "gpu_mem=80G"]) == 2
    assert capsys.readouterr().err == (
        f"error: plan: model={yaml}: plan takes a model's name ({names}); copy the file into conf/model/ as "
        "gpt-NAME.yaml (a GPT model there is a file named gpt*.yaml) and give model=gpt-NAME, or give a preset and "
        "model.* keys (model=gpt-mini model.n_layer=8); "
        "python -m framework.estimate predicts a model YAML's memory per rank\n")
    assert main(["model=gpt2", "gpu_mem=80G"]) == 2
    assert capsys.readouterr().err == f"error: plan: unknown model 'gpt2' (did you mean 'gpt2-small'?); plan takes one of {names}\n"
    # a path to one of our YAMLs without .yaml, or a folder with no config.json, is not a Hugging Face model
    for model in (ROOT / "conf" / "model" / "gpt-nano", "conf/model/gpt-nano", ROOT / "conf" / "model", cfg.parent):
        assert main([f"model={model}", "gpu_mem=80G"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: plan: unknown model '{model}'") and "Hugging Face" not in err, err
    assert main(["model=conf/model/gpt-nano", "gpu_mem=80G"]) == 2
    assert "(did you mean 'gpt-nano'?)" in capsys.readouterr().err
    # a Hub name (org/model, not a path here) keeps the Hugging Face line
    assert main(["model=openai-community/gpt2", "gpu_mem=80G"]) == 2
    assert "Hugging Face models (model=openai-community/gpt2) are not planned" in capsys.readouterr().err


def test_a_hugging_face_models_memory_is_predicted_with_its_own_loss():
    # predict() without loss_fn: the configured model's loss (model=hf: its trace_loss), not our GPT's
    from framework.config import compose
    from framework.memory.model import predict
    cfg = compose(["model=hf", f"model.config={ROOT / 'recipes' / 'hf_gpt2_zero3' / 'gpt2_config.json'}",
                   "model.context=32", "train.micro_batch=1"])
    pred = predict(cfg, 1)
    assert pred.transient["activations"] > 0 and pred.cuda_activations > 0


def test_steps_is_checked_and_needs_verify(capsys):
    """steps= only sets the length of the --verify runs: alone it is refused, not ignored; a bad value
    is one line before anything is probed or run."""
    from framework.cli.plan import main

    assert main(["model=gpt-nano", "steps=3"]) == 2
    assert "add --verify K or drop steps=" in capsys.readouterr().err
    assert main(["model=gpt-nano", "--verify", "1", "steps=x"]) == 2
    assert "steps='x' must be a whole number >= 2" in capsys.readouterr().err


@pytest.mark.parametrize("args,needle", [
    (["ranks=1", "micro_batches=0,3"], "plan: micro_batches=0,3: each size must be >= 1"),
    # a count that is no count: the tool's prefix, and a rank count's spelling (not a parameter count's "1.4B")
    (["ranks=-2"], "error: plan: ranks='-2' is not a count; write a whole number >= 1, e.g. 8\n"),
    (["ranks=1", "micro_batches=1,x"], "error: plan: micro_batches='x' is not a count; write a whole number >= 1"),
    (["ranks=1K"], "error: plan: ranks='1K' is not a plain whole number; write a whole number >= 1, e.g. 8\n"),
    (["ranks=3", "dist.nproc=2"], "plan: dist.nproc=2 and ranks=3 differ; give one of them"),
    (["data=text", "data.path=/nonexistent.txt"],   # never silently the model's vocabulary
     "memory prediction: the model is built at data=text's vocabulary, which needs its data here"),
    (["offloads=cpu,nvmee"], "plan: offloads: unknown value 'nvmee' (did you mean 'nvme'?)"),
    (["stages=zero2,zero4"], "plan: stages: unknown value 'zero4' (did you mean 'zero1', 'zero2' or 'zero3'?)"),
    (["checkpointing=maybe"], "plan: checkpointing: unknown value 'maybe'"),
    (["gpu_mem=-8G"], "plan: gpu_mem=-8G must be > 0"),
    (["gpu_mem=0"], "plan: gpu_mem=0 must be > 0"),
    (["cpu_mem=0"], "plan: cpu_mem=0 must be > 0"),
    (["nvme=-1T"], "plan: nvme=-1T must be >= 0"),
    (["gpu_mem=1e400"], "plan: '1e400' is not a size"),   # infinity, not a number of bytes
    (["gpu_mem=80"], "plan: gpu_mem=80 is 80 bytes; write 80G (GiB) or 80GB"),
    (["cpu_mem=512"], "plan: cpu_mem=512 is 512 bytes; write 512G (GiB) or 512GB"),
    (["nvme=2"], "plan: nvme=2 is 2 bytes; write 2G (GiB) or 2GB"),
    (["nvme=0.5"], "plan: nvme=0.5 is 0 bytes; write 0.5G (GiB) or 0.5GB"),   # a fraction too, not "no disk"
    (["gpu_mem=0.5"], "plan: gpu_mem=0.5 is 0 bytes; write 0.5G (GiB) or 0.5GB"),
    (["--top", "-1"], "plan: --top needs a whole number >= 1, got -1"),
    (["--top", "0"], "plan: --top needs a whole number >= 1, got 0"),
    (["--verify", "0"], "plan: --verify needs a whole number >= 1, got 0"),
    (["+stage=zero2", "stages=zero3"], "plan: the command line sets stage=zero2, but stages=zero3; plan tries each"),
    (["model.activation_checkpointing=true", "checkpointing=false"],
     "plan: the command line sets model.activation_checkpointing=true, but checkpointing=false"),
    (["+stage=ddp", "offload=cpu"], "plan: no stage of ddp supports an offload of cpu (see stages= and offloads=)"),
    (["ranks=1", "micro_batches=3", "gpu_mem=80G", "cpu_mem=64G"],
     "plan: no micro batch divides the per-rank batch 16 (global batch 16 over 1 rank)\n"),
    (["gpu_mme=8G"], "plan: unknown key 'gpu_mme' (did you mean 'gpu_mem'?); plan's keys: model, gpu_mem,"),
    (["gpus=8"], "plan: unknown key 'gpus' (did you mean 'ranks'?)"),   # (not gpu_mem: bytes)
    (["gpus_per_node=8"], "plan: unknown key 'gpus_per_node' (did you mean 'ranks'?)"),
    (["gpu=8"], "plan: unknown key 'gpu' (did you mean 'ranks'?)"),
    (["nodes=2"], "plan: unknown key 'nodes' (did you mean 'ranks'? ranks = gpus_per_node x nodes)"),   # (not 'model')
    (["seq_len=256"], "plan: unknown key 'seq_len' (did you mean 'model.context'?)"),   # (not 'seed')
    (["context=256"], "plan: unknown key 'context' (did you mean 'model.context'?)"),   # (estimate's own key)
    # Hydra's grammar has no leading / in a key (train refuses these): not a stage choice here either
    (["+/stage=zero3"], "plan: unknown key '/stage' (did you mean 'stage'?)"),
    (["/stage=zero3"], "plan: unknown key '/stage' (did you mean 'stage'?)"),
    # A command-line choice the DeepSpeed file refuses: the candidates' own composition's line, before the probe.
    (["+stage=zero3", f"ds_config={ROOT}/tests/config/ds/hf_zero2_cpu_offload.json"],
     "ds_config: stage=zero3 on the command line, but zero_optimization.stage in the file means stage=zero2"),
    (["+stage=zero2", f"ds_config={ROOT}/tests/config/ds/hf_zero3_cpu_offload.json"],
     "ds_config: stage=zero2 on the command line, but zero_optimization.stage in the file means stage=zero3"),
    (["offload=nvme", f"ds_config={ROOT}/tests/config/ds/hf_zero3_cpu_offload.json"],
     "ds_config: offload=nvme on the command line, but zero_optimization.offload_optimizer.device"),
    # A key of the given offload that every candidate's stage refuses: that composition's line, before the probe.
    (["stages=zero1,zero2", "offload=nvme", "offload.params=nvme"],
     "offload.params=nvme (parameter offload) needs +stage=zero3, got stage=zero1; use offload.params=none or "
     "+stage=zero3 (plan: no setup of stages=zero1,zero2 composes with the given keys; choose"),
])
def test_bad_arguments_are_one_line_before_the_probe(capsys, monkeypatch, args, needle):
    """Each value plan cannot use is refused with one line before anything is probed (nothing dropped,
    misread or divided by); an unknown key names the closest of plan's own keys."""
    from framework.cli import plan as cli

    monkeypatch.setattr(cli._probe, "load", lambda *a, **k: pytest.fail("probed"))
    assert cli.main(["model=gpt-nano", *args]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1, err


def _quiet_probe(monkeypatch):
    from framework.cli import plan as cli

    monkeypatch.setattr(cli._probe, "load", lambda *a, **k: {**PROBE, "cache": "test", "process_rss_bytes": 0})
    return cli


SMALL = ["model=gpt-mini", "micro_batches=16", "stages=ddp", "checkpointing=false"]


def test_plan_counts_the_vocabulary_training_builds(capsys, monkeypatch):
    """With or without data= on the command line, each setup is the model training builds: at the (default)
    data's vocabulary, which overrides the model config's."""
    cli = _quiet_probe(monkeypatch)
    assert cli.main([*SMALL, "ranks=1"]) == 0
    assert "vocab 64 (from data=synthetic)" in capsys.readouterr().out
    assert cli.main([*SMALL, "ranks=1", "data=synthetic", "data.vocab_size=256"]) == 0
    assert "vocab 256 (from data=synthetic)" in capsys.readouterr().out
    hw = Hardware(torch.device("cuda", 0), 2 ** 36, 2 ** 36, 2 ** 40, 1)
    own = {"micro_batches": "8", "stages": "ddp", "checkpointing": "false"}
    model = plan(compose(BASE), BASE, hw, own, PROBE)[0]
    data = plan(compose([*BASE, "data=synthetic"]), [*BASE, "data=synthetic"], hw, own, PROBE)[0]
    wide = plan(compose([*BASE, "data.vocab_size=256"]), [*BASE, "data.vocab_size=256"], hw, own, PROBE)[0]
    assert model.device_peak == data.device_peak < wide.device_peak   # 64 x 384 embedding against 256 x 384


def test_dist_nproc_gives_the_ranks_and_dropped_micro_batches_are_said(capsys, monkeypatch):
    cli = _quiet_probe(monkeypatch)
    assert cli.main(["model=gpt-nano", "dist.nproc=2", "micro_batches=3,16,64", "stages=ddp", "offloads=none",
                     "checkpointing=false", "--json"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("hardware: 2 ranks,"), out
    assert "note: micro_batches 3, 64 left out: they do not divide the per-rank batch 16 (train.micro_batch x " \
           "train.grad_accum, global batch 32 over 2 ranks)" in out, out
    assert [c["micro_batch"] for c in json.loads(out[-1])] == [16]
    assert cli.main(["model=gpt-nano", "dist.nproc=2", "ranks=2", "micro_batches=16", "stages=ddp",
                     "checkpointing=false"]) == 0
    assert "note: micro_batches" not in capsys.readouterr().out


@pytest.mark.parametrize("args,stages,offloads", [
    (["offload=cpu"], {"zero1", "zero2", "zero3"}, {"cpu"}),
    (["+stage=zero2"], {"zero2"}, {"none", "cpu", "nvme"}),
    (["+stage=zero3", "offload=cpu", "offload.params=cpu"], {"zero3"}, {"cpu+params"}),
    ([f"ds_config={ROOT}/tests/config/ds/hf_zero3_cpu_offload.json"], {"zero3"}, {"cpu+params"}),
    # offload=cpu leaves the file's offload_param (params on the host) standing, unless offload.params= is given
    (["offload=cpu", f"ds_config={ROOT}/tests/config/ds/hf_zero3_cpu_offload.json"], {"zero3"}, {"cpu+params"}),
    (["offload=cpu", "offload.params=none", f"ds_config={ROOT}/tests/config/ds/hf_zero3_cpu_offload.json"],
     {"zero3"}, {"cpu"}),
])
def test_a_given_stage_or_offload_restricts_the_search(capsys, monkeypatch, args, stages, offloads):
    """plan chooses the stage and offload of each candidate: one given on the command line, or by a
    DeepSpeed file (which refuses any other), is the search's restriction, said in one note line."""
    cli = _quiet_probe(monkeypatch)
    assert cli.main(["model=gpt-nano", "micro_batches=16", "checkpointing=false", "ranks=1", "--json", *args]) == 0, \
        capsys.readouterr().err
    out = capsys.readouterr().out
    rows = json.loads(out.strip().splitlines()[-1])
    assert {r["stage"] for r in rows} == stages and {r["offload"] for r in rows} == offloads, rows
    assert out.count("note: planned only with") == 1, out


@pytest.mark.parametrize("args,offloads,applied", [
    (["offload=cpu", "offload.ratio=0.5"], {"cpu"}, {("offload", "ratio"): 0.5}),
    (["offload=nvme", "offload.params=none", "offload.buffer_count=2"], {"nvme"},
     {("offload", "params"): "none", ("offload", "buffer_count"): 2}),
    (["+stage=zero3", "offload=cpu", "offload.params=cpu", "offload.pin_memory=false"], {"cpu+params"},
     {("offload", "pin_memory"): False, ("offload", "params"): "cpu"}),
    (["+stage=zero3", "stage.stage3_prefetch_bucket_size=5"], {"none", "cpu", "cpu+params", "nvme"},
     {("stage", "stage3_prefetch_bucket_size"): 5}),
])
def test_the_given_stages_or_offloads_own_keys_apply_to_its_candidates(capsys, monkeypatch, args, offloads, applied):
    """A key of the given offload (stage) goes with it: every candidate of that offload (stage) is
    planned with it, none is dropped, and it does not need the default offload (stage) to have it."""
    from framework.memory import planner

    cli = _quiet_probe(monkeypatch)
    seen = []
    real = planner.predict
    monkeypatch.setattr(planner, "predict", lambda cfg, *a, **k: seen.append(cfg) or real(cfg, *a, **k))
    assert cli.main(["model=gpt-nano", "micro_batches=16", "checkpointing=false", "ranks=1", "--json", *args]) == 0, \
        capsys.readouterr().err
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert {r["offload"] for r in rows} == offloads, rows
    assert len(seen) == len(rows) and all(getattr(getattr(c, group), key) == value
                                          for c in seen for (group, key), value in applied.items()), seen


@pytest.mark.parametrize("args,refused,needle", [
    (["offload=cpu", "offload.overlap_step=true"], {"zero1"}, "unavailable: config: offload.overlap_step=true"),
    (["offload=nvme", "offload.ratio=0.5"], {"zero3"}, "unavailable: config: offload.ratio<1"),
])
def test_a_setup_that_refuses_a_given_key_is_listed_unavailable(capsys, monkeypatch, args, refused, needle):
    """A given key that some stage refuses leaves that stage's setups out, listed with its reason; the
    other stages are planned (not the whole plan refused)."""
    cli = _quiet_probe(monkeypatch)
    assert cli.main(["model=gpt-nano", "micro_batches=16", "checkpointing=false", "ranks=1", "--json", *args]) == 0, \
        capsys.readouterr().err
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert {r["stage"] for r in rows if not r["fits"]} == refused and all(
        r["why"].startswith(needle) for r in rows if not r["fits"]), rows
    assert {r["stage"] for r in rows if r["fits"]} == {"zero1", "zero2", "zero3"} - refused, rows


def test_free_disk_and_the_disk_probe_are_those_of_the_nvme_path(capsys, monkeypatch, tmp_path):
    """offload.nvme_path (a folder about to be made) sizes the disk and is where the probe's disk test
    runs: its nearest existing folder, not the working directory."""
    from framework.cli import plan as cli
    from framework.memory import planner

    asked = {}
    monkeypatch.setattr(cli._probe, "load", lambda device, disk_dir, **k: asked.setdefault("probe", disk_dir) and
                        {**PROBE, "cache": "test", "process_rss_bytes": 0})
    monkeypatch.setattr(planner, "free_bytes", lambda folder: asked.setdefault("free", Path(folder)) and 2 ** 40)
    monkeypatch.chdir(ROOT)
    assert cli.main(["model=gpt-nano", "micro_batches=16", "checkpointing=false", "ranks=1", "offload=nvme",
                     f"offload.nvme_path={tmp_path}/swap/r0"]) == 0, capsys.readouterr().err
    assert asked == {"probe": tmp_path, "free": tmp_path}, asked
    assert not (tmp_path / "swap").exists()


def test_gpu_sizes_on_a_cpu_host_say_the_times_are_this_cpu(capsys, monkeypatch):
    cli = _quiet_probe(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main([*SMALL, "gpu_mem=80G", "cpu_mem=512G", "ranks=1"]) == 0
    out = capsys.readouterr().out
    assert "step times are measured on this host's CPU" in out and "not on the GPUs" in out, out
    assert cli.main([*SMALL, "ranks=1"]) == 0
    assert "step times are measured on this host's CPU" not in capsys.readouterr().out


def test_verify_refuses_when_nothing_fits_and_reports_failure_as_text(capsys, monkeypatch):
    cli = _quiet_probe(monkeypatch)
    monkeypatch.setattr(cli.subprocess, "run", lambda *a, **k: pytest.fail("ran"))
    assert cli.main([*SMALL, "ranks=1", "cpu_mem=1M", "--verify", "1"]) == 2
    err = capsys.readouterr().err
    assert "plan: no setup fits; the closest, ddp none micro 16" in err and err.count("\n") == 1, err
    monkeypatch.setattr(cli.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(
        a, 1, "", "Traceback ...\nhydra.errors.ConfigCompositionException: boom\n"))
    assert cli.main([*SMALL, "ranks=1", "--verify", "1"]) == 2
    err = capsys.readouterr().err
    assert "plan --verify: the multirun failed: hydra.errors.ConfigCompositionException: boom" in err, err
    assert "[" not in err and err.count("\n") == 1, err


def test_the_ds_configs_notices_are_printed_once(capsys, monkeypatch, tmp_path):
    """A DeepSpeed file's warnings (unknown keys) and notes (keys that change nothing) reach the user
    as training prints them, once (not for each candidate)."""
    cli = _quiet_probe(monkeypatch)
    ds = tmp_path / "ds.json"
    ds.write_text('{"steps_per_print": 10, "qqq_unheard_of": 1}')
    assert cli.main([*SMALL, "ranks=1", f"ds_config={ds}"]) == 0
    err = capsys.readouterr().err
    assert err.count("keys DeepSpeed does not know, ignored") == 1 and "qqq_unheard_of" in err, err
    assert err.count("accepted, change nothing here: steps_per_print") == 1, err


def test_the_host_holds_every_ranks_process_and_the_launcher():
    """On the host: each rank's process (the probe's resident set, what checkpointing loads where the setup
    checkpoints, plus a CUDA context's allowance where the probe ran without CUDA) and, for spawned ranks, the
    launcher's process (which does not train) and multiprocessing's tracker."""
    from framework.memory.planner import CUDA_HOST_BYTES, TRACKER_BYTES

    cfg, own = compose(BASE), {"micro_batches": "8", "stages": "ddp", "checkpointing": "false", "offloads": "none"}
    probe = {**PROBE, "process_rss_bytes": 300 * 2 ** 20, "checkpointing_rss_bytes": 70 * 2 ** 20}
    one, = plan(cfg, BASE, Hardware(torch.device("cpu"), None, 2 ** 40, 2 ** 40, 1), own, probe)
    two, = plan(cfg, BASE, Hardware(torch.device("cpu"), None, 2 ** 40, 2 ** 40, 2), own, probe)
    assert one.host == one.device_peak and two.host == 2 * two.device_peak + 300 * 2 ** 20 + TRACKER_BYTES
    # the ranks' peaks fit, the launcher does not
    tight, = plan(cfg, BASE, Hardware(torch.device("cpu"), None, two.host - 1, 2 ** 40, 2), own, probe)
    assert 2 * tight.device_peak < two.host - 1 and not tight.fits and tight.why.startswith("host "), tight.why
    for device, context in ((torch.device("cpu"), CUDA_HOST_BYTES), (torch.device("cuda", 0), 0)):
        gpu, = plan(cfg, BASE, Hardware(device, 2 ** 36, 2 ** 40, 2 ** 40, 2), own, probe)
        # (ddp without offload holds no tensor on the host)
        assert gpu.host == 2 * (300 * 2 ** 20 + context) + 300 * 2 ** 20 + TRACKER_BYTES, (device, gpu.host)
    # A checkpointing setup's ranks hold what its first use loads besides; the launcher does not train.
    own = {**own, "checkpointing": "true"}
    (ckpt,), (without,) = (plan(cfg, BASE, Hardware(torch.device("cpu"), None, 2 ** 40, 2 ** 40, 2), own, p)
                           for p in (probe, {**probe, "checkpointing_rss_bytes": 0}))
    assert ckpt.device_peak == without.device_peak + 70 * 2 ** 20 and ckpt.host == without.host + 2 * 70 * 2 ** 20
    gpu, = plan(cfg, BASE, Hardware(torch.device("cuda", 0), 2 ** 36, 2 ** 40, 2 ** 40, 2), own, probe)
    assert gpu.host == 2 * (300 + 70) * 2 ** 20 + 300 * 2 ** 20 + TRACKER_BYTES, gpu.host


def test_when_nothing_fits_the_closest_setup_is_one_line(capsys, monkeypatch):
    """Nothing fits: exit 2 with one line naming the setup closest to fitting and its needs in readable units."""
    cli = _quiet_probe(monkeypatch)
    # (two micro batch sizes of the five: every stage and offload still planned, with and without checkpointing)
    assert cli.main(["model=gpt-mini", "cpu_mem=10M", "nvme=1T", "ranks=1", "micro_batches=1,2", "--json"]) == 2
    out, err = capsys.readouterr()
    rows = json.loads(out.strip().splitlines()[-1])
    best = min(rows, key=lambda r: r["host"])
    label = f"{best['stage']} {best['offload']} micro {best['micro_batch']} x accum {best['grad_accum']} ckpt " \
            f"{'yes' if best['checkpointing'] else 'no'}"
    assert err.startswith(f"error: plan: no setup fits; the closest, {label}, needs host ") and \
        err.count("\n") == 1, (label, err)
    assert " MiB (10485760 bytes) (give more memory" in err and "setup" not in out.split("\n")[-2], err
    assert cli.main(["model=gpt-nano", "gpu_mem=80G", "cpu_mem=2M", "ranks=1", "stages=ddp,zero3",
                     "micro_batches=1"]) == 2   # every rank's process
    assert "> 2.00 MiB (2097152 bytes)" in capsys.readouterr().err


def test_the_summary_names_the_setup_closest_to_fitting_whole(capsys, monkeypatch):
    """The "(N of M setups fit; closest to fitting: ...)" line names one whole setup: its stage, offload, batch and
    checkpointing (a cut at a padding space left "zero3 cpu+params micro" or "ddp"), the rejected one whose need
    is the least over what is given (not the last one listed, the furthest)."""
    from framework.memory.planner import Candidate

    cli = _quiet_probe(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["model=gpt-nano", "micro_batches=1,16", "stages=ddp,zero3", "ranks=1", "cpu_mem=40M",
                     "nvme=1T", "--json"]) == 0
    out = capsys.readouterr().out
    found = re.search(r"setups fit; closest to fitting: (\w+ [\w+]+ micro \d+ x accum \d+ ckpt (yes|no)) \(", out)
    assert found, out
    rejected = [r for r in json.loads(out.strip().splitlines()[-1]) if not r["fits"]]   # host is the only need here
    near = min(rejected, key=lambda r: r["host"])
    fields = {k: near[k] for k in ("stage", "offload", "micro_batch", "grad_accum", "checkpointing")}
    assert found[1] == " ".join(Candidate(**fields).label().split()) and len(rejected) > 1, (found[1], rejected)


def test_nvme_0_is_no_nvme(capsys, monkeypatch):
    """nvme=0 (unlike gpu_mem=0 or cpu_mem=0, refused) means no NVMe: an offload=nvme setup's disk need says so,
    and such a setup is never the one "closest to fitting" (no smaller model or batch makes it fit)."""
    cli = _quiet_probe(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["model=gpt-nano", "ranks=1", "stages=zero3", "offloads=nvme", "micro_batches=1",
                     "checkpointing=false", "nvme=0"]) == 2
    err = capsys.readouterr().err
    assert re.search(r"^error: plan: no setup fits: every one buildable here offloads to NVMe, and nvme=0 gives none "
                     r"\(e\.g\. zero3 nvme .* needs disk [0-9.]+ MiB \(\d+ bytes\) > 0 \(nvme=0: no NVMe\)\): give "
                     r"nvme= its disk space", err), err
    assert "closest" not in err and "smaller model" not in err, err
    assert cli.main(["model=gpt-nano", "ranks=1", "stages=zero3", "offloads=cpu,nvme", "micro_batches=1",
                     "checkpointing=false", "nvme=0", "cpu_mem=10M"]) == 2   # cpu: over by a finite factor
    err = capsys.readouterr().err
    assert "the closest, zero3 cpu" in err and "(give more memory" in err, err
    assert cli.main(["model=gpt-nano", "ranks=1", "stages=zero3", "offloads=cpu,nvme", "micro_batches=1",
                     "checkpointing=false", "nvme=0"]) == 0
    out = capsys.readouterr().out
    assert "closest to fitting" not in out and "the others cannot fit here, e.g. zero3 nvme" in out, out


def test_a_model_vocab_size_the_data_overrides_is_refused_as_training_refuses_it(capsys):
    from framework.cli.plan import main
    assert main(["model=gpt-nano", "model.vocab_size=10", "gpu_mem=80G"]) == 2
    assert capsys.readouterr().err == ("error: model.vocab_size=10 differs from the 64 token ids of the data, which "
                                       "set the model's vocabulary; drop model.vocab_size (set data.vocab_size where the "
                                       "data source has it)\n")


def test_a_stage_of_ones_own_needs_a_compatible_row_and_the_plan_leaves_it_out_without_a_memory_model(
        own_component, capsys, monkeypatch):
    """A stage of one's own (ddp's code under another name): without a row in config.COMPATIBLE its refusal names
    that table; with one it trains, but the plan of every model leaves it out with a note (not a refusal of the
    whole plan), and its estimate names the file its memory model goes in."""
    from framework import ConfigError
    from framework.config import COMPATIBLE
    from framework.memory.model import predict

    search = own_component("stage", "mystage", "from framework.stages.ddp import COMPONENT  # noqa: F401\n",
                           "reduce_bucket_size: 6553600\noverlap_comm: true\n")
    with pytest.raises(ConfigError) as e:
        compose(["+stage=mystage", search])
    assert str(e.value) == ("config: stage mystage has no row in config.COMPATIBLE (framework/config/schema.py); "
                            "add 'mystage': (the offload tiers it supports, e.g. \"none\",) there")
    monkeypatch.setitem(COMPATIBLE, "mystage", ("none",))
    cfg = compose(["model=gpt-nano", "+stage=mystage", search])
    with pytest.raises(ConfigError) as e:
        predict(cfg, 1)
    assert str(e.value) == ("estimate: no memory model for stage 'mystage'; add its case (and its name to STAGES) "
                            "in framework/memory/model.py, its checks to tests/dist/test_footprint.py")
    cli = _quiet_probe(monkeypatch)
    assert cli.main(["model=gpt-nano", "gpu_mem=8G", "ranks=1", "micro_batches=8", "checkpointing=false",
                     search]) == 0
    out = capsys.readouterr().out
    assert ("note: stage mystage left out: no memory model (add its case to predict in framework/memory/model.py)"
            in out.splitlines() and "mystage" not in out.split("note: stage mystage")[1]), out
