"""Pre-tokenised data: a flat little-endian uint16 ``.bin`` of token ids (nanoGPT's format).

The file is memory-mapped, never loaded: each batch reads only its crops, so it scales to
files larger than RAM. The last ``val_fraction`` of the tokens is the held-out split.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from framework.data._base import CropSource, resolve_path
from framework.core.errors import ConfigError, DataError
from framework.core.registry import Component


@dataclass(kw_only=True)
class TokensConfig:
    path: str               # relative paths: working directory first, then the repo root
    vocab_size: int | None = None   # the tokenizer's size (50304 for padded GPT-2); None: meta.json beside it
    val_fraction: float = 0.1

    def __post_init__(self) -> None:
        if not 0.0 < self.val_fraction < 1.0:
            raise ConfigError(f"data.val_fraction must be in (0, 1), got {self.val_fraction}")
        if self.vocab_size is not None and not 1 <= self.vocab_size <= 1 << 16:
            raise ConfigError(f"data.vocab_size must be in [1, 65536] for uint16 tokens, "
                              f"got {self.vocab_size}")


class TokensSource(CropSource):
    def __init__(self, cfg: TokensConfig, *, seed: int, context: int) -> None:
        path = resolve_path(cfg.path, key="data.path")
        if path.stat().st_size % 2:
            raise DataError(f"{path} has an odd number of bytes, so it is not a uint16 token "
                            f"file; point data.path at a .bin of uint16 token ids")
        if path.stat().st_size == 0:
            raise DataError(f"{path} is empty; point data.path at a .bin of uint16 token ids")
        vocab = cfg.vocab_size if cfg.vocab_size is not None else _meta_vocab(path)
        try:
            data = np.memmap(path, dtype="<u2", mode="r")
        except OSError as e:
            raise DataError(f"data.path={path}: cannot read it ({e.strerror}); fix its permissions or point "
                            "data.path at a readable file") from None
        split = int((1.0 - cfg.val_fraction) * len(data))
        super().__init__(train=data[:split], val=data[split:], vocab_size=vocab,
                         seed=seed, context=context, kind="tokens", path=path)


def _meta_vocab(path) -> int:
    """The vocabulary size that ``prepare`` wrote into meta.json beside the token file."""
    meta = path.parent / "meta.json"
    try:
        vocab = json.loads(meta.read_text())["vocab_size"]
    except (OSError, ValueError, KeyError, TypeError):
        raise ConfigError(f"data.vocab_size is not set and {meta} gives none; set data.vocab_size to the "
                          f"tokenizer's size") from None
    if not isinstance(vocab, int) or not 1 <= vocab <= 1 << 16:
        raise ConfigError(f"{meta}: vocab_size {vocab!r} is not in [1, 65536]; set data.vocab_size")
    return vocab


COMPONENT = Component(config=TokensConfig, build=TokensSource)
