"""Character-level text: the vocabulary is the sorted set of the file's characters, the first
``int(0.9 * n)`` are the training split. ``prepare_chars`` writes the same encoding as a uint16 token file
for ``data=tokens`` plus its ``<stem>.meta.json`` (``val_fraction`` 0.1 gives the same split)."""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from framework.core import files
from framework.data._base import CropSource, resolve_path
from framework.data.tokens import meta_owner, meta_path, read_meta, tokens_stat
from framework.core.errors import DataError
from framework.core.registry import Component

TRAIN_FRACTION = 0.9


@dataclass(frozen=True, kw_only=True)
class TextConfig:
    # UTF-8 file; relative paths are tried against the working directory, then the repo root.
    path: str


def encode_file(source: str) -> tuple[Path, np.ndarray, str, int, dict]:
    """The UTF-8 file ``source`` -> (its path, int32 ids, vocabulary, length of the training split, its ``bytes``
    and ``sha256``)."""
    path = resolve_path(source)
    try:
        raw = path.read_bytes()
        # (newlines as a text-mode read gives them)
        text = raw.decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")
    except UnicodeDecodeError as e:
        raise DataError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start}); "
                        f"point data.path at a UTF-8 file") from None
    except OSError as e:
        raise DataError(f"data.path={path}: cannot read it ({e.strerror}); fix its permissions or point "
                        "data.path at a readable file") from None
    points = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    vocab = np.unique(points)
    if len(vocab) == 0:
        raise DataError(f"{path} is empty; point data.path at a non-empty text file")
    ids = np.searchsorted(vocab, points).astype(np.int32)
    stamp = {"bytes": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}
    return path, ids, "".join(map(chr, vocab.tolist())), int(TRAIN_FRACTION * len(ids)), stamp


def prepare_chars(source: str, out: Path) -> dict:
    """Encode the text file ``source`` into ``out`` (uint16 ids) and its ``<stem>.meta.json``; return the
    metadata. Each is written atomically, the metadata first with the tokens' checksum (a half-written pair is
    refused), then again with the token file's stat (sparing the reader the checksum). ``out`` must be new or
    this function's own earlier output."""
    path, ids, chars, split, stamp = encode_file(source)
    if len(chars) > 1 << 16:
        raise DataError(f"{path} has {len(chars)} distinct characters, more than uint16 token ids hold")
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
    tokens = ids.astype("<u2").tobytes()
    meta = {"source": str(path), "source_bytes": stamp["bytes"], "source_sha256": stamp["sha256"],
            "tokens": str(out.name), "vocab_size": len(chars), "chars": chars,
            "train_tokens": split, "val_tokens": len(ids) - split, "val_fraction": 1.0 - TRAIN_FRACTION,
            "tokens_sha256": hashlib.sha256(tokens).hexdigest()}
    try:
        files.make_dirs(out.parent)
    except OSError as e:
        raise DataError(f"--out {out}: cannot make its folder ({e.filename}: {e.strerror}); give a token file "
                        f"in a folder you can write, e.g. --out data/tokens.bin") from None
    try:
        files.write_atomic(meta_path(out), (json.dumps(meta, indent=2, ensure_ascii=False) + "\n").encode())
        files.write_atomic(out, tokens)   # never through a planted link
        meta["tokens_stat"] = tokens_stat(out)   # (a stop before this leaves it out: the reader hashes)
        files.write_atomic(meta_path(out), (json.dumps(meta, indent=2, ensure_ascii=False) + "\n").encode())
    except OSError as e:   # the name it gives is the temporary file's, relative to the folder
        raise DataError(f"--out {out}: cannot write it in {out.parent} ({e.strerror}); give a token file in a "
                        f"folder you can write, e.g. --out data/tokens.bin") from None
    return meta


class TextSource(CropSource):
    def __init__(self, cfg: TextConfig, *, seed: int, context: int) -> None:
        path, ids, chars, split, stamp = encode_file(cfg.path)
        self.chars = chars
        self._index = {c: i for i, c in enumerate(self.chars)}
        super().__init__(train=ids[:split], val=ids[split:], vocab_size=len(chars), seed=seed,
                         context=context, kind="text", path=path,
                         # the checksum of the ids: the file's newlines written another way change no row
                         identity={"vocab": chars, "bytes": stamp["bytes"],
                                   "sha256": hashlib.sha256(ids.tobytes()).hexdigest()})

    def encode(self, s: str) -> list[int]:
        return [self._index[c] for c in s]

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)


COMPONENT = Component(config=TextConfig, build=TextSource)
