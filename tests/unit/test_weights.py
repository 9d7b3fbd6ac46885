"""framework.persist.weights on one process: sliced reads, the one error listing every problem, refused
pickles, shard-size parsing, the file layout, and the stage3_gather_16bit_weights_on_model_save key."""
import json
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import framework
from framework.comm.distributed import connect
from framework.core.errors import ConfigError
from framework.models.gpt import gpt_loss
from framework.persist.tensorfiles import open_weights, parse_size, plan_files
from framework.persist.weights import load_weights, save_on_model_save, save_weights
from tests._helpers import build_gpt, tiny_config

ROOT = Path(__file__).resolve().parents[2]


def _engine(*overrides):
    cfg = tiny_config(*overrides)
    module, _ = build_gpt(cfg)
    return framework.initialize(module, gpt_loss, cfg, connect("gloo"))


def _plain_sd(seed=1234):
    plain, _ = build_gpt(tiny_config(), seed=seed)
    g = torch.Generator().manual_seed(seed)
    return {k: (v + 0.01 * torch.randn(v.shape, generator=g)).contiguous() for k, v in plain.state_dict().items()}


@pytest.mark.parametrize("shape", [(7,), (5, 6), (3, 4, 5), (2, 3, 2, 4), ()])
def test_sliced_reads_return_exactly_the_range(tmp_path, shape):
    from safetensors.torch import save_file
    t = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
    save_file({"t": t}, tmp_path / "t.safetensors")
    n = t.numel()
    with open_weights(tmp_path / "t.safetensors") as src:
        for lo in range(n + 1):
            for hi in range(lo, n + 1):
                before = src.bytes_read
                got = src.read("t", lo, hi)
                assert torch.equal(got, t.reshape(-1)[lo:hi]), (shape, lo, hi)
                assert src.bytes_read - before == 4 * (hi - lo)


def test_problems_are_one_error_listing_them_all(tmp_path):
    from safetensors.torch import save_file
    engine = _engine("+stage=zero2")
    sd = _plain_sd()
    del sd["wpe.weight"], sd["blocks.1.ln2.weight"]
    sd["blocks.0.attn.qkv.weight"] = torch.zeros(3, 3)
    sd["extra.weight"] = torch.zeros(2)
    sd["blocks.0.mlp.fc.weight"] = sd["blocks.0.mlp.fc.weight"].to(torch.int32)
    save_file(sd, tmp_path / "bad.safetensors")
    before = [t.clone() for t in engine.state.params]
    with pytest.raises(ConfigError) as e:
        load_weights(engine, tmp_path / "bad.safetensors")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("load_weights: ")
    for part in ("missing 2: wpe.weight, blocks.1.ln2.weight", "unexpected 1: extra.weight",
                 "blocks.0.attn.qkv.weight: (3, 3) in the file, (96, 32) in the model",
                 "blocks.0.mlp.fc.weight: dtype int32 in the file, float32 in the model"):
        assert part in msg, msg
    assert all(torch.equal(a, b) for a, b in zip(before, engine.state.params))   # nothing written
    # strict=False skips the absent and the unknown names, never a mismatch.
    with pytest.raises(ConfigError, match="mismatched 2"):
        load_weights(engine, tmp_path / "bad.safetensors", strict=False)
    ok = {k: v for k, v in sd.items() if k not in ("blocks.0.attn.qkv.weight", "blocks.0.mlp.fc.weight")}
    save_file(ok, tmp_path / "partial.safetensors")
    load_weights(engine, tmp_path / "partial.safetensors", strict=False)
    module = engine.components.module
    assert torch.equal(module.get_parameter("blocks.0.ln1.weight").detach(), sd["blocks.0.ln1.weight"])
    assert not torch.equal(module.get_parameter("wpe.weight").detach(), _plain_sd()["wpe.weight"])


def test_other_dtypes_are_converted_explicitly(tmp_path):
    engine = _engine("+stage=zero1")
    sd = _plain_sd()
    torch.save({k: v.to(torch.bfloat16) for k, v in sd.items()}, tmp_path / "bf16.pt")
    load_weights(engine, tmp_path / "bf16.pt")
    for n, p in engine.components.module.named_parameters():
        assert p.dtype == torch.float32 and torch.equal(p.detach(), sd[n].to(torch.bfloat16).float())


class _Boom:
    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_pickle_that_runs_code_is_refused(tmp_path):
    marker = tmp_path / "ran"
    boom = _Boom()
    boom.marker = marker
    with open(tmp_path / "evil.pt", "wb") as f:
        pickle.dump({"wte.weight": boom}, f, protocol=2)
    torch.save({"wte.weight": boom}, tmp_path / "evil_zip.pt")
    engine = _engine()
    for name in ("evil.pt", "evil_zip.pt"):
        with pytest.raises(ConfigError, match=r"refused .*weights_only=True"):
            load_weights(engine, tmp_path / name)
    assert not marker.exists()
    # torch's own reason, in one line of ours: no colour codes, no advice to load with weights_only=False.
    import argparse
    torch.save({"wte.weight": torch.zeros(2), "args": argparse.Namespace(a=1)}, tmp_path / "ns.pt")
    (tmp_path / "junk.pt").write_bytes(b"garbage\n")
    # text whose first byte is a pickle opcode the unpickler runs: it raises a bare IndexError or KeyError
    (tmp_path / "text.pt").write_text("the weights are elsewhere\n")
    (tmp_path / "h.bin").write_text("hf_xxx")
    for name, want in (("ns.pt", r"refused .*holds objects other than tensors .*GLOBAL argparse\.Namespace.*if you "
                                 r"trust the file"),
                       ("junk.pt", r"not a torch state-dict file \(corrupt or another format; .*Unsupported operand"),
                       ("text.pt", r"cannot read .*text\.pt: not a torch state-dict file .*IndexError"),
                       ("h.bin", r"cannot read .*h\.bin: not a torch state-dict file .*KeyError")):
        with pytest.raises(ConfigError, match=want) as e:
            load_weights(engine, tmp_path / name)
        assert "\n" not in str(e.value) and "\x1b" not in str(e.value) and "weights_only=False" not in str(e.value)


def test_not_a_state_dict_and_missing_paths(tmp_path):
    engine = _engine()
    torch.save([torch.zeros(1)], tmp_path / "list.pt")
    with pytest.raises(ConfigError, match="expected a flat"):
        load_weights(engine, tmp_path / "list.pt")
    with pytest.raises(ConfigError, match="does not exist"):
        load_weights(engine, tmp_path / "nope.safetensors")
    with pytest.raises(ConfigError, match="holds none of"):
        load_weights(engine, tmp_path)
    from safetensors.torch import save_file
    save_file({"a": torch.zeros(2)}, tmp_path / "s1.safetensors")
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"a": "s1.safetensors", "b": "s1.safetensors"}}))
    with pytest.raises(ConfigError, match=r"names 1 tensor that is not in their files: b"):
        load_weights(engine, tmp_path)
    for bad, why in (([1, 2], "its top level is a list"), ({"weight_map": None}, "no weight_map object"),
                     ({"weight_map": {"a": 5}}, "its weight_map maps a tensor to 5, not a shard's file name")):
        index.write_text(json.dumps(bad))
        with pytest.raises(ConfigError, match=f"is not a safetensors index \\({why}"):
            load_weights(engine, index)
    # The model in place of its engine (as transformers' save_pretrained is called): one line, both ways.
    for call in (load_weights, save_weights):
        with pytest.raises(ConfigError, match=r"first argument is the engine .*got a GPT \(a module: pass its engine"):
            call(engine.components.module, tmp_path / "s1.safetensors")
    index.write_text(json.dumps({"weight_map": {"a": "s2.safetensors"}}))
    with pytest.raises(ConfigError, match="shard\\(s\\) that do not exist"):
        load_weights(engine, index)
    # A sharded torch checkpoint (transformers' pytorch_model.bin.index.json): one line, not read as safetensors.
    bins = tmp_path / "bins"
    bins.mkdir()
    torch.save(_plain_sd(), bins / "pytorch_model-00001-of-00001.bin")
    (bins / "pytorch_model.bin.index.json").write_text(
        json.dumps({"weight_map": {k: "pytorch_model-00001-of-00001.bin" for k in _plain_sd()}}))
    for source in (bins, bins / "pytorch_model.bin.index.json"):
        with pytest.raises(ConfigError, match=r"indexes torch \.bin shards, .*convert the checkpoint to safetensors"):
            load_weights(engine, source)


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("500MB") == 500 * 10**6
    assert parse_size("2GiB") == 2 * 2**30 and parse_size("1.5kb") == 1500 and parse_size(123) == 123
    for bad in ("5 potatoes", "", "-1MB", 0):
        with pytest.raises(ConfigError, match="max_shard_size"):
            parse_size(bad)


def test_plan_files_splits_at_the_limit():
    tensors = [(f"t{i}", (10,), torch.float32) for i in range(5)] + [("big", (100,), torch.float32)]
    plans = plan_files(tensors, 100)   # 40 bytes each: two per file; the big one alone
    assert [[e.name for e in p.entries] for p in plans] == [["t0", "t1"], ["t2", "t3"], ["t4"], ["big"]]
    assert [p.name for p in plans][0] == "model-00001-of-00004.safetensors"
    for p in plans:
        assert len(p.header) % 8 == 0 and p.size == len(p.header) + sum(e.nbytes for e in p.entries)
    assert plan_files(tensors, "1GB")[0].name == "model.safetensors"


def test_an_index_naming_a_shard_outside_its_folder_is_refused_before_any_shard_is_read(tmp_path):
    from safetensors.torch import save_file
    save_file({"a": torch.zeros(2)}, tmp_path / "outside.safetensors")
    folder = tmp_path / "model"
    folder.mkdir()
    index = folder / "model.safetensors.index.json"
    for name in ("../outside.safetensors", str(tmp_path / "outside.safetensors"), "sub/../../outside.safetensors"):
        index.write_text(json.dumps({"weight_map": {"a": name}}))
        with pytest.raises(ConfigError, match=r"names a shard outside its folder .*name them so$"):
            open_weights(folder)
    # A shard that is a symlink to elsewhere stays readable: the hub cache's snapshot folders are laid out so.
    (folder / "s.safetensors").symlink_to(tmp_path / "outside.safetensors")
    index.write_text(json.dumps({"weight_map": {"a": "s.safetensors"}}))
    with open_weights(folder) as src:
        assert list(src.meta) == ["a"]


def test_save_weights_single_file_bf16_and_old_outputs_replaced(tmp_path):
    from safetensors.torch import load_file
    engine = _engine("+stage=zero3", "precision=bf16")
    save_weights(engine, tmp_path, max_shard_size="10KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    paths = save_weights(engine, tmp_path, dtype=torch.float16)
    assert [p.name for p in paths] == ["model.safetensors"]
    assert sorted(os.listdir(tmp_path)) == ["model.safetensors"]   # the earlier shards and index are gone
    saved = load_file(tmp_path / "model.safetensors")
    masters = engine.state_dict(engine.state)["params"]
    for name, entry in masters.items():
        full = torch.cat([f["master"] for f in sorted(entry["fragments"], key=lambda f: f["range"])])
        assert saved[name].dtype == torch.float16 and torch.equal(saved[name].reshape(-1), full.half())


def test_gather_16bit_weights_on_model_save_key(tmp_path):
    from safetensors.torch import load_file
    off = _engine("+stage=zero3")
    assert save_on_model_save(off, tmp_path / "off") is None and not (tmp_path / "off").exists()
    on = _engine("+stage=zero3", "precision=bf16", "stage.stage3_gather_16bit_weights_on_model_save=true")
    paths = save_on_model_save(on, tmp_path / "on")
    saved = load_file(paths[0])
    module = on.components.module
    with framework.gathered(list(module.parameters())):
        for n, p in module.named_parameters():
            assert saved[n].dtype == torch.bfloat16 and torch.equal(saved[n], p.detach())
    json.dumps([str(p) for p in paths])


class _WithBuffers(torch.nn.Module):
    """A frozen layer (outside the ddp/zero1/2 layouts), a persistent and a non-persistent buffer."""

    def __init__(self, freeze: bool = True):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.frozen = torch.nn.Linear(8, 8)
        self.frozen.requires_grad_(not freeze)
        self.register_buffer("scale", torch.ones(8))
        self.register_buffer("scratch", torch.zeros(3), persistent=False)

    def forward(self, x):
        return self.frozen(self.lin(x)) * self.scale


@pytest.mark.parametrize("stage", ["ddp", "zero1", "zero2", "zero3"])
def test_buffers_and_frozen_parameters_load_and_save(tmp_path, stage, capsys):
    from safetensors.torch import load_file, save_file
    torch.manual_seed(0)
    cfg = framework.compose(["logger=none", *([] if stage == "ddp" else [f"+stage={stage}"])])
    module = _WithBuffers()   # (every stage holds a frozen parameter whole on each rank, zero3 too)
    engine = framework.initialize(module, lambda m, b: m(b).square().mean(), cfg, connect("gloo"))
    g = torch.Generator().manual_seed(3)
    sd = {k: torch.randn(v.shape, generator=g) for k, v in _WithBuffers().state_dict().items()}
    assert set(sd) == {"lin.weight", "lin.bias", "frozen.weight", "frozen.bias", "scale"}
    save_file(sd, tmp_path / "in.safetensors")
    load_weights(engine, tmp_path / "in.safetensors")
    module = engine.components.module
    with framework.gathered(list(module.parameters())):
        now = {n: p.detach().clone() for n, p in module.named_parameters()}
    now["scale"] = module.scale
    assert all(torch.equal(now[k], v) for k, v in sd.items())
    save_weights(engine, tmp_path / "out")
    out = load_file(tmp_path / "out" / "model.safetensors")
    assert out.keys() == sd.keys() and all(torch.equal(out[k], v) for k, v in sd.items())
    # an inf in a buffer or frozen parameter may be by design (an additive mask): loaded and saved without a
    # word; a NaN there is refused, as in a trained parameter
    whole = ["scale", "frozen.weight"]
    for k in whole:
        sd[k].view(-1)[0] = float("-inf")
    save_file(sd, tmp_path / "inf.safetensors")
    load_weights(engine, tmp_path / "inf.safetensors")
    assert module.scale[0] == float("-inf")
    save_weights(engine, tmp_path / "inf")
    assert "NaN" not in capsys.readouterr().err
    for k in [*whole, "lin.weight"]:
        save_file({**sd, k: torch.full_like(sd[k], float("nan"))}, tmp_path / "nan.safetensors")
        with pytest.raises(ConfigError, match=fr"^load_weights: non-finite values \(NaN or inf\) in '{k}' of "):
            load_weights(engine, tmp_path / "nan.safetensors")
        # what was read before the NaN is in the weights (zero3 / 16-bit: in the masters, not the working copies):
        # stepping and saving are refused until a load finishes
        for refused in (lambda: engine.state_dict(engine.state), lambda: engine.eval_step(engine.state, [torch.ones(8)]),
                        lambda: save_weights(engine, tmp_path / "half")):
            with pytest.raises(framework.FrameworkError, match="^load_weights did not finish, which left the weights "
                                                               "partly loaded: load good weights again.*a new one "
                                                               "from a freshly built model"):
                refused()
        # a strict=False load of only some tensors leaves the others the failed load's: still refused
        save_file({n: v for n, v in sd.items() if n != k}, tmp_path / "some.safetensors")
        load_weights(engine, tmp_path / "some.safetensors", strict=False)
        with pytest.raises(framework.FrameworkError, match="^load_weights did not finish"):
            engine.state_dict(engine.state)
        load_weights(engine, tmp_path / "inf.safetensors")
        engine.state_dict(engine.state)
    # a load refused before anything is written (a missing name) leaves the engine as it was
    save_file({k: v for k, v in sd.items() if k != "scale"}, tmp_path / "short.safetensors")
    with pytest.raises(ConfigError, match="does not fit this model: missing 1: scale"):
        load_weights(engine, tmp_path / "short.safetensors")
    engine.eval_step(engine.state, [torch.ones(8)])
    load_weights(engine, tmp_path / "short.safetensors", strict=False)   # (no failed load before it: goes on)
    engine.eval_step(engine.state, [torch.ones(8)])


class _Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4)
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        return self.head(self.emb(x))


def test_tied_copies_must_hold_the_same_values(tmp_path):
    from safetensors.torch import save_file
    engine = framework.initialize(_Tied(), lambda m, b: m(b).square().mean(), framework.compose(["logger=none"]),
                                  connect("gloo"))
    w = torch.randn(10, 4)
    save_file({"emb.weight": w, "head.weight": w + 1}, tmp_path / "apart.safetensors")
    with pytest.raises(ConfigError, match="holds different values under emb.weight and head.weight, which this "
                                          "model ties into one parameter"):
        load_weights(engine, tmp_path / "apart.safetensors")
    w[0, 0] = float("nan")   # the same NaN in both copies: not weights to train from, not a different tie
    save_file({"emb.weight": w, "head.weight": w.clone()}, tmp_path / "nan.safetensors")
    with pytest.raises(ConfigError, match=r"^load_weights: non-finite values \(NaN or inf\) in 'emb.weight'"):
        load_weights(engine, tmp_path / "nan.safetensors")
    # a buffer two modules share: one buffer, not a tied parameter (no tie_word_embeddings setting applies)
    shared = _Tied()
    shared.emb.register_buffer("scale", torch.ones(4))
    shared.head.register_buffer("scale", shared.emb.scale)
    engine = framework.initialize(shared, lambda m, b: m(b).square().mean(), framework.compose(["logger=none"]),
                                  connect("gloo"))
    save_file({"emb.weight": w.nan_to_num(), "emb.scale": torch.ones(4), "head.scale": torch.full((4,), 2.0)},
              tmp_path / "buffers.safetensors")
    with pytest.raises(ConfigError, match=r"holds different values under emb.scale and head.scale, which this model "
                                          r"holds as one buffer \(shared by two modules\); keep one of them in the "
                                          r"file$"):
        load_weights(engine, tmp_path / "buffers.safetensors")


def test_weights_inside_a_checkpoint_are_checked_against_its_manifest(tmp_path):
    """load_weights from a step folder's model_16bit/ (the folder or a file in it) checks those files
    against the step's manifest first: a flipped byte there is refused before anything is written,
    as a resume or an export of that step would refuse it. The same files elsewhere load unchecked."""
    from safetensors.torch import save_file

    from framework.core.errors import CheckpointError
    from framework.persist import stepfolders
    engine = _engine("+stage=zero2")
    step = tmp_path / "ckpt" / "step-3"
    sub = step / stepfolders.WEIGHTS16
    sub.mkdir(parents=True)
    save_file(_plain_sd(), sub / "model.safetensors")
    (step / "train_state.json").write_text("{}")
    stepfolders.write_manifest(step, {n: stepfolders.file_entry(step, n) for n in stepfolders.files_of(step)})
    for source in (sub, sub / "model.safetensors"):
        load_weights(engine, source)
    weights = sub / "model.safetensors"
    with open(weights, "r+b") as f:   # the last byte of the last tensor's data
        f.seek(-1, os.SEEK_END)
        byte = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0x01]))
    before = [t.clone() for t in engine.state.params]
    for source in (sub, weights):
        with pytest.raises(CheckpointError, match=f"is damaged: {weights} does not match its sha256"):
            load_weights(engine, source)
    assert all(torch.equal(a, b) for a, b in zip(before, engine.state.params))   # nothing written
    # a manifest without model_16bit/ entries: those files were not written by that save
    (step / stepfolders.MANIFEST).unlink()
    stepfolders.write_manifest(step, {"train_state.json": stepfolders.file_entry(step, "train_state.json")})
    with pytest.raises(CheckpointError, match="lists no model_16bit/ files"):
        load_weights(engine, sub)
    # a run folder's model_16bit/ (not in a step folder) loads as any safetensors folder
    elsewhere = tmp_path / "run" / stepfolders.WEIGHTS16
    elsewhere.parent.mkdir()
    sub.rename(elsewhere)
    load_weights(engine, elsewhere)


def test_a_full_disk_names_the_folder_and_keeps_the_earlier_save(tmp_path):
    """No room for the files (a file size limit here) is one FrameworkError naming the folder; the earlier save
    there stays whole and no .tmp file is left. The checkpoint's 16-bit weights: a CheckpointError, no staging
    folder left."""
    from framework.core.errors import CheckpointError, FrameworkError
    from framework.persist.checkpoint import Checkpointer
    from tests._helpers import file_size_limit
    cfg = tiny_config("+stage=zero3", "precision=bf16", "stage.stage3_gather_16bit_weights_on_model_save=true",
                      f"checkpoint.dir={tmp_path / 'ckpt'}")
    module, _ = build_gpt(cfg)
    engine = framework.initialize(module, gpt_loss, cfg, connect("gloo"))
    out = tmp_path / "out"
    save_weights(engine, out, max_shard_size="10KB")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    for shard in ("10KB", "5GB"):
        with file_size_limit(4000), pytest.raises(FrameworkError) as e:
            save_weights(engine, out, max_shard_size=shard)
        assert f"save_weights: cannot write {out} (" in str(e.value) and "no room" in str(e.value), e.value
        assert "\n" not in str(e.value)
        assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    ckpt = Checkpointer(cfg, engine)
    with file_size_limit(4000), pytest.raises(CheckpointError, match=r"checkpoint: not saving step 0: save_pretrained: "
                                              r"cannot write .*step-0\.model_16bit \(.*the previous checkpoints"):
        ckpt.save(engine.state)
    ckpt.close()
    assert os.listdir(tmp_path / "ckpt") == []
    with file_size_limit(4000), pytest.raises(FrameworkError, match="no room"):
        save_on_model_save(engine, tmp_path / "end" / "inner")
    with file_size_limit(4000), pytest.raises(FrameworkError, match="no room"):
        save_weights(engine, tmp_path / "fresh" / "inner")
    assert not (tmp_path / "end").exists() and not (tmp_path / "fresh").exists()   # the folders it made: removed


def test_a_folder_holding_another_models_files_is_refused_or_warned(tmp_path, capsys):
    """As export: another model's weights beside the saved ones (a loader could take them) are refused, nothing
    written; a config.json save_weights does not write is kept with a warning (save_pretrained replaces it)."""
    from framework.core.errors import ConfigError
    engine = _engine("+stage=zero2")
    other = tmp_path / "other"
    other.mkdir()
    (other / "pytorch_model.bin").write_bytes(b"theirs")
    with pytest.raises(ConfigError, match=f"save_weights: {other} holds pytorch_model.bin: weights save_weights "
                                          "would leave beside its own; choose an empty folder"):
        save_weights(engine, other)
    assert os.listdir(other) == ["pytorch_model.bin"]
    (other / "pytorch_model.bin").unlink()
    (other / "config.json").write_text('{"model_type": "llama"}')
    capsys.readouterr()
    save_weights(engine, other)
    assert capsys.readouterr().err == (f"warning: save_weights: {other / 'config.json'} stays as it is (save_weights "
                                       "writes only the weights); check that it describes the saved model\n")
    assert sorted(os.listdir(other)) == ["config.json", "model.safetensors"]


def test_a_save_into_a_folder_another_save_is_writing_is_refused(tmp_path):
    """Two saves (or exports) into one folder would remove and rename each other's .tmp files, leaving one's weights
    under the other's report: the second is refused in one line naming the holder, the first's files untouched.
    The lock file goes with the save that made it."""
    from framework.core import files
    from framework.persist.tensorfiles import LOCK
    engine = _engine()
    out = tmp_path / "out"
    out.mkdir()
    fd = files.lock(out / LOCK, str, "")   # another save writing there, its .tmp file beside
    (out / "model.safetensors.tmp").write_bytes(b"theirs")
    try:
        with pytest.raises(framework.FrameworkError, match=rf"^save_weights: {re.escape(str(out))} is being written by "
                           rf"another save \(pid {os.getpid()} on host .+\): wait for it to end or choose another "
                           r"output folder$"):
            save_weights(engine, out)
        assert sorted(os.listdir(out)) == [LOCK, "model.safetensors.tmp"]
        assert (out / "model.safetensors.tmp").read_bytes() == b"theirs"
    finally:
        os.close(fd)
    save_weights(engine, out)   # (the .tmp file: an interrupted save's now)
    assert sorted(os.listdir(out)) == ["model.safetensors"]


def test_a_save_whose_lock_line_cannot_be_written_keeps_no_lock(tmp_path, monkeypatch):
    """Writing the holder's line into the lock file may fail (a full disk, a file size limit): the save goes on
    (or fails alone, naming its folder), and a retry is never refused as if another save held the folder."""
    import errno

    engine = _engine()
    out = tmp_path / "out"
    pwrite = os.pwrite

    def full(*a):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(os, "pwrite", full)
    try:
        save_weights(engine, out)
    except framework.FrameworkError as e:   # (the files' own writes may use pwrite too)
        assert "is being written by another save" not in str(e), e
    monkeypatch.setattr(os, "pwrite", pwrite)
    save_weights(engine, out)
    assert sorted(os.listdir(out)) == ["model.safetensors"]


def test_a_save_on_a_file_system_without_locks_says_nothing_of_it(tmp_path, monkeypatch, capsys):
    """No flock there (NFS without lockd): the save goes on unlocked and silent; a checkpoint's 16-bit copy would
    otherwise say so at every save, of a folder the user never named."""
    import errno
    import fcntl

    def unsupported(fd, op):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))
    engine = _engine()
    monkeypatch.setattr(fcntl, "flock", unsupported)
    save_weights(engine, tmp_path / "out")
    assert sorted(os.listdir(tmp_path / "out")) == ["model.safetensors"]
    assert "cannot lock" not in capsys.readouterr().err


def test_a_folder_in_a_committed_checkpoint_step_is_refused(tmp_path):
    """Writing into a committed step folder (a manifest in it) or a folder in it would make it differ from its
    manifest: refused before anything is written."""
    engine = _engine("+stage=zero3", "precision=bf16")
    step = tmp_path / "ckpt" / "step-3"
    (step / "model_16bit").mkdir(parents=True)
    (step / "manifest.json").write_text("{}")
    for where in (step, step / "model_16bit", step / "new"):
        with pytest.raises(ConfigError, match=f"save_weights: {where} is in the committed checkpoint {step}"):
            save_weights(engine, where)
    assert sorted(os.listdir(step)) == ["manifest.json", "model_16bit"] and not os.listdir(step / "model_16bit")
    save_weights(engine, tmp_path / "ckpt" / "step-4")   # (no manifest: not a checkpoint)


def test_an_empty_output_folder_is_refused(tmp_path, monkeypatch):
    """"" is not the current directory (where a model's shards would be replaced): refused, nothing written."""
    engine = _engine()
    monkeypatch.chdir(tmp_path)
    for out in ("", " "):
        for save in (save_weights, type(engine).save_pretrained):   # each names itself
            with pytest.raises(ConfigError, match=rf"^{save.__name__}: the output folder is empty \('\s*'\); name a "
                                                  "folder$"):
                save(engine, out)
    # A file's name (as torch.save takes) is not made into a folder of that name.
    for out in ("w.safetensors", "run/pytorch_model.bin", "m.PT"):
        with pytest.raises(ConfigError, match=r"^save_weights takes a folder, not a file name: .* ends in "):
            save_weights(engine, out)
    assert os.listdir(tmp_path) == []


def test_a_dtype_safetensors_cannot_hold_is_refused(tmp_path):
    from framework.persist.export import export
    engine = _engine()
    says = ("dtype=torch.float8_e4m3fn cannot be written; use one of torch.float64, torch.float32, torch.float16, "
            "torch.bfloat16")
    with pytest.raises(ConfigError, match=re.escape(f"save_weights: {says}")):
        save_weights(engine, tmp_path / "out", dtype=torch.float8_e4m3fn)
    with pytest.raises(ConfigError, match=re.escape(f"export: {says}")):   # (before the checkpoint is read)
        export(tmp_path / "no-checkpoint", tmp_path / "out", dtype=torch.float8_e4m3fn)
    assert not (tmp_path / "out").exists()


def test_values_beyond_float16_are_counted_in_one_warning(tmp_path, capsys, monkeypatch):
    from framework.persist import weights
    from framework.persist.tensorfiles import WeightsSource
    from safetensors.torch import load_file
    engine = _engine("+stage=zero2")
    sd = _plain_sd()
    name = next(k for k, v in sd.items() if v.numel() >= 3)
    sd[name].view(-1)[:3] = torch.tensor([1e5, -7e4, 6e4])   # two beyond 65504, one within
    load_weights(engine, WeightsSource("test", sd))
    capsys.readouterr()
    save_weights(engine, tmp_path / "bf16", dtype=torch.bfloat16)
    assert capsys.readouterr().err == ""
    save_weights(engine, tmp_path / "fp16", dtype=torch.float16)
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("warning: save_weights: 2 finite values beyond the float16 range"), err
    assert load_file(tmp_path / "fp16" / "model.safetensors")[name].view(-1)[:3].isinf().tolist() == [True, True, False]
    # NaN and inf in the masters (a diverged run): written as they are, with one warning naming the tensors,
    # from the overflow's scan (fp16: an inf is not counted again as an overflow)
    other = next(k for k, v in sd.items() if k != name and v.is_floating_point() and v.numel() >= 2)
    sd[other].view(-1)[:2] = torch.tensor([float("nan"), float("-inf")])
    with pytest.raises(ConfigError, match=fr"^load_weights: non-finite values \(NaN or inf\) in '{other}' of test: "
                                          r"not weights to train from; load ones saved before training diverged$"):
        load_weights(engine, WeightsSource("test", sd))   # (as load_state_dict refuses them)
    monkeypatch.setattr(weights, "nonfinite", lambda values, nan_only=False: None)   # a load that did not check
    load_weights(engine, WeightsSource("test", sd))
    monkeypatch.undo()
    for dtype in (None, torch.float16):
        capsys.readouterr()
        save_weights(engine, tmp_path / "nan", dtype=dtype)
        err = [line for line in capsys.readouterr().err.splitlines() if "NaN" in line]
        assert err == [f"warning: save_weights: NaN or inf values in {other!r} were written as they are: the "
                       "weights hold a diverged state (save from a checkpoint before it to get usable ones)"], err
        assert load_file(tmp_path / "nan" / "model.safetensors")[other].view(-1)[:2].isfinite().tolist() == [False] * 2


def test_a_torch_compiled_modules_weights_take_the_plain_models_names(tmp_path):
    """torch.compile's wrapper puts '_orig_mod.' before every name: saved so, its weights did not load into the
    plain model they came from. Saved and consolidated under the plain names; load_weights takes both."""
    from safetensors.torch import load_file
    loss = lambda m, mb: torch.nn.functional.mse_loss(m(mb[0]), mb[1])   # noqa: E731
    plain = lambda: torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))   # noqa: E731
    names = ["0.bias", "0.weight", "1.bias", "1.num_batches_tracked", "1.running_mean", "1.running_var", "1.weight"]
    compiled = torch.compile(plain(), backend="eager")
    with framework.initialize(compiled, loss, tiny_config("+stage=zero2")) as engine:
        assert sorted(engine.consolidated_state_dict()) == names
        save_weights(engine, tmp_path / "c")
    assert sorted(load_file(tmp_path / "c" / "model.safetensors")) == names
    for module in (plain(), torch.compile(plain(), backend="eager")):
        with framework.initialize(module, loss, tiny_config("+stage=zero2")) as engine:
            load_weights(engine, tmp_path / "c")
            assert torch.equal(engine.consolidated_state_dict()["0.weight"], compiled._orig_mod[0].weight.detach())


def test_a_sparse_torch_file_is_refused_without_torchs_sparse_warning(tmp_path):
    """torch 2.11's weights_only rebuild of a sparse tensor warns (once a process) that sparse invariant checks are
    implicitly disabled: above the refusal, of a tensor nothing uses. Each in a fresh process (it warns once)."""
    torch.save({"w": torch.eye(3).to_sparse()}, tmp_path / "sparse.pt")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    load = {"torch": f"torch.load({str(tmp_path / 'sparse.pt')!r}, weights_only=True, mmap=True)",
            "framework": f"open_weights({str(tmp_path / 'sparse.pt')!r})"}
    said = {k: subprocess.run([sys.executable, "-c", "import torch\nfrom framework.core.errors import ConfigError\n"
                               "from framework.persist.tensorfiles import open_weights\n"
                               f"try:\n    {code}\nexcept ConfigError as e:\n    print(e)"],
                              capture_output=True, text=True, env=env, timeout=120) for k, code in load.items()}
    if "Sparse invariant checks" not in said["torch"].stderr:
        pytest.skip(f"torch {torch.__version__} does not warn on loading a sparse tensor")
    assert said["framework"].stdout.endswith("is sparse_coo, not dense weights; save a dense tensor in its place "
                                             "(t.to_dense() of a sparse one; a materialized model's, not meta)\n")
    assert said["framework"].stderr == "", said["framework"].stderr


def test_an_index_nested_too_deeply_to_parse_is_one_line(tmp_path):
    index = tmp_path / "model.safetensors.index.json"
    index.write_text('{"weight_map": ' + '[' * 100_000 + ']' * 100_000 + '}')
    with pytest.raises(ConfigError, match=r"is not a safetensors index \(nested too deeply to parse\)"):
        load_weights(_engine(), index)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
def test_a_torch_file_with_sparse_meta_or_nested_tensors_is_refused_before_the_load_starts(tmp_path):
    """Refused on reading the file, so the engine is not left mid-load (refusing to step) for a caller that goes on."""
    engine = _engine()
    sd = _plain_sd()
    name = next(iter(sd))
    for kind, tensor, said in (("sparse", sd[name].to_sparse(), "is sparse_coo, not dense weights"),
                               ("meta", sd[name].to("meta"), "is on the meta device"),
                               # (a strided nested one: its layout is torch.strided, unlike a jagged one's)
                               ("nested", torch.nested.nested_tensor([sd[name], sd[name]]), "is nested")):
        torch.save({**sd, name: tensor}, tmp_path / f"{kind}.pt")
        with pytest.raises(ConfigError, match=f"{kind}.pt: tensor '{re.escape(name)}' {said}"):
            load_weights(engine, tmp_path / f"{kind}.pt")
        assert engine.consolidated_state_dict() is not None   # (an engine left mid-load refuses this)
