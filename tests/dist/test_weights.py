"""framework.persist.weights on 2 gloo ranks: load_weights and save_weights under every stage.

Each case builds an engine (default seed), loads weights written from a differently seeded
plain model (safetensors file, sharded folder with an index, or a torch state dict), and checks:
* the gathered working parameters and every rank's fp32 masters equal the plain model's
  load_state_dict bitwise (torch.equal; bf16: the plain values rounded as the stage rounds);
* each rank read only its own ranges: bytes through the slice API per rank (ddp: everything);
* the first loss equals the plain model's on the same batches, bitwise (fp32: the same per-rank
  forward, summed over ranks in the same two-term order);
* after one step, save_weights (sharded: small max_shard_size) gives files that the plain model
  loads with load_state_dict(strict=True), bitwise equal to the gathered working parameters.
"""
import contextlib
import io
import json
import os
import shutil

import pytest
import torch
from torch import nn

import framework
from framework.models.gpt import gpt_loss
from framework.persist.tensorfiles import open_weights
from framework.persist.weights import load_weights, save_weights
from tests._helpers import build_gpt, env_set, tiny_config
from tests.dist.test_layout import assemble

ROWS = 8
PLAIN_SEED = 1234


def _gathered(engine) -> dict[str, torch.Tensor]:
    module = engine.components.module
    with framework.gathered(list(module.parameters())):
        return {n: p.detach().clone() for n, p in module.named_parameters()}


def _read_files(out_dir) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    out = {}
    for name in sorted(os.listdir(out_dir)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(out_dir, name)))
    return out


def _case(dist, overrides, source, plain_file, out_dir):
    """Load ``source``, take one step, save; returns what the test compares."""
    cfg = tiny_config(*overrides, f"train.micro_batch={ROWS // dist.world}")
    module, data = build_gpt(cfg)
    engine = framework.initialize(module, gpt_loss, cfg, dist)
    before = engine.state_dict(engine.state)
    with open_weights(source) as src:
        load_weights(engine, src)
        read = src.bytes_read
    loaded, masters = _gathered(engine), engine.state_dict(engine.state)
    plain, _ = build_gpt(cfg, seed=7)
    plain.load_state_dict(torch.load(plain_file, weights_only=True))
    batch = data.train_batch(0, micro_batch=ROWS // dist.world, grad_accum=1, rank=dist.rank, world=dist.world)
    with torch.no_grad():
        plain_loss = gpt_loss(plain, batch.micro[0]).float()
    state, m = engine.train_step(engine.state, batch)
    trained = _gathered(engine)
    paths = save_weights(engine, out_dir, max_shard_size="30KB")
    paths16 = save_weights(engine, out_dir + "-bf16", dtype=torch.bfloat16) if "precision=bf16" in overrides else None
    engine.close()
    return {"read": read, "loaded": loaded, "masters": masters, "before": before, "loss": m["loss"],
            "plain_loss": plain_loss, "trained": trained, "paths": [str(p) for p in paths],
            "paths16": paths16 and [str(p) for p in paths16]}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """The plain model's weights (seed PLAIN_SEED) in every accepted format."""
    from safetensors.torch import save_file
    d = tmp_path_factory.mktemp("sources")
    cfg = tiny_config()
    plain, _ = build_gpt(cfg, seed=PLAIN_SEED)
    g = torch.Generator().manual_seed(5)   # off the init values (LayerNorm's ones, zero biases) too
    sd = {k: (v + 0.01 * torch.randn(v.shape, generator=g)).contiguous() for k, v in plain.state_dict().items()}
    torch.save(sd, d / "plain.pt")
    save_file(sd, d / "plain.safetensors")
    sharded = d / "sharded"
    sharded.mkdir()
    names = list(sd)
    weight_map = {}
    for i in range(3):   # three shards, as transformers writes them
        part = names[i::3]
        fname = f"model-{i + 1:05d}-of-00003.safetensors"
        save_file({k: sd[k] for k in part}, sharded / fname)
        weight_map.update({k: fname for k in part})
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return {"pt": d / "plain.pt", "safetensors": d / "plain.safetensors", "sharded": sharded, "sd": sd}


CASES = {
    "ddp <- torch file": ([], "pt"),
    "zero1 <- safetensors": (["+stage=zero1"], "safetensors"),
    "zero2 offload ratio 0.5 <- sharded": (["+stage=zero2", "offload=cpu", "offload.ratio=0.5"], "sharded"),
    "zero3 <- sharded": (["+stage=zero3", "stage.stage3_param_persistence_threshold=0"], "sharded"),
    "zero3 bf16 offload params <- safetensors": (
        ["+stage=zero3", "precision=bf16", "offload=cpu", "offload.params=cpu",
         "stage.stage3_param_persistence_threshold=300"], "safetensors"),
    "zero3 bf16 nvme (master, state, shards on disk) <- safetensors": (
        ["+stage=zero3", "precision=bf16", "offload=nvme", "offload.sub_group_size=1024",
         "stage.stage3_param_persistence_threshold=0"], "safetensors"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_load_and_save_under_every_stage(pools, sources, tmp_path, case):
    overrides, fmt = CASES[case]
    ranks = pools(2).run(_case, overrides, str(sources[fmt]), str(sources["pt"]), str(tmp_path / "out"), timeout=240)
    sd = sources["sd"]
    bf16 = "precision=bf16" in overrides
    total = sum(v.numel() * v.element_size() for v in sd.values())
    # Loaded values: working parameters (gathered) and fp32 masters, bitwise.
    masters = assemble([r["masters"] for r in ranks])
    before = assemble([r["before"] for r in ranks])
    for name, value in sd.items():
        want = value.to(torch.bfloat16) if bf16 else value
        for rank, r in enumerate(ranks):
            assert torch.equal(r["loaded"][name], want), f"{case} rank {rank}: working {name} differs"
        assert torch.equal(masters[name].view(value.shape), value), f"{case}: master {name} differs"
        assert not torch.equal(before[name].view(value.shape), value)   # the load changed something
    # Reads: ddp replicates everything; the ZeRO stages read their partitions, together the file once.
    reads = [r["read"] for r in ranks]
    if not overrides:
        assert reads == [total, total], reads
    else:
        assert sum(reads) == total and max(reads) <= 0.7 * total, (reads, total)
    # The first loss: the plain model's, on the same per-rank batches.
    ref = (ranks[0]["plain_loss"] + ranks[1]["plain_loss"]).item() / 2
    if bf16:
        assert ranks[0]["loss"] == pytest.approx(ref, rel=2e-2)
    else:
        assert ranks[0]["loss"] == ref and ranks[1]["loss"] == ref, (ranks[0]["loss"], ref)
    # save_weights after one step: sharded files + index, loadable by the plain model, bitwise.
    paths = ranks[0]["paths"]
    assert paths == ranks[1]["paths"] and paths[-1].endswith("model.safetensors.index.json") and len(paths) > 3
    index = json.loads(open(paths[-1]).read())
    assert set(index["weight_map"]) == set(sd)
    assert index["metadata"]["total_size"] == total
    saved = _read_files(tmp_path / "out")
    plain, _ = build_gpt(tiny_config(), seed=7)
    plain.load_state_dict(saved, strict=True)
    trained = ranks[0]["trained"]
    for name, p in plain.named_parameters():
        if bf16:   # fp32 masters are saved; the working parameters are those rounded
            assert torch.equal(p.detach().to(torch.bfloat16), trained[name]), name
        else:
            assert torch.equal(p.detach(), trained[name]), f"{case}: saved {name} differs from the trained one"
    if bf16:
        saved16 = _read_files(tmp_path / "out-bf16")
        assert all(torch.equal(saved16[n], trained[n]) for n in trained)


# --- Hugging Face: tied weights, save_pretrained -> from_pretrained ---------------------------------------


def _hf_model():
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=4, n_embd=64, vocab_size=1000, n_positions=128))


def _hf_loss(module, micro):
    x, y = micro
    return nn.functional.cross_entropy(module(input_ids=x).logits.flatten(0, 1).float(), y.flatten())


def _hf_case(dist, out_dir, tied_file):
    with env_set(HF_HUB_OFFLINE="1"):
        return _hf_round_trip(dist, out_dir, tied_file)


def _hf_round_trip(dist, out_dir, tied_file):
    cfg = tiny_config("+stage=zero3", "stage.gather_unit=[GPT2Block]", "stage.stage3_param_persistence_threshold=0")
    engine = framework.initialize(_hf_model(), _hf_loss, cfg, dist)
    g = torch.Generator().manual_seed(dist.rank)
    x, y = torch.randint(0, 1000, (2, 16), generator=g), torch.randint(0, 1000, (2, 16), generator=g)
    engine.train_step(engine.state, framework.Batch(((x, y),)))
    trained = _gathered(engine)
    paths = engine.save_pretrained(out_dir)
    engine.save_pretrained(out_dir + "-bf16-sharded", torch.bfloat16, max_shard_size="200KB")
    # Rank 0's config write is agreed on: when it fails (here a link where config.json goes) every rank
    # raises, none returns as if the folder were complete.
    if dist.is_main:
        os.makedirs(out_dir + "-link")
        os.symlink(os.path.join(out_dir, "config.json"), os.path.join(out_dir + "-link", "config.json"))
    dist.barrier()
    try:
        engine.save_pretrained(out_dir + "-link")
        refused = None
    except framework.FrameworkError as e:
        refused = str(e)
    # A fresh engine loads the export back, and a file naming the tied matrix by its other name.
    fresh = framework.initialize(_hf_model(), _hf_loss, cfg, dist)
    load_weights(fresh, out_dir)
    reloaded = _gathered(fresh)
    fresh2 = framework.initialize(_hf_model(), _hf_loss, cfg, dist)
    load_weights(fresh2, tied_file)
    via_alias = _gathered(fresh2)
    for e in (engine, fresh, fresh2):
        e.close()
    return trained, [str(p) for p in paths], reloaded, via_alias, refused


def test_save_pretrained_round_trip_and_tied_names(pools, tmp_path, monkeypatch):
    """GPT-2 (tied lm_head / wte) under zero3 on 2 ranks: save_pretrained -> from_pretrained bitwise;
    load_weights takes the tied matrix under either name."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM
    ref = _hf_model()
    sd = {k: v.clone() * 1.5 for k, v in ref.state_dict().items() if k != "transformer.wte.weight"}
    assert "lm_head.weight" in sd
    torch.save(sd, tmp_path / "tied.pt")   # the tie only under lm_head.weight
    ranks = pools(2).run(_hf_case, str(tmp_path / "hf"), str(tmp_path / "tied.pt"), timeout=240)
    trained, paths, reloaded, via_alias, _ = ranks[0]
    for r, (_, p, _, _, refused) in enumerate(ranks):
        assert [os.path.basename(x) for x in p] == ["model.safetensors", "config.json"], r
        assert refused is not None and "config.json" in refused, (r, refused)
    saved = _read_files(tmp_path / "hf")
    assert "lm_head.weight" not in saved and "transformer.wte.weight" in saved   # tied: written once
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert back.lm_head.weight is back.transformer.wte.weight
    for name, p in back.named_parameters():
        assert torch.equal(p.detach(), trained[name]), f"from_pretrained: {name} differs"
        assert torch.equal(reloaded[name], trained[name]), f"load_weights of the export: {name} differs"
    assert torch.equal(via_alias["transformer.wte.weight"], sd["lm_head.weight"])
    # bf16, sharded with an index: from_pretrained reads the index; values are the trained ones rounded.
    assert (tmp_path / "hf-bf16-sharded" / "model.safetensors.index.json").exists()
    back16 = AutoModelForCausalLM.from_pretrained(tmp_path / "hf-bf16-sharded")
    for name, p in back16.named_parameters():
        assert torch.equal(p.detach().to(torch.bfloat16), trained[name].to(torch.bfloat16)), name
    assert torch.equal(via_alias["transformer.h.0.attn.c_attn.weight"], sd["transformer.h.0.attn.c_attn.weight"])


# --- memory: save_weights never assembles the model; the rank-0 gather (the control) does ---------------

def _hwm_reset() -> int:
    """Reset this process's peak RSS to its current RSS (Linux clear_refs); returns it in bytes."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _hwm()


def _hwm() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _save_memory(dist, out_dir):
    cfg = tiny_config("+stage=zero3", "stage.stage3_param_persistence_threshold=0", "data.vocab_size=256",
                      "model.d_model=512", "model.n_head=4", "model.n_layer=3")   # 9.7 M parameters
    with torch.device("meta"):
        module, _ = build_gpt(cfg)
    engine = framework.initialize(module, gpt_loss, cfg, dist)
    model = sum(p.logical_shape.numel() for p in module.parameters()) * 4
    growth = {}
    for what, run in (("fp32", lambda: save_weights(engine, out_dir)),
                      ("bf16", lambda: save_weights(engine, out_dir + "-bf16", dtype=torch.bfloat16)),
                      ("gather to rank 0", engine.consolidated_state_dict)):
        base = _hwm_reset()
        kept = run()
        growth[what] = _hwm() - base
        del kept
    engine.close()
    return model, growth


def test_save_weights_peak_memory_is_not_the_model(pools, tmp_path):
    """Measured per rank (peak RSS growth, 2 ranks, zero3, a 39 MB fp32 model): save_weights grows by
    its chunks at most (fp32 values are written from the masters as they lie), while gathering the
    model on rank 0 -- the control, which shows the measurement can fail -- grows by the model."""
    ranks = pools(2).run(_save_memory, str(tmp_path / "out"), timeout=240)
    model = ranks[0][0]
    for rank, (_, growth) in enumerate(ranks):
        print(f"rank {rank}: model {model} B, peak RSS growth {growth}")
        assert growth["fp32"] < 0.1 * model and growth["bf16"] < 0.3 * model, (rank, growth, model)
    assert ranks[0][1]["gather to rank 0"] > 0.9 * model, (ranks[0][1], model)
    assert _read_files(tmp_path / "out").keys() == _read_files(tmp_path / "out-bf16").keys()


def _save_into_a_file(dist, path):
    cfg = tiny_config("+stage=zero2", f"train.micro_batch={ROWS // dist.world}")
    module, _ = build_gpt(cfg)
    engine = framework.initialize(module, gpt_loss, cfg, dist)
    try:
        save_weights(engine, path)
    except Exception as e:  # noqa: BLE001 - the test compares what each rank raised
        return type(e).__name__, str(e)
    finally:
        engine.close()
    return None


def test_a_rank_that_cannot_write_stops_every_rank(pools, tmp_path):
    """Rank 0 cannot create the files (out_dir is a file): it raises one line naming the folder, the other rank
    a FrameworkError naming that, and nobody waits for a collective that will never come."""
    (tmp_path / "taken").write_text("not a folder")
    r0, r1 = pools(2).run(_save_into_a_file, str(tmp_path / "taken"), timeout=120)
    assert r0[0] == "FrameworkError" and r0[1].startswith(f"save_weights: cannot write {tmp_path / 'taken'} ("), r0
    assert r1[0] == "FrameworkError" and r1[1].startswith("save_weights: create files failed on another rank: rank 0: "
                                                          f"save_weights: cannot write {tmp_path / 'taken'} ("), r1


class _WithBuffers(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.bn, self.head = nn.Embedding(24, 8), nn.BatchNorm1d(8), nn.Linear(8, 24)

    def forward(self, x):
        return self.head(self.bn(self.emb(x).reshape(-1, 8)))


def _buffers_loss(module, micro):
    x, y = micro
    return nn.functional.cross_entropy(module(x), y.reshape(-1))


def _save_rank_dependent_buffers(dist, out_dir):
    """BatchNorm's statistics differ per rank (each saw its own batches); save_weights writes rank 0's."""
    cfg = tiny_config("+stage=zero1", "train.micro_batch=2")
    with framework.initialize(_WithBuffers(), _buffers_loss, cfg, dist) as engine:
        bn = engine.components.module.bn
        with torch.no_grad():
            bn.running_mean.fill_(dist.rank + 1)
            bn.running_var.fill_(10 * (dist.rank + 1))
            bn.num_batches_tracked.fill_(100 * (dist.rank + 1))
        save_weights(engine, out_dir)
        return {k: v.clone() for k, v in bn.state_dict().items() if k.startswith(("running", "num"))}


def test_saved_buffers_are_rank_0s(pools, tmp_path):
    """Buffers are written from one rank (rank 0, as the checkpoint keeps them), never some from each."""
    rank0, rank1 = pools(2).run(_save_rank_dependent_buffers, str(tmp_path / "out"), timeout=120)
    saved = _read_files(tmp_path / "out")
    assert not torch.equal(rank0["running_mean"], rank1["running_mean"])
    for name, value in rank0.items():
        assert torch.equal(saved[f"bn.{name}"], value), (name, saved[f"bn.{name}"], value)


def _load_with_a_failed_map(dist, folder, via):
    """offload=nvme: rank 1 cannot map its swap file to write the loaded masters into it."""
    cfg = tiny_config("+stage=zero2", "offload=nvme", f"offload.nvme_path={folder}/r{dist.rank}",
                      f"train.micro_batch={ROWS // dist.world}")
    module, _ = build_gpt(cfg)
    with framework.initialize(module, gpt_loss, cfg, dist) as engine:
        save_weights(engine, f"{folder}/out")
        saved = dist.all_gather_object(engine.state_dict(engine.state), what="test state gather")
        if dist.rank == 1:   # the offload target's map of its swap file (an mmap) fails
            def fail(params, opt_state, *, write):
                raise OSError("injected: cannot map rank 1's swap file")
            engine.components.stage.offload.mapped_state = fail
        try:
            if via == "load_weights":
                load_weights(engine, f"{folder}/out")
            else:
                engine.load_state_dict(engine.state, saved)
        except Exception as e:  # noqa: BLE001 - the test compares what each rank raised
            return type(e).__name__, str(e)
    return None


@pytest.mark.parametrize("via", ["load_weights", "load_state_dict"])
def test_a_rank_that_cannot_map_its_swap_file_stops_every_rank_loading(pools, tmp_path, via):
    r0, r1 = pools(2).run(_load_with_a_failed_map, str(tmp_path), via, timeout=120)
    assert r1 == ("OSError", "injected: cannot map rank 1's swap file"), r1
    assert r0 is not None and r0[0] == "FrameworkError" and "on another rank: rank 1" in r0[1], r0


# --- a real checkpoint: stage3_gather_16bit_weights_on_model_save in each step folder, then export -------

def _checkpointed(dist, ckpt_dir):
    from framework.persist.checkpoint import Checkpointer
    cfg = tiny_config("+stage=zero3", "precision=bf16", "stage.stage3_gather_16bit_weights_on_model_save=true",
                      "stage.stage3_param_persistence_threshold=0", f"checkpoint.dir={ckpt_dir}",
                      "checkpoint.every=2", f"train.micro_batch={ROWS // dist.world}")
    module, data = build_gpt(cfg)
    engine = framework.initialize(module, gpt_loss, cfg, dist)
    ckpt = Checkpointer(cfg, engine)
    state = engine.state
    for _ in range(4):
        batch = data.train_batch(state.data, micro_batch=ROWS // dist.world, grad_accum=1, rank=dist.rank,
                                 world=dist.world)
        state, _ = engine.train_step(state, batch)
        ckpt.maybe_save(state)
    ckpt.close()
    out = _gathered(engine), engine.state_dict(state)
    engine.close()
    return out


def _resumed(dist, step):
    """(the step resumed from ``step``, what this rank printed)."""
    from framework.persist.checkpoint import Checkpointer
    cfg = tiny_config("+stage=zero3", "precision=bf16", "stage.stage3_gather_16bit_weights_on_model_save=true",
                      "stage.stage3_param_persistence_threshold=0", f"checkpoint.resume={step}", "checkpoint.every=0",
                      f"train.micro_batch={ROWS // dist.world}")
    module, _ = build_gpt(cfg)
    engine = framework.initialize(module, gpt_loss, cfg, dist)
    ckpt, out = Checkpointer(cfg, engine), io.StringIO()
    try:
        with contextlib.redirect_stderr(out):
            state = ckpt.resume(engine.state)
    finally:
        ckpt.close()
        engine.close()
    return state.step, out.getvalue()


def test_checkpoint_writes_16bit_weights_and_exports(pools, tmp_path, capsys):
    """zero3, bf16, 2 ranks, checkpoints at steps 2 and 4: each step folder holds model_16bit/ (the
    working bf16 parameters, bitwise); python -m framework.export of the checkpoint gives the fp32
    masters bitwise, loadable by the plain model with load_state_dict(strict=True)."""
    from framework.cli.export import main
    from framework.persist.export import get_fp32_state_dict_from_checkpoint
    ranks = pools(2).run(_checkpointed, str(tmp_path / "ckpt"), timeout=240)
    working, _ = ranks[0]
    masters = assemble([r[1] for r in ranks])
    for step in (2, 4):
        assert (tmp_path / "ckpt" / f"step-{step}" / "model_16bit" / "model.safetensors").is_file()
    assert not list((tmp_path / "ckpt").glob("*.model_16bit"))   # staging folders moved in
    w16 = _read_files(tmp_path / "ckpt" / "step-4" / "model_16bit")
    assert w16.keys() == working.keys()
    assert all(w16[n].dtype == torch.bfloat16 and torch.equal(w16[n], working[n]) for n in working)
    assert main([str(tmp_path / "ckpt"), "--to", str(tmp_path / "exported"), "--max-shard-size", "40KB"]) == 0
    exported = _read_files(tmp_path / "exported")
    plain, _ = build_gpt(tiny_config(), seed=7)
    plain.load_state_dict(exported, strict=True)
    fp32 = get_fp32_state_dict_from_checkpoint(tmp_path / "ckpt")
    for name, p in plain.named_parameters():
        assert torch.equal(p.detach().reshape(-1), masters[name]), f"exported {name} is not the fp32 master"
        assert torch.equal(fp32[name], p.detach())
        assert torch.equal(p.detach().to(torch.bfloat16), working[name])
    # model_16bit/ is in the step's manifest: a byte flipped there is damage, not exported
    from framework.persist.checkpoint import CheckpointError, verify
    step = tmp_path / "ckpt" / "step-4"
    listed = json.loads((step / "manifest.json").read_text())["files"]
    assert {f"model_16bit/{p.name}" for p in (step / "model_16bit").iterdir()} <= set(listed)
    assert "model_16bit/model.safetensors" in listed
    verify(step)
    weights = step / "model_16bit" / "model.safetensors"
    with open(weights, "r+b") as f:
        f.seek(weights.stat().st_size - 1)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(CheckpointError, match=f"is damaged: {weights} does not match its sha256"):
        verify(step)
    # an export and a resume do not read model_16bit/: they go on from the intact checkpoint, saying the copy is
    # damaged (a weights load from it is refused: check_weights16)
    capsys.readouterr()
    assert main([str(step), "--to", str(tmp_path / "past_damage")]) == 0
    assert any((tmp_path / "past_damage").glob("*.safetensors"))
    # the note on stderr: stdout lists only the paths written (for scripts); a removed copy is said missing
    printed = capsys.readouterr()
    assert printed.out == f"{tmp_path / 'past_damage' / 'model.safetensors'}\n", printed
    assert "('model_16bit/model.safetensors' fails the manifest check)" in printed.err, printed
    shutil.rmtree(tmp_path / "gone", ignore_errors=True)
    shutil.copytree(step, tmp_path / "gone")
    shutil.rmtree(tmp_path / "gone" / "model_16bit")
    assert main([str(tmp_path / "gone"), "--to", str(tmp_path / "past_missing")]) == 0
    printed = capsys.readouterr()
    assert printed.out.count("\n") == 1 and "(the 16-bit weights copy) is damaged ('model_16bit/" in printed.err
    assert "missing): going on" in printed.err and "manifest check" not in printed.err, printed
    for rank, (step_at, said) in enumerate(pools(2).run(_resumed, str(step), timeout=240)):
        assert step_at == 4
        assert ("(the 16-bit weights copy) is damaged ('model_16bit/model.safetensors' fails the manifest check): "
                "going on" in said) == (rank == 0), said
