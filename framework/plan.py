"""Plan a run: every stage x offload x micro-batch x activation-checkpointing setup that fits, fastest first.

    python -m framework.plan model=gpt2-medium                          # hardware detected
    python -m framework.plan model=gpt-1b gpu_mem=80G cpu_mem=512G nvme=2T ranks=8
    python -m framework.plan model=gpt-mini precision=bf16 train.micro_batch=16 --top 10
    python -m framework.plan model=gpt-mini --verify 3                  # run the top 3, compare
    python -m framework.plan ... --reprobe                              # measure the bandwidths again

The global batch is the composed config's (``train.micro_batch x train.grad_accum x ranks``); each
candidate splits it into micro batches (``micro_batches=1,2,4`` restricts the sizes tried; also
``stages=``, ``offloads=``, ``checkpointing=true,false``). Memory per rank comes from
``framework.estimate``'s prediction (activations traced on the meta device); a candidate fits when
its device peak fits ``gpu_mem`` (on a CPU-only machine: its whole peak, plus the resident set of a
process with torch loaded as the probe measured it, fits ``cpu_mem`` over all ranks)
and its host memory fits ``cpu_mem``. Step time is a roofline over bandwidths measured once by a
short probe (``framework._probe``; cached in the user cache dir): compute at the measured matmul
rate plus the measured fixed cost of each micro step, gradient and parameter collectives at the
measured all-reduce bandwidth, the optimizer step at the measured host (or device memory) rate,
host<->device copies, disk.
Ties keep the Hugging Face DeepSpeed guide's order (ZeRO-1 > 2 > 2+offload > 3 > 3+offload
optimizer > 3+offload params; no checkpointing before checkpointing; larger micro batches first).
``--json`` adds the plan (or, with ``--verify``, the comparison) as one JSON line.
``--verify K`` runs the top K for a few steps as one Hydra multirun (``+plan=cN`` configs written to a
temporary search path) and prints predicted against measured step time and peak memory.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from framework._memory import GIB, predict
from framework.estimate import split_assignment
from framework.errors import ConfigError, FrameworkError

OWN_KEYS = ("model", "gpu_mem", "cpu_mem", "nvme", "ranks", "micro_batches", "stages", "offloads",
            "checkpointing", "steps")


@dataclass(frozen=True)
class Candidate:
    stage: str
    offload: str            # none | cpu | cpu+params | nvme
    micro_batch: int
    grad_accum: int
    checkpointing: bool

    @property
    def guide_rank(self) -> int:
        """The guide's speed order (fastest first) for ties."""
        order = [("ddp", "none"), ("zero1", "none"), ("zero2", "none"), ("zero1", "cpu"), ("zero2", "cpu"),
                 ("zero3", "none"), ("zero3", "cpu"), ("zero3", "cpu+params"), ("zero2", "nvme"),
                 ("zero3", "nvme")]
        key = (self.stage, self.offload)
        return order.index(key) if key in order else len(order)

    def overrides(self) -> list[str]:
        out = [f"+stage={self.stage}"]
        if self.offload != "none":
            out.append(f"offload={self.offload.split('+')[0]}")
        if self.offload == "cpu+params":
            out.append("offload.params=cpu")
        return out + [f"train.micro_batch={self.micro_batch}", f"train.grad_accum={self.grad_accum}",
                      f"model.activation_checkpointing={str(self.checkpointing).lower()}"]

    def label(self) -> str:
        return (f"{self.stage:5s} {self.offload:10s} micro {self.micro_batch:3d} x accum {self.grad_accum:3d}  "
                f"ckpt {'yes' if self.checkpointing else 'no '}")


@dataclass(frozen=True)
class Hardware:
    device: torch.device
    gpu_mem: int | None     # bytes per GPU (None: CPU-only, the host is the device)
    cpu_mem: int            # host bytes (the whole node)
    nvme: int               # bytes free under the NVMe path
    ranks: int


def detect(own: dict[str, str]) -> Hardware:
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    gpu = parse_bytes(own["gpu_mem"]) if "gpu_mem" in own else (
        torch.cuda.get_device_properties(0).total_memory if cuda else None)
    cpu = parse_bytes(own["cpu_mem"]) if "cpu_mem" in own else _mem_available()
    nvme = parse_bytes(own["nvme"]) if "nvme" in own else shutil.disk_usage(os.getcwd()).free
    ranks = int(own["ranks"]) if "ranks" in own else (torch.cuda.device_count() if cuda else 1)
    if ranks < 1:
        raise ConfigError("plan: ranks must be >= 1")
    return Hardware(device, gpu, cpu, nvme, ranks)


def parse_bytes(text: str) -> int:
    """``80G``/``80GiB`` (2^30), ``512M``, ``2T``, or plain bytes."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30, "T": 2 ** 40}.get(t[-1:], 1)
    try:
        return int(float(t[:-1] if mult > 1 else t) * mult)
    except ValueError:
        raise ConfigError(f"plan: {text!r} is not a size; write e.g. 80G, 512M or 2T") from None


def _mem_available() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


# --- the roofline --------------------------------------------------------------------------------

def step_time(cfg, cand: Candidate, hw: Hardware, probe: dict, params: int) -> dict[str, float]:
    """Seconds per optimizer step on one rank, by phase (see the module docstring)."""
    from framework.build import component

    m = cfg.model
    policy = component(cfg, "precision").build(cfg.precision)
    n, w, red = hw.ranks, policy.param_dtype.itemsize, policy.reduce_dtype.itemsize
    tokens = cand.micro_batch * m.context
    # 6 flops per parameter and token for forward + backward (2 + 4), 8 with the forward recomputed;
    # the position table does no matmul; attention scores and values add 12 * layers * d * context.
    matmul_params = params - m.context * m.d_model
    per_token = (8 if cand.checkpointing else 6) * matmul_params + \
        (16 if cand.checkpointing else 12) * m.n_layer * m.d_model * m.context
    # Per micro step, the measured cost of a train_step micro batch that does no arithmetic (module
    # calls, autograd, hooks, dispatch), per layer a third more with the forward recomputed.
    overhead = probe["micro_fixed_s"] + m.n_layer * probe["micro_per_layer_s"] * (4 / 3 if cand.checkpointing else 1)
    compute = cand.grad_accum * (per_token * tokens / probe["matmul_flops"] + overhead)
    shard = params / n
    ar = probe.get("allreduce_bytes_s") or float("inf")
    frac = (n - 1) / n
    comm = 0.0
    if n > 1:   # algorithmic bandwidths: a reduce-scatter or all-gather moves about half an all-reduce
        if cand.stage == "ddp":
            comm = params * red / ar
        elif cand.stage == "zero1":
            comm = frac * params * red / (ar / 2) / 2 + frac * params * w / (ar / 2) / 2
        elif cand.stage == "zero2":
            comm = cand.grad_accum * params * red / ar + params * w / ar
        else:
            comm = cand.grad_accum * (2 * params * w + params * red) / ar
    k = 12   # Adam: master, m, v (fp32); read and write, plus the gradient read
    host_opt = cand.offload != "none"
    if host_opt:
        optimizer = shard / probe["host_optimizer_params_s"]
        copies = shard * 4 / probe["d2h_bytes_s"] + shard * w / probe["h2d_bytes_s"]
    else:
        optimizer = (shard / probe["host_optimizer_params_s"] if hw.device.type == "cpu"
                     else shard * 2 * (k + 4) / probe["device_copy_bytes_s"])
        copies = 0.0
    if cand.offload == "cpu+params":   # each gather loads the shard from the host, forward and backward
        copies += cand.grad_accum * 2 * shard * w / probe["h2d_bytes_s"]
    if cand.stage == "zero3":          # gathering into and releasing unit buffers: a copy per use
        copies += cand.grad_accum * 2 * params * w / probe["device_copy_bytes_s"]
    disk = 0.0
    if cand.offload == "nvme":   # master + state read and written once per step; zero3 shards read per use
        disk = shard * k / probe["disk_read_bytes_s"] + shard * k / probe["disk_write_bytes_s"]
        if cand.stage == "zero3":
            disk += cand.grad_accum * 2 * shard * w / probe["disk_read_bytes_s"]
    overlap = cand.stage in ("ddp", "zero3")   # buckets reduced during backward by default
    total = (max(compute, comm) if overlap else compute + comm) + optimizer + copies + disk + probe["step_fixed_s"]
    return {"total": total, "compute": compute, "comm": comm, "optimizer": optimizer, "copies": copies,
            "disk": disk}


# --- candidates ----------------------------------------------------------------------------------

def candidates(cfg, hw: Hardware, own: dict[str, str]) -> list[Candidate]:
    from framework.config import COMPATIBLE

    global_batch = cfg.train.micro_batch * cfg.train.grad_accum * hw.ranks
    per_rank = global_batch // hw.ranks
    micro = [int(x) for x in own["micro_batches"].split(",")] if "micro_batches" in own else \
        [b for b in (1, 2, 4, 8, 16, 32, 64, 128) if b <= per_rank]
    micro = [b for b in micro if per_rank % b == 0]
    if not micro:
        raise ConfigError(f"plan: no micro batch divides the per-rank batch {per_rank} "
                          f"(global batch {global_batch} over {hw.ranks} ranks)")
    stages = own["stages"].split(",") if "stages" in own else list(COMPATIBLE)
    ckpts = [x.strip().lower() == "true" for x in own["checkpointing"].split(",")] if "checkpointing" in own \
        else [False, True]
    out = []
    for stage in stages:
        if stage not in COMPATIBLE:
            raise ConfigError(f"plan: unknown stage {stage!r}; one of {', '.join(COMPATIBLE)}")
        offs = []
        for o in COMPATIBLE[stage]:
            offs.append(o)
            if o == "cpu" and stage == "zero3":
                offs.append("cpu+params")
        if "offloads" in own:
            offs = [o for o in offs if o in own["offloads"].split(",")]
        for o in offs:
            for b in micro:
                for c in ckpts:
                    out.append(Candidate(stage, o, b, per_rank // b, c))
    return out


@dataclass
class Planned:
    cand: Candidate
    time: dict[str, float]
    device_peak: int
    host: int
    fits: bool
    why: str = ""


def plan(cfg, base: list[str], hw: Hardware, own: dict[str, str], probe: dict) -> list[Planned]:
    """Every candidate with its predicted time and memory, fitting ones first, fastest first.
    ``base``: the overrides ``cfg`` was composed from (each candidate adds its own)."""
    from framework.build import component

    vocab = None
    try:
        vocab = component(cfg, "data").build(cfg.data, seed=cfg.seed, context=cfg.model.context).vocab_size
    except FrameworkError:
        pass
    from framework.config import compose

    traces: dict = {}   # activation traces shared by candidates with the same micro batch and checkpointing
    out = []
    composed: dict[tuple[str, str], object] = {}   # one Hydra compose per stage and offload
    for cand in candidates(cfg, hw, own):
        key = (cand.stage, cand.offload)
        if key not in composed:
            composed[key] = compose([*base, *cand.overrides()])
            try:   # an offload target that cannot be built here is listed, never run
                component(composed[key], "offload").build(composed[key].offload)
            except FrameworkError as e:
                composed[key] = e
        c = composed[key]
        if isinstance(c, FrameworkError):
            out.append(Planned(cand, {"total": float("inf")}, 0, 0, False, f"unavailable: {c}"))
            continue
        ccfg = dataclasses.replace(c, train=dataclasses.replace(c.train, micro_batch=cand.micro_batch,
                                                                grad_accum=cand.grad_accum),
                                   model=dataclasses.replace(c.model, activation_checkpointing=cand.checkpointing))
        with torch.device("meta"):
            module = component(ccfg, "model").build(ccfg.model, vocab_size=vocab)
        pred = predict(ccfg, hw.ranks, module=module, traces=traces)
        cuda = hw.gpu_mem is not None
        # On a CPU-only machine each rank is also a process with torch loaded (measured by the probe).
        device_peak = pred.device_peak(cuda) if cuda else pred.peak + probe.get("process_rss_bytes", 0)
        host = pred.host_total() * (hw.ranks if cuda else 1)
        fits, why = True, ""
        if cuda and device_peak > hw.gpu_mem:
            fits, why = False, f"device {device_peak / GIB:.1f} > {hw.gpu_mem / GIB:.1f} GiB"
        elif not cuda and device_peak * hw.ranks > hw.cpu_mem:
            fits, why = False, f"host {device_peak * hw.ranks / GIB:.2f} > {hw.cpu_mem / GIB:.2f} GiB"
        elif host > hw.cpu_mem:
            fits, why = False, f"host {host / GIB:.1f} > {hw.cpu_mem / GIB:.1f} GiB"
        elif sum(pred.disk.values()) * hw.ranks > hw.nvme:
            fits, why = False, f"disk {sum(pred.disk.values()) * hw.ranks / GIB:.1f} > {hw.nvme / GIB:.1f} GiB"
        out.append(Planned(cand, step_time(ccfg, cand, hw, probe, pred.params), device_peak, host, fits, why))
    out.sort(key=lambda p: (not p.fits, p.time["total"], p.cand.guide_rank, p.cand.checkpointing,
                            -p.cand.micro_batch))
    return out


# --- verify: the top K as one Hydra multirun ------------------------------------------------------

def verify(planned: list[Planned], k: int, base_overrides: list[str], hw: Hardware, steps: int) -> list[dict]:
    top = [p for p in planned if p.fits][:k]
    with tempfile.TemporaryDirectory(prefix="framework-plan-") as d:
        group = Path(d) / "search" / "plan"
        group.mkdir(parents=True)
        for i, p in enumerate(top):
            group.joinpath(f"c{i}.yaml").write_text(_plan_yaml(p.cand))
        sweep = Path(d) / "runs"
        # The plan group must be on the search path both of the up-front check of every job (an
        # override) and of each job's composition inside the Hydra app (--config-dir).
        cmd = [sys.executable, "-m", "framework.train", "-m", "--config-dir", str(group.parent),
               f"hydra.searchpath=[file://{group.parent}]",
               "+plan=" + ",".join(f"c{i}" for i in range(len(top))), *base_overrides,
               f"train.steps={steps}", "train.log_every=1", "train.eval_every=0", "train.eval_batches=1",
               "logger=none", f"dist.nproc={hw.ranks}", f"hydra.sweep.dir={sweep}"]
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode != 0:
            raise FrameworkError(f"plan --verify: the multirun failed: {run.stderr.strip().splitlines()[-1:]}")
        results = []
        for i, p in enumerate(top):
            job = sweep / str(i)
            summary = json.loads((job / "summary.json").read_text())
            recs = [json.loads(line) for line in (job / "metrics.jsonl").read_text().splitlines()]
            tps = [r["tokens_per_s"] for r in recs if "tokens_per_s" in r][1:]   # the first step warms up
            tokens = summary["config"]["train"]["micro_batch"] * summary["config"]["train"]["grad_accum"] * \
                summary["world"] * summary["config"]["model"]["context"]
            peaks = summary["peak_memory_per_rank"]
            key = "peak_device_allocated_bytes" if "peak_device_allocated_bytes" in peaks[0] else "peak_rss_bytes"
            results.append({"candidate": p.cand, "predicted_s": p.time["total"],
                            "measured_s": statistics.median(tokens / t for t in tps),
                            "predicted_peak": p.device_peak, "measured_peak": max(x[key] for x in peaks),
                            "measured_kind": key})
    return results


def _plan_yaml(c: Candidate) -> str:
    lines = ["# @package _global_", "defaults:", f"  - /stage: {c.stage}"]
    if c.offload != "none":
        lines.append(f"  - override /offload: {c.offload.split('+')[0]}")
    lines += ["train:", f"  micro_batch: {c.micro_batch}", f"  grad_accum: {c.grad_accum}",
              "model:", f"  activation_checkpointing: {str(c.checkpointing).lower()}"]
    if c.offload == "cpu+params":
        lines += ["offload:", "  params: cpu"]
    return "\n".join(lines) + "\n"


# --- command line ----------------------------------------------------------------------------------

def parse(argv: list[str]) -> tuple[dict[str, str], list[str], dict]:
    own, overrides, flags = {}, [], {"top": 20, "verify": 0, "reprobe": False, "json": False}
    it = iter(argv)
    for arg in it:
        if arg in ("--top", "--verify"):
            try:
                flags[arg[2:]] = int(next(it))
            except (StopIteration, ValueError):
                raise ConfigError(f"plan: {arg} needs a number") from None
        elif arg in ("--reprobe", "--json"):
            flags[arg[2:]] = True
        elif arg.startswith("--"):
            raise ConfigError(f"plan: unknown flag {arg} (known: --top N, --verify K, --reprobe, --json)")
        else:
            split_assignment(arg, OWN_KEYS, own, overrides, "plan")
    return own, overrides, flags


def main(argv: list[str] | None = None) -> int:
    from framework import _probe
    from framework.config import compose

    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    try:
        own, overrides, flags = parse(argv)
        if "model" not in own:
            raise ConfigError("plan: give model=NAME (one of our model configs)")
        base = [f"model={own['model']}", *overrides]
        cfg = compose(base)
        hw = detect(own)
        probe = _probe.load(hw.device, Path(os.getcwd()), collectives=hw.ranks > 1, reprobe=flags["reprobe"])
        planned = plan(cfg, base, hw, own, probe)
        print(_describe(hw, probe, cfg, planned, flags["top"]))
        if flags["json"] and not flags["verify"]:
            print(json.dumps([{**dataclasses.asdict(p.cand), "time": p.time, "device_peak": p.device_peak,
                               "host": p.host, "fits": p.fits, "why": p.why} for p in planned]))
        if flags["verify"]:
            rows = verify(planned, flags["verify"], base, hw, int(own.get("steps", 6)))
            print(f"\nverify: top {len(rows)} as one Hydra multirun ({own.get('steps', 6)} steps each; "
                  f"measured = median s/step after the first)")
            for i, r in enumerate(rows):
                print(f"  {i + 1}. {r['candidate'].label()}  predicted {r['predicted_s']:.3f} s  measured "
                      f"{r['measured_s']:.3f} s   peak predicted {r['predicted_peak'] / 2**20:.0f} MiB  "
                      f"measured {r['measured_peak'] / 2**20:.0f} MiB ({r['measured_kind']})")
            if rows and rows[0]["measured_kind"] == "peak_rss_bytes":
                print("  (peak RSS is per process, and a multirun runs its jobs in one: after the first job "
                      "it includes the earlier jobs' peaks)")
            if flags["json"]:
                print(json.dumps([{**r, "candidate": dataclasses.asdict(r["candidate"])} for r in rows]))
    except FrameworkError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def _describe(hw: Hardware, probe: dict, cfg, planned: list[Planned], top: int) -> str:
    gpu = f"{hw.gpu_mem / GIB:.1f} GiB per GPU" if hw.gpu_mem else "no GPU (the host is the device)"
    lines = [f"hardware: {hw.ranks} rank(s), {gpu}, {hw.cpu_mem / GIB:.1f} GiB host, {hw.nvme / GIB:.0f} GiB disk",
             f"probe ({'measured now' if probe.get('measured_now') else 'cached'}: {probe['cache']}): "
             f"matmul {probe['matmul_flops'] / 1e9:.1f} GFLOP/s, copy {probe['device_copy_bytes_s'] / 1e9:.1f} GB/s, "
             f"h2d {probe['h2d_bytes_s'] / 1e9:.1f} GB/s, host optimizer {probe['host_optimizer_params_s'] / 1e6:.0f} "
             f"M params/s, disk w/r {probe['disk_write_bytes_s'] / 1e9:.2f}/{probe['disk_read_bytes_s'] / 1e9:.2f} "
             f"GB/s" + (f", all-reduce {probe['allreduce_bytes_s'] / 1e9:.2f} GB/s"
                        if probe.get("allreduce_bytes_s") else ""),
             f"model {cfg.choices['model']}, precision {cfg.choices['precision']}, context {cfg.model.context}",
             "", f"  #  {'setup':52s} {'s/step':>8s} {'peak/rank':>11s}  {'host':>9s}"]
    fitting = [p for p in planned if p.fits]
    for i, p in enumerate(fitting[:top]):
        lines.append(f"{i + 1:3d}  {p.cand.label():52s} {p.time['total']:8.3f} {p.device_peak / GIB:9.2f}Gi "
                     f"{p.host / GIB:8.2f}Gi")
    lines.append(f"({len(fitting)} of {len(planned)} setups fit"
                 + (f"; e.g. not: {planned[-1].cand.label().split('  ')[0]} ({planned[-1].why})"
                    if len(fitting) < len(planned) else "") + ")")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
