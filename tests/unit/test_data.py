"""Data sources: determinism, rank layout, the synthetic floor, text split, tokens file reads."""
from __future__ import annotations

import dataclasses
import hashlib
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from framework.data import Batch, DataSource
from framework.data import synthetic, text, tokens
from framework.core.errors import DataError
from framework.core.registry import registry
from tests._helpers import shakespeare

ROOT = Path(__file__).resolve().parents[2]
SHAKESPEARE = shakespeare()
needs_shakespeare = pytest.mark.skipif(not SHAKESPEARE.is_file(),
                                       reason="tinyshakespeare.txt not available")


@pytest.fixture(scope="module")
def token_file(tmp_path_factory) -> tuple[Path, np.ndarray]:
    data = np.random.default_rng(0).integers(0, 1000, size=20_000, dtype=np.uint16)
    path = tmp_path_factory.mktemp("tokens") / "train.bin"
    data.tofile(path)
    return path, data


@pytest.fixture(scope="module")
def sources(token_file) -> dict[str, DataSource]:
    out = {
        "synthetic": synthetic.SyntheticSource(synthetic.SyntheticConfig(), seed=3, context=16),
        "tokens": tokens.TokensSource(tokens.TokensConfig(path=str(token_file[0]), vocab_size=1000),
                               seed=3, context=16),
    }
    if SHAKESPEARE.is_file():
        out["text"] = text.TextSource(text.TextConfig(path=str(SHAKESPEARE)), seed=3, context=16)
    return out


def test_registry_and_yamls():
    OmegaConf = pytest.importorskip("omegaconf").OmegaConf   # (a run reads them with it; not on the GPU image)
    reg = registry("data")
    assert set(reg.names()) >= {"synthetic", "text", "tokens"}
    for name in ("synthetic", "text", "tokens"):
        schema = reg.get(name).config
        node = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "data" / f"{name}.yaml"))
        assert set(node) == {f.name for f in dataclasses.fields(schema)}, name
        schema(**node)   # valid values


def test_protocol(sources):
    for src in sources.values():
        assert isinstance(src, DataSource)
        assert isinstance(src.vocab_size, int) and isinstance(src.describe(), dict)


def test_batch_shapes_and_determinism(sources):
    for name, src in sources.items():
        b = src.train_batch(5, micro_batch=3, grad_accum=2, rank=0, world=1)
        assert isinstance(b, Batch) and b.position == 6 and len(b.micro) == 2
        for x, y in b.micro:
            assert x.shape == y.shape == (3, 16) and x.dtype == y.dtype == torch.int64
            assert torch.equal(x[:, 1:], y[:, :-1])            # y is x shifted by one
            assert 0 <= int(x.min()) and int(y.max()) < src.vocab_size
        again = src.train_batch(5, micro_batch=3, grad_accum=2, rank=0, world=1)
        other = src.train_batch(6, micro_batch=3, grad_accum=2, rank=0, world=1)
        assert all(torch.equal(a[0], c[0]) and torch.equal(a[1], c[1]) for a, c in zip(b.micro, again.micro)), name
        assert not torch.equal(b.micro[0][0], other.micro[0][0]), name


def test_run_seed_changes_train_data_but_not_val():
    a = synthetic.SyntheticSource(synthetic.SyntheticConfig(), seed=0, context=16)
    b = synthetic.SyntheticSource(synthetic.SyntheticConfig(), seed=1, context=16)
    kw = dict(micro_batch=4, grad_accum=1, rank=0, world=1)
    assert not torch.equal(a.train_batch(0, **kw).micro[0][0], b.train_batch(0, **kw).micro[0][0])
    # seed s at position p+1 must not replay seed s+1 at position p
    assert not torch.equal(a.train_batch(1, **kw).micro[0][0], b.train_batch(0, **kw).micro[0][0])
    torch.testing.assert_close(a.val_batches(2, batch=4, rank=0, world=1),
                               b.val_batches(2, batch=4, rank=0, world=1))


@pytest.mark.parametrize("grad_accum", [1, 3])
def test_rank_split_equivalence(sources, grad_accum):
    """1 rank x micro_batch 2m == 2 ranks x micro_batch m, per accumulation step, rank 0 first."""
    m = 2
    for name, src in sources.items():
        one = src.train_batch(7, micro_batch=2 * m, grad_accum=grad_accum, rank=0, world=1)
        two = [src.train_batch(7, micro_batch=m, grad_accum=grad_accum, rank=r, world=2)
               for r in range(2)]
        assert one.position == two[0].position == two[1].position == 8
        for k in range(grad_accum):
            for i in (0, 1):    # x, then y
                joined = torch.cat([two[0].micro[k][i], two[1].micro[k][i]])
                assert torch.equal(one.micro[k][i], joined), (name, k)
        # Ranks never share rows (distinct crops/sequences are overwhelmingly likely).
        rows0 = {tuple(r) for mb in two[0].micro for r in mb[0].tolist()}
        rows1 = {tuple(r) for mb in two[1].micro for r in mb[0].tolist()}
        assert not rows0 & rows1, name


def test_val_fixed_and_rank_split(sources):
    for name, src in sources.items():
        first = src.val_batches(3, batch=4, rank=0, world=1)
        assert len(first) == 3 and first[0][0].shape == (4, 16)
        torch.testing.assert_close(src.val_batches(3, batch=4, rank=0, world=1), first)
        torch.testing.assert_close(src.val_batches(1, batch=4, rank=0, world=1), first[:1])
        halves = [src.val_batches(3, batch=2, rank=r, world=2) for r in range(2)]
        for j in range(3):
            assert torch.equal(torch.cat([halves[0][j][0], halves[1][j][0]]), first[j][0]), name
        train = src.train_batch(0, micro_batch=4, grad_accum=1, rank=0, world=1)
        assert not torch.equal(train.micro[0][0], first[0][0]), name


def test_val_rows_depend_on_the_global_batch_only(sources):
    """16 rows in one micro batch, in two of 8 (grad_accum 2), or over 2 ranks of 2 x 4: the same
    held-out rows, in micro batches of train's size (so the same mean loss, whatever the split)."""
    for name, src in sources.items():
        whole = src.val_batches(2, batch=16, rank=0, world=1)
        assert [x.shape[0] for x, _ in whole] == [16, 16], name
        split = src.val_batches(2, batch=8, grad_accum=2, rank=0, world=1)
        assert [x.shape[0] for x, _ in split] == [8, 8, 8, 8], name
        ranks = [src.val_batches(2, batch=4, grad_accum=2, rank=r, world=2) for r in range(2)]
        for j in range(2):
            for i in (0, 1):    # x, then y
                assert torch.equal(torch.cat([split[2 * j][i], split[2 * j + 1][i]]), whole[j][i]), name
                # accumulation step k of rank r: global rows (k * world + r) * micro_batch + ...
                joined = torch.cat([ranks[0][2 * j][i], ranks[1][2 * j][i], ranks[0][2 * j + 1][i],
                                    ranks[1][2 * j + 1][i]])
                assert torch.equal(joined, whole[j][i]), name


def test_synthetic_floor_matches_empirical_nll():
    src = synthetic.SyntheticSource(synthetic.SyntheticConfig(), seed=0, context=64)
    p, pi = src.transition, src.stationary
    torch.testing.assert_close(p.sum(1), torch.ones(64, dtype=torch.float64))
    torch.testing.assert_close(pi @ p, pi)                     # stationary
    h = -(pi * torch.special.xlogy(p, p).sum(1)).sum().item()
    info = src.describe()
    assert info["entropy_floor"] == pytest.approx(h, abs=1e-12)
    assert info["entropy_floor"] < info["unigram_entropy"] < info["uniform_loss"] == math.log(64)
    # ~262k predicted tokens: the true chain's mean NLL is the floor up to sampling noise
    # (per-token std ~1.1 nats -> standard error ~0.002).
    nll = [-p[x, y].log() for pos in range(4)
           for x, y in src.train_batch(pos, micro_batch=256, grad_accum=4, rank=0, world=1).micro]
    assert torch.cat([n.flatten() for n in nll]).mean().item() == pytest.approx(h, abs=0.01)
    # Sequences start from pi, not from a fixed state.
    starts = torch.cat([x[:, 0] for x, _ in src.val_batches(4, batch=256, rank=0, world=1)])
    assert len(starts.unique()) > 20


def test_synthetic_default_floor():
    info = synthetic.SyntheticSource(synthetic.SyntheticConfig(), seed=0, context=64).describe()
    assert info["entropy_floor"] == pytest.approx(1.9022, abs=1e-4)
    assert {k: info[k] for k in ("vocab_size", "concentration", "chain_seed")} == \
        {"vocab_size": 64, "concentration": 0.05, "chain_seed": 0}


@needs_shakespeare
def test_text_tinyshakespeare_split(sources):
    src = sources["text"]
    assert src.vocab_size == 65 and len(src.chars) == 65 and list(src.chars) == sorted(src.chars)
    assert (len(src.train), len(src.val)) == (1_003_854, 111_540)
    info = src.describe()
    assert (info["train_tokens"], info["val_tokens"]) == (1_003_854, 111_540)
    assert src.decode(src.encode("First Citizen:")) == "First Citizen:"
    assert src.decode(src.train[:14]) == "First Citizen:"


def test_text_relative_to_cwd(tmp_path, monkeypatch):
    (tmp_path / "tiny.txt").write_text("hello world, héllo again " * 20, encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    src = text.TextSource(text.TextConfig(path="tiny.txt"), seed=0, context=8)
    assert src.chars == "".join(sorted(set("hello world, héllo again ")))
    assert src.decode(src.train_batch(0, micro_batch=2, grad_accum=1, rank=0, world=1).micro[0][0][0])
    # what a checkpoint records of it: the characters the ids stand for, the file's size and a checksum of the ids
    raw = (tmp_path / "tiny.txt").read_bytes()
    ids = src.encode(raw.decode("utf-8"))
    assert src.identity() == {"source": "text", "path": str(tmp_path / "tiny.txt"), "vocab": src.chars,
                              "bytes": len(raw), "sha256": hashlib.sha256(np.array(ids, np.int32).tobytes()).hexdigest()}
    (tmp_path / "tiny.txt").write_bytes(b"ab\ncd\nab\n" * 20)
    unix = text.TextSource(text.TextConfig(path="tiny.txt"), seed=0, context=8).identity()
    (tmp_path / "tiny.txt").write_bytes(b"ab\r\ncd\rab\n" * 20)   # newlines as a text-mode read gives them
    windows = text.TextSource(text.TextConfig(path="tiny.txt"), seed=0, context=8)
    assert windows.chars == "\nabcd"
    # the same rows: the same checksum (a resume says nothing of it), whatever the file's size
    assert windows.identity()["sha256"] == unix["sha256"] and windows.identity()["bytes"] != unix["bytes"]


@pytest.mark.parametrize("module, cfg", [
    (text, text.TextConfig(path="no/such/input.txt")),
    (tokens, tokens.TokensConfig(path="no/such/input.txt", vocab_size=10)),
])
def test_missing_file_is_a_one_line_data_error(module, cfg):
    with pytest.raises(DataError) as err:
        module.COMPONENT.build(cfg, seed=0, context=8)
    msg = str(err.value)
    assert "no/such/input.txt" in msg and "data.path" in msg and "\n" not in msg


def test_tokens_round_trip(token_file, sources):
    path, data = token_file
    src = sources["tokens"]
    assert (len(src.train), len(src.val)) == (18_000, 2_000)
    assert np.array_equal(src._crops(src.val, np.array([0, 2_000 - 17])), [data[18_000:18_017], data[-17:]])
    windows = np.lib.stride_tricks.sliding_window_view(data, 17)      # every crop of context + 1

    def crop_at(row_x, row_y) -> np.ndarray:
        """Start offsets where (x, y) is a crop of the file."""
        return np.flatnonzero((windows == np.append(row_x, row_y[-1])).all(axis=1))

    for x, y in src.train_batch(0, micro_batch=4, grad_accum=2, rank=0, world=1).micro:
        for row_x, row_y in zip(x.numpy(), y.numpy()):
            assert len(crop_at(row_x, row_y)) and crop_at(row_x, row_y).max() <= 18_000 - 17
    for x, y in src.val_batches(2, batch=4, rank=0, world=1):
        for row_x, row_y in zip(x.numpy(), y.numpy()):
            assert len(crop_at(row_x, row_y)) and crop_at(row_x, row_y).min() >= 18_000


def test_tokens_file_shrunk_while_training(tmp_path):
    # A prepare rerun truncates the token file in place under a running job: through a memory mapping the next
    # crop past the new end killed the process with SIGBUS (no message); a read says what happened.
    path = tmp_path / "t.bin"
    np.arange(20_000, dtype="<u2").tofile(path)
    src = tokens.TokensSource(tokens.TokensConfig(path=str(path), vocab_size=20_000), seed=0, context=8)
    src.train_batch(0, micro_batch=4, grad_accum=1, rank=0, world=1)
    os.truncate(path, 1000)
    with pytest.raises(DataError, match=r"shrank from 40000 to 1000 bytes while training; do not rewrite"):
        for position in range(1, 50):
            src.train_batch(position, micro_batch=4, grad_accum=1, rank=0, world=1)


def test_a_tokens_source_closes_its_file_as_it_is_collected(tmp_path):
    # Each source keeps a descriptor for its reads: one left open per source built (a sweep in one process, tests,
    # report tools), with a ResourceWarning each, until it was closed with the source.
    import gc
    import warnings

    path = tmp_path / "t.bin"
    np.arange(1000, dtype="<u2").tofile(path)
    before = len(os.listdir("/proc/self/fd"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        for _ in range(5):
            src = tokens.TokensSource(tokens.TokensConfig(path=str(path), vocab_size=1000), seed=0, context=8)
            src.train_batch(0, micro_batch=2, grad_accum=1, rank=0, world=1)
        del src
        gc.collect()
    assert len(os.listdir("/proc/self/fd")) == before and not [w for w in caught if w.category is ResourceWarning]


def test_a_copy_of_a_tokens_source_reads_its_own_file_after_the_original_is_collected(tmp_path):
    # A copy kept the bare descriptor number, closed with the original: a later open() got that number and the
    # copy read the other file's bytes as training data, with no error.
    import copy
    import gc
    import pickle

    a, b = tmp_path / "a.bin", tmp_path / "b.bin"
    np.arange(1000, dtype="<u2").tofile(a)
    np.full(1000, 7, dtype="<u2").tofile(b)
    src = tokens.TokensSource(tokens.TokensConfig(path=str(a), vocab_size=1000), seed=0, context=8)
    want = src.train_batch(0, micro_batch=2, grad_accum=1, rank=0, world=1).micro[0][0]
    twins = [copy.copy(src), copy.deepcopy(src), pickle.loads(pickle.dumps(src))]
    del src
    gc.collect()
    with open(b, "rb"), open(b, "rb"):   # (takes a freed descriptor number, if any)
        for twin in twins:
            assert torch.equal(twin.train_batch(0, micro_batch=2, grad_accum=1, rank=0, world=1).micro[0][0], want)


def test_tokens_out_of_vocab_and_bad_files(token_file, tmp_path, monkeypatch):
    # A token id past data.vocab_size is refused when the source is built, however rare: not when (and on
    # whichever rank) a random crop first reaches it.
    rare = tmp_path / "rare.bin"
    ids = np.arange(20_000, dtype="<u2") % 100
    ids[12_345] = 500
    ids.tofile(rare)
    for path, top in ((token_file[0], 999), (rare, 500)):
        with pytest.raises(DataError, match=rf"^{path}: token id {top} >= vocab_size 100; set data.vocab_size "
                                            rf"to the tokenizer's size \(at least {top + 1}\)$"):
            tokens.TokensSource(tokens.TokensConfig(path=str(path), vocab_size=100), seed=0, context=8)
    assert tokens.TokensSource(tokens.TokensConfig(path=str(rare), vocab_size=501), seed=0, context=8)
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x00\x01\x02")
    with pytest.raises(DataError, match="uint16"):
        tokens.TokensSource(tokens.TokensConfig(path=str(odd), vocab_size=10), seed=0, context=8)
    short = tmp_path / "short.bin"
    np.arange(20, dtype=np.uint16).tofile(short)
    with pytest.raises(DataError) as e:
        tokens.TokensSource(tokens.TokensConfig(path=str(short), vocab_size=100), seed=0, context=8)
    assert str(e.value) == f"tokens {short}: the val split has 2 tokens, fewer than context + 1 = 9; use more data, " \
                           "a shorter model.context or a larger data.val_fraction (now 0.1)"
    with pytest.raises(DataError, match=r"the train split has 1 tokens, .* or a smaller data.val_fraction \(now 0.9\)$"):
        tokens.TokensSource(tokens.TokensConfig(path=str(short), vocab_size=100, val_fraction=0.9), seed=0, context=8)
    # A file prepare wrote and recorded is not read for it (every rank of every job builds the source).
    (tmp_path / "a.txt").write_text("abcdefgh" * 20)
    text.prepare_chars(str(tmp_path / "a.txt"), tmp_path / "a.bin")
    monkeypatch.setattr(tokens, "_top_id", lambda data: pytest.fail("read for its largest id"))
    for vocab_size in (None, 300):
        tokens.TokensSource(tokens.TokensConfig(path=str(tmp_path / "a.bin"), vocab_size=vocab_size), seed=0, context=8)
    # ... so a recorded file edited in place since (its stat kept) is still caught where a crop reads the id
    ids = np.fromfile(tmp_path / "a.bin", dtype="<u2")
    st = (tmp_path / "a.bin").stat()
    np.full_like(ids, 250).tofile(tmp_path / "a.bin")
    os.utime(tmp_path / "a.bin", ns=(st.st_atime_ns, st.st_mtime_ns))
    source = tokens.TokensSource(tokens.TokensConfig(path=str(tmp_path / "a.bin"), vocab_size=None), seed=0, context=8)
    with pytest.raises(DataError, match=r"token id 250 >= vocab_size \d+; set data.vocab_size"):
        source.train_batch(0, micro_batch=2, grad_accum=1, rank=0, world=1)


def test_tokens_vocab_from_the_meta_json_prepare_writes(tmp_path):
    import json

    import numpy as np
    import pytest

    from framework.data.tokens import TokensConfig, TokensSource
    from framework.core.errors import ConfigError

    np.arange(200, dtype="<u2").tofile(tmp_path / "tokens.bin")
    with pytest.raises(ConfigError, match="data.vocab_size is not set and .*meta.json gives none"):
        TokensSource(TokensConfig(path=str(tmp_path / "tokens.bin")), seed=0, context=4)
    (tmp_path / "meta.json").write_text(json.dumps({"vocab_size": 201}))
    assert TokensSource(TokensConfig(path=str(tmp_path / "tokens.bin")), seed=0, context=4).vocab_size == 201
    assert TokensSource(TokensConfig(path=str(tmp_path / "tokens.bin"), vocab_size=300), seed=0,
                        context=4).vocab_size == 300
    # A meta.json vocab_size no uint16 file can have (another tool's, or not a number): data.vocab_size
    # set wins (a note says the file's was ignored); unset, the file's is refused.
    from framework.data.tokens import COMPONENT
    for bad in ("x", 100277):
        (tmp_path / "meta.json").write_text(json.dumps({"vocab_size": bad}))
        with pytest.raises(ConfigError, match=f"^{tmp_path / 'meta.json'}: vocab_size {bad!r} is not in "
                                              r"\[1, 65536\]; set data.vocab_size to the tokenizer's size$"):
            TokensSource(TokensConfig(path=str(tmp_path / "tokens.bin")), seed=0, context=4)
        cfg = TokensConfig(path=str(tmp_path / "tokens.bin"), vocab_size=300)
        assert TokensSource(cfg, seed=0, context=4).vocab_size == 300
        assert COMPONENT.notes(cfg, None) == [f"note: {tmp_path / 'meta.json'} gives vocab_size {bad!r}, not in "
                                        "[1, 65536]: ignored, data.vocab_size=300 is used"]


def test_each_token_file_has_its_own_meta_and_data_vocab_size_must_fit_it(tmp_path):
    """Two data sets prepared into one folder keep their own vocabularies; a data.vocab_size below the
    file's is refused, above it is a start-up note; an old folder-wide meta.json counts only for the
    file it names."""
    import json

    from framework.config import compose
    from framework.core.errors import ConfigError

    for name, chars in (("a", "abc"), ("b", "abcdefgh")):
        (tmp_path / f"{name}.txt").write_text(chars * 50)
        text.prepare_chars(str(tmp_path / f"{name}.txt"), tmp_path / "ds" / f"{name}.bin")
    ds = tmp_path / "ds"

    def vocab(name, vocab_size=None):
        cfg = tokens.TokensConfig(path=str(ds / name), vocab_size=vocab_size)
        return tokens.TokensSource(cfg, seed=0, context=4).vocab_size

    assert (vocab("a.bin"), vocab("b.bin"), vocab("a.bin", 300)) == (3, 8, 300)
    assert json.loads((ds / "a.meta.json").read_text())["chars"] == "abc"
    with pytest.raises(ConfigError, match=r"^data.vocab_size=2 is smaller than the 3 token ids of .*a.meta.json"):
        vocab("a.bin", 2)
    notes = compose(["data=tokens", f"data.path={ds / 'a.bin'}"]).notices   # the default 50304
    assert [n for n in notes if "data.vocab_size=50304" in n and "3 token ids" in n], notes
    assert not compose(["data=tokens", f"data.path={ds / 'a.bin'}", "data.vocab_size=null"]).notices
    np.tile(np.arange(9, dtype="<u2"), 10).tofile(ds / "c.bin")
    (ds / "meta.json").write_text(json.dumps({"tokens": "b.bin", "vocab_size": 8}))   # another file's
    with pytest.raises(ConfigError, match="data.vocab_size is not set"):
        vocab("c.bin")
    (ds / "meta.json").write_text(json.dumps({"tokens": "c.bin", "vocab_size": 9}))
    assert vocab("c.bin") == 9
    # Token files of one stem would share a.meta.json: prepare refuses to take another's, and the reader of a
    # file of that stem without metadata of its own says whose it is.
    with pytest.raises(DataError, match=rf"^--out {ds / 'a.dat'}: its metadata file {ds / 'a.meta.json'} is that "
                                        rf"of {ds / 'a.bin'} \(token files .*; give the token file a stem of its own$"):
        text.prepare_chars(str(tmp_path / "b.txt"), ds / "a.dat")
    assert vocab("a.bin") == 3 and not (ds / "a.dat").exists()
    np.tile(np.arange(9, dtype="<u2"), 10).tofile(ds / "a.dat")
    with pytest.raises(ConfigError, match=rf"^data.vocab_size is not set and {ds / 'a.meta.json'} is that of "
                                          rf"another token file, {ds / 'a.bin'} \(token files of one stem share it\)"):
        vocab("a.dat")


def test_synthetic_vocab_size_is_bounded():
    from framework.core.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^data.vocab_size must be <= 4096 for synthetic data, got 50304"):
        synthetic.SyntheticConfig(vocab_size=50304)


@pytest.mark.parametrize("vocab_size,concentration,chain_seed", [
    (64, 1e-6, 0),    # a singular system: numpy would raise LinAlgError
    (8, 3e-3, 2),     # a solve that returns, but whose answer is not stationary
])
def test_synthetic_chain_without_a_unique_stationary_distribution_is_one_line(vocab_size, concentration, chain_seed):
    from framework.core.errors import ConfigError

    cfg = synthetic.SyntheticConfig(vocab_size=vocab_size, concentration=concentration, chain_seed=chain_seed)
    with pytest.raises(ConfigError, match=rf"^data.concentration={concentration} gives a chain .* raise "
                                          r"data.concentration \(0.01 or more") as e:
        synthetic.SyntheticSource(cfg, seed=0, context=8)
    assert "\n" not in str(e.value)


def test_a_token_file_is_hashed_only_when_it_is_not_the_one_prepare_recorded(tmp_path, monkeypatch):
    """Every rank of every job builds the source: the checksum (a read of the whole file) is skipped for
    the file prepare wrote and recorded; a file written since, or a metadata file without the record (an
    earlier prepare, or one stopped before it), is hashed, and refused when it differs."""
    import hashlib
    import json

    from framework.data.tokens import TokensConfig, TokensSource, meta_path

    hashed = []
    monkeypatch.setattr(tokens, "hashlib", type("H", (), {"sha256": staticmethod(
        lambda b=b"": hashed.append(len(memoryview(b).cast("B"))) or hashlib.sha256(b))}))
    (tmp_path / "a.txt").write_text("abcdefgh" * 8)
    out = tmp_path / "tok.bin"
    text.prepare_chars(str(tmp_path / "a.txt"), out)
    build = lambda: TokensSource(TokensConfig(path=str(out), vocab_size=None), seed=0, context=4)  # noqa: E731
    build()
    assert hashed == []
    out.write_bytes(out.read_bytes())   # the same tokens written again: hashed, accepted
    build()
    assert hashed == [128]
    meta = json.loads(meta_path(out).read_text())
    out.write_bytes(out.read_bytes()[::-1])   # other tokens, same size
    with pytest.raises(DataError, match=rf"^{out} is not the token file"):
        build()
    del meta["tokens_stat"]
    meta_path(out).write_text(json.dumps(meta))
    with pytest.raises(DataError, match=rf"^{out} is not the token file"):
        build()


@pytest.mark.parametrize("stopped_after", ["tokens", "meta"])
def test_prepare_stopped_between_its_two_files_leaves_a_pair_the_reader_refuses(tmp_path, stopped_after):
    """The token file and its meta.json are renamed into place one after the other: a prepare stopped
    between them leaves one old and one new (same size here: only the checksum tells), which is one
    DataError line, and prepare run again puts it right."""
    from framework.data.tokens import TokensConfig, TokensSource, meta_path

    a, b, out = tmp_path / "a.txt", tmp_path / "b.txt", tmp_path / "tok.bin"
    a.write_text("abcdefgh" * 8)
    b.write_text("hgfedcba" * 8)
    text.prepare_chars(str(a), out)
    old = {p: p.read_bytes() for p in (out, meta_path(out))}
    text.prepare_chars(str(b), out)
    kept = out if stopped_after == "meta" else meta_path(out)   # the file the stopped run did not write
    kept.write_bytes(old[kept])
    with pytest.raises(DataError, match=rf"^{out} is not the token file .* run prepare again$"):
        TokensSource(TokensConfig(path=str(out), vocab_size=None), seed=0, context=4)
    text.prepare_chars(str(b), out)
    source = TokensSource(TokensConfig(path=str(out), vocab_size=None), seed=0, context=4)
    assert source.vocab_size == 8


def test_a_meta_json_nested_too_deeply_is_skipped_as_unreadable_json_is(tmp_path):
    path = tmp_path / "train.bin"
    np.zeros(8, np.uint16).tofile(path)
    for meta in (tokens.meta_path(path), tmp_path / "meta.json"):
        meta.write_text('[' * 100_000 + ']' * 100_000)
    assert tokens.read_meta(path) == (tokens.meta_path(path), {})
    assert tokens.meta_owner(path) is None
