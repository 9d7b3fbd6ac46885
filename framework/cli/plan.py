"""Plan a run: every stage x offload x micro-batch x activation-checkpointing setup that fits, fastest first.

    python -m framework.plan model=gpt2-medium                          # hardware detected
    python -m framework.plan model=gpt-1b gpu_mem=80G cpu_mem=512G nvme=2T ranks=8
    python -m framework.plan model=gpt-mini precision=bf16 train.micro_batch=16 --top 10
    python -m framework.plan model=gpt-mini --verify 3                  # run the top 3, compare
    python -m framework.plan ... --reprobe                              # measure the bandwidths again

Each candidate splits the composed config's global batch (``train.micro_batch x train.grad_accum x ranks``)
into micro batches. ``micro_batches=1,2,4``, ``stages=``, ``offloads=`` and ``checkpointing=true,false``
restrict the search; so do a stage or offload chosen on the command line or by a ``ds_config=`` file (the
chosen one's keys, as in ``offload=cpu offload.ratio=0.5``, go to each of its candidates),
``model.activation_checkpointing=``, and a file's fixed micro batch or accumulation (not "auto"). Sizes:
``80G`` = ``80GiB`` (2^30 bytes each), ``80GB`` (10^9), or bytes (``nvme=0``: no NVMe). Memory per rank
is ``framework.estimate``'s prediction; step time is a roofline over bandwidths a short probe measures once
on this machine (cached; on a host without CUDA, ``gpu_mem=`` checks memory against those GPUs, but the times
are this CPU's). Ties keep the Hugging Face DeepSpeed guide's order. ``--json`` adds the plan (or, with
``--verify``, the comparison) as one JSON line. ``--verify K`` runs the top K for ``steps=`` steps (default 6)
as one Hydra multirun and prints predicted against measured step time and peak memory. The host column is the
node's: every rank's process and, with more than one rank, the launcher's. When no setup fits, one line names
the closest and what it needs (exit code 2). More in docs/estimate.md.
"""
from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from framework.cli import RANK_NAMES, run_command
from framework.cli.estimate import model_kind
from framework.cli.report import load_jobs
from framework.config import check_model_vocab, compose, override_key
from framework.config.dsconfig import DS_FILE
from framework.core.errors import ConfigError, FrameworkError
from framework.core.paths import user_path
from framework.core.registry import closest_hint, registry
from framework.core.room import nearest_existing
from framework.core.units import GB, GiB, MiB
from framework.core.utils import counted
from framework.memory import probe as _probe
from framework.memory.model import data_vocab
from framework.memory.planner import (NO_NVME, Candidate, Hardware, Planned, candidates, compose_setups, detect,
                                      micro_batches, plan, unmodelled)
from framework.memory.tables import parse_count

# Other tools' names for the rank count (estimate's gpus_per_node, torchrun's nproc, world size) and node count.
ALIASES = {**dict.fromkeys((*RANK_NAMES, "gpus_per_node"), "ranks"),
           **dict.fromkeys(("nodes", "nnodes", "num_nodes"), ("ranks", "ranks = gpus_per_node x nodes"))}
OWN_KEYS = ("model", "gpu_mem", "cpu_mem", "nvme", "ranks", "micro_batches", "stages", "offloads",
            "checkpointing", "steps")
# What each candidate's ``+plan=cN`` file sets: verify's jobs leave the command line's out (they would win).
CANDIDATE_KEYS = ("train.micro_batch", "train.grad_accum", "model.activation_checkpointing")


def verify(planned: list[Planned], k: int, base_overrides: list[str], hw: Hardware, steps: int,
           from_file: frozenset[str] = frozenset(), pinned: frozenset[str] = frozenset()) -> list[dict]:
    """Run the top ``k``; ``from_file``: the groups the DeepSpeed file chooses (left to it in the jobs' plan files);
    ``pinned``: the batch keys it fixes, whose command-line values stay in the jobs."""
    top = [p for p in planned if p.fits][:k]
    base_overrides = [o for o in base_overrides if (override_key(o) not in CANDIDATE_KEYS or override_key(o) in pinned)
                      and override_key(o) != "dist.nproc"]   # (the jobs' is hw.ranks, given last)
    with tempfile.TemporaryDirectory(prefix="framework-plan-") as d:
        group, sweep = Path(d) / "search" / "plan", Path(d) / "runs"
        group.mkdir(parents=True)
        for i, p in enumerate(top):
            group.joinpath(f"c{i}.yaml").write_text(_plan_yaml(p.cand, from_file))
        # The plan group on the search path of the up-front check of every job and of each job's own composition.
        cmd = [sys.executable, "-m", "framework.train", "-m", "--config-dir", str(group.parent),
               f"hydra.searchpath=[file://{group.parent}]",
               "+plan=" + ",".join(f"c{i}" for i in range(len(top))), *base_overrides,
               f"train.steps={steps}", "train.log_every=1", "train.eval_every=0", "train.eval_batches=1",
               "logger=none", f"dist.nproc={hw.ranks}", f"hydra.sweep.dir={sweep}"]
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode != 0:
            last = (run.stderr.strip().splitlines() or [f"exit code {run.returncode}"])[-1]
            raise FrameworkError(f"plan --verify: the multirun failed: {last}")
        results = []
        for p, job in zip(top, load_jobs(sweep)):
            train, model = job.summary["config"]["train"], job.summary["config"]["model"]
            tokens = train["micro_batch"] * train["grad_accum"] * job.summary["world"] * model["context"]
            tps = job.curve("tokens_per_s")[1][1:]   # the first step warms up
            device = job.peak("peak_device_allocated_bytes")   # None on a CPU run: the process's peak instead
            key = "peak_rss_bytes" if device is None else "peak_device_allocated_bytes"
            ran = {"micro_batch": train["micro_batch"], "grad_accum": train["grad_accum"],
                   "checkpointing": model["activation_checkpointing"]}
            results.append({"candidate": p.cand, "ran": ran, "predicted_s": p.time["total"],
                            "measured_s": statistics.median(tokens / t for t in tps),
                            "predicted_peak": p.device_peak, "measured_peak": job.peak(key), "measured_kind": key})
    return results


def _plan_yaml(c: Candidate, from_file: frozenset[str] = frozenset()) -> str:
    # A group the DeepSpeed file chooses, it chooses again in each job (a second choice: a duplicate default).
    defaults = [f"  - /stage: {c.stage}"] if "stage" not in from_file else []
    if c.offload != "none" and "offload" not in from_file:
        defaults.append(f"  - override /offload: {c.offload.split('+')[0]}")
    lines = ["# @package _global_", *(["defaults:", *defaults] if defaults else []),
             "train:", f"  micro_batch: {c.micro_batch}", f"  grad_accum: {c.grad_accum}", "model:",
             f"  activation_checkpointing: {str(c.checkpointing).lower()}"]
    if c.offload == "cpu+params":
        lines += ["offload:", "  params: cpu"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    flags = {"top": 20, "verify": 0, "reprobe": False, "json": False}
    return run_command(__doc__, argv, "plan", OWN_KEYS, flags, _run, ALIASES)


def _run(own: dict[str, str], overrides: list[str], flags: dict) -> None:
    if "model" not in own:
        raise ConfigError("plan: give model=NAME (one of our model configs)")
    value, path = own["model"], Path(own["model"])
    kind = model_kind(value)
    # Hugging Face only when it is one (a config.json, a folder holding one, or a Hub name org/model that is not a
    # path here): a mistyped path to one of our YAMLs, or any other folder, is an unknown name with a hint.
    hub = kind == "hf" and value.count("/") == 1 and not path.exists() and not value.startswith((".", "/", "~"))
    if value == "hf" or (path.suffix == ".json" and path.is_file()) or (path / "config.json").is_file() or hub:
        # before its config's own refusals (and the probe)
        raise ConfigError(f"plan: Hugging Face models (model={own['model']}) are not planned: its step-time model "
                          "reads our GPT's keys (model.d_model, n_layer); python -m framework.estimate predicts their "
                          "memory per rank")
    # Each setup, and --verify's runs, compose model=NAME: a name of ours (the shared line would point to model=hf).
    names = sorted(n for n in registry("model").names() if n != "hf")
    if kind == "yaml":
        raise ConfigError(f"plan: model={own['model']}: plan takes a model's name ({', '.join(names)}); copy the "
                          "file into conf/model/ as gpt-NAME.yaml (a GPT model there is a file named gpt*.yaml) and "
                          "give model=gpt-NAME, or give a preset and model.* keys (model=gpt-mini model.n_layer=8); "
                          "python -m framework.estimate predicts a model YAML's memory per rank")
    if own["model"] not in names:
        raise ConfigError(f"plan: unknown model {value!r}{closest_hint(path.stem, names)}; plan takes one "
                          f"of {', '.join(names)}")
    if "steps" in own and not flags["verify"]:
        raise ConfigError("plan: steps= sets the length of the --verify runs; add --verify K or drop steps=")
    if not (steps := own.get("steps", "6")).isdigit() or int(steps) < 2:   # the first step warms up and is not measured
        raise ConfigError(f"plan: steps={steps!r} must be a whole number >= 2")
    overrides, keys, given = _given_setup(overrides)
    cfg = compose([f"model={own['model']}", *overrides])
    base = [f"model={own['model']}", *overrides, *keys]   # each candidate's, with its stage and offload
    disk = _disk_dir(cfg, base)
    if any(override_key(o) == "dist.nproc" for o in overrides):   # the ranks to plan for, as ranks= gives them
        if "ranks" in own and parse_count(own["ranks"], "plan: ranks", whole=True) != cfg.dist.nproc:
            raise ConfigError(f"plan: dist.nproc={cfg.dist.nproc} and ranks={own['ranks']} differ; give one of them")
        own = {**own, "ranks": str(cfg.dist.nproc)}
    hw = detect(own, disk)
    # composed for the planned ranks, as each verify job is (a DeepSpeed file's train_batch_size fixes grad_accum)
    ranked = [f"model={own['model']}", *overrides, f"dist.nproc={hw.ranks}"]
    base = [*base, f"dist.nproc={hw.ranks}"]
    cfg = compose(ranked)
    own, notes = _restrict(own, given, cfg, base, overrides)
    own, notes, pinned = _restrict_batch(own, ranked, cfg, notes)
    # (a bad micro_batches= is its line, before the probe)
    notes = [*notes, *micro_batches(cfg, hw, own)[1], *unmodelled(own)]
    # before the probe: a bad micro_batches=, stages=, offloads= or checkpointing=, or a key every setup refuses
    setups = compose_setups(base, candidates(cfg, hw, own))
    check_model_vocab(cfg, size := data_vocab(cfg))   # (data that is not here, or training's refusal: its line now)
    vocab = f"vocab {size} (from data={cfg.choices['data']})"
    if cfg.notices:   # the DeepSpeed file's warnings and notes, as training prints them (after the checks)
        print("\n".join(cfg.notices), file=sys.stderr, flush=True)
    probe = _probe.load(hw.device, disk, collectives=hw.ranks > 1, reprobe=flags["reprobe"])
    planned = plan(cfg, base, hw, own, probe, setups, vocab=size)
    print(_describe(hw, probe, cfg, planned, flags["top"], vocab, notes))
    if flags["json"] and not flags["verify"]:
        print(json.dumps([{**dataclasses.asdict(p.cand), "time": p.time, "device_peak": p.device_peak,
                           "host": p.host, "fits": p.fits, "why": p.why} for p in planned]))
    if not any(p.fits for p in planned):
        raise ConfigError(_none_fits(planned))
    if flags["verify"]:
        rows = verify(planned, flags["verify"], base, hw, int(steps),
                      frozenset(g for g in ("stage", "offload") if cfg.sources.get(f"{g}.name") == DS_FILE), pinned)
        print(f"\nverify: top {len(rows)} as one Hydra multirun ({steps} steps each; "
              f"measured = median s/step after the first)")
        for i, r in enumerate(rows):
            print(f"  {i + 1}. {r['candidate'].label()}  predicted {r['predicted_s']:.3f} s  measured "
                  f"{r['measured_s']:.3f} s   peak predicted {r['predicted_peak'] / MiB:.0f} MiB  "
                  f"measured {r['measured_peak'] / MiB:.0f} MiB ({r['measured_kind']})")
            planned_as = {k: getattr(r["candidate"], k) for k in r["ran"]}
            if r["ran"] != planned_as:   # its measurement is of another setup than the row's prediction
                print(f"     warning: this job ran {_setup(r['ran'])}, not the planned {_setup(planned_as)}: "
                      "its measurement is of another setup")
        if rows and rows[0]["measured_kind"] == "peak_rss_bytes":
            print("  (peak RSS is per process, and a multirun runs its jobs in one: after the first job "
                  "it includes the earlier jobs' peaks)")
        if flags["json"]:
            print(json.dumps([{**r, "candidate": dataclasses.asdict(r["candidate"])} for r in rows]))


def _setup(batch: dict) -> str:
    return (f"micro {batch['micro_batch']} x accum {batch['grad_accum']}"
            f"{' with' if batch['checkpointing'] else ' without'} activation checkpointing")


def _restrict_batch(own: dict[str, str], overrides: list[str], cfg,
                    notes: list[str]) -> tuple[dict, list[str], frozenset[str]]:
    """A DeepSpeed file fixing the micro batch or accumulation (not "auto") restricts the search to the composed
    micro batch, with a note; also the keys so fixed (``verify``'s ``pinned``)."""
    keys = ("train.micro_batch", "train.grad_accum")
    if cfg.ds_config is None:
        return own, notes, frozenset()
    job = cfg   # what a verify job composes: without the command line's batch keys (the candidate's own)
    given = {override_key(o) for o in overrides} & set(keys)
    if given:
        try:
            job = compose([o for o in overrides if override_key(o) not in CANDIDATE_KEYS])
        except ConfigError:   # the file's batch does not compose without them: they are what runs
            job = None
    pinned = frozenset(given if job is None else {k for k in keys if job.sources.get(k) == DS_FILE})
    if not pinned:
        return own, notes, pinned
    micro = cfg.train.micro_batch
    if "micro_batches" in own and [x.strip() for x in own["micro_batches"].split(",")] != [str(micro)]:
        raise ConfigError(f"plan: ds_config={cfg.ds_config} fixes train.micro_batch={micro} (with "
                          f"train.grad_accum={cfg.train.grad_accum}), but micro_batches={own['micro_batches']}; "
                          f"give micro_batches={micro}, or \"auto\" in the file to let plan choose")
    return {**own, "micro_batches": str(micro)}, [
        *notes, f"note: planned only with train.micro_batch={micro} x train.grad_accum={cfg.train.grad_accum} "
                f"(ds_config={cfg.ds_config}{' and the command line' if given & pinned else ''}), as "
                f"micro_batches={micro} would; \"auto\" in the file lets plan choose"], pinned


def _disk_dir(cfg, base: list[str]) -> Path:
    """Where offload=nvme would swap (free bytes, the probe's disk test): the nearest existing folder of
    ``offload.nvme_path``, or cwd."""
    given = [o.partition("=")[2].strip() for o in base if override_key(o) == "offload.nvme_path" and o[0] != "~"]
    path = given[-1] if given else getattr(cfg.offload, "nvme_path", None)
    return Path(os.getcwd()) if path in (None, "", "null") else nearest_existing(Path(user_path(path)))


def _given_setup(overrides: list[str]) -> tuple[list[str], list[str], dict[str, str]]:
    """(the overrides without a stage or offload choice or a key of a chosen one, each candidate's own; those keys,
    which every candidate of that choice gets; the choices, {"stage": ..., "offload": none|cpu|cpu+params|nvme})."""
    chosen = {override_key(o) for o in overrides if not o.startswith("~")} & {"stage", "offload"}
    given, keys, rest = {}, [], []
    for o in overrides:
        name = override_key(o)
        if name in chosen and not o.startswith("~"):
            given[name] = o.partition("=")[2].strip()
        elif name.partition(".")[0] in chosen and "." in name:
            keys.append(o)
        else:
            rest.append(o)
    params = [o for o in keys if override_key(o) == "offload.params"]
    if given.get("offload") == "cpu" and params and params[-1].partition("=")[2].strip() == "cpu":
        given["offload"], keys = "cpu+params", [o for o in keys if o not in params]   # the candidate's own choice
    return rest, keys, given


def _chosen(cfg, group: str) -> str:
    """The stage or offload (none|cpu|cpu+params|nvme) of a composed config, as ``_given_setup`` names it."""
    cpu_params = group == "offload" and cfg.choices[group] == "cpu" and getattr(cfg.offload, "params", None) == "cpu"
    return "cpu+params" if cpu_params else cfg.choices[group]


def _restrict(own: dict[str, str], given: dict[str, str], cfg, base: list[str],
              overrides: list[str]) -> tuple[dict[str, str], list[str]]:
    """A stage or offload chosen on the command line or by the DeepSpeed file, and ``model.activation_checkpointing=``
    on the command line, restrict the search as ``stages=`` / ``offloads=`` / ``checkpointing=`` do, with a note."""
    own, chosen = dict(own), []

    def pin(where: str, group: str, key: str, value: str) -> tuple[str, str]:
        if key in own and [x.strip().lower() for x in own[key].split(",")] != [value]:
            raise ConfigError(f"plan: {where} sets {group}={value}, but {key}={own[key]}; plan tries each of "
                              f"{key}= itself: give one of them")
        own[key] = value
        return f"{group}={value} ({where})", f"{key}={value}"

    def note(chosen: list[tuple[str, str]]) -> str:
        return (f"note: planned only with {' and '.join(c for c, _ in chosen)}, as "
                f"{' '.join(k for _, k in chosen)} would")

    for group, key in (("stage", "stages"), ("offload", "offloads")):
        where, value = "the command line", given.get(group)
        if cfg.sources.get(f"{group}.name") == DS_FILE:
            if value is None:
                where, value = f"ds_config={cfg.ds_config}", _chosen(cfg, group)
            elif value != _chosen(cfg, group):   # the file refuses it (its line now, not each candidate's after
                # the probe), or it is offload=cpu against the file's cpu+params, whose offload_param stands
                choice = ([f"+stage={value}"] if group == "stage" else [f"offload={value.split('+')[0]}"]
                          + ["offload.params=cpu"] * (value == "cpu+params"))
                value = _chosen(compose([*base, *choice]), group)
        if value is not None:
            chosen.append(pin(where, group, key, value))
    notes = [note(chosen)] if chosen else []
    ckpt = [o.partition("=")[2].strip().lower() for o in overrides
            if override_key(o) == "model.activation_checkpointing"]
    if ckpt and ckpt[-1] in ("true", "false"):   # a bad value is the composition's line
        notes.append(note([pin("the command line", "model.activation_checkpointing", "checkpointing", ckpt[-1])]))
    return own, notes


def _closest(planned: list[Planned]) -> Planned | None:
    """The rejected setup closest to fitting (its largest need over what is given the least), None where none of
    them can fit here (it cannot be built, or it needs NVMe where nvme=0 gives none: no smaller need fits 0)."""
    return min((p for p in planned if not p.fits and p.over != float("inf")), key=lambda p: p.over, default=None)


def _none_fits(planned: list[Planned]) -> str:
    """The line for a plan where no setup fits: the one closest to fitting and what it needs."""
    if (p := _closest(planned)) is None:
        if p := next((p for p in planned if NO_NVME in p.why), None):
            return (f"plan: no setup fits: every one buildable here offloads to NVMe, and nvme=0 gives none (e.g. "
                    f"{' '.join(p.cand.label().split())} needs {p.why}): give nvme= its disk space, or plan other "
                    f"offloads= (none, cpu)")
        return f"plan: no setup fits: none can be built here ({planned[0].why})"
    return (f"plan: no setup fits; the closest, {' '.join(p.cand.label().split())}, needs {p.why} (give more "
            f"memory with gpu_mem=, cpu_mem= or nvme=, or choose a smaller model, micro batch or context)")


def _describe(hw: Hardware, probe: dict, cfg, planned: list[Planned], top: int, vocab: str,
              notes: list[str] = ()) -> str:
    gpu = f"{hw.gpu_mem / GiB:.1f} GiB per GPU" if hw.gpu_mem else "no GPU (the host is the device)"
    lines = [f"hardware: {counted(hw.ranks, 'rank')}, {gpu}, {hw.cpu_mem / GiB:.1f} GiB host, "
             f"{hw.nvme / GiB:.0f} GiB disk",
             f"probe ({'measured now' if probe.get('measured_now') else 'cached'}: {probe['cache']}): "
             f"matmul {probe['matmul_flops'] / 1e9:.1f} GFLOP/s, copy {probe['device_copy_bytes_s'] / GB:.1f} GB/s, "
             f"h2d {probe['h2d_bytes_s'] / GB:.1f} GB/s, host optimizer {probe['host_optimizer_params_s'] / 1e6:.0f} "
             f"M params/s, disk w/r {probe['disk_write_bytes_s'] / GB:.2f}/{probe['disk_read_bytes_s'] / GB:.2f} "
             f"GB/s" + (f", all-reduce {probe['allreduce_bytes_s'] / GB:.2f} GB/s"
                        if probe.get("allreduce_bytes_s") else ""),
             f"model {cfg.choices['model']}, {vocab}, precision {cfg.choices['precision']}, "
             f"context {cfg.model.context}", *notes,
             *(["note: no CUDA here: step times are measured on this host's CPU, so they rank these setups "
                "as CPU runs, not on the GPUs gpu_mem= describes (memory fit is for those GPUs)"]
               if hw.gpu_mem is not None and hw.device.type == "cpu" else [])]
    if not (fitting := [p for p in planned if p.fits]):   # (the error line says what the closest setup needs)
        return "\n".join(lines)
    lines += ["", f"  #  {'setup':52s} {'s/step':>8s} {'peak/rank':>11s}  {'host/node':>9s}"]
    lines += [f"{i + 1:3d}  {p.cand.label():52s} {p.time['total']:8.3f} {p.device_peak / GiB:9.2f}Gi "
              f"{p.host / GiB:8.2f}Gi" for i, p in enumerate(fitting[:top])]
    near, last = _closest(planned), planned[-1]   # (none closest: the others cannot fit here, e.g. the last)
    near_text = f"closest to fitting: {' '.join(near.cand.label().split())} ({near.why})" if near else \
        f"the others cannot fit here, e.g. {' '.join(last.cand.label().split())} ({last.why})"
    lines.append(f"({len(fitting)} of {len(planned)} setups fit"
                 + (f"; {near_text}" if len(fitting) < len(planned) else "") + ")")
    return "\n".join(lines)
