"""The training loop of the CLI: build by registry name, then state, metrics = train_step(state, batch)."""
from __future__ import annotations

import contextlib
import gc
import math
import os
import signal
import sys
import time
from collections import deque
from dataclasses import replace
from pathlib import Path
from statistics import fmean
from typing import Callable

import torch

from framework.engine.build import component, initialize
from framework import ops
from framework.core import files
from framework.persist.checkpoint import Checkpointer, checkpoint_root
from framework.config import Config, check_model_vocab
from framework.comm.distributed import Dist, agree
from framework.core.errors import Interrupted, Terminated
from framework.core.room import descriptors_named
from framework.loggers import NullLogger, RunInfo, RunRecord, console_log, run_header
from framework.engine.materialize import zero_init
from framework.memory.probe import rss_now, rss_peak
from framework.stages import param_count
from framework.engine.state import capture_rng
from framework.core.utils import to_device
from framework.persist.rng import fresh_seed, seed_all
from framework.persist.weights import load_weights, save_on_model_save


def train(cfg: Config, run: RunInfo, dist: Dist, on_point: Callable[[str], None] | None = None,
          on_ready: Callable[[Path], None] | None = None) -> dict:
    """Train the configured model; rank 0 logs, writes metrics.jsonl and summary.json, and copies its console
    to the run folder's train.log. ``on_point(point)`` (fault tests) is called after each step (``step:<N>``)
    and at each save's points; ``on_ready(run folder)`` on rank 0 once the checks that can refuse the run passed."""
    if not dist.is_main:
        with descriptors_named():
            return _train(cfg, run, dist, on_point, None)
    files.make_dirs(run.run_dir)
    with console_log(run.run_dir / "train.log"), descriptors_named():
        print("\n".join(run_header(cfg, run, dist.world, dist.backend, dist.device,
                                   checkpoint_root(cfg, run.run_dir, run.job))), flush=True)
        return _train(cfg, run, dist, on_point, on_ready)


def _train(cfg: Config, run: RunInfo, dist: Dist, on_point: Callable[[str], None] | None,
           on_ready: Callable[[Path], None] | None) -> dict:
    # An earlier job of this process (a sweep's) left its engine in reference cycles (stage <-> placement,
    # zero3's units <-> parameters): free its device and pinned buffers before this job measures and allocates.
    gc.collect()
    rss_start = reset_peak_memory(dist.device)  # this job's peak, not an earlier multirun job's
    if cfg.choices["offload"] == "nvme" and cfg.offload.nvme_path is None:   # swap files in the run directory
        cfg = replace(cfg, offload=replace(cfg.offload, nvme_path=str(run.run_dir / "nvme")))
    seed_all(cfg.seed)  # same model initialisation on every rank
    data = component(cfg, "data").build(cfg.data, seed=cfg.seed, context=cfg.model.context)
    check_model_vocab(cfg, data.vocab_size)
    if getattr(cfg.precision, "auto_cast", False) and type(data).__module__.startswith("framework.") and dist.is_main:
        # (a plugin's data may give floating inputs; the built-in sources give token ids, which it never casts)
        print(f"note: precision.auto_cast=true changes nothing here: data={cfg.choices['data']} gives the model "
              "integer token ids, and auto_cast casts floating inputs only (it is for a module called with them, "
              "in a loop of your own); drop it", file=sys.stderr, flush=True)
    # The config as built (W&B's, summary.json's): the data's vocabulary (checkpoints keep the composed one, which a
    # resume is compared with)
    built = cfg if getattr(cfg.model, "vocab_size", None) in (None, data.vocab_size) else \
        replace(cfg, model=replace(cfg.model, vocab_size=data.vocab_size))
    model = component(cfg, "model")
    with zero_init():  # on the meta device: the stage materialises parameters (only its shard under zero3)
        module = model.build(cfg.model, vocab_size=data.vocab_size)
    engine = initialize(module, model.loss, cfg, dist)
    weights = model.weights(cfg.model)
    if weights is not None:  # pretrained: each rank reads only the ranges its shards hold
        load_weights(engine, weights)
    # dropout streams differ per rank, fixed per run (a resume restores the saved ones)
    seed_all(fresh_seed(cfg.seed, dist.rank))
    state = replace(engine.state, rng=capture_rng(dist.device))

    t = cfg.train
    shard = dict(rank=dist.rank, world=dist.world)
    # Global batches of train's size, evaluated in its micro batches: the val loss does not depend on the split.
    val = to_device(data.val_batches(t.eval_batches, batch=t.micro_batch, grad_accum=t.grad_accum, **shard),
                    dist.device)
    tokens_per_step = t.micro_batch * t.grad_accum * dist.world * cfg.model.context
    logger = NullLogger()
    # The last log_every losses (a save's record) and finite ones (the summary's): bounded for a run of millions of
    # steps; and the last val loss
    recent, finite, val_loss = deque(maxlen=t.log_every), deque(maxlen=t.log_every), math.nan
    ckpt = Checkpointer(cfg, engine, job=run.job, run_dir=run.run_dir, on_point=on_point,   # collective
                        batch_from_config=True, data=data.identity(), lock=run.checkpoint_lock)
    try:
        state = ckpt.resume(state)
        # The summary's train loss is the mean of the last log_every steps: those before the checkpoint too
        carried = ckpt.recent_losses[-t.log_every:]
        if state.step > t.steps and dist.is_main:
            print(f"checkpoint: the checkpoint's step {state.step} is already past train.steps={t.steps}: nothing is "
                  f"trained; set train.steps above {state.step} to train on from it, or "
                  f"{ckpt.afresh(ckpt.resumed_from)}", flush=True)
        if dist.is_main:
            # A resume from this run's own checkpoints continues its W&B run and metrics.jsonl; any other
            # start is a new run here: the folder's records (of another history) are set aside.
            mine = ckpt.resumed_from is not None and bool(
                {run.run_dir.resolve(), ckpt.root.resolve()} & set(ckpt.resumed_from.resolve().parents))
            start = state.step if mine else 0
            logger = RunRecord(run.run_dir, component(cfg, "logger").build(cfg.logger, run=replace(
                run, resumed=mine, start=start, peers_wait_s=dist.timeout_s if dist.world > 1 else None)), start=start)
        # The W&B config: the resolved values and where each came from. Rank 0's start (W&B reaching its server)
        # may fail: the other ranks hear its error rather than wait in the first step's collectives.
        agree(dist, lambda: logger.start({**built.to_dict(), "config_sources": dict(cfg.sources)}, t.steps),
              "the logger's start")
        if on_ready is not None:   # (rank 0's)
            on_ready(run.run_dir)
        t_start = t_window = time.perf_counter()
        first = state.step   # a resumed run: throughput and ETA count only the steps this process runs
        # Throughput is of training: evaluating and saving are left out of each log window's rate and the summary's
        window, paused = 0, 0.0  # steps, and seconds evaluating and saving, since the last log line
        eval_s = save_s = 0.0   # the run's
        while state.step < t.steps:
            batch = data.train_batch(state.data, micro_batch=t.micro_batch, grad_accum=t.grad_accum, **shard)
            state, m = engine.train_step(state, replace(batch, micro=to_device(batch.micro, dist.device)))
            recent.append(m["loss"])
            if math.isfinite(m["loss"]):
                finite.append(m["loss"])
            if on_point is not None:
                on_point(f"step:{state.step}")
            window += 1
            if state.step % t.log_every == 0 or state.step == t.steps:
                now = time.perf_counter()
                logger.log({"step": state.step, **{k: v for k, v in m.items() if k != "skipped"},
                            "skipped_steps": state.precision.skipped_steps,
                            "tokens_per_s": tokens_per_step * window / (now - t_window - paused),
                            "eta_s": (now - t_start) / (state.step - first) * (t.steps - state.step)})
                t_window, window, paused = now, 0, 0.0
            if (t.eval_every and state.step % t.eval_every == 0) or state.step == t.steps:
                t_eval = time.perf_counter()
                val_loss = engine.eval_step(state, val)
                took = time.perf_counter() - t_eval
                paused, eval_s = paused + took, eval_s + took
                logger.log({"step": state.step, "val_loss": val_loss})
            if cfg.checkpoint.every:   # (else the run's header said none are saved)
                t_save = time.perf_counter()
                ckpt.maybe_save(state, last=state.step == t.steps, metrics=m,
                                losses=[*carried, *recent][-t.log_every:])
                took = time.perf_counter() - t_save
                paused, save_s = paused + took, save_s + took
        if state.step == first:   # resumed at train.steps: the loaded state's numbers, not NaN
            val_loss = engine.eval_step(state, val)
        t_save = time.perf_counter()
        ckpt.wait()   # (the last save's writing)
        save_s += time.perf_counter() - t_save
        elapsed = time.perf_counter() - t_start
        summary = {
            "steps": state.step,
            # The mean of the last log_every trained steps' losses; none where this process trained none
            **train_loss([*carried, *finite] if recent else [], t.log_every),
            "val_loss": val_loss,
            # Over the training time (as each log window's); none measured where this process trained no step
            "tokens_per_s": tokens_per_step * (state.step - first) / (elapsed - eval_s - save_s)
                            if state.step > first else None,
            "steps_run": state.step - first,   # by this process (fewer than steps after a resume)
            "skipped_steps": state.precision.skipped_steps,
            "elapsed_s": elapsed,   # the loop's wall time: training, evaluating (eval_s) and saving (save_s)
            "eval_s": eval_s, "save_s": save_s, "world": dist.world, "params": param_count(module),
            "data": data.describe(),
            # The ledger: bytes of the tensors the engine holds, by item and place; the peak is measured.
            "memory_per_rank": dist.all_gather_object(engine.memory(state).as_dict(), what="memory ledger gather"),
            "peak_memory_per_rank": dist.all_gather_object(peak_memory(dist.device, rss_start),
                                                          what="peak memory gather"),
            "config": built.to_dict(),
            "config_sources": dict(cfg.sources),   # default, YAML, DeepSpeed file/default, auto, command line
        }
        if cfg.resume_given:   # (the config has where latest led: the report shows the run's overrides as typed)
            summary["resume_given"] = cfg.resume_given
        if cfg.notices:
            summary["ds_config_notices"] = list(cfg.notices)
        if (host_kernels := ops.in_use()) is not None:   # the two paths differ in the last bits (docs/stages.md)
            summary["cpu_optimizer_kernels"] = host_kernels
        # stage3_gather_16bit_weights_on_model_save (collective): under on_nonfinite=stop a diverged state is refused as
        # its checkpoint would be; with checkpoints on, the last save (or the one resumed) has checked it already.
        if t.on_nonfinite == "stop" and not cfg.checkpoint.every and engine.components.stage.weights_on_save():
            ckpt.check_finite(state, f"not exporting model_16bit at step {state.step}")
        if save_on_model_save(engine, run.run_dir / "model_16bit") is not None:
            summary["exported"], summary["exported_dtype"] = "model_16bit", engine.components.policy.name
        logger.finish(summary)
        return summary
    except KeyboardInterrupt:   # Ctrl-C: one line with the last finished step (the CLI prints it)
        raise Interrupted(state.step) from None
    except SystemExit as e:   # SIGTERM (_signals.signals_unwind): the same, for this signal
        if isinstance(e, Terminated):
            raise
        # (a save to resume from: one this run resumed from, or a periodic one it passed)
        saved = ckpt.resumed_from is not None or 0 < cfg.checkpoint.every <= state.step
        why = None if e.code == 128 + signal.SIGTERM else exit_why(e.code, cfg.checkpoint.every, saved)
        raise Terminated(state.step, e.code, why) from None
    finally:   # every close runs: a SIGTERM (SystemExit) inside one must not leave swap files or an unfinished W&B run
        close_all(ckpt.close, engine.close, logger.close)


# submitit's exits once it requeued the job (Slurm's job_environment._exit, local LOCAL_REQUEUE_RETURN_CODE)
REQUEUE_EXITS = (-1, 144)


def exit_why(code, every: int, saved: bool) -> str:
    """What a SystemExit raised while training (not SIGTERM's) was: in a submitit task, its pre-emption (or time
    limit) handler's once it requeued the job, which resumes from a periodic save if one was ``saved`` (``every``:
    checkpoint.every), else starts again at step 0; else some code's exit."""
    if not os.environ.get("SUBMITIT_EXECUTOR") or code not in REQUEUE_EXITS:
        return f"exit {code} raised while training"
    then = ("resumes from its last periodic save" if saved else
            f"starts again at step 0 (no periodic save yet: checkpoint.every={every})" if every else
            "starts again at step 0 (checkpoint.every=0)")
    return f"requeued by the submitit launcher (its pre-emption/time-limit signal, exit {code}); the job {then}"


def train_loss(losses: list[float], window: int) -> dict:
    """The summary's train loss: the mean of the last ``window`` finite losses (a non-finite one trained nothing),
    and over how many steps; None where no step trained."""
    last = [x for x in losses if math.isfinite(x)][-window:]
    return {"train_loss": fmean(last) if last else None, "train_loss_steps": len(last)}


def close_all(*closes: Callable[[], None]) -> None:
    """Call every one of ``closes`` in order whatever an earlier one raised (a SIGTERM's SystemExit too); then raise
    the first exception."""
    first: BaseException | None = None
    for close in closes:
        try:
            close()
        except BaseException as e:   # (SystemExit, KeyboardInterrupt too: the rest must still run)
            if first is None:
                first = e
    if first is not None:
        raise first


def reset_peak_memory(device: torch.device) -> int:
    """Start a new peak window (the RSS high-water mark too: a multirun's jobs share a process); return the RSS now."""
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    return rss_now()


def peak_memory(device: torch.device, rss_start: int) -> dict[str, int]:
    """Peak memory since ``reset_peak_memory``: RSS (VmHWM), the RSS at the start and, on CUDA, the allocator's."""
    # (VmHWM lags the RSS: the kernel folds per-thread counters in lazily, so it can read below the start or now)
    out = {"peak_rss_bytes": max(rss_peak(), rss_start, rss_now()), "rss_start_bytes": rss_start}
    if device.type == "cuda":
        out["peak_device_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
        out["peak_device_reserved_bytes"] = torch.cuda.max_memory_reserved(device)
    return out
