"""Pre-tokenised data: a flat little-endian uint16 ``.bin`` of token ids (nanoGPT's format), read a crop at a time;
the last ``val_fraction`` is held out. ``<stem>.meta.json`` beside it (``recipe prepare``'s) gives its vocabulary."""
from __future__ import annotations

import contextlib
import hashlib
import os
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from framework.data._base import CropSource, resolve_path
from framework.core.errors import ConfigError, DataError
from framework.core.files import parse_json
from framework.core.registry import Component


@dataclass(frozen=True, kw_only=True)
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
        path = resolve_path(cfg.path)
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
            whose = (f"is that of another token file, {path.parent / other} (token files of one stem share it)"
                     if (other := meta_owner(path)) else "gives none")
            raise ConfigError(f"data.vocab_size is not set and {meta} {whose}; set data.vocab_size to the "
                              f"tokenizer's size")
        if own is not None and vocab < own:
            raise ConfigError(f"data.vocab_size={vocab} is smaller than the {own} token ids of {meta}: its "
                              f"tokens would be out of range; set data.vocab_size={own} (or null: the file's own)")
        try:
            data = np.memmap(path, dtype="<u2", mode="r")
        except OSError as e:
            raise DataError(f"data.path={path}: cannot read it ({e.strerror}); fix its permissions or point "
                            "data.path at a readable file") from None
        found = check_pair(path, data)
        recorded = found is not None and own is not None
        if not recorded and vocab < 1 << 16 and (top := _top_id(data)) >= vocab:
            # Once here rather than when a crop happens to reach it: mid-run, on one rank, after checkpoints
            # of a vocabulary the fix then changes. (prepare's recorded files hold ids below their vocab_size.)
            raise DataError(f"{path}: token id {top} >= vocab_size {vocab}; set data.vocab_size to the "
                            f"tokenizer's size (at least {top + 1})")
        split = int((1.0 - cfg.val_fraction) * len(data))
        # Crops are read with pread on a descriptor kept open, not through the mapping: a file rewritten in
        # place while a run reads it (a prepare rerun truncates the same inode) faults a mapping with SIGBUS,
        # which kills the process without a word; a short read is a DataError. (The mapping is for the checks
        # above, at start.) One read per crop costs about what its page faults did. A raw descriptor closed as
        # the source is collected: a source has no close() the data pipeline calls, and a process building many
        # (a sweep, tests, report tools) would keep one descriptor open for each otherwise.
        self._file, self._size = _OpenFile(path), path.stat().st_size
        del data
        # the checksum and characters its metadata records (prepare's), else its size alone
        chars = found.get("chars") if found is not None else None
        stamp = {"sha256": found["tokens_sha256"]} if found is not None else {}
        super().__init__(train=range(split), val=range(split, self._size // 2), vocab_size=vocab, seed=seed,
                         context=context, kind="tokens", path=path,
                         identity={"vocab": chars if isinstance(chars, str) else None, "bytes": self._size, **stamp},
                         val_fraction=cfg.val_fraction)

    def _crops(self, data: range, starts: np.ndarray) -> np.ndarray:
        """``data``: the split's token positions in the file."""
        out = np.empty((len(starts), self.context + 1), dtype="<u2")
        for row, start in zip(out, starts):
            offset = 2 * data[int(start)]
            if os.preadv(self._file.fd, [row], offset) < row.nbytes:
                now = os.fstat(self._file.fd).st_size
                raise DataError(f"data.path={self.path} shrank from {self._size} to {now} bytes while training; "
                                "do not rewrite a token file a run is reading (write a new file and point "
                                "data.path at it; the checkpoints saved so far are kept)")
        return out


class _OpenFile:
    """A read-only descriptor of ``path``, closed as the last object holding it is collected. Copies of a source
    (copy.copy, deepcopy) share this holder, so the descriptor lives as long as any of them: a copy of a bare int
    would outlive its close and read whatever file a later open() got that number for. A pickle reopens the path."""

    def __init__(self, path: Path):
        self.path, self.fd = path, os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        weakref.finalize(self, os.close, self.fd)

    def __copy__(self) -> _OpenFile:
        return self

    def __deepcopy__(self, memo: dict) -> _OpenFile:
        return self

    def __reduce__(self):
        return _OpenFile, (self.path,)


def meta_path(path: Path) -> Path:
    """Where ``recipe prepare`` writes the metadata of the token file ``path``: ``<stem>.meta.json``."""
    return path.with_name(f"{path.stem}.meta.json")


def meta_owner(path: Path) -> str | None:
    """The other token file that ``meta_path(path)`` describes (one of the same stem), if it does."""
    try:
        owner = parse_json(meta_path(path).read_bytes()).get("tokens")
    except (OSError, ValueError, AttributeError):   # none, not JSON, not an object
        return None
    return owner if isinstance(owner, str) and owner != path.name else None


def tokens_stat(path: Path) -> list[int]:
    """The token file's identity as prepare records it: size, modification time (ns) and inode."""
    st = path.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ino]


def check_pair(path: Path, data: np.ndarray) -> dict | None:
    """Refuse a token file whose count or checksum is not that of the ``<stem>.meta.json`` naming it (a prepare
    stopped between the two renames); the checksum is read only where ``tokens_stat`` differs. The metadata
    where its checksum records the file, else None."""
    meta, found = read_meta(path)
    if found.get("tokens") != path.name:
        return None
    counts, digest = (found.get("train_tokens"), found.get("val_tokens")), found.get("tokens_sha256")
    if (all(isinstance(c, int) for c in counts) and sum(counts) != len(data)) or \
            (isinstance(digest, str) and found.get("tokens_stat") != tokens_stat(path)
             and hashlib.sha256(data).hexdigest() != digest):
        raise DataError(f"{path} is not the token file {meta} describes (another token count or checksum: a "
                        f"prepare that was stopped, or a file changed by hand); run prepare again")
    return found if isinstance(digest, str) else None


def check_tokens(path: Path) -> None:
    """``check_pair`` of the file at ``path``, as a run starts (a file a run refuses for its size, or cannot read:
    left to it, which says so in one line)."""
    with contextlib.suppress(OSError):
        if (size := path.stat().st_size) and not size % 2:
            check_pair(path, np.memmap(path, dtype="<u2", mode="r"))


_CHUNK = 1 << 24   # tokens _top_id reads at a time


def _top_id(data: np.ndarray) -> int:
    """The largest token id, a chunk at a time (any file size in bounded memory)."""
    return max(int(data[i:i + _CHUNK].max()) for i in range(0, len(data), _CHUNK))


def read_meta(path: Path) -> tuple[Path, dict]:
    """(where, contents) of the token file's metadata: its ``<stem>.meta.json``, else a folder-wide ``meta.json``
    not naming another file; ``(meta_path(path), {})`` when there is none."""
    for meta in (meta_path(path), path.parent / "meta.json"):
        try:
            found = parse_json(meta.read_bytes())
        except (OSError, ValueError):
            continue
        if isinstance(found, dict) and found.get("tokens", path.name) == path.name:
            return meta, found
    return meta_path(path), {}


def _meta_vocab(path: Path) -> tuple[Path, object, bool, object]:
    """(where the metadata is, its valid vocab_size or None, whether there is any, its invalid vocab_size or None)."""
    meta, found = read_meta(path)
    vocab = found.get("vocab_size")
    if vocab is not None and (not isinstance(vocab, int) or isinstance(vocab, bool) or not 1 <= vocab <= 1 << 16):
        return meta, None, bool(found), vocab
    return meta, vocab, bool(found), None


# conf/data/tokens.yaml's data.vocab_size (GPT-2's 50257 padded): what a file without metadata is read with.
DEFAULT_VOCAB = 50304
# Printable ASCII and whitespace: a uint16 token file's high bytes are below 0x20 for ids under 8192.
_TEXT_BYTES = frozenset(range(0x20, 0x7F)) | {0x09, 0x0A, 0x0D}


def _notes(cfg: TokensConfig, config) -> list[str]:
    """A word on a data.vocab_size above the file's own, or on a file without metadata (or one that looks like
    text) read with an assumed vocabulary."""

    try:
        path = resolve_path(cfg.path)
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
