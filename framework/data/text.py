"""Character-level text: the vocabulary is the sorted set of the file's characters, the first
``int(0.9 * n)`` are the training split. ``prepare_chars`` writes the same encoding as a uint16 token file
for ``data=tokens`` plus its ``<stem>.meta.json`` (``val_fraction`` 0.1 gives the same split).

The file is read a chunk at a time, twice: once for its characters, then to encode them through a lookup table
into ids of the smallest type that holds the vocabulary (uint8 for up to 256 characters, else uint16, else
int32), so the peak is about the ids, not several copies of the whole text."""
from __future__ import annotations

import codecs
import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from framework.core import files
from framework.data._base import CropSource, check_splits, resolve_path
from framework.data.tokens import meta_owner, meta_path, read_meta, tokens_stat
from framework.core.errors import DataError
from framework.core.registry import Component

TRAIN_FRACTION = 0.9
_CHUNK = 1 << 24   # bytes read at a time
_POINTS = 0x110000   # Unicode code points


@dataclass(frozen=True, kw_only=True)
class TextConfig:
    # UTF-8 file; relative paths are tried against the working directory, then the repo root.
    path: str


def _points(path: Path) -> Iterator[tuple[bytes, np.ndarray]]:
    """(raw bytes, their code points with newlines as a text-mode read gives them) of the UTF-8 file, a chunk at a
    time; an ASCII chunk's points as uint8."""
    decoder, held, offset = codecs.getincrementaldecoder("utf-8")(), "", 0
    try:
        with open(path, "rb") as f:
            while True:
                raw = f.read(_CHUNK)
                pending = len(decoder.getstate()[0])
                try:
                    text = held + decoder.decode(raw, final=not raw)
                except UnicodeDecodeError as e:   # (its start counts from the bytes held back from the last chunk)
                    raise DataError(f"{path} is not UTF-8 text ({e.reason} at byte {offset - pending + e.start}); "
                                    f"point data.path at a UTF-8 file") from None
                offset += len(raw)
                held = "\r" if raw and text.endswith("\r") else ""   # ("\r\n" may span two chunks)
                text = text[:len(text) - len(held)].replace("\r\n", "\n").replace("\r", "\n")
                yield raw, (np.frombuffer(text.encode("ascii"), np.uint8) if text.isascii()
                            else np.frombuffer(text.encode("utf-32-le"), np.uint32))
                if not raw:
                    return
    except OSError as e:
        raise DataError(f"data.path={path}: cannot read it ({e.strerror}); fix its permissions or point "
                        "data.path at a readable file") from None


@dataclass(frozen=True)
class Scan:
    """A text file's characters (its code points, sorted), its length in characters and its ``bytes`` and
    ``sha256``."""
    path: Path
    points: np.ndarray
    count: int
    stamp: dict

    @property
    def chars(self) -> str:
        return "".join(map(chr, self.points.tolist()))

    @property
    def split(self) -> int:
        return int(TRAIN_FRACTION * self.count)

    @property
    def dtype(self) -> type:
        return np.uint8 if len(self.points) <= 1 << 8 else np.uint16 if len(self.points) <= 1 << 16 else np.int32

    def check_splits(self, context: int) -> None:
        """``check_splits`` of the file's training and held-out splits for a model of ``context``."""
        check_splits(f"text {self.path}", {"train": self.split, "val": self.count - self.split}, context)


def scan_chars(source: str) -> Scan:
    """The characters of the UTF-8 file ``source`` (one read, no encoding)."""
    path = resolve_path(source)
    present, count, size, digest = np.zeros(_POINTS, bool), 0, 0, hashlib.sha256()
    for raw, points in _points(path):
        present[points] = True
        count, size = count + len(points), size + len(raw)
        digest.update(raw)
    if count == 0:
        raise DataError(f"{path} is empty; point data.path at a non-empty text file")
    return Scan(path, np.flatnonzero(present), count, {"bytes": size, "sha256": digest.hexdigest()})


def encoded(scan: Scan) -> Iterator[np.ndarray]:
    """The ids of the file ``scan`` describes (``scan.dtype``), a chunk at a time; refused where it changed."""
    lut = np.zeros(_POINTS, scan.dtype)
    lut[scan.points] = np.arange(len(scan.points))
    count, digest = 0, hashlib.sha256()
    for raw, points in _points(scan.path):
        digest.update(raw)
        count += len(points)
        if count > scan.count:
            break
        yield lut[points]
    if count != scan.count or digest.hexdigest() != scan.stamp["sha256"]:
        raise DataError(f"{scan.path} changed while it was read; do not edit data.path while it is read, then "
                        "run again")


def encode_file(source: str) -> tuple[Path, np.ndarray, str, int, dict]:
    """The UTF-8 file ``source`` -> (its path, ids (``Scan.dtype``), vocabulary, length of the training split,
    its ``bytes`` and ``sha256``)."""
    scan = scan_chars(source)
    ids, at = np.empty(scan.count, scan.dtype), 0
    for part in encoded(scan):
        ids[at:at + len(part)] = part
        at += len(part)
    return scan.path, ids, scan.chars, scan.split, scan.stamp


def prepare_chars(source: str, out: Path, *, context: int | None = None) -> dict:
    """Encode the text file ``source`` into ``out`` (uint16 ids) and its ``<stem>.meta.json``; return the
    metadata. Each is written atomically, the metadata first with the tokens' checksum (a half-written pair is
    refused), then again with the token file's stat (sparing the reader the checksum). ``out`` must be new or
    this function's own earlier output; ``context``: the model's, which each split must exceed. The text is read
    a chunk at a time (three reads: characters, checksum, tokens), so its size is not bounded by memory."""
    scan = scan_chars(source)
    path = scan.path
    if len(scan.points) > 1 << 16:
        raise DataError(f"{path} has {len(scan.points)} distinct characters, more than the 65536 uint16 token ids "
                        f"of a token file hold; train on the text itself: data=text data.path={path}")
    if context is not None:
        scan.check_splits(context)
    if out.is_dir():
        raise DataError(f"--out {out} is a folder; give the token file to write, e.g. --out {out / 'tokens.bin'}")
    if out.exists():
        if os.path.samefile(out, path):   # a link to it too
            raise DataError(f"--out {out} is the text file being encoded (data.path); write the tokens to "
                            f"another file")
        _, old = read_meta(out)
        # Metadata naming it with a checksum: prepare's (perhaps stopped before the tokens: any size).

        ours = old.get("tokens") == out.name and isinstance(old.get("tokens_sha256"), str)
        if not ours and (not isinstance(old.get("train_tokens"), int) or not isinstance(old.get("val_tokens"), int)
                         or out.stat().st_size != 2 * (old["train_tokens"] + old["val_tokens"])):
            raise DataError(f"--out {out} exists and is not a token file prepare wrote (no {meta_path(out)} "
                            f"describes it); remove it or choose another file")
    if (other := meta_owner(out)) and (out.parent / other).exists():
        raise DataError(f"--out {out}: its metadata file {meta_path(out)} is that of {out.parent / other} (token "
                        f"files of one stem share it); give the token file a stem of its own")
    digest = hashlib.sha256()
    for part in _tokens(scan):
        digest.update(part)
    meta = {"source": str(path), "source_bytes": scan.stamp["bytes"], "source_sha256": scan.stamp["sha256"],
            "tokens": str(out.name), "vocab_size": len(scan.points), "chars": scan.chars,
            "train_tokens": scan.split, "val_tokens": scan.count - scan.split,
            "val_fraction": round(1.0 - TRAIN_FRACTION, 12), "tokens_sha256": digest.hexdigest()}
    try:
        files.make_dirs(out.parent)
    except OSError as e:
        raise DataError(f"--out {out}: cannot make its folder ({e.filename}: {e.strerror}); give a token file "
                        f"in a folder you can write, e.g. --out data/tokens.bin") from None
    try:
        files.write_atomic(meta_path(out), (json.dumps(meta, indent=2, ensure_ascii=False) + "\n").encode())
        files.write_atomic(out, _tokens(scan))   # never through a planted link; (the text unchanged: encoded's check)
        meta["tokens_stat"] = tokens_stat(out)   # (a stop before this leaves it out: the reader hashes)
        files.write_atomic(meta_path(out), (json.dumps(meta, indent=2, ensure_ascii=False) + "\n").encode())
    except OSError as e:   # the name it gives is the temporary file's, relative to the folder
        raise DataError(f"--out {out}: cannot write it in {out.parent} ({e.strerror}); give a token file in a "
                        f"folder you can write, e.g. --out data/tokens.bin") from None
    return meta


def _tokens(scan: Scan) -> Iterator[bytes]:
    """The token file's bytes (little-endian uint16 ids), a chunk at a time."""
    return (part.astype("<u2").tobytes() for part in encoded(scan))


def _int32_sha256(ids: np.ndarray) -> str:
    """The checksum of ``ids`` as int32 (what checkpoints record, whatever type the ids are kept in)."""
    digest = hashlib.sha256()
    for i in range(0, len(ids), _CHUNK):
        digest.update(ids[i:i + _CHUNK].astype(np.int32).tobytes())
    return digest.hexdigest()


class TextSource(CropSource):
    def __init__(self, cfg: TextConfig, *, seed: int, context: int) -> None:
        path, ids, chars, split, stamp = encode_file(cfg.path)
        self.chars = chars
        self._index = {c: i for i, c in enumerate(self.chars)}
        super().__init__(train=ids[:split], val=ids[split:], vocab_size=len(chars), seed=seed,
                         context=context, kind="text", path=path,
                         # the checksum of the ids: the file's newlines written another way change no row
                         identity={"vocab": chars, "bytes": stamp["bytes"], "sha256": _int32_sha256(ids)})

    def encode(self, s: str) -> list[int]:
        return [self._index[c] for c in s]

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)


def _vocab(cfg: TextConfig, *, seed: int, context: int) -> int:
    """The vocabulary ``TextSource`` would have, from one read of the characters (estimate and plan need no ids)."""
    scan = scan_chars(cfg.path)
    scan.check_splits(context)
    return len(scan.points)


COMPONENT = Component(config=TextConfig, build=TextSource, vocab=_vocab)
