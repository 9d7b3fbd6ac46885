"""A recipe's checks: expected.json's sections validated, then evaluated against a run's jobs
(the kinds of check: recipes/README.md); and the plots a recipe asks for beside the sweep report (a
curve's deviation from a reference job, memory against world size next to the ZeRO paper's formula)."""
from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path

from framework.cli.report import Job, matches, new_figure, save_png
from framework.config.schema import get_key
from framework.core.errors import FrameworkError, first_line
from framework.core.registry import closest_hint
from framework.core.units import MiB
from framework.core.utils import counted

_BOUNDS = {"min", "max", "equals", "tol"}
# Each kind of check (by its first key) and the keys it reads: a misspelled bound would else pass any numbers.
_CHECK_KEYS = {"metric": {"metric", "where"} | _BOUNDS,
               "curves_match": {"curves_match", "reference", "atol", "rtol"},
               "memory_scaling": {"memory_scaling", "worlds", "min_ratio", "max_ratio", "max_change"},
               "file": {"file", "key"} | _BOUNDS}


class RecipeError(FrameworkError):
    """A recipe is malformed, one of its runs failed, or its result is off the expected numbers."""


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


def evaluate(jobs, want: dict, out: Path | None = None) -> list[dict]:
    """Each check's verdict with the numbers behind it (the kinds of check: recipes/README.md)."""
    validate_checks(want)
    results, n = [], want.get("jobs")
    done, failed = [j for j in jobs if j.summary is not None], [j for j in jobs if j.summary is None]
    if n is not None or failed:
        ok = not failed and (n is None or len(done) == n)
        msg = f"jobs finished: {len(done)}" + (f" (expected {n})" if n is not None else "")
        if failed:
            msg += f"; without summary.json: {', '.join(j.dir.name for j in failed)}"
        results.append({"check": "jobs", "passed": ok, "message": msg, "finished": len(done), "expected": n})
    kinds = {"metric": _metric, "curves_match": _curves, "memory_scaling": _memory, "file": lambda _, c: _file(out, c)}
    return results + [kinds[next(k for k in kinds if k in c)](done, c) for c in want.get("checks", [])]


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
            if over := [(s, a, b) for s, a, b in rows if abs(a - b) > atol + rtol * abs(b)]:
                s0, a0, b0 = over[0]
                failures.append(f"{j.label} first differs at step {s0}: {a0:.8f} vs {b0:.8f} "
                                f"(|diff| {abs(a0 - b0):.2e}; largest {d:.2e} at step {s})")
    tol = f"atol {atol:g}" + (f" + rtol {rtol:g}" if rtol else "")
    head = f"{key} curves equal the reference ({ref.label}) at {counted(len(rsteps), 'step')} within {tol}"
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
    """What a stage saves per rank from the smallest to the largest world, measured, against the ZeRO formula's."""
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
    # (rounded to whole MiB as ints: a saving of -0.3 MiB reads 0, not -0)
    head = (f"{stage}: per-rank memory saved from world {wl} to {wh}: measured {round(saved):,} MiB, "
            f"ZeRO formula {round(f_saved):,} MiB")
    if f_saved <= 0:   # replicated: nothing to save; the measured change must stay small
        limit = float(c["max_change"]) * measured_memory(lo) / MiB
        return {"check": c, "passed": abs(saved) <= limit, "saved_mib": saved,
                "message": f"{head}; |change| at most {limit:,.0f} MiB ({c['max_change']} of world {wl}'s)"}
    ratio = saved / f_saved
    lo_r, hi_r = float(c.get("min_ratio", 0.0)), float(c.get("max_ratio", math.inf))
    return {"check": c, "passed": lo_r <= ratio <= hi_r, "ratio": ratio, "saved_mib": saved,
            "message": f"{head}; measured/formula {ratio:.2f}, expected in [{lo_r}, {hi_r}]"}


def zero_model_state_bytes(stage: str, params: int, world: int, precision: str = "fp32") -> float:
    """The ZeRO paper's model-state bytes per rank with Adam: 2 + 2 + 12 bytes per parameter in mixed precision,
    4 + 4 + 8 in fp32; zero1 divides the optimizer share by the world size, zero2 also gradients, zero3 all."""
    p, g, k = (4, 4, 8) if precision == "fp32" else (2, 2, 12)
    per_param = {"ddp": p + g + k, "zero1": p + g + k / world, "zero2": p + (g + k) / world,
                 "zero3": (p + g + k) / world}
    if stage not in per_param:
        raise FrameworkError(f"recipe: no ZeRO formula for stage {stage!r}")
    return per_param[stage] * params


def plot_deviation(jobs: list[Job], key: str, reference: dict, path: Path) -> Path:
    """All jobs' ``key`` curves, and beside them each one's distance from the job matching ``reference``."""
    done = [j for j in jobs if j.records]
    ref = next((j for j in done if matches(j, reference)), None)
    rs, rv = ref.curve(key) if ref is not None else (None, None)
    fig, (a, b) = new_figure((11, 4.2), 2)
    for i, j in enumerate(done):
        steps, vals = j.curve(key)
        a.plot(steps, vals, ls=("-", "--", ":", "-.")[i % 4], color=f"C{i % 10}", lw=1.2, label=textwrap.fill(j.label, 60))
        if j is not ref and rs == steps:   # (no reference: rs is None)
            b.plot(steps, [abs(x - y) for x, y in zip(vals, rv)], color=f"C{i % 10}", lw=1,
                   label=textwrap.fill(j.label, 60))
    a.set(xlabel="step", ylabel=key, title=f"{key}: every job")
    a.legend(fontsize=7)
    b.set_yscale("symlog", linthresh=1e-9)
    b.set(xlabel="step", ylabel=f"|{key} - reference| (0 = identical)",
          title=f"distance from {ref.label if ref else 'reference (missing)'}")
    if b.lines:
        b.legend(fontsize=7)
    return save_png(fig, path)


def measured_memory(j: Job) -> int:
    """Per-rank memory for scaling plots: the device allocator's peak on CUDA, else the largest rank's RSS growth."""
    dev = j.peak("peak_device_allocated_bytes")
    return dev if dev is not None else (j.added() or 0)


def plot_memory_scaling(jobs: list[Job], path: Path) -> Path:
    """Per-rank memory against world size per stage beside the ZeRO formula, and what each saves over the smallest."""
    by_stage: dict[str, list[Job]] = {}
    for j in jobs:
        if j.summary is not None:
            by_stage.setdefault(j.summary["config"]["stage"]["name"], []).append(j)
    fig, (ax, sv) = new_figure((11, 4.5), 2)
    for i, (stage, js) in enumerate(sorted(by_stage.items())):
        js.sort(key=lambda j: j.summary["world"])
        worlds = [j.summary["world"] for j in js]
        color = f"C{i % 10}"
        measured = [measured_memory(j) / MiB for j in js]
        params, precision = js[0].summary["params"], js[0].summary["config"]["precision"]["name"]
        formula = [zero_model_state_bytes(stage, params, w, precision) / MiB for w in worlds]
        ax.plot(worlds, measured, color=color, marker="o", lw=1.5, label=f"{stage} measured")
        ax.plot(worlds, formula, color=color, ls="--", lw=1, label=f"{stage} ZeRO formula")
        sv.plot(worlds, [measured[0] - m for m in measured], color=color, marker="o", lw=1.5, label=f"{stage} measured")
        sv.plot(worlds, [formula[0] - f for f in formula], color=color, ls="--", lw=1, label=f"{stage} formula")
    ticks = sorted({j.summary["world"] for js in by_stage.values() for j in js})
    for a in (ax, sv):
        a.set(xlabel="world size (ranks)", xticks=ticks)
        a.legend(fontsize=7, ncol=2)
    ax.set_ylabel("MiB per rank")
    ax.set_title("per rank: measured (solid) vs model states, ZeRO formula (dashed)", fontsize=9)
    sv.set_ylabel(f"MiB per rank saved vs world size {ticks[0] if ticks else 1}")
    sv.set_title("what partitioning saves: measured (solid) vs formula (dashed)", fontsize=9)
    return save_png(fig, path)
