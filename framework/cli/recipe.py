"""Run a recipe (a published result to reproduce) and check it against its expected numbers.

    python -m framework.recipe --list                                # the recipes and what they reproduce
    python -m framework.recipe shakespeare_char_cpu prepare data.path=input.txt   # build its data set once
    python -m framework.recipe shakespeare_char_cpu                  # run it; exit 1 if a number is off
    python -m framework.recipe shakespeare_char_cpu --quick          # the tiny twin the test suite runs
    python -m framework.recipe zero_equivalence train.steps=20      # extra overrides go to every job
    python -m framework.recipe shakespeare_char_cpu check OUT_DIR   # re-check a finished run

A recipe is a folder (``recipes/<name>/`` or any path) with ``config.yaml``, ``recipe.yaml``,
``expected.json`` and ``README.md``, each described in recipes/README.md. All jobs write into one
multirun folder (default ``outputs/recipes/<name>/<time>``), which gets the report and ``checks.json``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import yaml

from framework.comm.distributed import gpu_count
from framework.core import files
from framework.core.errors import DataError, FrameworkError, first_line
from framework.core.paths import PACKAGE_DIR, REPO_ROOT
from framework.core.registry import closest_hint
from framework.core.units import MiB
from framework.cli import report
from framework.cli.report import matches, measured_memory, zero_model_state_bytes
from framework.config.schema import get_key

RECIPES_DIR = REPO_ROOT / "recipes"
ACTIONS = ("run", "prepare", "check")
JOB_DIRS = "run*-job*"   # the job folders of a recipe's run in its output folder (hydra.sweep.subdir)
_SPEC_KEYS = {"description", "runs", "quick", "prepare", "plots", "before", "after", "requires"}
_REQUIRES = {"cuda"}   # what the full run needs of the machine (the quick twin runs anywhere)
_BOUNDS = {"min", "max", "equals", "tol"}
# Each kind of check (named by its first key) and every key it reads: a misspelled bound would
# otherwise be ignored and the check pass whatever the numbers.
_CHECK_KEYS = {"metric": {"metric", "where"} | _BOUNDS,
               "curves_match": {"curves_match", "reference", "atol", "rtol"},
               "memory_scaling": {"memory_scaling", "worlds", "min_ratio", "max_ratio", "max_change"},
               "file": {"file", "key"} | _BOUNDS}


class RecipeError(FrameworkError):
    """A recipe is malformed, one of its runs failed, or its result is off the expected numbers."""


@dataclass(frozen=True)
class Recipe:
    name: str
    dir: Path
    spec: dict        # recipe.yaml
    expected: dict    # expected.json

    def runs(self, quick: bool) -> list[list[str]]:
        q = (self.spec.get("quick") or {}) if quick else {}
        return [merge_overrides(list(r), list(q.get("overrides") or [])) for r in q.get("runs") or self.spec["runs"]]

    def checks(self, quick: bool) -> dict:
        """expected.json's section for the full run or the twin, every check in it valid."""
        key = "quick" if quick else "full"
        if not isinstance(self.expected.get(key), dict):
            raise RecipeError(f"{self.dir / 'expected.json'} has no '{key}' section (an object with jobs and checks)")
        try:
            validate_checks(self.expected[key])
        except RecipeError as e:
            raise RecipeError(f"{self.dir / 'expected.json'}, section '{key}': {e}") from None
        return self.expected[key]


def validate_checks(want: dict) -> None:
    """Refuse a section of expected.json with an unknown key, check kind or check key, or a bound-less check."""
    if extra := sorted(set(want) - {"jobs", "checks"}):
        raise RecipeError(f"unknown key {extra[0]!r}{closest_hint(extra[0], ['jobs', 'checks'])}; valid: checks, jobs")
    if not isinstance(want.get("checks", []), list):
        raise RecipeError("'checks' must be a list of checks")
    for c in want.get("checks", []):
        kind = next((k for k in _CHECK_KEYS if k in c), None) if isinstance(c, dict) else None
        if kind is None:
            raise RecipeError(f"unknown check {c}; use metric, curves_match, memory_scaling or file "
                              f"(recipes/README.md)")
        if extra := sorted(set(c) - _CHECK_KEYS[kind]):
            raise RecipeError(f"{kind} check {c}: unknown key {extra[0]!r}{closest_hint(extra[0], _CHECK_KEYS[kind])}"
                              f"; valid: {', '.join(sorted(_CHECK_KEYS[kind]))}")
        if kind == "file" and "key" not in c:
            raise RecipeError(f"file check {c} has no 'key' (the value to read in the file)")
        if kind in ("metric", "file") and not set(c) & {"min", "max", "equals"}:
            raise RecipeError(f"{kind} check {c} has no bound: give min, max or equals (with tol)")
        if "tol" in c and "equals" not in c:   # (tol widens only equals)
            raise RecipeError(f"{kind} check {c}: 'tol' without 'equals' bounds nothing; give equals with it, "
                              f"or drop it")
        if kind == "memory_scaling":   # ddp's formula saves nothing: only max_change bounds it (_memory)
            need = ["max_change"] if c["memory_scaling"] == "ddp" else ["min_ratio", "max_ratio"]
            if not set(c) & set(need):
                raise RecipeError(f"memory_scaling check {c} has no bound: give {' or '.join(need)}")
            unread = ["min_ratio", "max_ratio"] if c["memory_scaling"] == "ddp" else ["max_change"]
            if used := [k for k in unread if k in c]:
                raise RecipeError(f"memory_scaling check {c}: {used[0]!r} is not read for {c['memory_scaling']} "
                                  f"(its bound: {' or '.join(need)}); drop it")
        for lo, hi in (("min", "max"), ("min_ratio", "max_ratio")):
            if all(isinstance(c.get(k), (int, float)) for k in (lo, hi)) and c[lo] > c[hi]:
                raise RecipeError(f"{kind} check {c}: {lo} {c[lo]} is above {hi} {c[hi]} (no value passes)")


def find(name: str) -> Recipe:
    """A recipe by name (``recipes/<name>``) or by folder path."""
    d = next((d for d in (Path(name).expanduser(), RECIPES_DIR / name) if (d / "recipe.yaml").is_file()), None)
    if d is None:
        raise RecipeError(f"no recipe '{name}'{closest_hint(name, available())}; available: {', '.join(available()) or 'none'} "
                          f"(or give a folder with recipe.yaml, config.yaml and expected.json)")
    for f in ("config.yaml", "expected.json"):
        if not (d / f).is_file():
            raise RecipeError(f"recipe {d} has no {f}")
    try:
        spec = yaml.safe_load((d / "recipe.yaml").read_text()) or {}
    except yaml.YAMLError as e:
        raise RecipeError(f"{d / 'recipe.yaml'} is not valid YAML ({' '.join(str(e).split())})") from None
    if not isinstance(spec, dict):
        raise RecipeError(f"{d / 'recipe.yaml'} is not a mapping (runs:, quick:, ...) but a {type(spec).__name__}")

    def refuse_unknown(what: str, given, allowed: set) -> None:
        extra = set(given or []) - allowed
        if extra:
            raise RecipeError(f"{d / 'recipe.yaml'}: unknown {what} {', '.join(sorted(extra))}; "
                              f"valid: {', '.join(sorted(allowed))}")

    refuse_unknown("key(s)", spec, _SPEC_KEYS)
    if not spec.get("runs") or not all(isinstance(r, list) for r in spec["runs"]):
        raise RecipeError(f"{d / 'recipe.yaml'}: 'runs' must be a list of override lists")
    refuse_unknown("key(s) under quick:", spec.get("quick"), {"overrides", "runs"})
    refuse_unknown("key(s) under prepare:", spec.get("prepare"), {"kind", "source"})
    refuse_unknown("plot(s)", spec.get("plots"), {"deviation", "memory_scaling"})
    if "requires" in spec and spec["requires"] not in _REQUIRES:
        raise RecipeError(f"{d / 'recipe.yaml'}: requires: {spec['requires']!r} is not one of "
                          f"{', '.join(sorted(_REQUIRES))} (what the full run needs; or drop the key)")
    try:
        expected = json.loads((d / "expected.json").read_text())
    except json.JSONDecodeError as e:
        raise RecipeError(f"{d / 'expected.json'}: {e}") from None
    if not isinstance(expected, dict):
        raise RecipeError(f"{d / 'expected.json'} is not a JSON object (full, quick, ...) but a {type(expected).__name__}")
    return Recipe(name=d.name, dir=d.resolve(), spec=spec, expected=expected)


def available() -> list[str]:
    return sorted(p.parent.name for p in RECIPES_DIR.glob("*/recipe.yaml"))


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def merge_overrides(*groups: list[str]) -> list[str]:
    """Concatenate override lists; a later override of the same key replaces an earlier one
    (Hydra itself refuses two values for one key)."""
    flat = [o for group in groups for o in group]
    last = {_key(o): i for i, o in enumerate(flat)}
    return [o for i, o in enumerate(flat) if last[_key(o)] == i]


def compose_jobs(recipe: Recipe, overrides: list[str]):
    """Every job's typed config for one run's overrides (sweeps expanded): fails before any run."""
    from framework.config import compose
    from framework.cli.train import _jobs

    jobs, *_ = _jobs(["-m", *[_fill(o, {"recipe": str(recipe.dir)}) for o in overrides]])
    return [compose(job, config_dir=str(recipe.dir), config_name="config") for job in jobs]


def prepare(recipe: Recipe, overrides: list[str], out: Path | None = None) -> dict:
    """Build the recipe's data set from the text file ``data.path`` (default: recipe.yaml's
    ``prepare.source``) into the file its config trains on (or ``out``)."""
    spec = recipe.spec.get("prepare")
    if not spec:
        raise RecipeError(f"recipe {recipe.name} has no prepare step (its data needs none)")
    if spec.get("kind") != "chars":
        raise RecipeError(f"{recipe.dir / 'recipe.yaml'}: prepare.kind must be 'chars', got {spec.get('kind')!r}")
    # (data.path without "=FILE", or deleted with ~, names no text either)
    rest = [o for o in overrides if _key(o) != "data.path" or o.startswith("~") or not o.partition("=")[2]]
    if rest:
        raise RecipeError(f"prepare takes only data.path=FILE (the text to encode), got {' '.join(rest)}")
    source = overrides[-1].split("=", 1)[1] if overrides else spec.get("source")
    from framework.data.text import prepare_chars
    from framework.data.tokens import meta_path

    out = Path(out if out is not None else compose_jobs(recipe, list(recipe.spec["runs"][0]))[0].data.path).expanduser()
    meta = prepare_chars(source, out)
    want = recipe.expected.get("data") or {}
    print(f"wrote {out} ({meta['train_tokens'] + meta['val_tokens']:,} tokens, vocab {meta['vocab_size']}: "
          f"train {meta['train_tokens']:,} / val {meta['val_tokens']:,}) and {meta_path(out)}")
    if want.get("source_sha256") and want["source_sha256"] != meta["source_sha256"]:
        print(f"warning: {meta['source']} has sha256 {meta['source_sha256']}, not the reference's "
              f"{want['source_sha256']}: the expected numbers assume the reference file", file=sys.stderr)
    return meta


def run(recipe: Recipe, *, quick: bool, overrides: list[str], out: Path, stream=None) -> dict:
    """Run every job of the recipe into ``out``, write the report, check it; return the verdict."""
    stream = stream or sys.stdout
    recipe.checks(quick)   # a malformed expected.json: before anything trains
    if not quick and recipe.spec.get("requires") == "cuda" and gpu_count() == 0:
        # (on the CPU its full run would go on for hours and then fail the GPU's expected numbers)
        raise RecipeError(f"recipe {recipe.name} needs a CUDA GPU (its recipe.yaml: requires: cuda) and torch sees "
                          f"none here; run it on a machine with one, or its CPU twin with --quick")
    # A second run into a folder holding a run's results would resume or overwrite its jobs (and
    # count the leftovers of a larger one): refused, nothing deleted; ``check DIR`` re-checks it.
    if out.is_dir() and (any(out.glob("run*-job*")) or (out / "checks.json").exists()):
        raise RecipeError(f"--out {out} already holds a recipe's results (run*-job* folders or checks.json); "
                          f"pass a new folder with --out, or re-check it with `check {out}`")
    # The recipe places its jobs (hydra.sweep.dir={out}, subdir run<i>-job<n>, which finish reads).
    if placed := next((o for o in overrides if _key(o) in ("hydra.sweep.dir", "hydra.sweep.subdir")), None):
        raise RecipeError(f"{placed}: a recipe writes its jobs into --out DIR (as run<i>-job<n>); use --out DIR "
                          f"instead of {_key(placed)}")
    # {recipe} in an override is the recipe's folder (its own files, wherever it is run from).
    runs = [[_fill(o, {"recipe": str(recipe.dir)}) for o in merge_overrides(r, overrides)] for r in recipe.runs(quick)]
    _check_data(recipe, runs)
    cfg_fill = _config_fill(recipe, runs[0])   # (a {cfg.KEY} naming no key: refused before the folder is made)
    try:
        files.make_dirs(out)
    except OSError as e:   # e.g. --out names a file
        raise RecipeError(f"cannot make the output folder {out} ({e.strerror}); pass a new folder with --out") from None
    t0 = time.perf_counter()
    fill = {"python": sys.executable, "out": str(out), "recipe": str(recipe.dir), "quick": "--quick" if quick else "",
            **cfg_fill}
    jobs = [(f"run{i}", f"run {i + 1}/{len(runs)}: {' '.join(r) or '(no overrides)'}",
             [sys.executable, "-m", "framework.train", "-m", "--config-dir", str(recipe.dir), "--config-name", "config",
              *r, f"hydra.sweep.dir={out}", f"hydra.sweep.subdir=run{i}-job${{hydra.job.num}}"])
            for i, r in enumerate(runs)]
    for log, say, cmd in [*_commands(recipe, "before", fill), *jobs, *_commands(recipe, "after", fill)]:
        print(f"[recipe {recipe.name}] {say}", file=stream, flush=True)
        _run_logged(cmd, out / f"{log}.log", stream)
    return finish(recipe, out, quick=quick, elapsed_s=time.perf_counter() - t0, stream=stream)


def _check_data(recipe: Recipe, runs: list[list[str]]) -> None:
    """Every job's data file is there and built from the reference text (its ``<stem>.meta.json``, written
    by prepare, against expected.json's ``data``): one from another text would train for nothing, then fail."""
    from framework.data import resolve_path
    from framework.data.tokens import read_meta

    hint = (f"`python -m framework.recipe {recipe.name} prepare data.path=FILE` "
            f"(see {recipe.dir / 'README.md'} for where to get FILE)")
    want = recipe.expected.get("data") or {}
    for cfg in (cfg for r in runs for cfg in compose_jobs(recipe, r)):
        if getattr(cfg.data, "path", None) is None:
            continue
        try:
            path = resolve_path(cfg.data.path, key="data.path")
        except DataError as e:
            raise DataError(f"{e}; build it with {hint}" if recipe.spec.get("prepare") else str(e)) from None
        meta_file, meta = read_meta(path)
        off = [k for k in ("source_sha256", "train_tokens", "val_tokens")
               if k in want and meta.get(k, want[k]) != want[k]]
        if off:
            raise DataError(f"data.path {path} was built from {meta.get('source', 'another file')} "
                            f"({', '.join(f'{k} {meta[k]}' for k in off)} in {meta_file}), not the reference's "
                            f"({', '.join(f'{k} {want[k]}' for k in off)}); build it from the reference text "
                            f"with {hint}")


def _config_fill(recipe: Recipe, run0: list[str]) -> dict:
    """``{cfg.KEY}`` in a before/after command: KEY's value in the first job's config (overrides,
    --quick's and the user's, included), so e.g. an estimate describes the job that trains."""
    wanted = {m for cmd in (*(recipe.spec.get("before") or []), *(recipe.spec.get("after") or []))
              for a in cmd for m in re.findall(r"(?<!\$)\{(cfg\.[\w.]+)\}", str(a))}
    if not wanted:
        return {}
    # The config as its YAML spells it (optimizer.name, checkpoint.async), so a placeholder takes
    # the keys an override takes, and only values: a group, a list or a method is no command argument.
    tree, fill = compose_jobs(recipe, run0)[0].to_dict(), {}
    for key in sorted(wanted):
        parent, _, leaf = key.partition(".")[2].rpartition(".")
        node = get_key(tree, parent) if parent else tree
        if not isinstance(node, dict) or leaf not in node:
            raise RecipeError(f"{recipe.dir / 'recipe.yaml'}: {{{key}}} names no key of the job's config")
        value = node[leaf]
        if isinstance(value, (dict, list, tuple)):
            raise RecipeError(f"{recipe.dir / 'recipe.yaml'}: {{{key}}} is a section or a list of the job's "
                              f"config, not one value; name a key with one value, e.g. {{cfg.train.micro_batch}}")
        fill[key] = json.dumps(value) if isinstance(value, (bool, type(None))) else str(value)
    return fill


def _checked_section(recipe: Recipe, out: Path, quick: bool | None) -> tuple[bool, float | None]:
    """What ``check DIR`` re-checks against: the quick section or the full one, the run's own (its
    checks.json), so a re-check never replaces the verdict of one section with the other's, nor one
    recipe's with another's; and the run's own elapsed_s, kept."""
    try:
        before = json.loads((out / "checks.json").read_text())
    except (OSError, ValueError):
        before = {}
    before = before if isinstance(before, dict) else {}
    name = before.get("recipe")
    if isinstance(name, str) and name != recipe.name:
        raise RecipeError(f"{out} holds a run of recipe {name} (its checks.json), not of {recipe.name}; "
                          f"check it with `python -m framework.recipe {name} check {out}`")
    ran = before.get("quick")
    if isinstance(ran, bool) and quick is not None and quick != ran:
        raise RecipeError(f"{out} holds a {'quick' if ran else 'full'} run (its checks.json); check it "
                          f"{'with' if ran else 'without'} --quick")
    took = before.get("elapsed_s")
    took = took if isinstance(took, (int, float)) and not isinstance(took, bool) else None
    return (ran if isinstance(ran, bool) else bool(quick)), took


def _fill(arg, fill: dict) -> str:
    # Not str.format: overrides may hold Hydra's ${...} interpolations, left as they are.
    return re.sub(r"(?<!\$)\{([\w.]+)\}", lambda m: fill.get(m[1], m[0]), str(arg))


def _commands(recipe: Recipe, when: str, fill: dict) -> list[tuple[str, str, list[str]]]:
    """recipe.yaml's commands ``before`` or ``after`` the jobs: (log name, what to print, command)."""
    cmds = [[a for a in (_fill(a, fill) for a in cmd) if a != ""] for cmd in recipe.spec.get(when) or []]
    return [(f"{when}{i}", " ".join(cmd), cmd) for i, cmd in enumerate(cmds)]   # (an empty {quick} dropped out)


def _run_logged(cmd: list[str], log: Path, stream) -> None:
    # The jobs import this very package, whatever the working directory.
    path = [str(PACKAGE_DIR.parent), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    tail: deque[str] = deque(maxlen=8)
    with os.fdopen(files.open_nofollow(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), "w") as f, subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(path)}) as p:
        for line in p.stdout:
            f.write(line)
            stream.write(line)
            tail.append(line.rstrip())
    if p.returncode != 0:
        raise RecipeError(f"a run failed (exit {p.returncode}); its log: {log}; last lines:\n  " + "\n  ".join(tail))


def finish(recipe: Recipe, out: Path, *, quick: bool, elapsed_s: float | None = None, stream=None) -> dict:
    """Report, extra plots and checks of a finished (or re-checked) output folder."""
    stream = stream or sys.stdout
    # Only this run's own job folders (run() names them): not an earlier run's below --out.
    res = report.write_report(out, title=f"{recipe.name}{' (quick)' if quick else ''}", pattern=JOB_DIRS)
    jobs = res["jobs"]
    want = recipe.checks(quick)
    results = evaluate(jobs, want, out)
    plots = [str(p) for p in res["plots"]]
    ref = next((c for c in want.get("checks", []) if "curves_match" in c), None)
    for kind in recipe.spec.get("plots") or []:   # (find allows only these two)
        if kind == "memory_scaling":
            plots.append(str(report.plot_memory_scaling(jobs, out / "memory_scaling.png")))
        elif ref is not None:
            plots.append(str(report.plot_deviation(jobs, ref["curves_match"], ref.get("reference", {}),
                                                   out / "deviation.png")))
    verdict = {"recipe": recipe.name, "quick": quick, "out": str(out), "passed": all(r["passed"] for r in results),
               "checks": results, "elapsed_s": elapsed_s, "report": str(res["report"]), "plots": plots,
               "reference": recipe.expected.get("reference")}
    files.write_atomic(out / "checks.json", (json.dumps(verdict, indent=2) + "\n").encode())
    print(res["table"], end="", file=stream)
    for r in results:
        print(f"{'ok  ' if r['passed'] else 'FAIL'} {r['message']}", file=stream)
    took = f" in {elapsed_s:.0f} s" if elapsed_s is not None else ""
    print(f"[recipe {recipe.name}] {'passed' if verdict['passed'] else 'FAILED'}{took}; report: {res['report']}",
          file=stream, flush=True)
    return verdict


def evaluate(jobs, want: dict, out: Path | None = None) -> list[dict]:
    """Each check's verdict with the numbers behind it (the kinds of check: recipes/README.md)."""
    validate_checks(want)
    results = []
    done = [j for j in jobs if j.summary is not None]
    failed = [j for j in jobs if j.summary is None]
    n = want.get("jobs")
    if n is not None or failed:
        ok = not failed and (n is None or len(done) == n)
        msg = f"jobs finished: {len(done)}" + (f" (expected {n})" if n is not None else "")
        if failed:
            msg += f"; without summary.json: {', '.join(j.dir.name for j in failed)}"
        results.append({"check": "jobs", "passed": ok, "message": msg, "finished": len(done), "expected": n})
    kinds = {"metric": _metric, "curves_match": _curves, "memory_scaling": _memory,
             "file": lambda _, c: _file(out, c)}
    for c in want.get("checks", []):
        results.append(kinds[next(k for k in kinds if k in c)](done, c))
    return results


def _metric(jobs, c: dict) -> dict:
    key, where = c["metric"], c.get("where") or {}
    rows = [(j, _value(j, key)) for j in jobs if matches(j, where)]
    head = f"{key} {_bound(c)}" + (f" where {where}" if where else "")
    if not rows:
        return {"check": c, "passed": False, "message": f"{head}: no job matches"}
    bad = "; ".join(f"{j.label} has {_num(v)}" for j, v in rows if not _bound_ok(v, c))
    values = ", ".join(f"{j.label}: {_num(v)}" for j, v in rows)
    return {"check": c, "passed": not bad, "message": f"{head}: {bad or values}",
            "values": {j.label: v for j, v in rows}}


def _value(job, key: str):
    if key.startswith(("min:", "drop:")):
        kind, name = key.split(":", 1)
        vals = [v for v in job.curve(name)[1] if isinstance(v, (int, float)) and not math.isnan(v)]
        if not vals:
            return None
        # drop: how far the curve fell below its first logged value (0 for a model that learns nothing)
        return min(vals) if kind == "min" else vals[0] - min(vals)
    return get_key(job.summary, key)


def _num(v) -> str:
    return f"{v:.4f}" if isinstance(v, float) else str(v)


def _curves(jobs, c: dict) -> dict:
    key, ref_where = c["curves_match"], c.get("reference") or {}
    atol, rtol = float(c.get("atol", 0.0)), float(c.get("rtol", 0.0))
    refs = [j for j in jobs if matches(j, ref_where)]
    if len(refs) != 1:
        return {"check": c, "passed": False,
                "message": f"{key} curves: {len(refs)} jobs match the reference {ref_where} (need exactly 1)"}
    ref = refs[0]
    rsteps, rvals = ref.curve(key)
    worst, failures = {}, []
    for j in (j for j in jobs if j is not ref):
        steps, vals = j.curve(key)
        rows = list(zip(steps, vals, rvals))
        # NaN compares false with every tolerance: a non-finite value on either side is a failure.
        bad = [(s, a, b) for s, a, b in rows if not (_finite(a) and _finite(b))]
        if steps != rsteps or not steps:
            failures.append(f"{j.label} logged {key} at steps {steps[:5]}... vs the reference's {rsteps[:5]}...")
        elif bad:
            s0, a0, b0 = bad[0]
            who, v = (j.label, a0) if _finite(b0) else (f"the reference ({ref.label})", b0)
            failures.append(f"{who} logged {key} {v} at step {s0} ({j.label}: {a0}, reference: {b0})")
        else:
            d, s, a, b = max((abs(a - b), s, a, b) for s, a, b in rows)
            worst[j.label] = d
            over = [(s, a, b) for s, a, b in rows if abs(a - b) > atol + rtol * abs(b)]
            if over:
                s0, a0, b0 = over[0]
                failures.append(f"{j.label} first differs at step {s0}: {a0:.8f} vs {b0:.8f} "
                                f"(|diff| {abs(a0 - b0):.2e}; largest {d:.2e} at step {s})")
    tol = f"atol {atol:g}" + (f" + rtol {rtol:g}" if rtol else "")
    head = f"{key} curves equal the reference ({ref.label}) at {len(rsteps)} steps within {tol}"
    tail = "; ".join(failures) if failures else f"largest |diff| {max(worst.values(), default=0.0):.2e}"
    return {"check": c, "passed": not failures, "message": f"{head}: {tail}", "max_abs_diff": worst}


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _bound(c: dict) -> str:
    """Every bound ``_bound_ok`` enforces, so a failing check says which one it failed."""
    parts = [f"{op} {c[k]}" for k, op in (("min", ">="), ("max", "<=")) if k in c]
    if "equals" in c:
        parts.append(f"== {c['equals']}" + (f" ± {c['tol']}" if c.get("tol") else ""))
    return " and ".join(parts)


def _bound_ok(v, c: dict) -> bool:
    """``v`` within the check's ``min``/``max``/``equals`` (± ``tol``); flags and strings only equal."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return "equals" in c and v == c["equals"]
    return (not math.isnan(v) and c.get("min", -math.inf) <= v <= c.get("max", math.inf)
            and ("equals" not in c or abs(v - c["equals"]) <= c.get("tol", 0)))


def _file(out: Path | None, c: dict) -> dict:
    path = Path(out or ".") / c["file"]
    head = f"{c['file']}: {c['key']} {_bound(c)}"
    if not path.is_file():
        return {"check": c, "passed": False, "message": f"{head}: {path} was not written"}
    try:
        v = get_key(json.loads(path.read_text()), c["key"])
    except ValueError as e:   # e.g. a command killed while writing it
        return {"check": c, "passed": False, "message": f"{head}: {path.name} is malformed ({first_line(e)})"}
    return {"check": c, "passed": _bound_ok(v, c), "message": f"{head}: {_num(v)}", "value": v}


def _memory(jobs, c: dict) -> dict:
    """What a stage saves per rank from the smallest to the largest world size, measured, against
    what the ZeRO formula says it saves (the constant part of a rank's memory cancels out)."""
    stage = c["memory_scaling"]
    sel = sorted((j for j in jobs if matches(j, {"stage": stage})
                  and ("worlds" not in c or j.summary["world"] in c["worlds"])), key=lambda j: j.summary["world"])
    if len({j.summary["world"] for j in sel}) < 2:
        return {"check": c, "passed": False, "message": f"{stage} memory scaling: need jobs at 2 world sizes, "
                                                        f"got {[j.summary['world'] for j in sel]}"}
    lo, hi = sel[0], sel[-1]
    wl, wh = lo.summary["world"], hi.summary["world"]
    prec = lo.summary["config"]["precision"]["name"]
    saved = (measured_memory(lo) - measured_memory(hi)) / MiB
    f_saved = (zero_model_state_bytes(stage, lo.summary["params"], wl, prec)
               - zero_model_state_bytes(stage, hi.summary["params"], wh, prec)) / MiB
    head = (f"{stage}: per-rank memory saved from world {wl} to {wh}: measured {saved:,.0f} MiB, "
            f"ZeRO formula {f_saved:,.0f} MiB")
    if f_saved <= 0:   # replicated: nothing to save; the measured change must stay small
        limit = float(c["max_change"]) * measured_memory(lo) / MiB
        return {"check": c, "passed": abs(saved) <= limit, "saved_mib": saved,
                "message": f"{head}; |change| at most {limit:,.0f} MiB ({c['max_change']} of world {wl}'s)"}
    ratio = saved / f_saved
    lo_r, hi_r = float(c.get("min_ratio", 0.0)), float(c.get("max_ratio", math.inf))
    return {"check": c, "passed": lo_r <= ratio <= hi_r, "ratio": ratio, "saved_mib": saved,
            "message": f"{head}; measured/formula {ratio:.2f}, expected in [{lo_r}, {hi_r}]"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m framework.recipe", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("name", nargs="?", help="recipe name (recipes/<name>) or folder")
    ap.add_argument("args", nargs="*", help="[prepare|check DIR] then key=value overrides")
    ap.add_argument("--quick", action="store_true", default=None,
                    help="run the tiny twin (what the test suite runs); check: default, the section the run used")
    ap.add_argument("--out", type=Path, default=None,
                    help="output folder (run) or data file (prepare); default outputs/recipes/<name>/<time>")
    ap.add_argument("--list", action="store_true", help="list the recipes")
    a = ap.parse_intermixed_args(argv)
    try:
        if a.list or not a.name:
            for name in available():
                desc = find(name).spec.get("description", "")
                print(f"{name:24s} {desc.strip().splitlines()[0] if desc else ''}")
            return 0
        recipe = find(a.name)
        args = list(a.args)
        if args and args[0] not in ACTIONS and "=" not in args[0] and not args[0].startswith("~"):
            raise RecipeError(f"unknown action {args[0]!r}{closest_hint(args[0], ACTIONS)}: give one of "
                              f"{', '.join(ACTIONS)} (or none: run), then key=value overrides")
        action = args.pop(0) if args and args[0] in ACTIONS else "run"
        if action == "prepare":
            prepare(recipe, args, a.out)
            return 0
        if action == "check":
            if not args:
                raise RecipeError("check needs the output folder of a finished run: check DIR")
            if len(args) > 1:   # overrides or a second folder would be ignored: the re-check reads what ran
                raise RecipeError(f"check takes one folder (check DIR), not also {' '.join(args[1:])}; overrides "
                                  f"belong to a run, and each folder is checked on its own")
            out = Path(args[0])
            quick, took = _checked_section(recipe, out, a.quick)
            verdict = finish(recipe, out, quick=quick, elapsed_s=took)
        else:
            out = a.out or Path("outputs") / "recipes" / recipe.name / (time.strftime("%Y-%m-%d_%H-%M-%S")
                                                                       + ("-quick" if a.quick else ""))
            verdict = run(recipe, quick=bool(a.quick), overrides=args, out=out)
        return 0 if verdict["passed"] else 1
    except FrameworkError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
