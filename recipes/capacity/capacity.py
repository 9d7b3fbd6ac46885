"""Capacity: the largest models this machine trains from disk (zero3 + offload=nvme), measured.

    python recipes/capacity/capacity.py gpt   --nvme /path/on/disk          # 4.08 B GPT (36 x 3072)
    python recipes/capacity/capacity.py llama --nvme /path/on/disk          # 4.03 B Llama-shaped HF model (llama_4b_config.json)
    python recipes/capacity/capacity.py gpt   --nvme /tmp/x --quick         # the tiny twin (tests/cli/test_recipes.py)

Each run, in one process: measures the disk's sequential write and read bandwidth in ``--nvme``
through the swap stores' own IO engine at the run's ``offload.aio`` settings (O_DIRECT, 1 MiB requests,
8 in flight by default), builds the model under ``framework.zero_init()`` and trains ``--steps``
steps of bf16 zero3 with parameters and optimizer on NVMe, then prints one JSON line (also written
to ``--out``): parameters, model-state bytes (2 + 4 + 8 + 2 bytes per parameter: bf16 weights, fp32
master, Adam moments, bf16 gradients, as the ZeRO paper counts them) beside the machine's RAM, peak
resident memory as the kernel measured it (``ru_maxrss`` and ``VmHWM``) beside the estimator's
prediction for the same configuration (plus the process's resident set before the model is built:
Python, torch, the imports), bytes on disk (swap files),
setup seconds, seconds per step, the losses, and per step the disk floor: bytes the step moved
(read + written by the swap stores) over the bandwidth measured above. The swap files are removed
when the run ends.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

from framework.config import override_key
from framework.core.errors import FrameworkError

HERE = Path(__file__).resolve().parent
# The twin's parameters are all below the default persistence threshold, so none would ever be gathered from
# disk again: with 0 each is, as the full run's large weights are (its small ones, e.g. the 3072-wide norms, stay
# resident under the default threshold).
TWIN = ["stage.stage3_param_persistence_threshold=0"]
MODELS = {   # kind -> overrides (full run, quick twin)
    "gpt": (["model.n_layer=36", "model.d_model=3072", "model.n_head=24", "model.context=64"],
            ["model.n_layer=4", "model.d_model=128", "model.n_head=4", "model.context=32", *TWIN]),
    # llama_config.json (TinyLlama's shape, 0.97 B) fits smaller disks: add model.config=<it>
    # Four sequences per step and a larger rate: with one sequence per step the held-out loss of this
    # shape only wandered (measured at lr 1e-6, 1e-5 and 3e-5); four at 1e-5 lower it step after step.
    "llama": ([f"model.config={HERE / 'llama_4b_config.json'}", "model.context=64", "train.micro_batch=4",
               "optimizer.lr=1e-5"],
              [f"model.config={HERE / 'llama_tiny_config.json'}", "model.context=32", *TWIN]),
}
EVAL_BATCH = {"gpt": 2, "llama": 8}   # sequences of the fixed held-out batch
COMMON = ["+stage=zero3", "offload=nvme", "precision=bf16", "train.micro_batch=1", "train.grad_accum=1",
          # a constant lr from the first step (a warm-up would spend these few steps near 0), small: Adam's
          # first steps move every weight by about lr, and at d_model 3072 with one 64-token sequence per
          # step 1e-4 (even a warm-up's 3e-6..9e-6 at 36 layers) drove the loss up (measured)
          "optimizer.lr=1e-6", "scheduler=constant", "train.grad_clip=1.0",
          # one unit gathered at a time (and one prefetched): the working set is one layer
          "stage.stage3_max_live_parameters=1", "stage.stage3_prefetch_bucket_size=1",
          "offload.sub_group_size=10000000", "offload.buffer_count=4", "offload.pipeline_read=true",
          "offload.pipeline_write=true", "offload.param_buffer_count=3",
          "offload.param_buffer_size=200000000"]
# Config keys this script composes but never reads (it trains --steps steps in one process, evaluates
# its own held-out batch after each, prints every step, saves nothing): an override of one is refused,
# naming what to use instead.
UNREAD = {"train.steps": "use --steps N", "train.eval_batches": "use --eval-batch N (sequences of the held-out batch)",
          "train.eval_every": "the held-out batch is evaluated after every step (--eval-batch 0: never)",
          "train.log_every": "every step is printed", "dist": "it runs one process",
          "checkpoint": "it saves no checkpoint", "logger": "it prints one JSON line (and writes it to --out FILE)",
          "hydra": "it writes no run folder (its result goes to --out FILE)"}


def disk_bandwidth(folder: str, nbytes: int, aio) -> tuple[float, float]:
    """(write, read) bytes per second of ``nbytes`` in one swap file in ``folder``, moved by the swap stores'
    own IO engine at the run's ``offload.aio`` settings (block size; queue_depth x intra_op_parallelism
    requests in flight, O_DIRECT, checksums on): the rate a step's swap IO can reach, so a step is not
    held to a floor measured with fewer requests in flight than it keeps."""
    import torch

    from framework.comm.accelerator import for_device
    from framework.offload import AsyncIO, SwapFile, aligned_empty

    tensor = 64 << 20
    names = [f"t{i}" for i in range(max(1, nbytes // tensor))]
    # one page-aligned buffer (as the stores' pools) behind every extent, the same bytes in each: the probe
    # adds 64 MiB, not nbytes, to the run's peak
    buf = aligned_empty(tensor // 4, torch.int32, pin=False, acc=for_device(torch.device("cpu"), "plain"))
    buf.copy_(torch.randint(-2**31, 2**31 - 1, buf.shape, dtype=torch.int32))
    path = os.path.join(folder, f".bandwidth-{os.getpid()}.swap")
    rates = {}
    with SwapFile.create(path, {n: tensor for n in names}, layout_hash="bandwidth", world_size=1, rank=0,
                         dtype=torch.int32) as swap, \
            AsyncIO(aio.block_size, aio.queue_depth, aio.intra_op_parallelism) as io:
        for op, call in (("write", io.pwrite), ("read", io.pread)):
            t = time.perf_counter()
            for h in [call(swap, swap.extent(n)[0], buf, n) for n in names]:
                h.wait()
            rates[op] = len(names) * tensor / (time.perf_counter() - t)
    return rates["write"], rates["read"]


def status_bytes(key: str) -> int:
    """A memory line of /proc/self/status (``VmHWM``: the kernel's peak resident set; ``VmRSS``: now)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def estimate(cfg, vocab_size: int) -> int:
    """``framework.estimate``'s per-rank peak for this run's configuration (the model built on the
    meta device as the run builds it, traced at the run's micro batch and context)."""
    import torch

    from framework.engine.build import component
    from framework.memory.model import predict

    with torch.device("meta"):
        module = component(cfg, "model").build(cfg.model, vocab_size=vocab_size)
    return predict(cfg, 1, module=module).peak   # (traced with the model's own loss)


def ram_total() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def unread(overrides: list[str]) -> str | None:
    """The message refusing the first override of a key the script does not read (None: all are read)."""
    for o in overrides:
        key = override_key(o)
        hit = next((k for k in UNREAD if key == k or key.startswith(k + ".")), None)
        if hit is not None:
            return f"{o}: capacity.py does not read {key}; {UNREAD[hit]}"
    return None


def main(argv: list[str] | None = None) -> int:
    try:
        run(argv)
    except FrameworkError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def run(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", choices=sorted(MODELS))
    ap.add_argument("--nvme", required=True, help="folder on the disk to swap to")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--quick", action="store_true", help="the tiny twin")
    ap.add_argument("--eval-batch", type=int, default=None,
                    help="sequences of the fixed held-out batch whose loss is measured before and after each step "
                         "(one 64-token sequence per step is noisy; 0: none; default: gpt 2, llama 8)")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    ap.add_argument("overrides", nargs="*", help="more config overrides")
    args = ap.parse_intermixed_args(argv)
    if args.eval_batch is None:
        args.eval_batch = EVAL_BATCH[args.model]
    if args.steps < 1 or args.eval_batch < 0:
        raise FrameworkError(f"--steps must be at least 1 (got {args.steps}) and --eval-batch at least 0 "
                             f"(got {args.eval_batch})")
    if msg := unread(args.overrides):
        raise FrameworkError(msg)
    import torch

    import framework
    from framework.engine.build import component
    from framework.comm.distributed import connect

    torch.set_num_threads(os.cpu_count() or 1)
    kind = "hf" if args.model == "llama" else "gpt-nano"
    model = MODELS[args.model][1 if args.quick else 0]
    # Composed (and so checked) before the disk test, which writes 4 GiB on a full run.
    cfg = framework.compose([f"model={kind}", *COMMON, *model, f"train.steps={args.steps}",
                             f"offload.nvme_path={os.path.join(args.nvme, 'swap')}", *args.overrides])
    os.makedirs(args.nvme, exist_ok=True)
    bw_write, bw_read = disk_bandwidth(args.nvme, (64 << 20) if args.quick else (4 << 30), cfg.offload.aio)
    dist = connect("gloo")
    torch.manual_seed(cfg.seed)   # the same initial weights on every run
    data = component(cfg, "data").build(cfg.data, seed=cfg.seed, context=cfg.model.context)
    if args.model == "llama":
        import transformers  # noqa: F401  (imported by the build below: part of the runtime)
    runtime = status_bytes("VmRSS")   # Python, torch and the imports: what the estimator's prediction is added to
    t0 = time.perf_counter()
    with framework.zero_init():
        module = component(cfg, "model").build(cfg.model, vocab_size=data.vocab_size)
    params = sum(p.numel() for p in module.parameters())
    loss_fn = component(cfg, "model").loss
    engine = framework.initialize(module, loss_fn, cfg, dist)
    setup_s = time.perf_counter() - t0
    update = engine.components.update
    state, losses, steps = engine.state, [], []
    held_out = data.val_batches(1, batch=args.eval_batch, rank=0, world=1) if args.eval_batch else None
    evals = [engine.eval_step(state, held_out)] if held_out else []
    for i in range(args.steps):
        before = update.swap_stats()
        batch = data.train_batch(state.data, micro_batch=cfg.train.micro_batch, grad_accum=cfg.train.grad_accum, rank=0, world=1)
        t = time.perf_counter()
        state, m = engine.train_step(state, batch)
        dt = time.perf_counter() - t
        after = update.swap_stats()
        read, written = after["read"] - before["read"], after["written"] - before["written"]
        floor = read / bw_read + written / bw_write
        losses.append(m["loss"])
        if held_out:
            evals.append(engine.eval_step(state, held_out))
        steps.append({"s": dt, "read_bytes": read, "written_bytes": written, "floor_s": floor,
                      "vs_floor": dt / floor if floor else None, "io_wait_s": after["wait_s"] - before["wait_s"]})
        print(f"step {i + 1}: loss {m['loss']:.4f}{f'  held-out {evals[-1]:.4f}' if held_out else ''}  {dt:.1f} s  "
              f"(disk floor {floor:.1f} s: "
              f"{read / 1e9:.1f} GB read, {written / 1e9:.1f} GB written)", flush=True)
    disk = update.swap_stats()["file"]
    engine.close()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    hwm = status_bytes("VmHWM")
    predicted = estimate(cfg, data.vocab_size)
    out = {"model": args.model, "quick": args.quick, "params": params,
           "model_state_bytes": params * 16, "ram_bytes": ram_total(),
           "model_state_over_ram": params * 16 / ram_total(),
           "peak_rss_bytes": peak, "vm_hwm_bytes": hwm, "runtime_rss_bytes": runtime,
           "estimated_peak_bytes": predicted + runtime, "estimate_vs_measured": (predicted + runtime) / hwm,
           "disk_bytes": disk,
           "disk_write_Bps": bw_write, "disk_read_Bps": bw_read,
           "disk_aio": {k: getattr(cfg.offload.aio, k) for k in ("block_size", "queue_depth", "intra_op_parallelism")},
           "setup_s": setup_s, "s_per_step": sum(s["s"] for s in steps[1:] or steps) / len(steps[1:] or steps),
           "losses": losses, "held_out_losses": evals, "steps": steps, "torch": torch.__version__, "cpus": os.cpu_count()}
    line = json.dumps(out)
    if args.out:
        Path(args.out).write_text(line + "\n")
    print(line, flush=True)


if __name__ == "__main__":
    sys.exit(main())
