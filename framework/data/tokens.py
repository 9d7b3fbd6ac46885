"""Pre-tokenised data: a flat little-endian uint16 ``.bin`` of token ids (nanoGPT's format).

The file is memory-mapped, never loaded: each batch reads only its crops, so it scales to
files larger than RAM. The last ``val_fraction`` of the tokens is the held-out split.
``<stem>.meta.json`` beside it (``recipe prepare`` writes one per token file) gives its vocabulary.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from framework.data._base import CropSource, resolve_path
from framework.core.errors import ConfigError, DataError
from framework.core.registry import Component


@dataclass(kw_only=True)
class TokensConfig:
    path: str               # relative paths: working directory first, then the repo root
    vocab_size: int | None = None   # the tokenizer's size (50304 for padded GPT-2); None: the file's meta
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
        meta, own, _, bad = _meta_vocab(path)
        if bad is not None and cfg.vocab_size is None:   # (with data.vocab_size set, the file's is not used)
            raise ConfigError(f"{meta}: vocab_size {bad!r} is not in [1, 65536]; set data.vocab_size to the "
                              "tokenizer's size")
        vocab = cfg.vocab_size if cfg.vocab_size is not None else own
        if vocab is None:
            raise ConfigError(f"data.vocab_size is not set and {meta} gives none; set data.vocab_size "
                              f"to the tokenizer's size")
        if own is not None and vocab < own:
            raise ConfigError(f"data.vocab_size={vocab} is smaller than the {own} token ids of {meta}: its "
                              f"tokens would be out of range; set data.vocab_size={own} (or null: the file's own)")
        try:
            data = np.memmap(path, dtype="<u2", mode="r")
        except OSError as e:
            raise DataError(f"data.path={path}: cannot read it ({e.strerror}); fix its permissions or point "
                            "data.path at a readable file") from None
        check_pair(path, data)
        split = int((1.0 - cfg.val_fraction) * len(data))
        super().__init__(train=data[:split], val=data[split:], vocab_size=vocab,
                         seed=seed, context=context, kind="tokens", path=path)


def meta_path(path: Path) -> Path:
    """Where ``recipe prepare`` writes the metadata of the token file ``path``: ``<stem>.meta.json``."""
    return path.with_name(f"{path.stem}.meta.json")


def tokens_stat(path: Path) -> list[int]:
    """The token file's identity as prepare records it: size, modification time (ns) and inode. Any
    write changes the time, a replacement the inode."""
    st = path.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ino]


def check_pair(path: Path, data: np.ndarray) -> None:
    """The token file against the ``<stem>.meta.json`` prepare wrote for it (one naming it): its token
    count and checksum. The two are renamed into place one after the other, so a prepare stopped
    between them leaves one file new and the other old; such a pair is refused, not read. The checksum
    (a read of the whole file, on every rank) only where the file is not the one prepare recorded
    (``tokens_stat``): a stopped prepare, a copy, a file changed by hand."""
    meta, found = read_meta(path)
    if found.get("tokens") != path.name:
        return
    counts, digest = (found.get("train_tokens"), found.get("val_tokens")), found.get("tokens_sha256")
    if (all(isinstance(c, int) for c in counts) and sum(counts) != len(data)) or \
            (isinstance(digest, str) and found.get("tokens_stat") != tokens_stat(path)
             and hashlib.sha256(data).hexdigest() != digest):
        raise DataError(f"{path} is not the token file {meta} describes (another token count or checksum: a "
                        f"prepare that was stopped, or a file changed by hand); run prepare again")


def read_meta(path: Path) -> tuple[Path, dict]:
    """The metadata of the token file ``path`` and where it is: its own ``<stem>.meta.json``, else a
    folder-wide ``meta.json`` (written by earlier versions, or by hand) unless that names another
    token file; ``(meta_path(path), {})`` when there is none."""
    for meta in (meta_path(path), path.parent / "meta.json"):
        try:
            found = json.loads(meta.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(found, dict) and found.get("tokens", path.name) == path.name:
            return meta, found
    return meta_path(path), {}


def _meta_vocab(path: Path) -> tuple[Path, object, bool, object]:
    """Where the token file's metadata is, the vocabulary size it gives (None: none or not valid),
    whether there is any, and the size it gives when that is not valid (a uint16 file's: in [1, 65536])."""
    meta, found = read_meta(path)
    vocab = found.get("vocab_size")
    if vocab is not None and (not isinstance(vocab, int) or isinstance(vocab, bool) or not 1 <= vocab <= 1 << 16):
        return meta, None, bool(found), vocab
    return meta, vocab, bool(found), None


# conf/data/tokens.yaml's data.vocab_size (GPT-2's 50257 padded): what a file without metadata is read with.
DEFAULT_VOCAB = 50304
# Bytes of text: printable ASCII and whitespace. A uint16 token file has high bytes below 0x20 for
# every id under 8192, so its first bytes are hardly ever all of these.
_TEXT_BYTES = frozenset(range(0x20, 0x7F)) | {0x09, 0x0A, 0x0D}


def _notes(cfg: TokensConfig, run) -> list[str]:
    """A data.vocab_size above the file's own vocabulary: valid (unused ids), but worth a word; a
    file without metadata read with the default vocabulary, or one that looks like text: the
    assumption said once."""
    try:
        path = resolve_path(cfg.path, key="data.path")
        meta, own, found, bad = _meta_vocab(path)
        with open(path, "rb") as f:
            head = f.read(4096)
    except (DataError, ConfigError, OSError):   # the build says it, in its own words
        return []
    if bad is not None and cfg.vocab_size is not None:
        return [f"note: {meta} gives vocab_size {bad!r}, not in [1, 65536]: ignored, data.vocab_size="
                f"{cfg.vocab_size} is used"]
    if not found and cfg.vocab_size is not None and head and set(head) <= _TEXT_BYTES:
        return [f"note: data.path={cfg.path} looks like text (its first {len(head)} bytes are printable "
                f"characters) and has no {meta.name}, so its bytes are read as uint16 token ids of a "
                f"{cfg.vocab_size}-token vocabulary; for a text file use data=text data.path={cfg.path}"]
    if not found and cfg.vocab_size == DEFAULT_VOCAB:
        return [f"note: data.path={cfg.path} has no {meta.name}: its uint16 token ids are taken to be of the "
                f"default vocabulary (data.vocab_size={DEFAULT_VOCAB}, GPT-2's padded); set data.vocab_size to "
                f"the tokenizer's size"]
    if cfg.vocab_size is None or own is None or cfg.vocab_size <= own:
        return []
    return [f"note: data.vocab_size={cfg.vocab_size} is larger than the {own} token ids of {meta}: "
            f"{cfg.vocab_size - own} of the model's vocabulary rows are never used; set data.vocab_size=null "
            f"to take the file's"]


COMPONENT = Component(config=TokensConfig, build=TokensSource, notes=_notes)
