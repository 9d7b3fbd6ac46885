"""Every example command of README.md, the docs/ pages and recipes/README.md runs as printed, from a
folder that holds what a fresh clone holds, with only its steps shortened.

The fenced ``bash`` blocks are extracted (continuation lines joined, comments dropped) and run in the
order of ``DOCS``, each document top to bottom. Later examples use what earlier ones wrote (the sweep's
report, the checkpoint a resume names, the 16-bit weights a pretrained run loads, the checkpoints an
export reads), so a page comes after the pages whose commands write what it uses; a command an earlier
document showed does not run again (``make train`` counts as the ``python -m framework.train`` it
runs), unless a page shows it more often than those before it (checkpoints.md's save, then its resume).
Shortening: ``train.steps`` and the step counts checkpoints are named after become a few, logs and
evaluations happen every step, a recipe runs its ``--quick`` twin. ``python -m framework.*`` commands,
and torchrun (as ``python -m torch.distributed.run``, which is what its script runs), run in a fork
server that has imported the framework once (tests/cli/_forkrun.py); the ranks they start are fresh
processes, as always. The few commands that cannot run here are listed in SKIP with the reason, those
another test runs with more overrides and more checks in COVERED with that test, and each must still be in a
document; a line an earlier run of this test holds with only a checkpoint interval or a run folder more is not
run again (ONLY_MORE).
"""
from __future__ import annotations

import importlib.util
import re
import shlex
import shutil
import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest

from framework.core.paths import cache_dir
from framework.ops._loader import cache_root
from tests._helpers import shakespeare

ROOT = Path(__file__).resolve().parents[2]
# README first (its headline commands), then the pages, each after those that write what it reads:
# checkpoints.md saves the checkpoints hf.md exports; gpu.md's one command is skipped.
DOCS = ["README.md", "docs/running.md", "docs/stages.md", "docs/nvme.md", "docs/deepspeed.md",
        "docs/checkpoints.md", "docs/hf.md", "docs/sweeps.md", "docs/estimate.md", "docs/library.md",
        "docs/gpu.md", "docs/architecture.md", "recipes/README.md"]
STEPS = 2   # a step, a checkpoint, and one more step after it (a resume trains that one)
SKIP = {
    "make test": "it is this test suite",
    "bash bench/gpu_check.sh": "needs a CUDA GPU (its --dry-run runs in tests/cli/test_gpu_check.py)",
    "hydra.launcher.partition=gpu": "needs a Slurm cluster (tests/cli/test_cluster.py checks the submission)",
    "python -m framework.plan model=gpt-mini --verify 3":
        "runs three setups for minutes; tests/cli/test_plan.py runs --verify on a shortened config",
}
# Lines another test runs as printed with only more overrides (a smaller model, a shorter run) and checks more of
# than its exit status: they are not spawned twice. Each must still be in a document and its test still there.
# (file, test, a text of that file that keeps the line's case in the test: its removal runs the line here again)
COVERED = {
    "python -m framework.train +stage=zero3 dist.nproc=2":
        ("tests/cli/test_cli.py", "test_zero_stages_from_the_command_line",   # (+ the 16-bit export it loads)
         '@pytest.mark.parametrize("stage", ["zero3"])\ndef test_zero_stages_from_the_command_line('),
    "python -m framework.train +stage=ddp dist.nproc=2":
        ("tests/cli/test_recipes.py", "test_memory_scaling_quick", '("ddp", 2)'),   # (its ddp job on 2 ranks)
}
# A line whose words an earlier run line of this test holds, with only these more (a checkpoint every N steps, a
# named run or sweep folder, the log and evaluation intervals that shorten() sets on every run anyway), ran there:
# stages.md's `+stage=zero2 dist.nproc=2` is the README's checkpointed zero2 run, sweeps.md's first 4-job sweep the
# README's into multirun/opt-lr (the default sweep folder is still run: sweeps.md's `-m logger=wandb` sweep).
ONLY_MORE = re.compile(r"^(checkpoint\.every|hydra\.(run|sweep)\.dir|train\.(log_every|eval_every))=")
# Lines that need an optional package (not on the GPU image): not run where it is missing; the framework's own line
# for each missing one is tested in tests/unit/test_loggers.py and tests/cli/test_recipes.py.
NEEDS = {"python -m framework.report ": "matplotlib", "logger=wandb": "wandb"}
# Recipes run their --quick twin, which tests/cli/test_recipes.py runs for every recipe.
RECIPE_RUN = re.compile(r"^python -m framework\.recipe (\w+)( --quick)?$")
PLACEHOLDER = re.compile(r"\b(NAME|DIR|FILE)\b|key=value \.\.\.")
# The user's copy of tiny shakespeare (``path/to/input.txt`` in the docs): the suite's (tests/_helpers.py);
# any text file where it is missing (prepare only warns).
SHAKESPEARE = shakespeare()


def commands() -> list[tuple[str, str]]:
    """(document, command line) of every example, in order."""
    out = []
    for doc in DOCS:
        text = (ROOT / doc).read_text()
        for block in re.findall(r"```bash\n(.*?)```", text, re.S):
            for line in block.replace("\\\n", " ").splitlines():
                line = re.sub(r"\s+#.*$", "", line).strip()
                if line and not line.startswith("#"):
                    out.append((doc, " ".join(line.split())))
    return out


def shorten(args: list[str], steps: int = STEPS) -> list[str]:
    out = []
    for a in args:
        a = re.sub(r"^train\.steps=\d+$", f"train.steps={steps}", a)
        a = re.sub(r"^checkpoint\.every=\d+$", "checkpoint.every=1", a)
        a = re.sub(r"/step-(\d+)$", lambda m: f"/step-{STEPS - 1}", a)
        out.append(a)
    if not any(a.startswith("train.steps=") for a in out):
        out.append(f"train.steps={steps}")
    return out + ["train.log_every=1", f"train.eval_every={steps}", "train.eval_batches=1"]


def _next_second(last: int) -> int:
    """Wait for a second after ``last`` and return it: Hydra names a run's folder by the second it starts
    (outputs/DATE/TIME), so two shortened runs within one second would share it, the second resuming the first's
    checkpoints."""
    while int(time.time()) == last:
        time.sleep(0.05)
    return int(time.time())


def test_every_page_is_listed():
    """A page under docs/ that DOCS leaves out would have commands nobody runs."""
    pages = {f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")}
    assert pages <= set(DOCS), sorted(pages - set(DOCS))


@pytest.mark.parametrize("doc,heading", [("README.md", "## Library API"), ("docs/library.md", "# Library use")])
def test_the_library_loop_runs_as_pasted(doc, heading):
    """The first python block after ``heading`` (the training loop a newcomer copies first) defines all it uses
    and trains, with its steps shortened."""
    text = (ROOT / doc).read_text()
    block = re.search(r"```python\n(.*?)```", text[text.index(heading):], re.S).group(1)
    assert "train.steps=100" in block, block
    exec(compile(block.replace("train.steps=100", f"train.steps={STEPS}"), doc, "exec"), {})


def test_the_hf_library_example_runs_as_pasted(tmp_path):
    """docs/hf.md's example of a transformers model in your own code (zero3, pretrained values, both batch
    conventions) runs as printed, on a tiny GPT-2 folder written here (nothing downloaded) for its path."""
    from tests._hf import write_config   # (first: it keeps transformers off the Hub)
    from transformers import AutoConfig, AutoModelForCausalLM

    text = (ROOT / "docs/hf.md").read_text()
    block = re.search(r"```python\n(.*?)```", text[text.index("## In your own code"):], re.S).group(1)
    assert block.count('"path/to/folder"') == 2, block
    write_config("gpt2", tmp_path)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path)).save_pretrained(tmp_path)
    names = {}
    exec(compile(block.replace('"path/to/folder"', repr(str(tmp_path))), "docs/hf.md", "exec"), names)
    with names["engine"] as engine:
        assert engine.state.step == 2 and engine.components.stage.forward_gathers   # (zero3's)


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    """A folder with what a fresh clone has (the documents, recipes, the test configs) and
    nothing a run wrote."""
    d = tmp_path_factory.mktemp("clone")
    for name in ("README.md", "docs", "recipes", "tests", "conf", "Makefile", "pyproject.toml"):
        (d / name).symlink_to(ROOT / name)
    (d / ".venv").symlink_to(ROOT / ".venv")
    return d


@pytest.mark.timeout(900)
def test_every_documented_command_runs(clone, forkrun, tmp_path):
    cmds = commands()
    assert len(cmds) > 40, len(cmds)
    skipped = {k: False for k in SKIP}
    covered = {k: False for k in COVERED}
    runs: list[list[str]] = []   # the word lists of the lines run so far
    failures, ran, started, missing = [], 0, 0, 0
    # The runs write into a temporary cache, not this user's: plan's bandwidth probe (a copy of those measured
    # here, so none is measured again: about a minute on a loaded 2-core machine); the kernels are read where
    # they are built.
    cache, probes = tmp_path / "cache", {f.name: f.stat().st_mtime_ns for f in cache_dir().glob("probe-*.json")}
    (cache / "framework").mkdir(parents=True)
    for name in probes:
        shutil.copy2(cache_dir() / name, cache / "framework")
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1", "XDG_CACHE_HOME": str(cache),
           "FRAMEWORK_OPS_CACHE": str(cache_root())}
    before, here = Counter(), Counter()   # lines of the earlier documents, of this one so far
    trained = Counter()   # train lines run so far: a line's rerun resumes its folder, so it gets one step more
    for i, (doc, line) in enumerate(cmds):
        if i and doc != cmds[i - 1][0]:
            before, here = before + here, Counter()
        here[line] += 1
        why = next((k for k in SKIP if k in line), None)
        if why:
            skipped[why] = True
            continue
        if PLACEHOLDER.search(line):
            continue   # the syntax lines of recipes/README.md; their concrete forms are in the docs
        if here[line] <= before[line]:
            continue   # a page repeating a README command: it ran there, on the same files
        if line in COVERED:
            covered[line] = True
            continue
        if any(k in line and importlib.util.find_spec(pkg) is None for k, pkg in NEEDS.items()):
            missing += 1
            continue
        if here[line] == 1 and any(r[:3] == line.split()[:3] and set(line.split()) < set(r)
                                   and all(ONLY_MORE.match(w) for w in set(r) - set(line.split())) for r in runs):
            continue
        words = shlex.split(line.replace("path/to/input.txt", str(SHAKESPEARE if SHAKESPEARE.is_file()
                                                                  else ROOT / "README.md")))
        assigned = {}
        while words and re.match(r"^[A-Z_]+=", words[0]):   # VAR=value python ...
            k, _, v = words.pop(0).partition("=")
            assigned[k] = v
        # W&B online needs an account and the network: the same run, offline.
        assigned.pop("WANDB_MODE", None)
        if words[:1] == ["."]:
            assert (clone / words[1]).is_file(), line
            continue
        if words == ["make", "train"]:   # what the target runs, after setup (done: this suite runs in it)
            dry = subprocess.run(["make", "-n", "train"], cwd=clone, capture_output=True, text=True)
            assert "-m framework.train $(ARGS)" in (ROOT / "Makefile").read_text() and dry.returncode == 0
            words = ["python", "-m", "framework.train"]
            here[" ".join(words)] += 1   # the same command as a page's plain line (running.md): it ran here
        m = RECIPE_RUN.match(" ".join(words))
        if m:
            continue   # its --quick twin: tests/cli/test_recipes.py
        if words[:2] == ["python", "-m"] and words[2].startswith("framework."):
            module, args = words[2], words[3:]
            if module == "framework.train" and "--cfg" not in args:
                args, started = shorten(args, STEPS + trained[line]), _next_second(started)
                trained[line] += 1
            p = forkrun.run(module, args, cwd=clone, env={**env, **assigned}, timeout=240)
        elif words[0] == "torchrun":   # (the torchrun script is ``sys.exit(torch.distributed.run.main())``)
            at = words.index("framework.train") + 1
            started = _next_second(started)   # (its run folder too is named by the second)
            p = forkrun.run("torch.distributed.run", [*words[1:at], *shorten(words[at:])], cwd=clone,
                            env={**env, **assigned}, timeout=240)
        else:
            raise AssertionError(f"{doc}: no rule to run {line!r}")
        ran += 1
        runs.append(line.split())
        if p.returncode != 0:
            failures.append(f"{doc}: {line}\n  -> rc {p.returncode}: {p.stderr[-1500:]}")
    assert not failures, "\n".join(failures)
    assert {f.name: f.stat().st_mtime_ns for f in cache_dir().glob("probe-*.json")} == probes, \
        "a documented command wrote this user's cache"
    assert all(skipped.values()), f"SKIP entries no document holds any more: {skipped}"
    assert all(covered.values()), f"COVERED entries no document holds any more: {covered}"
    for path, test, case in COVERED.values():
        text = (ROOT / path).read_text()
        assert f"def {test}(" in text and case in text, f"{path}: {test} runs no {case!r} any more: run its line here"
    assert ran + missing > 35
