"""Character-level text: the vocabulary is the sorted set of characters of the whole file.

The first 90% of the characters (``int(0.9 * n)``) are the training split, the rest the
held-out split; batches are random crops (see ``_base.CropSource``). With tinyshakespeare
this is the classic 65-character baby-GPT setup.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from framework.data._base import CropSource, resolve_path
from framework.errors import DataError
from framework.registry import Component

TRAIN_FRACTION = 0.9


@dataclass(kw_only=True)
class TextConfig:
    # UTF-8 file; relative paths are tried against the working directory, then the repo root.
    path: str


class TextSource(CropSource):
    def __init__(self, cfg: TextConfig, *, seed: int, context: int) -> None:
        path = resolve_path(cfg.path, key="data.path")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start}); "
                            f"point data.path at a UTF-8 file") from None
        # Vectorised encoding: code points -> rank in the sorted set of distinct code points.
        points = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
        vocab = np.unique(points)
        if len(vocab) == 0:
            raise DataError(f"{path} is empty; point data.path at a non-empty text file")
        ids = np.searchsorted(vocab, points).astype(np.int32)
        split = int(TRAIN_FRACTION * len(ids))
        self.path = path
        self.chars = "".join(map(chr, vocab.tolist()))
        self._index = {c: i for i, c in enumerate(self.chars)}
        super().__init__(train=ids[:split], val=ids[split:], vocab_size=len(vocab), seed=seed,
                         context=context, name=f"text {path}")

    def encode(self, s: str) -> list[int]:
        return [self._index[c] for c in s]

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)

    def describe(self) -> dict:
        return {**super().describe(), "source": "text", "path": str(self.path)}


def build(cfg: TextConfig, *, seed: int, context: int) -> TextSource:
    return TextSource(cfg, seed=seed, context=context)


COMPONENT = Component(config=TextConfig, build=build)
