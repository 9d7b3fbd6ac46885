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
from framework.core.errors import ConfigError, DataError, FrameworkError
from framework.core.paths import PACKAGE_DIR, REPO_ROOT, user_path
from framework.core.registry import closest_hint
from framework.core.utils import plain_text
from framework.cli import fail, hydra_missing, report
from framework.cli.recipe_checks import RecipeError, evaluate, plot_deviation, plot_memory_scaling, validate_checks
from framework.config import compose, have_hydra, override_key, parse_overrides
from framework.config.plainconf import parse as plain_parse
from framework.config.schema import get_key
from framework.data import resolve_path
from framework.data.text import prepare_chars
from framework.data.tokens import check_tokens, meta_path, read_meta

RECIPES_DIR = REPO_ROOT / "recipes"
ACTIONS = ("run", "prepare", "check")
JOB_DIRS = "run*-job*"   # the job folders of a recipe's run in its output folder (hydra.sweep.subdir)
_SPEC_KEYS = {"description", "runs", "quick", "prepare", "plots", "before", "after", "requires"}
_REQUIRES = {"cuda"}   # what the full run needs of the machine (the quick twin runs anywhere)


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


def find(name: str) -> Recipe:
    """A recipe by name (``recipes/<name>``) or by folder path."""
    d = next((d for d in (Path(user_path(name)), RECIPES_DIR / name) if (d / "recipe.yaml").is_file()), None)
    if d is None and (other := _not_a_recipe(name)):
        raise RecipeError(other)
    if d is None:
        raise RecipeError(f"no recipe '{name}'{closest_hint(name, available())}; available: {', '.join(available()) or 'none'} "
                          f"(or give a folder with recipe.yaml, config.yaml and expected.json)")
    for f in ("config.yaml", "expected.json"):
        if not (d / f).is_file():
            raise RecipeError(f"recipe {d} has no {f}")
    try:
        spec = files.parse_yaml((d / "recipe.yaml").read_text()) or {}
    except yaml.YAMLError as e:
        raise RecipeError(f"{d / 'recipe.yaml'} is not valid YAML ({' '.join(str(e).split())})") from None
    except ValueError as e:
        raise RecipeError(f"{d / 'recipe.yaml'}: {e}") from None
    if not isinstance(spec, dict):
        raise RecipeError(f"{d / 'recipe.yaml'} is not a mapping (runs:, quick:, ...) but a {type(spec).__name__}")

    def refuse_unknown(what: str, given, allowed: set) -> None:
        if extra := set(given or []) - allowed:
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


def _not_a_recipe(name: str) -> str | None:
    """What a folder of recipes/ without recipe.yaml is (its README's title), pointing at its README for how it runs
    (its commands need arguments or a launcher of their own: a command made up here would run it wrongly)."""
    d = next((c for c in (RECIPES_DIR / name, Path(user_path(name)))
              if name and c.resolve().parent == RECIPES_DIR.resolve() and (c / "README.md").is_file()), None)
    if d is None:
        return None
    d = d.resolve()
    title = d.joinpath("README.md").read_text(errors="replace").partition("\n")[0].lstrip("# ").partition(": ")[2]
    what = ("a script" if (d / f"{d.name}.py").is_file() else "a config" if (d / "config.yaml").is_file()
            else "a folder")
    return (f"recipes/{d.name} is not a recipe framework.recipe runs (it has no recipe.yaml) but {what}"
            f"{f' ({title.strip()})' if title.strip() else ''}; its README says how to run it: {d / 'README.md'}")


def available() -> list[str]:
    return sorted(p.parent.name for p in RECIPES_DIR.glob("*/recipe.yaml"))


def merge_overrides(*groups: list[str]) -> list[str]:
    """Concatenate override lists; a later override of a key replaces an earlier one (Hydra refuses two)."""
    flat = [o for group in groups for o in group]
    last = {override_key(o): i for i, o in enumerate(flat)}
    return [o for i, o in enumerate(flat) if last[override_key(o)] == i]


def compose_jobs(recipe: Recipe, overrides: list[str]):
    """Every job's typed config for one run's overrides (sweeps expanded): fails before any run."""
    jobs, *_ = _sweep_jobs()(["-m", *[_fill(o, {"recipe": str(recipe.dir)}) for o in overrides]])
    return [compose(job, config_dir=str(recipe.dir), config_name="config") for job in jobs]


def _sweep_jobs():
    """train's sweep expansion; without Hydra, the one line naming it and how to install it."""
    try:
        from framework.cli.train import _jobs   # (Hydra's import: only where a recipe runs)
    except ModuleNotFoundError as e:
        raise ConfigError(hydra_missing(e, "recipe")) from None
    return _jobs


def _source(override: str) -> str:
    """data.path's value parsed as train's is (Hydra's grammar, else plainconf's); an interpolation resolved on its
    own (``${oc.env:..}``: no config is composed here); anything but one value is one line."""
    value = parse_overrides([override])[0].value() if have_hydra() else plain_parse(override).value
    if value is None or not isinstance(value, (str, int, float)):   # a sweep (a,b), a list ([a]), null, a dict
        raise RecipeError(f"{override}: prepare takes one file: data.path=FILE (quote a path with a comma: "
                          "data.path='a,b'; a sweep, -m, is not run here)")
    if "${" not in str(value):   # (a number: its str, as train's str key takes it)
        return str(value)
    from omegaconf import OmegaConf   # (here: the commands run without Hydra, and an interpolation needs it)
    from omegaconf.errors import OmegaConfBaseException

    try:
        return str(OmegaConf.create({"path": value}).path)
    except OmegaConfBaseException as e:
        raise RecipeError(f"{override}: cannot resolve it here ({str(e).splitlines()[0]}); only ${{oc.env:..}} is "
                          "resolved (not the config's keys): give the file's path") from None


def prepare(recipe: Recipe, overrides: list[str], out: Path | None = None) -> dict:
    """Build the recipe's data set from ``data.path`` (default: ``prepare.source``) into the file it trains on."""
    spec = recipe.spec.get("prepare")
    if not spec:
        raise RecipeError(f"recipe {recipe.name} has no prepare step (its data needs none)")
    if spec.get("kind") != "chars":
        raise RecipeError(f"{recipe.dir / 'recipe.yaml'}: prepare.kind must be 'chars', got {spec.get('kind')!r}")
    # (data.path without "=FILE", or deleted with ~, names no text either)
    if rest := [o for o in overrides if override_key(o) != "data.path" or o.startswith("~") or not o.partition("=")[2]]:
        raise RecipeError(f"prepare takes only data.path=FILE (the text to encode), got {' '.join(rest)}")
    source = _source(overrides[-1]) if overrides else spec.get("source")
    # The run it trains: its file and the context each split must exceed (without Hydra, given --out: unchecked).
    job = compose_jobs(recipe, list(recipe.spec["runs"][0]))[0] if out is None or have_hydra() else None
    out = Path(user_path(str(out if out is not None else job.data.path)))
    meta = prepare_chars(source, out, context=job.model.context if job is not None else None)
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
    _sweep_jobs()   # Hydra, which every run needs, named first (docs/gpu.md); then the report's optional extra:
    report.require_matplotlib()   # (the report's plots, after every job)
    if not quick and recipe.spec.get("requires") == "cuda" and gpu_count() == 0:
        # (on the CPU its full run would go on for hours and then fail the GPU's expected numbers)
        raise RecipeError(f"recipe {recipe.name} needs a CUDA GPU (its recipe.yaml: requires: cuda) and torch sees "
                          f"none here; run it on a machine with one, or its CPU twin with --quick")
    # A second run into a folder holding a run's results would resume or overwrite its jobs: refused. One whose
    # run stopped before its first job made a folder (checks.json's start record alone) holds none: reused.
    if out.is_dir() and (any(out.glob(JOB_DIRS)) or ((out / "checks.json").exists() and not _started(out))):
        raise RecipeError(f"--out {out} already holds a recipe's results (run*-job* folders or checks.json); "
                          f"pass a new folder with --out, or re-check it with `check {out}`")
    # The recipe places its jobs (hydra.sweep.dir={out}, subdir run<i>-job<n>, which finish reads).
    if placed := next((o for o in overrides if override_key(o) in ("hydra.sweep.dir", "hydra.sweep.subdir")), None):
        raise RecipeError(f"{placed}: a recipe writes its jobs into --out DIR (as run<i>-job<n>); use --out DIR "
                          f"instead of {override_key(placed)}")
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
        if log == jobs[0][0]:
            # What ran, recorded as its first job starts: `check DIR` of a run stopped before its checks (a failed
            # job, Ctrl-C) takes its section; a failed `before` command leaves the folder free for a rerun.
            files.write_atomic(out / "checks.json", json.dumps({"recipe": recipe.name, "quick": quick,
                                                               "out": str(out), "passed": None}).encode())
        print(f"[recipe {recipe.name}] {say}", file=stream, flush=True)
        _run_logged(cmd, out / f"{log}.log", stream)
    return finish(recipe, out, quick=quick, elapsed_s=time.perf_counter() - t0, stream=stream)


def _started(out: Path) -> bool:
    """``out``'s checks.json is the record a run writes as its first job starts (no verdict yet)."""
    try:
        record = files.parse_json((out / "checks.json").read_bytes())
    except (OSError, ValueError):
        return False
    return isinstance(record, dict) and "passed" in record and record["passed"] is None


def _check_data(recipe: Recipe, runs: list[list[str]]) -> None:
    """Every job's data file is there and was built (its ``<stem>.meta.json``) from the text expected.json's ``data``
    names: one from another text would train for nothing, then fail."""
    hint = (f"`python -m framework.recipe {recipe.name} prepare data.path=FILE` "
            f"(see {recipe.dir / 'README.md'} for where to get FILE)")
    want, seen = recipe.expected.get("data") or {}, set()
    for cfg in (cfg for r in runs for cfg in compose_jobs(recipe, r)):
        if getattr(cfg.data, "path", None) is None:
            continue
        try:
            path = resolve_path(cfg.data.path)
        except DataError as e:
            raise DataError(f"{e}; build it with {hint}" if recipe.spec.get("prepare") else str(e)) from None
        if path in seen:   # (the jobs of a sweep share a file: read and maybe hashed once)
            continue
        seen.add(path)
        check_tokens(path)   # (the run's own test of the file against its metadata, before any job starts)
        meta_file, meta = read_meta(path)
        off = [k for k in ("source_sha256", "train_tokens", "val_tokens")
               if k in want and meta.get(k, want[k]) != want[k]]
        if off:
            raise DataError(f"data.path {path} was built from {meta.get('source', 'another file')} "
                            f"({', '.join(f'{k} {meta[k]}' for k in off)} in {meta_file}), not the reference's "
                            f"({', '.join(f'{k} {want[k]}' for k in off)}); build it from the reference text "
                            f"with {hint}")


def _config_fill(recipe: Recipe, run0: list[str]) -> dict:
    """``{cfg.KEY}`` in a before/after command: KEY's value in the first job's config (all overrides included)."""
    wanted = {m for cmd in (*(recipe.spec.get("before") or []), *(recipe.spec.get("after") or []))
              for a in cmd for m in re.findall(r"(?<!\$)\{(cfg\.[\w.]+)\}", str(a))}
    if not wanted:
        return {}
    tree, fill = compose_jobs(recipe, run0)[0].to_dict(), {}   # keys as an override spells them
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


def _check_folder(recipe: Recipe, out: Path) -> None:
    """``check DIR``'s folder is a recipe run's --out holding at least one job folder."""
    if not out.is_dir():
        raise RecipeError(f"check DIR: {out} is not a folder; pass a recipe run's --out folder "
                          f"(e.g. outputs/recipes/{recipe.name}/<time>)")
    if not any(out.glob(JOB_DIRS)) and _started(out):
        raise RecipeError(f"check DIR: {out} holds no job folder ({JOB_DIRS}): its run stopped before its first "
                          f"job started (its run*.log say why); run the recipe again with --out {out}")


def _checked_section(recipe: Recipe, out: Path, quick: bool | None) -> tuple[bool | None, float | None]:
    """The section (quick or full) ``check DIR`` re-checks, the run's own (its checks.json: a re-check never
    replaces a verdict with another section's or recipe's; None where neither it nor --quick says), and elapsed_s."""
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
    return (ran if isinstance(ran, bool) else quick), took


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


def finish(recipe: Recipe, out: Path, *, quick: bool | None, elapsed_s: float | None = None, stream=None) -> dict:
    """Report, extra plots and checks of a finished (or re-checked) output folder; ``quick`` None: unknown (the
    full section is checked, recorded as null)."""
    stream = stream or sys.stdout
    # Only this run's own job folders (run() names them): not an earlier run's below --out.
    res = report.write_report(out, title=f"{recipe.name}{' (quick)' if quick else ''}", pattern=JOB_DIRS)
    jobs = res["jobs"]
    want = recipe.checks(bool(quick))
    results = evaluate(jobs, want, out)
    plots = [str(p) for p in res["plots"]]
    ref = next((c for c in want.get("checks", []) if "curves_match" in c), None)
    for kind in recipe.spec.get("plots") or []:   # (find allows only these two)
        if kind == "memory_scaling":
            plots.append(str(plot_memory_scaling(jobs, out / "memory_scaling.png")))
        elif ref is not None:
            plots.append(str(plot_deviation(jobs, ref["curves_match"], ref.get("reference", {}),
                                            out / "deviation.png")))
    verdict = {"recipe": recipe.name, "quick": quick, "out": str(out), "passed": all(r["passed"] for r in results),
               "checks": results, "elapsed_s": elapsed_s, "report": str(res["report"]), "plots": plots,
               "reference": recipe.expected.get("reference")}
    files.write_atomic(out / "checks.json", (json.dumps(verdict, indent=2) + "\n").encode())
    print(res["table"], end="", file=stream)
    for r in results:
        print(f"{'ok  ' if r['passed'] else 'FAIL'} {r['message']}", file=stream)
    if quick is None:
        print(f"[recipe {recipe.name}] {out} records no section (quick or full): checked against the full run's; "
              f"`check {out} --quick` checks the twin's", file=stream)
    took = f" in {elapsed_s:.0f} s" if elapsed_s is not None else ""
    print(f"[recipe {recipe.name}] {'passed' if verdict['passed'] else 'FAILED'}{took}; report: {res['report']}",
          file=stream, flush=True)
    return verdict


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m framework.recipe", description=plain_text(__doc__.split("\n\n")[0]),
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
            _check_folder(recipe, out)
            quick, took = _checked_section(recipe, out, a.quick)
            verdict = finish(recipe, out, quick=quick, elapsed_s=took)
        else:
            out = a.out or Path("outputs") / "recipes" / recipe.name / (time.strftime("%Y-%m-%d_%H-%M-%S")
                                                                       + ("-quick" if a.quick else ""))
            verdict = run(recipe, quick=bool(a.quick), overrides=args, out=out)
        return 0 if verdict["passed"] else 1
    except FrameworkError as e:
        return fail(e, 2)
