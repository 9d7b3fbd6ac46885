"""The planner: every stage x offload x micro-batch x checkpointing candidate of a config with its per-rank
memory (``model.predict``) and step time (a roofline over ``probe``'s bandwidths), fitting ones first,
fastest first. ``python -m framework.plan --help`` says what each counts."""
from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch

from framework.config import COMPATIBLE, check_model_vocab, compose
from framework.engine.build import component
from framework.memory.model import STAGES, data_vocab, predict
from framework.memory.tables import parse_count
from framework.core.errors import ConfigError, FrameworkError
from framework.core.registry import closest_hint
from framework.core.room import available_ram, free_bytes
from framework.core import units
from framework.core.utils import counted

# Host memory besides the tensors: each rank is a Python process with torch and the framework loaded
# (the probe's own resident set, ``process_rss_bytes``, and with activation checkpointing what its first use
# loads, ``checkpointing_rss_bytes``). More than one local rank are spawned by the
# launcher, whose process stays loaded while they train (counted as one more such process), beside
# multiprocessing's resource tracker.
TRACKER_BYTES = 16 * units.MiB
# Each rank's CUDA context and libraries (cuBLAS, cuDNN) in host memory, where the probe ran without CUDA
# (with ``gpu_mem=`` on a CPU host): an allowance, not measured here; the probe on a GPU machine measures
# them in its own resident set.
CUDA_HOST_BYTES = units.GiB
NO_NVME = "0 (nvme=0: no NVMe)"   # a disk need against nvme=0: no smaller setup can fit it


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
        offload = {"none": [], "cpu+params": ["offload=cpu", "offload.params=cpu"]}
        return [f"+stage={self.stage}", *offload.get(self.offload, [f"offload={self.offload}"]),
                f"train.micro_batch={self.micro_batch}", f"train.grad_accum={self.grad_accum}",
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


def detect(own: dict[str, str], disk: str | os.PathLike | None = None) -> Hardware:
    """``disk``: where offload=nvme would swap (its free bytes are ``nvme``; default the working directory)."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    gpu = parse_bytes(own["gpu_mem"]) if "gpu_mem" in own else (
        torch.cuda.get_device_properties(0).total_memory if cuda else None)
    cpu = parse_bytes(own["cpu_mem"]) if "cpu_mem" in own else available_ram()
    if cpu is None:   # no /proc/meminfo: the physical memory
        cpu = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    nvme = parse_bytes(own["nvme"]) if "nvme" in own else free_bytes(disk or os.getcwd())
    for key, value, least in (("gpu_mem", gpu, 1), ("cpu_mem", cpu, 1), ("nvme", nvme, 0)):   # nvme=0: no disk
        if key not in own:
            continue
        # A plain number is bytes; one too small for any setup (0.5 too: 0 bytes) is a size whose unit was left out.
        n = own[key].strip()
        if not any(c.isalpha() and c not in "eE" for c in n) and 0 < float(n) < units.MiB:
            raise ConfigError(f"plan: {key}={n} is {value} bytes; write {n}G (GiB) or {n}GB")
        if value < least:
            raise ConfigError(f"plan: {key}={own[key]} must be {'> 0' if least else '>= 0'}")
    ranks = parse_count(own["ranks"], "plan: ranks", whole=True) if "ranks" in own else (
        torch.cuda.device_count() if cuda else 1)
    if ranks < 1:
        raise ConfigError("plan: ranks must be >= 1")
    return Hardware(device, gpu, cpu, nvme, ranks)


def parse_bytes(text: str) -> int:
    """``80G`` = ``80GiB`` (2^30), ``80GB`` (10^9), ``512M``, ``2T``, or plain bytes."""
    try:
        return units.parse_size(text, bare=1024)
    except ValueError:
        raise ConfigError(f"plan: {text!r} is not a size; write e.g. 80G, 80GB, 512M or 2T") from None


# --- the roofline --------------------------------------------------------------------------------

def step_time(cfg, cand: Candidate, hw: Hardware, probe: dict, params: int, policy=None) -> dict[str, float]:
    """Seconds per optimizer step on one rank, by phase (``policy``: ``cfg``'s precision, if built already)."""
    m = cfg.model
    policy = policy or component(cfg, "precision").build(cfg.precision)
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
    # Algorithmic bandwidths: a reduce-scatter or all-gather moves about half an all-reduce.
    comm = {"ddp": params * red / ar,
            "zero1": frac * params * red / (ar / 2) / 2 + frac * params * w / (ar / 2) / 2,
            "zero2": cand.grad_accum * params * red / ar + params * w / ar,
            "zero3": cand.grad_accum * (2 * params * w + params * red) / ar}[cand.stage] if n > 1 else 0.0
    k = 12   # Adam: master, m, v (fp32); read and write, plus the gradient read
    offloaded = cand.offload != "none"   # the optimizer steps on the host, as it does on a CPU-only machine
    optimizer = (shard / probe["host_optimizer_params_s"] if offloaded or hw.device.type == "cpu"
                 else shard * 2 * (k + 4) / probe["device_copy_bytes_s"])
    copies = shard * 4 / probe["d2h_bytes_s"] + shard * w / probe["h2d_bytes_s"] if offloaded else 0.0
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

def micro_batches(cfg, hw: Hardware, own: dict[str, str]) -> tuple[list[int], list[str]]:
    """(the micro batch sizes to try: those of ``micro_batches=`` that divide the per-rank batch, else the
    powers of two that do; a note naming the given sizes left out, if any)."""
    global_batch = cfg.train.micro_batch * cfg.train.grad_accum * hw.ranks
    per_rank = global_batch // hw.ranks
    micro = [parse_count(x, "plan: micro_batches", whole=True) for x in own["micro_batches"].split(",")] \
        if "micro_batches" in own else [b for b in (1, 2, 4, 8, 16, 32, 64, 128) if b <= per_rank]
    if "micro_batches" in own and min(micro) < 1:
        raise ConfigError(f"plan: micro_batches={own['micro_batches']}: each size must be >= 1")
    kept = [b for b in micro if per_rank % b == 0]
    if not kept:
        raise ConfigError(f"plan: no micro batch divides the per-rank batch {per_rank} "
                          f"(global batch {global_batch} over {counted(hw.ranks, 'rank')})")
    dropped = [b for b in micro if b not in kept]
    return kept, [f"note: micro_batches {', '.join(map(str, dropped))} left out: they do not divide the per-rank "
                  f"batch {per_rank} (train.micro_batch x train.grad_accum, global batch {global_batch} over "
                  f"{counted(hw.ranks, 'rank')})"] if dropped and "micro_batches" in own else []


# The stages a search naming none tries: those ``predict`` has a memory model of (``unmodelled`` notes the rest).
_MODELLED = tuple(s for s in COMPATIBLE if s in STAGES)


def candidates(cfg, hw: Hardware, own: dict[str, str]) -> list[Candidate]:
    micro = micro_batches(cfg, hw, own)[0]
    per_rank = cfg.train.micro_batch * cfg.train.grad_accum
    stages = _choices(own, "stages", list(COMPATIBLE)) if "stages" in own else list(_MODELLED)
    wanted = _choices(own, "offloads", sorted({o for offs in COMPATIBLE.values() for o in offs} | {"cpu+params"}))
    ckpts = [x == "true" for x in _choices(own, "checkpointing", ["false", "true"])]
    out = []
    for stage in stages:
        offs = [x for o in COMPATIBLE[stage] for x in ([o, "cpu+params"] if (stage, o) == ("zero3", "cpu") else [o])]
        offs = [o for o in offs if o in wanted]
        out += [Candidate(stage, o, b, per_rank // b, c) for o in offs for b in micro for c in ckpts]
    if not out:
        raise ConfigError(f"plan: no stage of {','.join(stages)} supports an offload of {','.join(wanted)} "
                          f"(see stages= and offloads=)")
    return out


def unmodelled(own: dict[str, str]) -> list[str]:
    """The note for the stages a search naming none leaves out: those ``predict`` has no memory model of."""
    left = [s for s in COMPATIBLE if s not in _MODELLED]
    return [f"note: stage {', '.join(left)} left out: no memory model (add its case to predict in "
            f"framework/memory/model.py)"] if left and "stages" not in own else []


def _choices(own: dict[str, str], key: str, valid: list[str]) -> list[str]:
    """``key=a,b``'s values (all of ``valid`` when not given); one outside ``valid`` is an error."""
    if key not in own:
        return valid
    values = [x.strip().lower() for x in own[key].split(",")]
    for x in values:
        if x not in valid:
            raise ConfigError(f"plan: {key}: unknown value {x!r}{closest_hint(x, valid)}; one of {', '.join(valid)}")
    return values


@dataclass
class Planned:
    cand: Candidate
    time: dict[str, float]
    device_peak: int
    host: int       # the node's host memory: every rank's process and, with more than one, the launcher's
    why: str = ""   # what does not fit (empty: the candidate fits)
    over: float = 0.0   # the largest of its needs over what is given (device, host, disk): > 1 does not fit

    @property
    def fits(self) -> bool:
        return not self.why


def compose_setups(base: list[str], cands: list[Candidate]) -> dict[tuple[str, str], object]:
    """One composed config per stage and offload of ``cands``, or its error where it does not compose or its
    offload cannot be built here (listed, never run); when none composes, the first error is raised."""
    composed: dict[tuple[str, str], object] = {}
    refused: list[ConfigError] = []
    for cand in cands:
        key = (cand.stage, cand.offload)
        if key not in composed:
            try:
                composed[key] = compose([*base, *cand.overrides()])
            except ConfigError as e:
                composed[key] = e
                refused.append(e)
                continue
            try:
                component(composed[key], "offload").build(composed[key].offload)
            except FrameworkError as e:
                composed[key] = e
    if composed and len(refused) == len(composed):
        stages = ",".join(dict.fromkeys(stage for stage, _ in composed))
        raise ConfigError(f"{refused[0]} (plan: no setup of stages={stages} composes with the given keys; choose "
                          f"the stages they allow with stages=)")
    return composed


def plan(cfg, base: list[str], hw: Hardware, own: dict[str, str], probe: dict,
         composed: dict[tuple[str, str], object] | None = None, vocab: int | None = None) -> list[Planned]:
    """Every candidate with its predicted time and memory, fitting ones first, fastest first. ``base``: the
    overrides each candidate adds its choices to; ``composed``: ``compose_setups``' result, if made already;
    ``vocab``: ``data_vocab(cfg)``, if read (and checked) already (a text file is read to learn it)."""
    if vocab is None:
        vocab = data_vocab(cfg)   # the vocabulary training builds the model at
        check_model_vocab(cfg, vocab)   # (one training refuses: not planned)
    cuda = hw.gpu_mem is not None
    process = probe.get("process_rss_bytes", 0)
    rank_base = process + (CUDA_HOST_BYTES if cuda and hw.device.type != "cuda" else 0)
    launcher = process + TRACKER_BYTES if hw.ranks > 1 else 0
    traces: dict = {}   # activation traces shared by candidates with the same micro batch and checkpointing
    modules: dict = {}   # meta models by model config and working dtype
    policies: dict = {}   # precision policies by precision config
    out = []
    cands = candidates(cfg, hw, own)
    composed = compose_setups(base, cands) if composed is None else composed   # one compose per stage and offload
    for cand in cands:
        c = composed[(cand.stage, cand.offload)]
        if isinstance(c, FrameworkError):
            out.append(Planned(cand, {"total": float("inf")}, 0, 0, f"unavailable: {c}", float("inf")))
            continue
        ccfg = replace(c, train=replace(c.train, micro_batch=cand.micro_batch, grad_accum=cand.grad_accum),
                       model=replace(c.model, activation_checkpointing=cand.checkpointing))
        if (policy := policies.get(ccfg.precision)) is None:
            policy = policies[ccfg.precision] = component(ccfg, "precision").build(ccfg.precision)
        dtype = policy.param_dtype
        if (module := modules.get((ccfg.model, dtype))) is None:
            with torch.device("meta"):
                module = component(ccfg, "model").build(ccfg.model, vocab_size=vocab)
            # Shared by the candidates of this model config only where predict's cast to the working dtype
            # changes nothing: each then reads it as built.
            if all(t.dtype == dtype for t in (*module.parameters(), *module.buffers()) if t.is_floating_point()):
                modules[(ccfg.model, dtype)] = module
        pred = predict(ccfg, hw.ranks, module=module, traces=traces, device="cuda" if cuda else "cpu", policy=policy)
        # On a CPU-only machine the host is the device: a rank's peak is all of its process.
        rank_held = rank_base + (probe.get("checkpointing_rss_bytes", 0) if cand.checkpointing else 0)
        device_peak = pred.device_peak(cuda) if cuda else pred.peak + rank_held
        host = (pred.host_total() + rank_held if cuda else device_peak) * hw.ranks + launcher
        needs = {**({"device": (device_peak, hw.gpu_mem)} if cuda else {}), "host": (host, hw.cpu_mem),
                 "disk": (sum(pred.disk.values()) * hw.ranks, hw.nvme)}
        over = max(n / limit if limit else float("inf") if n else 0.0 for n, limit in needs.values())
        why = ", ".join(f"{k} {units.size(n)} > {units.size(limit) if limit or k != 'disk' else NO_NVME}"
                        for k, (n, limit) in needs.items() if n > limit)
        out.append(Planned(cand, step_time(ccfg, cand, hw, probe, pred.params, policy), device_peak, host, why, over))
    out.sort(key=lambda p: (not p.fits, p.time["total"], p.cand.guide_rank, p.cand.checkpointing,
                            -p.cand.micro_batch))
    return out
