"""Our ddp / zero1 / zero2 (/ zero3) stages against torch DDP, ZeroRedundancyOptimizer, FSDP2
and DeepSpeed ZeRO 1/2/3, side by side: step time and peak RSS per rank.

Set-up (a venv of its own, so that DeepSpeed never enters the project's .venv)::

    cd path/to/framework     # the repository root
    python3 -m venv .bench-venv
    .bench-venv/bin/pip install torch==2.13.0        # first: keeps pip off the CUDA build of torch
    .bench-venv/bin/pip install -e .
    DS_BUILD_OPS=0 .bench-venv/bin/pip install deepspeed   # 0.19.x; nothing compiles at install

Run::

    .bench-venv/bin/python -m bench.stages --rounds 3 [--systems ddp,zero1,torch-ddp,...] [--steps 20]

Same model (GPT, 6 layers, d 384, vocab 256, context 128: 10.8 M params), same init
(``torch.manual_seed(0)`` before building it), same batches (the framework's synthetic
source, 8 sequences per rank), fp32, AdamW lr 1e-3, betas (0.9, 0.99), weight decay 0.1 on
>=2-D parameters only, constant lr, gradient clipping at global norm 1.0, N gloo ranks with one
thread each. Median step time of ``--steps`` steps after 3 warm-up steps, the slower rank
counts; every system runs in fresh rank processes each round and systems alternate order
over rounds. Peak RSS is the VmHWM of each rank process; "RSS over start" subtracts the
peak measured after imports and process-group set-up, before the model is built.

Every system steps with the same optimizer kernel: torch's fused AdamW (``torch.optim.AdamW(fused=
True)`` for the peers; ours with ``FRAMEWORK_OPS=0``, which makes our AdamW dispatch to that same
kernel). ``--kernel ours`` runs our stages with our C++ CPU kernel instead (the table says which).
torch DDP runs with ``gradient_as_bucket_view=True``.

DeepSpeed runs on CPU over the same gloo group (``DS_ACCELERATOR=cpu``; the group exists
before ``deepspeed.initialize``) with ``torch.optim.AdamW`` as its client optimizer and
``zero_allow_untested_optimizer``, so none of its C++ ops is needed. One is still JIT-built
unasked: ``deepspeed.comm.torch.TorchBackend`` builds the shared-memory all-reduce op
(``ShareMemCommBuilder``, used only by ``inference_all_reduce``) whenever the accelerator is
the CPU. We replace its ``build_shm_op`` with one that returns None (the code path DeepSpeed
takes when the op is incompatible), so nothing compiles and no lock file can be left behind.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import os
import statistics
import sys
import time

import torch

OVERRIDES = ["model=gpt-mini", "model.context=128", "data.vocab_size=256", "train.micro_batch=8",
             "train.steps=1000", "scheduler=constant", "optimizer=adamw", "optimizer.lr=1e-3",
             "optimizer.beta1=0.9", "optimizer.beta2=0.99", "optimizer.weight_decay=0.1",
             "train.grad_clip=1.0", "precision=fp32", "logger=none"]
MICRO = 8
CLIP = 1.0
WARMUP = 3
BUCKET = 6_553_600  # 25 MiB of fp32: torch DDP's bucket
TUNED = ["stage.overlap_comm=true", f"stage.reduce_bucket_size={BUCKET}"]

# Ours: system name -> stage overrides.
OURS = {
    "ddp": [],
    "zero1": ["+stage=zero1"],
    "zero1-overlap": ["+stage=zero1", *TUNED],
    "zero2": ["+stage=zero2"],
    "zero2-overlap": ["+stage=zero2", *TUNED],
    "zero3": ["+stage=zero3"],
    # CPU offload ablation (ours only: no peer offloads without building C++ ops here).
    "zero2-offload": ["+stage=zero2", "offload=cpu", *TUNED],
    "zero2-offload-overlap": ["+stage=zero2", "offload=cpu", "offload.overlap_step=true", *TUNED],
}
PEERS = ["torch-ddp", "torch-zero", "fsdp2", "fsdp2-reshard", "ds-zero1", "ds-zero2", "ds-zero3"]
ALL = ["torch-ddp", "ddp", "zero1", "zero1-overlap", "zero2", "zero2-overlap", "zero3", "torch-zero", "fsdp2",
       "fsdp2-reshard", "ds-zero1", "ds-zero2", "ds-zero3"]
EXTRA = ["zero2-offload", "zero2-offload-overlap"]  # chosen with --systems only
BASELINE = "torch-ddp"
ATTEMPTS = 2  # a system whose ranks crash is retried once in that round


# --- per-rank side ---------------------------------------------------------------------------

def _adamw_groups(params) -> list[dict]:
    params = list(params)
    return [{"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]


ADAMW = dict(lr=1e-3, betas=(0.9, 0.99), eps=1e-8)


def _global_loss(loss: torch.Tensor, world: int) -> float:
    # The same per-step global loss all-reduce that our train_step does for its metrics.
    t = loss.detach().clone()
    torch.distributed.all_reduce(t)
    return t.item() / world


def _ours(dist, name, cfg, model, data):
    from framework import initialize
    from framework.models.gpt import gpt_loss

    engine = initialize(model, gpt_loss, cfg, dist)
    box = {"state": engine.state}

    def step(pos: int) -> float:
        s = box["state"]
        batch = data.train_batch(s.data, micro_batch=MICRO, grad_accum=1, rank=dist.rank, world=dist.world)
        box["state"], m = engine.train_step(s, batch)
        return m["loss"]

    return step


def _plain_step(dist, data, model, opt, loss_fn, set_to_none=True):
    """forward, backward, clip, step, zero_grad, global loss: the loop every torch peer shares.
    ``set_to_none``: zero_grad's, torch's default (gradients freed between steps)."""

    def step(pos: int) -> float:
        batch = data.train_batch(pos, micro_batch=MICRO, grad_accum=1, rank=dist.rank, world=dist.world)
        loss = loss_fn(model, batch.micro[0])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
        return _global_loss(loss, dist.world)

    return step


def _wrap_ddp(model):
    """torch DDP as every bench script runs it."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    # Gradients as views of DDP's buckets: no copy between .grad and the buckets (its fast setting).
    return DDP(model, gradient_as_bucket_view=True)


def _torch_ddp(dist, name, cfg, model, data):
    from framework.models.gpt import gpt_loss

    model = _wrap_ddp(model)
    if name == "torch-ddp":
        opt = torch.optim.AdamW(_adamw_groups(model.parameters()), **ADAMW, fused=True)
    else:  # torch-zero
        from torch.distributed.optim import ZeroRedundancyOptimizer

        opt = ZeroRedundancyOptimizer(_adamw_groups(model.parameters()), optimizer_class=torch.optim.AdamW,
                                      **ADAMW, fused=True)
    # The gradients are views of DDP's buckets, which DDP keeps allocated either way: freeing the
    # views saves nothing, and zeroing them in place keeps .grad and the buckets one memory.
    return _plain_step(dist, data, model, opt, gpt_loss, set_to_none=False)


def _fsdp2(dist, name, cfg, model, data):
    from torch.distributed.fsdp import fully_shard

    from framework.models.gpt import gpt_loss

    reshard = name == "fsdp2-reshard"
    for block in model.blocks:
        fully_shard(block, reshard_after_forward=reshard)
    fully_shard(model, reshard_after_forward=reshard)
    opt = torch.optim.AdamW(_adamw_groups(model.parameters()), **ADAMW, fused=True)
    return _plain_step(dist, data, model, opt, gpt_loss)


def _deepspeed(dist, name, cfg, model, data):
    import deepspeed

    stage = int(name[-1])
    opt = torch.optim.AdamW(_adamw_groups(model.parameters()), **ADAMW, fused=True)
    ds_cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1,
              "gradient_clipping": CLIP, "zero_allow_untested_optimizer": True,
              "zero_optimization": {"stage": stage},  # DeepSpeed's defaults otherwise
              "fp16": {"enabled": False}, "bf16": {"enabled": False},
              "steps_per_print": 10**9, "wall_clock_breakdown": False}
    # The tied output projection is a call of the wte module itself (``unembed=True``), so ZeRO-3's
    # module hooks see both uses of its weight: no external-parameter registration is needed.
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds_cfg)
    return deepspeed_step(engine, data, dist)


def deepspeed_step(engine, data, dist):
    """One DeepSpeed training step on position ``pos`` of ``data``: the global mean loss."""
    from framework.models.gpt import gpt_loss

    def step(pos: int) -> float:
        batch = data.train_batch(pos, micro_batch=MICRO, grad_accum=1, rank=dist.rank, world=dist.world)
        loss = gpt_loss(engine, batch.micro[0])
        engine.backward(loss)
        engine.step()
        return _global_loss(loss, dist.world)

    return step


def _import_deepspeed():
    """Import DeepSpeed for the CPU without letting it JIT-build its shared-memory comm op."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed  # noqa: F401

    # ``import deepspeed.comm.torch`` would bind the name ``torch`` that deepspeed.comm re-exports.
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    for name in ("DeepSpeed", "deepspeed"):
        logging.getLogger(name).setLevel(logging.WARNING)
    return deepspeed


def run_system(dist, name: str, steps: int) -> dict:
    """One rank of one system: build, 3 warm-up steps, ``steps`` timed steps."""
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)  # torch's collective renames, per step
    from framework import compose
    from framework.engine.build import component
    from bench._common import peak_rss_bytes

    if name.startswith("ds-"):
        _import_deepspeed()
    elif name.startswith("fsdp2"):
        importlib.import_module("torch.distributed.fsdp")
    build = (_ours if name in OURS else _torch_ddp if name in ("torch-ddp", "torch-zero")
             else _fsdp2 if name.startswith("fsdp2") else _deepspeed)
    cfg = compose(OVERRIDES + [o for o in OURS.get(name, [])])
    data = component(cfg, "data").build(cfg.data, seed=0, context=cfg.model.context)
    start_rss = peak_rss_bytes()
    torch.manual_seed(0)
    model = component(cfg, "model").build(cfg.model, vocab_size=data.vocab_size)
    n_params = sum(p.numel() for p in model.parameters())
    step = build(dist, name, cfg, model, data)
    losses, times = [], []
    for pos in range(WARMUP + steps):
        t = time.perf_counter()
        losses.append(step(pos))
        if pos >= WARMUP:
            times.append(time.perf_counter() - t)
    return {"times": times, "losses": losses, "start_rss": start_rss, "params": n_params,
            "threads": torch.get_num_threads()}


# --- driver ---------------------------------------------------------------------------------

def _available(systems: list[str]) -> tuple[list[str], list[str]]:
    """Drop systems that cannot run here; return (runnable, notes)."""
    keep, notes = [], []
    ds_error = None
    if any(s.startswith("ds-") for s in systems):
        try:
            _import_deepspeed()
        except Exception as e:  # ImportError, or DeepSpeed failing to set up its accelerator
            ds_error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    for s in systems:
        if s == "zero3":
            from framework import compose
            try:
                compose(["+stage=zero3"])
            except Exception as e:
                notes.append(f"zero3 skipped: `framework.compose(['+stage=zero3'])` raised "
                             f"{type(e).__name__}: {str(e).splitlines()[0]}")
                continue
        if s.startswith("ds-") and ds_error is not None:
            notes.append(f"{s} skipped: `import deepspeed` failed in {sys.executable} ({ds_error})")
            continue
        keep.append(s)
    return keep, notes


def _busy_seconds() -> tuple[float, float]:
    """(CPU seconds all processes on this machine have used, those this process and its reaped
    children used): the difference over a run is what others took from the machine meanwhile."""
    import resource

    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    hz = os.sysconf("SC_CLK_TCK")
    busy = (v[0] + v[1] + v[2] + v[5] + v[6] + (v[7] if len(v) > 7 else 0)) / hz  # incl. steal
    own = sum(resource.getrusage(w).ru_utime + resource.getrusage(w).ru_stime
              for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return busy, own


def _git_state() -> str:
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                              text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "framework", "conf"], cwd=root,
                               capture_output=True, text=True).stdout.split("\n")
    except OSError:
        return "unknown (no git)"
    dirty = [line[3:] for line in dirty if line.strip()]
    return f"commit {head}" + (f" + uncommitted changes in {len(dirty)} files under framework/, conf/"
                               if dirty else " (clean)")


def kernel_option(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--kernel", choices=["torch", "ours"], default="torch",
                    help="optimizer kernel of our stages: torch's fused AdamW (the peers' kernel) or our C++ one")


def use_kernel(ap: argparse.ArgumentParser, kernel: str) -> None:
    """``--kernel``'s choice for the ranks about to be spawned, or one error line where ours cannot be had."""
    # Read by our optimizers in every spawned rank (they inherit the environment).
    os.environ["FRAMEWORK_OPS"] = "0" if kernel == "torch" else "1"
    if kernel == "ours":
        import framework.ops

        # (builds it here if needed, once, before the ranks): without it ours would run torch's kernel
        if not framework.ops.available():
            ap.error(f"--kernel ours: our C++ CPU kernel is not available ({framework.ops.unavailable_reason()}); "
                     f"see `python -m framework.ops status`, or use --kernel torch")


def main(argv: list[str] | None = None) -> None:
    from bench._common import machine, run_ranks_detail

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--systems", default=",".join(ALL), help=f"comma-separated, from: {', '.join(ALL)}; and, named only, {', '.join(EXTRA)}")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--world", type=int, default=2)
    kernel_option(ap)
    ap.add_argument("--max-other", type=float, default=0.2,
                    help="a run during which other processes used more CPU cores than this is repeated")
    ap.add_argument("--noisy-retries", type=int, default=4, help="repeats of a noisy run before keeping the quietest")
    ap.add_argument("--noisy-wait", type=float, default=20.0, help="seconds to wait before repeating a noisy run")
    args = ap.parse_args(argv)
    asked = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in asked if s not in ALL + EXTRA]
    if unknown:
        ap.error(f"unknown system(s) {', '.join(unknown)}; choose from {', '.join(ALL + EXTRA)}")
    use_kernel(ap, args.kernel)
    systems, notes = _available(asked)
    for n in notes:
        print(f"note: {n}", flush=True)
    load_before = os.getloadavg()
    results: dict[str, list] = {k: [] for k in systems}
    failed: dict[str, str] = {}
    retried: list[str] = []
    discarded: list[str] = []
    other: dict[str, list[float]] = {k: [] for k in systems}  # cores used by others during each run
    for r in range(args.rounds):
        for name in (systems if r % 2 == 0 else systems[::-1]):
            if name in failed:
                continue
            runs = []  # (result, cores others used) of each completed try
            crashes = 0  # counted apart from noisy repeats: noise must not use up a crash's retry
            while crashes < ATTEMPTS:
                attempt = len(runs) + crashes + 1
                try:
                    b0, o0, w0 = *_busy_seconds(), time.perf_counter()
                    res = run_ranks_detail(args.world, run_system, name, args.steps)
                    b1, o1, w1 = *_busy_seconds(), time.perf_counter()
                except Exception as e:  # one system failing must not lose the others' numbers
                    why = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
                    print(f"round {r} {name}: attempt {attempt} FAILED {why}", flush=True)
                    retried.append(f"{name} round {r} attempt {attempt}: {why}")
                    crashes += 1
                    continue
                runs.append((res, max(0.0, (b1 - b0) - (o1 - o0)) / (w1 - w0)))
                if runs[-1][1] <= args.max_other:
                    break
                if len(runs) > args.noisy_retries:
                    print(f"round {r} {name}: {res[0]:.3f} s/step, others used {runs[-1][1]:.2f} cores: noisy, "
                          f"no repeats left, the quietest run is kept", flush=True)
                    break
                print(f"round {r} {name}: {res[0]:.3f} s/step, others used {runs[-1][1]:.2f} cores: noisy, "
                      f"repeating", flush=True)
                time.sleep(args.noisy_wait)
            if not runs:
                failed[name] = why
                continue
            kept = min(range(len(runs)), key=lambda i: runs[i][1])  # the quietest (the last, unless all noisy)
            discarded += [f"{name} round {r}: {x[0]:.3f} s/step while others used {c:.2f} cores"
                          for i, (x, c) in enumerate(runs) if i != kept]
            res, cores = runs[kept]
            results[name].append(res)
            other[name].append(cores)
            t, rss, info = results[name][-1]
            print(f"round {r} {name}: {t:.3f} s/step, peak RSS {max(rss) / 2**20:.0f} MiB, "
                  f"first loss {info[0]['losses'][0]:.6f}, others used {other[name][-1]:.2f} cores", flush=True)
    load_after = os.getloadavg()
    done = [s for s in systems if results[s]]
    print(f"\n{machine()}; {args.world} gloo ranks, 1 thread each; median over {args.rounds} rounds of the "
          f"per-round median of {args.steps} steps after {WARMUP} warm-up; our optimizer kernel: "
          f"{'torch fused AdamW (same as the peers)' if args.kernel == 'torch' else 'our C++ CPU kernel'}")
    print(f"load average (1/5/15 min) before {load_before[0]:.2f}/{load_before[1]:.2f}/{load_before[2]:.2f}, "
          f"after {load_after[0]:.2f}/{load_after[1]:.2f}/{load_after[2]:.2f}")
    noise = [x for v in other.values() for x in v]
    if noise:
        print(f"CPU used by other processes during the kept runs: median {statistics.median(noise):.2f}, "
              f"max {max(noise):.2f} cores (of {os.cpu_count()}); {len(discarded)} runs discarded as noisy "
              f"(others above {args.max_other:g} cores) and repeated")
    print(f"code: {_git_state()}")
    if done:
        info0 = results[done[0]][0][2][0]
        print(f"model: {info0['params']:,} params; threads per rank seen at the end: "
              f"{sorted({i['threads'] for s in done for _, _, infos in results[s] for i in infos})}\n")
    base = statistics.median(t for t, _, _ in results[BASELINE]) if results.get(BASELINE) else None
    n = WARMUP + args.steps
    print(f"| system | s/step | vs torch DDP | peak RSS per rank (MiB) | RSS over start (MiB) | first loss "
          f"| loss at step {n} |\n|---|---|---|---|---|---|---|")
    firsts, lasts = {}, {}
    for name in done:
        runs = results[name]
        t = statistics.median(x for x, _, _ in runs)
        rss = max(max(r) for _, r, _ in runs) / 2**20
        over = max(r - i["start_rss"] for _, rs, infos in runs for r, i in zip(rs, infos)) / 2**20
        firsts[name] = runs[0][2][0]["losses"][0]
        lasts[name] = runs[0][2][0]["losses"][-1]
        rel = f"{t / base:.3f}x" if base else "n/a"
        print(f"| {name} | {t:.3f} | {rel} | {rss:.0f} | {over:.0f} | {firsts[name]:.6f} | {lasts[name]:.6f} |")
    if firsts:
        spread = max(firsts.values()) - min(firsts.values())
        ref = lasts.get(BASELINE, next(iter(lasts.values())))
        worst = max(lasts, key=lambda k: abs(lasts[k] - ref))
        print(f"\nfirst-step loss spread across systems: {spread:.2e} ({'agrees' if spread < 1e-5 else 'DISAGREES'}); "
              f"loss at step {n}: largest gap to {BASELINE if BASELINE in lasts else 'the first system'} "
              f"{abs(lasts[worst] - ref):.2e} ({worst})")
    for n_ in notes:
        print(f"note: {n_}")
    for line in discarded:
        print(f"note: discarded noisy run: {line}")
    for line in retried:
        print(f"note: failed attempt (retried): {line}")
    for name, why in failed.items():
        print(f"note: {name} failed {ATTEMPTS} times and was dropped: {why}")


if __name__ == "__main__":
    main()
