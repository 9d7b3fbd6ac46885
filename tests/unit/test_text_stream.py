"""data=text and recipe prepare read the text a chunk at a time: the same ids as the whole file decoded at once,
in bounded memory (ids of the smallest type), and the checks a whole read made."""
from __future__ import annotations

import json
import tracemalloc

import numpy as np
import pytest

from framework.core import files
from framework.core.errors import DataError
from framework.data import text

# "\r\n" and multi-byte characters across the 5-byte chunks, a lone "\r", one at the end
SAMPLE = "ab\r\ncd\ré ✓x𝄞\r\n\r\rhé\n\r\nend\r"


def _reference(raw: bytes) -> tuple[np.ndarray, str]:
    decoded = raw.decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")
    chars = "".join(sorted(set(decoded)))
    return np.array([chars.index(c) for c in decoded], np.int64), chars


@pytest.mark.parametrize("chunk", [1, 2, 3, 5, 7, 1 << 20])
def test_chunks_encode_as_the_whole_file(tmp_path, monkeypatch, chunk):
    monkeypatch.setattr(text, "_CHUNK", chunk, raising=False)
    raw = (SAMPLE * 7).encode()
    (tmp_path / "t.txt").write_bytes(raw)
    path, ids, chars, split, stamp = text.encode_file(str(tmp_path / "t.txt"))
    want, want_chars = _reference(raw)
    assert ids.dtype == np.uint8 and chars == want_chars and np.array_equal(ids, want)
    assert split == int(0.9 * len(want)) and stamp["bytes"] == len(raw)


def test_ids_are_kept_in_the_smallest_type(tmp_path):
    for n, dtype in ((256, np.uint8), (257, np.uint16), (70_000, np.int32)):
        (tmp_path / "t.txt").write_text("".join(map(chr, range(0x10000, 0x10000 + n))) * 2, encoding="utf-8")
        _, ids, chars, _, _ = text.encode_file(str(tmp_path / "t.txt"))
        assert ids.dtype == dtype and len(chars) == n and ids[n - 1] == n - 1


def test_not_utf8_names_the_byte_across_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr(text, "_CHUNK", 4, raising=False)
    for raw in (b"abcdefg\xe9h", b"abcdef\xc3", "abcdeé".encode() + b"\xff"):   # mid-file, cut at the end
        (tmp_path / "t.txt").write_bytes(raw)
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as e:
            want = f"({e.reason} at byte {e.start})"
        with pytest.raises(DataError) as e:
            text.encode_file(str(tmp_path / "t.txt"))
        assert want in str(e.value), (raw, str(e.value))


def test_a_text_changed_between_reads_is_refused(tmp_path):
    (tmp_path / "t.txt").write_text("abc" * 100)
    scan = text.scan_chars(str(tmp_path / "t.txt"))
    (tmp_path / "t.txt").write_text("abd" * 100)   # (a character the scan did not see would be id 0)
    with pytest.raises(DataError, match="changed while it was read"):
        list(text.encoded(scan))


def _peak(fn) -> tuple[object, int]:
    tracemalloc.start()
    try:
        out = fn()
        return out, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_memory_is_about_the_ids_not_copies_of_the_text(tmp_path, monkeypatch):
    """(before: the text, its UTF-32 copy, np.unique's, searchsorted's int64 and int32 ids: ~19x the file)"""
    monkeypatch.setattr(text, "_CHUNK", 1 << 18, raising=False)
    line = b"To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer\n"
    (tmp_path / "t.txt").write_bytes(line * (8_000_000 // len(line)))
    size = (tmp_path / "t.txt").stat().st_size
    (_, ids, chars, _, _), peak = _peak(lambda: text.encode_file(str(tmp_path / "t.txt")))
    assert ids.nbytes == size and peak < 1.6 * size, peak / size   # uint8 ids, a chunk's copies, two tables
    source = text.TextSource(text.TextConfig(path=str(tmp_path / "t.txt")), seed=0, context=8)
    vocab, peak = _peak(lambda: text.COMPONENT.vocab(text.TextConfig(path=str(tmp_path / "t.txt")), seed=0,
                                                      context=8))
    assert vocab == source.vocab_size == len(chars) and peak < 0.6 * size, peak / size   # no ids at all
    meta, peak = _peak(lambda: text.prepare_chars(str(tmp_path / "t.txt"), tmp_path / "t.bin"))
    assert peak < 0.6 * size, peak / size   # streamed to the file
    assert np.array_equal(np.fromfile(tmp_path / "t.bin", "<u2"), ids) and meta["vocab_size"] == len(chars)


def test_memory_grows_by_the_ids_alone_and_not_at_all_for_the_vocab_and_prepare(tmp_path, monkeypatch):
    """The bounds above at one size, here their growth between two: 6 MB more text costs encode_file its 6 MB of
    uint8 ids (and no more), and the vocabulary scan and prepare nothing (they hold a chunk, not the text)."""
    monkeypatch.setattr(text, "_CHUNK", 1 << 18, raising=False)
    line = b"To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer\n"
    peaks = []
    for n in (2_000_000, 8_000_000):
        path = tmp_path / f"t{n}.txt"
        path.write_bytes(line * (n // len(line)))
        size = path.stat().st_size
        encode = _peak(lambda: text.encode_file(str(path)))[1]
        vocab = _peak(lambda: text.COMPONENT.vocab(text.TextConfig(path=str(path)), seed=0, context=8))[1]
        prepare = _peak(lambda: text.prepare_chars(str(path), tmp_path / f"t{n}.bin"))[1]
        peaks.append((size, encode, vocab, prepare))
    (s0, e0, v0, p0), (s1, e1, v1, p1) = peaks
    assert abs((e1 - e0) - (s1 - s0)) < 0.05 * (s1 - s0), (e1 - e0, s1 - s0)
    assert abs(v1 - v0) < 0.01 * (s1 - s0) and abs(p1 - p0) < 0.01 * (s1 - s0), (v0, v1, p0, p1)


def test_prepare_refuses_a_text_too_short_for_the_context(tmp_path):
    (tmp_path / "t.txt").write_text("to be or not to be\n" * 20)   # val: 38 characters
    with pytest.raises(DataError) as e:
        text.prepare_chars(str(tmp_path / "t.txt"), tmp_path / "t.bin", context=64)
    assert str(e.value) == (f"text {tmp_path / 't.txt'}: the val split has 38 tokens, fewer than context + 1 = 65; "
                            "use more data or a shorter model.context")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.txt"]
    meta = text.prepare_chars(str(tmp_path / "t.txt"), tmp_path / "t.bin", context=37)
    assert meta["val_fraction"] == 0.1 == json.loads((tmp_path / "t.meta.json").read_text())["val_fraction"]


def test_prepare_of_more_characters_than_uint16_points_at_data_text(tmp_path):
    (tmp_path / "t.txt").write_text("".join(map(chr, range(0x10000, 0x10000 + 70_000))), encoding="utf-8")
    with pytest.raises(DataError) as e:
        text.prepare_chars(str(tmp_path / "t.txt"), tmp_path / "t.bin")
    assert str(e.value).endswith(f"; train on the text itself: data=text data.path={tmp_path / 't.txt'}")


def test_a_failed_chunked_write_keeps_the_old_file_and_no_temporary(tmp_path):
    (tmp_path / "f").write_bytes(b"old")

    def chunks():
        yield b"new"
        raise DataError("stopped")

    with pytest.raises(DataError):
        files.write_atomic(tmp_path / "f", chunks())
    assert [p.name for p in tmp_path.iterdir()] == ["f"] and (tmp_path / "f").read_bytes() == b"old"
    files.write_atomic(tmp_path / "f", iter([b"a", b"bc"]))
    assert (tmp_path / "f").read_bytes() == b"abc"
