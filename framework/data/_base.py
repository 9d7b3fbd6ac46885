"""The data-source base class and the batch layout every source shares.

The global batch at ``position`` is drawn from a generator seeded by ``(seed, position)`` alone: a restarted
run sees the same batches whatever the ranks or micro-batch split. Its ``micro_batch * grad_accum * world``
rows are viewed as ``[grad_accum, world, micro_batch]``, so each accumulation step's micro batches, in rank
order, are the rows one rank with ``world * micro_batch`` would see at that step.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from framework.core.batch import Batch
from framework.core.errors import ConfigError, DataError
from framework.core.paths import REPO_ROOT, user_path

TRAIN_STREAM, VAL_STREAM, CHAIN_STREAM = 0, 1, 2   # independent random streams
_MASK64 = (1 << 64) - 1


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


def rank_rows(*, micro_batch: int, grad_accum: int, rank: int, world: int) -> Tensor:
    """Global-batch row indices of this rank, micro batch after micro batch (see module doc)."""
    if micro_batch < 1 or grad_accum < 1 or world < 1:
        raise ConfigError(f"micro_batch ({micro_batch}), grad_accum ({grad_accum}) and world "
                          f"({world}) must all be >= 1")
    if not 0 <= rank < world:
        raise ConfigError(f"rank {rank} is outside [0, {world})")
    steps = torch.arange(grad_accum, device="cpu").unsqueeze(1)
    return ((steps * world + rank) * micro_batch + torch.arange(micro_batch, device="cpu")).flatten()


def resolve_path(path: str) -> Path:
    """A data file (``data.path``): absolute, or relative to the working directory, else to the repo root."""
    p = Path(user_path(path))
    candidates = [p] if p.is_absolute() else list(dict.fromkeys([Path.cwd() / p, REPO_ROOT / p]))
    for c in candidates:
        if c.is_file():
            return c.resolve()
    if folder := next((c for c in candidates if c.is_dir()), None):
        raise DataError(f"data.path={path}: {folder} is a folder; point data.path at the file in it to train on")
    looked = ", ".join(str(c) for c in candidates)
    raise DataError(f"data file {path!r} not found (looked at {looked}); "
                    "point data.path at an existing file, e.g. data.path=/abs/path/to/file")


def check_splits(name: str, lengths: dict[str, int], context: int, val_fraction: float | None = None) -> None:
    """Refuse a split (name -> its tokens) too short for one crop of ``context + 1``; ``val_fraction``:
    ``data.val_fraction``, where the config sets the split."""
    for split, n in lengths.items():
        if n < context + 1:
            fix = "more data or a shorter model.context" if val_fraction is None else \
                f"more data, a shorter model.context or a {'larger' if split == 'val' else 'smaller'} " \
                f"data.val_fraction (now {val_fraction})"
            raise DataError(f"{name}: the {split} split has {n} tokens, fewer than "
                            f"context + 1 = {context + 1}; use {fix}")


class DataSource:
    """Batches of a source whose ``_draw(split, n, gen, rows)`` returns the ``rows`` of ``n`` sequences of
    ``context + 1`` tokens drawn from ``gen``; ``describe()`` is what the run's summary says of it."""

    vocab_size: int
    seed: int
    val_key: tuple[int, ...] = ()   # seeds the held-out batches with VAL_STREAM and the batch index

    def _draw(self, split: str, n: int, gen: torch.Generator, rows: Tensor) -> Tensor:
        raise NotImplementedError

    def describe(self) -> dict:
        raise NotImplementedError

    def identity(self) -> dict | None:
        """What a checkpoint records of the data (a resume refuses another vocabulary and notes other content):
        ``path``, ``vocab`` (the characters the ids stand for, or None where unknown) and a content stamp,
        ``bytes`` with ``sha256`` where a checksum is at hand (text: of its ids). None: the config says it all."""
        return None

    def train_batch(self, position: int, *, micro_batch: int, grad_accum: int, rank: int,
                    world: int) -> Batch:
        if position < 0:
            raise ValueError(f"data position must be >= 0, got {position}")
        rows = rank_rows(micro_batch=micro_batch, grad_accum=grad_accum, rank=rank, world=world)
        micro = self._micro("train", seeded(TRAIN_STREAM, self.seed, position), rows, world, micro_batch)
        return Batch(micro=tuple(micro), position=position + 1)

    def val_batches(self, n: int, *, batch: int, rank: int, world: int,
                    grad_accum: int = 1) -> list[tuple[Tensor, Tensor]]:
        """This rank's micro batches (``batch`` rows each) of ``n`` held-out global batches, split as train's:
        the held-out rows depend on the global batch only. Independent of the run seed and of ``n``."""
        rows = rank_rows(micro_batch=batch, grad_accum=grad_accum, rank=rank, world=world)
        return [m for j in range(n)
                for m in self._micro("val", seeded(VAL_STREAM, *self.val_key, j), rows, world, batch)]

    def _micro(self, split: str, gen: torch.Generator, rows: Tensor, world: int,
               size: int) -> list[tuple[Tensor, Tensor]]:
        """This rank's ``rows`` of a global batch, as (inputs, next-token targets) micro batches of ``size``."""
        seqs = self._draw(split, len(rows) * world, gen, rows)
        x, y = seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous()
        return [(x[i:i + size], y[i:i + size]) for i in range(0, len(x), size)]


class CropSource(DataSource):
    """Random crops of ``context + 1`` tokens from flat integer arrays ``train`` and ``val``; a source whose splits
    are not in memory (any sized object) reads them in its own ``_crops``."""


    def __init__(self, *, train: np.ndarray, val: np.ndarray, vocab_size: int, seed: int,
                 context: int, kind: str, path: Path, identity: dict, val_fraction: float | None = None) -> None:
        """``identity``: ``identity()``'s vocab and content stamp; ``val_fraction``: ``data.val_fraction``, where the
        config sets the split (named when a split is too short)."""
        check_splits(f"{kind} {path}", {"train": len(train), "val": len(val)}, context, val_fraction)
        self.train, self.val = train, val
        self.vocab_size, self.seed, self.context = vocab_size, seed, context
        self.kind, self.path = kind, path
        self._identity = {"source": kind, "path": str(path), **identity}

    def _draw(self, split: str, n: int, gen: torch.Generator, rows: Tensor) -> Tensor:
        data = self.train if split == "train" else self.val
        starts = torch.randint(0, len(data) - self.context, (n,), generator=gen, device="cpu")[rows]
        seqs = torch.from_numpy(self._crops(data, starts.numpy()).astype(np.int64))
        # (host data, no device sync) a file edited since its check, clearer than an index error in an embedding
        if seqs.numel() and int(seqs.max()) >= self.vocab_size:
            raise DataError(f"{self.kind} {self.path}: token id {int(seqs.max())} >= vocab_size "
                            f"{self.vocab_size}; set data.vocab_size to the tokenizer's size")
        return seqs

    def _crops(self, data, starts: np.ndarray) -> np.ndarray:
        """The ``context + 1`` tokens of ``data`` (``self.train`` or ``self.val``) from each of ``starts``."""
        return np.asarray(data[starts[:, None] + np.arange(self.context + 1)])

    def describe(self) -> dict:
        return {"source": self.kind, "vocab_size": self.vocab_size, "train_tokens": len(self.train),
                "val_tokens": len(self.val), "path": str(self.path)}

    def identity(self) -> dict:
        return dict(self._identity)
