"""The data-source protocol and the batch layout shared by every source.

Data is a pure function of a position: the global batch at ``position`` is drawn from a
generator seeded by ``(seed, position)`` alone, so a run restarted from a position (no
checkpoint save/load exists yet) sees exactly the batches it would have seen, whatever the
number of ranks or the micro-batch split.

Layout. The global batch has ``micro_batch * grad_accum * world`` rows, viewed as
``[grad_accum, world, micro_batch]``: accumulation step k of rank r holds global rows
``(k * world + r) * micro_batch + i``. A rank's rows are therefore disjoint from every other
rank's, contiguous within each micro batch, and, in each accumulation step, the ranks'
micro batches concatenated in rank order are the same rows that one rank with
``world * micro_batch`` would see at that step. (Giving each rank one contiguous block of
``micro_batch * grad_accum`` rows would only preserve the union over the whole step, not the
per-micro-step split.) The rows themselves depend only on ``(seed, position)`` and the
global size, never on how it is factored.
"""
from __future__ import annotations

from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np
import torch
from torch import Tensor

from framework.core.batch import Batch  # noqa: F401 - re-exported for data sources
from framework.core.errors import ConfigError, DataError

# Independent random streams: training batches, held-out batches, and anything else a
# source needs (e.g. the synthetic chain itself).
TRAIN_STREAM, VAL_STREAM, CHAIN_STREAM = 0, 1, 2
_MASK64 = (1 << 64) - 1
# framework/data/_base.py -> repository root (used to resolve relative data paths).
REPO_ROOT = Path(__file__).resolve().parents[2]


@runtime_checkable
class DataSource(Protocol):
    vocab_size: int

    def train_batch(self, position: int, *, micro_batch: int, grad_accum: int, rank: int,
                    world: int) -> Batch: ...

    def val_batches(self, n: int, *, batch: int, rank: int,
                    world: int) -> list[tuple[Tensor, Tensor]]: ...

    def describe(self) -> dict: ...


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def seeded(*key: int) -> torch.Generator:
    """A CPU generator seeded by hashing ``key``: nearby keys give unrelated streams
    (``seed + position`` would make run seed 1 at position 0 replay seed 0 at position 1)."""
    h = 0
    for k in key:
        h = _splitmix64(h ^ (int(k) & _MASK64))
    return torch.Generator().manual_seed(h >> 1)  # 63 bits: manual_seed's safe range


def check_layout(*, micro_batch: int, grad_accum: int, rank: int, world: int) -> None:
    if micro_batch < 1 or grad_accum < 1 or world < 1:
        raise ConfigError(f"micro_batch ({micro_batch}), grad_accum ({grad_accum}) and world "
                          f"({world}) must all be >= 1")
    if not 0 <= rank < world:
        raise ConfigError(f"rank {rank} is outside [0, {world})")


def rank_rows(*, micro_batch: int, grad_accum: int, rank: int, world: int) -> Tensor:
    """Global-batch row indices of this rank, micro batch after micro batch (see module doc)."""
    check_layout(micro_batch=micro_batch, grad_accum=grad_accum, rank=rank, world=world)
    steps = torch.arange(grad_accum).unsqueeze(1)
    return ((steps * world + rank) * micro_batch + torch.arange(micro_batch)).flatten()


def split_micro(seqs: Tensor, *, micro_batch: int, position: int) -> Batch:
    """Sequences [grad_accum * micro_batch, T + 1] -> a Batch of (x, y) micro batches."""
    x, y = seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous()
    micro = tuple((x[i:i + micro_batch], y[i:i + micro_batch])
                  for i in range(0, seqs.shape[0], micro_batch))
    return Batch(micro=micro, position=position + 1)


def resolve_path(path: str, *, key: str) -> Path:
    """A data file: absolute, or relative to the working directory, else to the repo root."""
    p = Path(path).expanduser()
    candidates = [p] if p.is_absolute() else list(dict.fromkeys([Path.cwd() / p, REPO_ROOT / p]))
    for c in candidates:
        if c.is_file():
            return c.resolve()
    looked = ", ".join(str(c) for c in candidates)
    raise DataError(f"data file {path!r} not found (looked at {looked}); "
                    f"point {key} at an existing file, e.g. {key}=/abs/path/to/file")


class CropSource:
    """Random crops of ``context + 1`` tokens from a flat token array (text and tokens).

    ``train`` and ``val`` are 1-D integer arrays (in memory or a memmap); a crop is read with
    one fancy index, so a memmap only touches the pages the batch needs.
    """

    def __init__(self, *, train: np.ndarray, val: np.ndarray, vocab_size: int, seed: int,
                 context: int, name: str) -> None:
        for split, arr in (("train", train), ("val", val)):
            if len(arr) < context + 1:
                raise DataError(f"{name}: the {split} split has {len(arr)} tokens, fewer than "
                                f"context + 1 = {context + 1}; use more data or a shorter context")
        self.train, self.val = train, val
        self.vocab_size, self.seed, self.context, self.name = vocab_size, seed, context, name

    def _crops(self, data: np.ndarray, starts: Tensor) -> Tensor:
        idx = starts.numpy()[:, None] + np.arange(self.context + 1)
        seqs = torch.from_numpy(np.asarray(data[idx]).astype(np.int64))
        # Cheap here, and far clearer than an out-of-range index inside an embedding kernel.
        if seqs.numel() and int(seqs.max()) >= self.vocab_size:
            raise DataError(f"{self.name}: token id {int(seqs.max())} >= vocab_size "
                            f"{self.vocab_size}; set data.vocab_size to the tokenizer's size")
        return seqs

    def _starts(self, data: np.ndarray, n: int, gen: torch.Generator) -> Tensor:
        return torch.randint(0, len(data) - self.context, (n,), generator=gen)

    def train_batch(self, position: int, *, micro_batch: int, grad_accum: int, rank: int,
                    world: int) -> Batch:
        if position < 0:
            raise ValueError(f"data position must be >= 0, got {position}")
        rows = rank_rows(micro_batch=micro_batch, grad_accum=grad_accum, rank=rank, world=world)
        starts = self._starts(self.train, micro_batch * grad_accum * world,
                              seeded(TRAIN_STREAM, self.seed, position))
        return split_micro(self._crops(self.train, starts[rows]), micro_batch=micro_batch,
                           position=position)

    def val_batches(self, n: int, *, batch: int, rank: int,
                    world: int) -> list[tuple[Tensor, Tensor]]:
        # Independent of the run seed (so val losses compare across seeds) and of n (batch j
        # is the same whether 4 or 40 are asked for); ranks split each batch like train does.
        rows = rank_rows(micro_batch=batch, grad_accum=1, rank=rank, world=world)
        out = []
        for j in range(n):
            starts = self._starts(self.val, batch * world, seeded(VAL_STREAM, j))
            seqs = self._crops(self.val, starts[rows])
            out.append((seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous()))
        return out

    def describe(self) -> dict:
        return {"source": self.name, "vocab_size": self.vocab_size,
                "train_tokens": len(self.train), "val_tokens": len(self.val)}
