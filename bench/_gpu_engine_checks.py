"""The GPU check's checks that drive our engine (bench/gpu_check.py runs each in a child process:
``python -m bench.gpu_check --one NAME``): memory (peak allocated per stage against the estimator)
and sync (host syncs during backward and over a step, and in model=hf's forward).
"""
from __future__ import annotations

import json
import threading
import warnings
from pathlib import Path

from bench._gpu_checks import _device, _first_line, row

MEMORY = {"ddp": [], "zero1": ["+stage=zero1"], "zero2": ["+stage=zero2"], "zero3": ["+stage=zero3"],
          "zero2+cpu": ["+stage=zero2", "offload=cpu"], "zero3+cpu params": ["+stage=zero3", "offload=cpu",
                                                                             "offload.params=cpu"]}
SYNC = {"zero2+cpu": ["+stage=zero2", "offload=cpu", "stage.overlap_comm=true"],
        "zero3+cpu params": ["+stage=zero3", "offload=cpu", "offload.params=cpu"], "zero3": ["+stage=zero3"],
        # owned gradients in the swap file, read back by the second micro batch's hooks
        "zero3+nvme accum": ["+stage=zero3", "offload=nvme", "train.grad_accum=2"]}


def _engine_run(cfg, device, steps: int, around_backward=None):
    """Our engine on ``cfg`` (built on the meta device, as bench.gpu does), ``steps`` steps of random
    batches; ``around_backward(phase)`` is told when backward starts and ends, and ("autograd") from the
    thread that runs the backward graph (on CUDA autograd's device thread, not the caller's). Returns the
    engine's final loss."""
    import torch

    from bench.gpu import _batch, _ours_step

    step, extra = _ours_step(cfg, device)
    engine = extra["engine"]
    try:
        if around_backward is not None:
            stage = engine.components.stage
            backward = stage.backward

            def told(loss, *, sync):
                around_backward("backward")
                if loss.requires_grad:   # (the hook runs where the graph runs: on that thread)
                    loss.register_hook(lambda _g: around_backward("autograd"))
                try:
                    return backward(loss, sync=sync)
                finally:
                    around_backward("step")
            stage.backward = told
        gen = torch.Generator().manual_seed(0)
        loss = None
        for _ in range(steps):
            loss = step(_batch(cfg, device, gen))
        return loss
    finally:
        engine.close()


def check_memory(dry: bool, out: Path) -> list[dict]:
    import gc

    import torch

    from bench.gpu import _predicted_gib
    from framework.config import compose

    device = _device(dry)
    model = ["model=gpt-nano", "train.micro_batch=2"] if dry else ["model=gpt2-medium", "train.micro_batch=8"]
    if device.type == "cuda":   # the caching allocator's statistics exist once CUDA is initialised
        torch.zeros(1, device=device)
    rows = []
    for name, overrides in MEMORY.items():
        if dry and name != "zero3+cpu params":   # the code path once: the CPU suite's time is short
            continue
        try:
            cfg = compose([*model, "precision=bf16", "optimizer=adamw", "logger=none", "train.steps=3", *overrides])
            predicted = _predicted_gib(cfg, device)
            if device.type == "cuda":
                gc.collect()
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
                base = torch.cuda.memory_allocated(device)
            _engine_run(cfg, device, 3)
            measured = (torch.cuda.max_memory_allocated(device) - base) / 2**30 if device.type == "cuda" else None
            if measured is None:
                rows.append(row("memory", name, None, "no device allocator on the CPU", f"estimated {predicted} GiB"))
                continue
            ratio = measured / predicted if predicted else float("nan")
            rows.append(row("memory", name, 0.8 <= ratio <= 1.1, f"{measured:.2f} GiB peak allocated",
                            f"estimated {predicted} GiB", f"measured / estimated = {ratio:.2f}"))
        except Exception as e:  # noqa: BLE001 - one stage's failure is its own row
            rows.append(row("memory", name, False, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"))
    return rows


def check_sync(dry: bool, out: Path) -> list[dict]:
    import torch

    from framework.config import compose

    device = _device(dry)
    rows = []
    for name, overrides in SYNC.items():
        if dry and name != "zero3+cpu params":
            continue
        cfg = compose(["model=gpt-nano", "precision=bf16", "logger=none", "train.micro_batch=4", *overrides])
        counts, phase, steps = {"backward": 0, "step": 0}, {"now": "step"}, {"n": 0}
        # The main thread, and the thread that runs backward's hooks: not the offload worker threads,
        # whose waits on events are their job.
        watched = {threading.main_thread().ident}

        def seen(message, category, filename, lineno, file=None, line=None):
            if threading.get_ident() in watched and steps["n"] > 0 and "synchroniz" in str(message).lower():
                counts[phase["now"]] += 1

        def told(now):
            if now == "autograd":
                watched.add(threading.get_ident())
                return
            phase["now"] = now
            if now == "step" and device.type == "cuda":   # debug mode from the second step on (after warm-up)
                steps["n"] += 1
                torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("always")
                warnings.showwarning = seen
                _engine_run(cfg, device, 3, around_backward=told)
        finally:
            if device.type == "cuda":
                torch.cuda.set_sync_debug_mode("default")
        if device.type != "cuda":
            rows.append(row("sync", f"{name}: host syncs in backward", True, "none (the check mode raised nothing)",
                            "0", "CUDA's sync debug mode needs a GPU; on the CPU the checking accelerator watches hooks"))
            continue
        rows.append(row("sync", f"{name}: syncs in backward (main and autograd threads), steps 2-3", counts["backward"] == 0,
                        counts["backward"], "0"))
        rows.append(row("sync", f"{name}: main-thread syncs outside backward, after the first", None, counts["step"],
                        "a few per step: gradient norm, loss, event waits"))
    rows.append(_hf_forward_syncs(device, out))
    return rows


def _hf_forward_syncs(device, out: Path) -> dict:
    """model=hf (a 2-layer GPT-2 config.json written to ``out``) under zero2, 3 steps: the host reads of a
    tensor's value inside the forward (``causal_lm_loss``), counted on every device, and on CUDA the syncs
    that CUDA's sync debug mode reports there, from the second step on (docs/hf.md: transformers' mask code)."""
    import torch
    from torch.overrides import TorchFunctionMode

    try:
        from framework import initialize
        from framework.config import compose
        from framework.engine.build import component
        from framework.models.hf import causal_lm_loss
    except ImportError as e:   # (transformers not installed)
        return row("sync", "model=hf: host syncs in the forward", None, f"skipped: {_first_line(e)}")
    path = out / "hf_gpt2" / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict(model_type="gpt2", n_layer=2, n_head=4, n_embd=64, vocab_size=128,
                                    n_positions=64, bos_token_id=0, eos_token_id=0)))
    cfg = compose(["model=hf", f"model.config={path}", "model.context=32", "data.vocab_size=128",
                   "precision=bf16", "logger=none", "train.micro_batch=4", "+stage=zero2"])
    counts, step = {"reads": 0, "syncs": 0}, {"n": 0}

    class Reads(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if step["n"] > 0 and getattr(func, "__name__", "") in ("__bool__", "item", "tolist", "__int__"):
                counts["reads"] += 1
            return func(*args, **(kwargs or {}))

    def seen(message, *_a, **_k):
        if step["n"] > 0 and "synchroniz" in str(message).lower():
            counts["syncs"] += 1

    with torch.device("meta"):
        model = component(cfg, "model").build(cfg.model, vocab_size=128)
    engine = initialize(model, causal_lm_loss, cfg)
    loss_fn = engine.components.loss_fn

    def counted(m, batch):
        cuda = device.type == "cuda" and step["n"] > 0
        with warnings.catch_warnings(), Reads():
            warnings.simplefilter("always")
            warnings.showwarning = seen
            if cuda:
                torch.cuda.set_sync_debug_mode("warn")
            try:
                return loss_fn(m, batch)
            finally:
                if cuda:
                    torch.cuda.set_sync_debug_mode("default")
    object.__setattr__(engine.components, "loss_fn", counted)
    try:
        gen, state = torch.Generator().manual_seed(0), engine.state
        for n in range(3):
            step["n"] = n
            x = torch.randint(0, 128, (4, 33), generator=gen).to(device)
            state, _ = engine.train_step(state, [(x[:, :-1], x[:, 1:])])
    finally:
        engine.close()
    syncs = f", {counts['syncs']} CUDA syncs" if device.type == "cuda" else " (CUDA syncs: needs a GPU)"
    return row("sync", "model=hf (GPT-2, zero2): host reads in the forward, steps 2-3", None,
               f"{counts['reads']} value reads{syncs}", "2 (one a forward): transformers' packed-sequence check "
               "(docs/hf.md)")
