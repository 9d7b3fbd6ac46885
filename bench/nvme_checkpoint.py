"""Host memory of a checkpoint save and load under offload=nvme against offload=cpu, as the OS sees it.

    .venv/bin/python -m bench.nvme_checkpoint                     # gpt2-small (124 M parameters)
    .venv/bin/python -m bench.nvme_checkpoint --model gpt-mini    # the quick twin the test suite runs

Each configuration runs in a fresh process, one rank, zero2, fp32, AdamW, random tokens of the
model's vocabulary (micro batch 1, context 64): build, train ``--steps`` steps, ``Checkpointer.save``
(sync), close; then a fresh engine of the same configuration resumes from that checkpoint
(``Checkpointer.resume``: checksum verification, DCP read, re-slicing into the new layout).

Measured: a thread samples the process's anonymous resident memory (``RssAnon`` in
/proc/self/status: heap and tensors, what a save would have to fit in RAM) and its resident
mapped file pages (``RssFile`` + ``RssShmem``: page cache that the kernel can write back and
drop) every millisecond during the save and during the load; reported as the peak over the value
just before (after ``malloc_trim``), with the wall seconds of each.
offload=cpu holds the state in host memory and copies it once for a save (that copy is what lets
training go on during an async save); offload=nvme saves and loads the swapped state from the
memory-mapped swap file, so its anonymous memory should stay near zero, with the file's pages
passing through the page cache instead. Prints one JSON object.
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("RssAnon", "RssFile", "RssShmem"):
                out[key] = int(value.split()[0]) * 1024
    # Mapped file pages: RssShmem when the swap file lies on tmpfs, RssFile otherwise.
    return {"anon": out["RssAnon"], "mapped": out["RssFile"] + out["RssShmem"]}


class _Peak:
    """Peak anonymous / mapped-file resident memory over a block, above the values at its start, sampled every millisecond."""

    def __enter__(self) -> "_Peak":
        gc.collect()   # what earlier objects (reference cycles) hold goes now, not during the block
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        self.base = _status()
        self.peak = dict(self.base)
        self.t0 = time.perf_counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.001):
            for k, v in _status().items():
                self.peak[k] = max(self.peak[k], v)

    def __exit__(self, *exc) -> None:
        self.seconds = time.perf_counter() - self.t0
        self._stop.set()
        self._thread.join()
        for k, v in _status().items():
            self.peak[k] = max(self.peak[k], v)

    def result(self) -> dict[str, int]:
        return {"anon_bytes": self.peak["anon"] - self.base["anon"],
                "mapped_bytes": self.peak["mapped"] - self.base["mapped"], "seconds": round(self.seconds, 3)}


def _child(spec: dict) -> dict:
    import numpy as np
    import torch

    import framework
    from framework.engine.build import component
    from framework.persist.checkpoint import Checkpointer
    from framework.config import compose
    from framework.models.gpt import gpt_loss

    # The checkpoint package imports torch.distributed.checkpoint on its first save; import it
    # here so that the module's own memory (tens of MB, once per process) is not counted as the save's.
    import torch.distributed.checkpoint  # noqa: F401

    torch.set_num_threads(1)
    folder = Path(spec["dir"])
    tokens = folder / "tokens.bin"
    np.random.default_rng(0).integers(0, spec["vocab"], 50_000, dtype=np.uint16).tofile(tokens)
    # the swap files go into the folder asked for (--dir), not under the run directory's default
    swap = [f"offload.nvme_path={folder / 'nvme'}"] if "offload=nvme" in spec["offload"] else []
    cfg = compose([f"model={spec['model']}", "+stage=zero2", *spec["offload"], *swap, "data=tokens",
                   f"data.path={tokens}", f"data.vocab_size={spec['vocab']}", "model.context=64", "train.micro_batch=1",
                   f"checkpoint.dir={folder / 'ckpt'}", "checkpoint.every=1", "checkpoint.keep_last=0",
                   "checkpoint.resume=auto", "logger=none"])
    data = component(cfg, "data").build(cfg.data, seed=cfg.seed, context=cfg.model.context)

    def engine():
        torch.manual_seed(cfg.seed)
        module = component(cfg, "model").build(cfg.model, vocab_size=data.vocab_size)
        return framework.initialize(module, gpt_loss, cfg)

    out = {}
    with engine() as e:
        state = e.state
        for i in range(spec["steps"]):
            state, m = e.train_step(state, data.train_batch(i, micro_batch=1, grad_accum=1, rank=0, world=1))
        out["loss"] = m["loss"]
        # fp32 masters and the two Adam moments of every parameter: what the rank's state holds
        out["state_bytes"] = 12 * sum(p.numel() for p in e.components.module.parameters())
        ckpt = Checkpointer(cfg, e)
        with _Peak() as p:
            ckpt.save(state)
        ckpt.close()
        out["save"] = p.result()
        out["swap_dir_bytes"] = sum(f.stat().st_size for f in (folder / "nvme").rglob("*") if f.is_file())
    del state, m, e   # the first engine's tensors go before the second is measured
    with engine() as e:
        ckpt = Checkpointer(cfg, e)
        with _Peak() as p:
            state = ckpt.resume(e.state)
        ckpt.close()
        out["load"] = p.result()
        out["resumed_step"] = state.step
    return out


def measure(model: str, offload: list[str], vocab: int, steps: int = 1, folder: str | None = None) -> dict:
    """One configuration in a fresh process (see the module docstring); returns its numbers."""
    if folder is not None:   # --dir: created when missing, as bench.nvme_io does
        os.makedirs(folder, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="nvme-ckpt-", dir=folder) as tmp:
        spec = {"model": model, "offload": offload, "vocab": vocab, "steps": steps, "dir": tmp}
        env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        proc = subprocess.run([sys.executable, "-m", "bench.nvme_checkpoint", "--child", json.dumps(spec)],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            raise RuntimeError(f"{offload} failed:\n{proc.stderr[-3000:]}")
        return json.loads(proc.stdout.strip().splitlines()[-1])


def compare(model: str = "gpt2-small", vocab: int = 50304, steps: int = 1, folder: str | None = None) -> dict:
    return {name: measure(model, offload, vocab, steps, folder)
            for name, offload in (("cpu", ["offload=cpu"]), ("nvme", ["offload=nvme"]))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt2-small")
    ap.add_argument("--vocab", type=int, default=None, help="default: 50304 for gpt2-*, else 256")
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--dir", default=None, help="folder for the swap files and checkpoints (default /tmp)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(_child(json.loads(args.child))))
        return
    vocab = args.vocab or (50304 if args.model.startswith("gpt2") else 256)
    print(json.dumps(compare(args.model, vocab, args.steps, args.dir), indent=1))


if __name__ == "__main__":
    main()
