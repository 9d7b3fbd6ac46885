"""Shared builders for tests: tiny configs, engines and a plain-PyTorch reference loop."""
from __future__ import annotations

import contextlib
import copy
import functools
import math
import os
from pathlib import Path

import torch

from framework import compose
from framework.engine.build import component, initialize
from framework.models.gpt import gpt_loss

TINY = ["model=gpt-nano", "model.n_layer=2", "model.n_head=2", "model.d_model=32", "model.context=16",
        "data.vocab_size=24", "train.steps=20", "train.micro_batch=4", "logger=none"]


def shakespeare() -> Path:
    """The suite's copy of tiny shakespeare: the file $TINYSHAKESPEARE names (e.g. from a git worktree, which has
    no ../shared), else the copy beside the repository. Tests that need it skip when it is not a file."""
    default = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "tinyshakespeare.txt"
    return Path(os.environ.get("TINYSHAKESPEARE", default))


def count_params(cfg) -> int:
    """Exact parameter count of ``GPT(cfg)`` from its config alone: a check of the built model."""
    d, b = cfg.d_model, int(cfg.bias)
    ln = d + b * d
    attn = 3 * d * d + b * 3 * d + d * d + b * d
    mlp = 4 * d * d + b * 4 * d + 4 * d * d + b * d
    block = 2 * ln + attn + mlp
    head = 0 if cfg.tie_weights else cfg.vocab_size * d
    return cfg.vocab_size * d + cfg.context * d + cfg.n_layer * block + ln + head


def tiny_config(*overrides: str):
    """The tiny test config with ``overrides``. A Hydra composition takes about 0.3 s and the suite makes
    thousands: each set of overrides is composed once per process, world and folder, and every call gets its
    own copy (tests edit theirs). Overrides naming a file (other than the swap and checkpoint folders, which
    composing does not read) are composed afresh: the file may have changed."""
    if any("/" in o and not o.startswith(("offload.nvme_path=", "checkpoint.dir=")) for o in overrides):
        return compose([*TINY, *overrides])
    return copy.deepcopy(_composed(overrides, os.environ.get("WORLD_SIZE"), os.getcwd()))


@functools.lru_cache(maxsize=None)
def _composed(overrides: tuple[str, ...], world: str | None, cwd: str):
    return compose([*TINY, *overrides])


def build_gpt(cfg, seed: int | None = None):
    """Same init on every call with the same seed; returns (module, data source)."""
    torch.manual_seed(cfg.seed if seed is None else seed)
    data = component(cfg, "data").build(cfg.data, seed=cfg.seed, context=cfg.model.context)
    return component(cfg, "model").build(cfg.model, vocab_size=data.vocab_size), data


def run_engine(cfg, dist=None, steps: int | None = None, metrics: list | None = None):
    """Train with our engine; return (per-step losses, engine, final state). ``metrics``: each step's are
    appended to it."""
    module, data = build_gpt(cfg)
    engine = initialize(module, gpt_loss, cfg, dist)
    state, losses = engine.state, []
    rank, world = (dist.rank, dist.world) if dist is not None else (0, 1)
    for _ in range(steps or cfg.train.steps):
        batch = data.train_batch(state.data, micro_batch=cfg.train.micro_batch,
                                 grad_accum=cfg.train.grad_accum, rank=rank, world=world)
        state, m = engine.train_step(state, batch)
        losses.append(m["loss"])
        if metrics is not None:
            metrics.append(m)
    return losses, engine, state


def flat_params(module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).float() for p in module.parameters()])


def reference_losses(cfg, steps: int | None = None, norms: list | None = None):
    """A plain PyTorch loop: same init and batches, torch.optim.AdamW (or SGD), clip_grad_norm_."""
    module, data = build_gpt(cfg)
    ref = copy.deepcopy(module)
    no_decay = cfg.optimizer.weight_decay if cfg.optimizer.decay_1d else 0.0
    losses = plain_loop(cfg, ref, data, gpt_loss, steps=steps or cfg.train.steps,
                        micro_batch=cfg.train.micro_batch, no_decay_weight_decay=no_decay, norms=norms)
    return losses, ref


def plain_loop(cfg, model, data, loss_fn, *, steps: int, micro_batch: int,
               no_decay_weight_decay: float = 0.0, device=None, norms: list | None = None) -> list[float]:
    """Train ``model`` in place on one process: torch AdamW, or SGD for ``optimizer=sgd`` (1-D tensors with
    ``no_decay_weight_decay``), clip_grad_norm_, our schedule; the mean loss of each step.
    ``device``: where the batches go (the model is already there); ``norms``: each step's gradient
    norm before clipping (clip_grad_norm_'s) is appended to it."""
    from framework.core.utils import to_device

    o, t = cfg.optimizer, cfg.train
    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": o.weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": no_decay_weight_decay}]
    if cfg.choices["optimizer"] == "sgd":
        opt = torch.optim.SGD(groups, lr=o.lr, momentum=o.momentum, dampening=o.dampening, nesterov=o.nesterov)
    else:
        opt = torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)
    schedule = component(cfg, "scheduler").build(cfg.scheduler, base_lr=o.lr, total_steps=t.steps)
    losses = []
    for step in range(steps):
        batch = data.train_batch(step, micro_batch=micro_batch, grad_accum=t.grad_accum, rank=0, world=1)
        total = 0.0
        for micro in batch.micro:
            loss = loss_fn(model, micro if device is None else to_device(micro, device))
            (loss / len(batch.micro)).backward()
            total += loss.item()
        if t.grad_clip > 0 or norms is not None:   # (a max norm of inf scales by exactly 1)
            norm = torch.nn.utils.clip_grad_norm_(params, t.grad_clip if t.grad_clip > 0 else math.inf)
            if norms is not None:
                norms.append(norm.item())
        for g in opt.param_groups:
            g["lr"] = schedule(step)
        opt.step()
        opt.zero_grad()
        losses.append(total / len(batch.micro))
    return losses


class OverflowAt:
    """``gpt_loss`` made infinite on rank ``rank`` at step ``inf_at`` (the caller sets ``step``
    before each train_step): an fp16 overflow on one rank only."""

    def __init__(self, rank: int, inf_at: int | None, overflow_rank: int = 0):
        self.rank, self.inf_at, self.overflow_rank, self.step = rank, inf_at, overflow_rank, 0

    def __call__(self, module, micro):
        loss = gpt_loss(module, micro)
        return loss * float("inf") if self.step == self.inf_at and self.rank == self.overflow_rank else loss


@contextlib.contextmanager
def file_size_limit(nbytes: int):
    """A write past ``nbytes`` in any file fails with EFBIG (RLIMIT_FSIZE, SIGXFSZ ignored) while inside: a full
    disk for this process alone. The limits and the signal's handler are restored after."""
    import resource
    import signal
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)


@contextlib.contextmanager
def no_collection():
    """Garbage collection runs before and not inside: live pinned bytes measured inside change only by
    what the code inside allocates and frees (a collection that frees an earlier engine's buffers, held
    in a reference cycle, would look like the step freed them)."""
    import gc
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def reset_peak_rss() -> int:
    """Collect garbage, give freed heap back to the OS (``malloc_trim``) and reset the kernel's peak
    resident set to the current one (``clear_refs`` 5); return that baseline in bytes. A long-lived
    process (a pool rank that ran earlier tests) holds freed heap and an old peak that would otherwise
    show up as growth, or hide it."""
    import ctypes
    import gc
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return peak_rss()


def peak_rss() -> int:
    """Peak resident set since the last reset, in bytes (VmHWM; getrusage's ru_maxrss also keeps the peak
    of exited threads and of the process this one was forked from, which no reset clears)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


@contextlib.contextmanager
def env_set(**values: str):
    """Environment variables set while inside, their previous values (or absence) back after: for code
    that runs on a pool rank, a process that serves later tests (no monkeypatch there)."""
    import os
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# W&B's words for a server it did not reach (its Go service's, after its own retries), its advice to the caller
# included (on a line of its own, as W&B's service writes it)
WANDB_UNREACHABLE = ('Timed out while retrying: Post "https://api.wandb.ai/graphql": dial tcp: lookup api.wandb.ai: '
                     'no such host\nConsider increasing the init_timeout setting: '
                     'wandb.init(settings=wandb.Settings(init_timeout=...))')


def fake_wandb(asked: dict, wait_s: float = 0.0, viewer_s: float = 10.0):
    """A stand-in ``wandb`` module whose ``init`` records its keywords in ``asked``, waits ``wait_s``, then fails as
    W&B does without a network: no server is contacted, and wandb need not be installed. ``asked["gives_up_in"]``:
    how long after ``init`` was called W&B itself would give up without a network: its account look-up's retries
    (``viewer_s``, unless setup's settings turned it off), which its ``init_timeout`` does not count, then that."""
    import time
    import types

    class Settings(types.SimpleNamespace):
        model_fields = {"mode": None, "init_timeout": None, "x_disable_viewer": None}

    def setup(settings=None):
        asked["setup"] = settings
        return types.SimpleNamespace(settings=types.SimpleNamespace(init_timeout=90.0))

    def init(**kw):
        asked.update(kw)
        viewer = 0.0 if getattr(asked.get("setup"), "x_disable_viewer", False) else viewer_s
        asked["gives_up_in"] = viewer + (getattr(kw.get("settings"), "init_timeout", None) or 90.0)
        time.sleep(wait_s)
        raise RuntimeError(WANDB_UNREACHABLE)

    fake = types.ModuleType("wandb")
    fake.Settings = Settings
    fake.setup = setup
    fake.init = init
    return fake


def wandb_records(path) -> list:
    """The records of an offline W&B run's ``.wandb`` file, in order: W&B's record log, 32 KiB blocks of chunks
    (crc, length, type: 1 whole, 2-4 first, middle, last part of a record) after a 7-byte header."""
    import struct

    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, buf, block, out = Path(path).read_bytes(), 7, b"", 32768, []
    while pos + 7 <= len(data):
        if (left := block - pos % block) < 7:   # (a block's tail too short for a chunk header is padding)
            pos += left
            continue
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + n], pos + 7 + n
        if kind == 0 and n == 0:   # the block's padding
            pos += left - 7
            continue
        buf = chunk if kind in (1, 2) else buf + chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(buf)
            out.append(record)
    return out


def wandb_summaries(path) -> list[dict]:
    """The summary records of an offline run's ``.wandb`` file, in order (the last one is what W&B shows): key ->
    JSON-decoded value (a nested key joined by "/")."""
    import json

    return [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.summary.update}
            for r in wandb_records(path) if r.WhichOneof("record_type") == "summary"]
