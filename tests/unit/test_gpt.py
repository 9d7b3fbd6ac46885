"""GPT model: preset sizes, shapes, causality, tying, checkpointing, init, generation."""
from __future__ import annotations

import dataclasses
import importlib.util
import math
from pathlib import Path

import pytest
import torch

from framework.core.errors import ConfigError
from framework.models.gpt import COMPONENTS, GPT, Block, GPTConfig, build, gpt_loss, preset
from framework.core.registry import registry
from framework.stages import param_count
from tests._helpers import count_params

CONF = Path(__file__).resolve().parents[2] / "conf" / "model"

# Exact sizes at each YAML's default vocabulary.
EXPECTED_PARAMS = {
    "gpt-nano": 804_096,
    "gpt-mini": 10_818_432,
    "gpt2-small": 124_475_904,
    "gpt2-medium": 354_871_296,
    "gpt-1b": 1_416_744_960,
}


def tiny(**overrides) -> GPTConfig:
    base = dict(vocab_size=50, context=16, n_layer=2, n_head=2, d_model=32, bias=True)
    return GPTConfig(**{**base, **overrides})


def batch(cfg: GPTConfig, b: int = 3, t: int | None = None, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    t = t or cfg.context
    return (torch.randint(0, cfg.vocab_size, (b, t), generator=g),
            torch.randint(0, cfg.vocab_size, (b, t), generator=g))


@pytest.mark.parametrize("name", sorted(COMPONENTS))
def test_preset_yaml_has_every_field_and_states_its_size(name):
    OmegaConf = pytest.importorskip("omegaconf").OmegaConf   # (not on the GPU image)
    text = (CONF / f"{name}.yaml").read_text()
    node = OmegaConf.to_container(OmegaConf.create(text))
    assert set(node) == {f.name for f in dataclasses.fields(GPTConfig)}
    # preset() reads with PyYAML, a run's config with OmegaConf: both must read the same values.
    assert GPTConfig(**node) == preset(name)
    # The header a user reads is the size the model has.
    assert text.startswith(f"# {name}: {count_params(preset(name)):,} parameters at this vocab_size")


@pytest.mark.parametrize("name", sorted(COMPONENTS))
def test_preset_param_counts(name):
    cfg = preset(name)
    assert count_params(cfg) == EXPECTED_PARAMS[name]
    with torch.device("meta"):          # no memory, even for the 1.4 B model
        model = build(cfg)
    assert param_count(model) == EXPECTED_PARAMS[name]   # a tied matrix counts once


def test_registry_lists_presets():
    assert set(COMPONENTS) == set(EXPECTED_PARAMS)   # every preset YAML was found
    assert set(registry("model").names()) >= set(COMPONENTS)
    assert all(c.config is GPTConfig for c in COMPONENTS.values())


def test_a_bad_preset_file_breaks_only_its_own_name(tmp_path, monkeypatch):
    """A nanoGPT-style file dropped into conf/model/ must not stop the runs of every other model: the module
    reads no preset at import, and reading the bad one is one line naming its file."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "gpt-nano.yaml").write_text((CONF / "gpt-nano.yaml").read_text())
    bad = tmp_path / "model" / "gpt-bad.yaml"
    bad.write_text("vocab_size: 65\nblock_size: 64\nn_layer: 2\nn_head: 2\nn_embd: 64\nbias: false\n")
    monkeypatch.setattr("framework.core.paths.conf_dir", lambda: tmp_path)
    spec = importlib.util.find_spec("framework.models.gpt")
    fresh = importlib.util.module_from_spec(spec)   # a second copy: the imported module's classes stay as they are
    spec.loader.exec_module(fresh)
    assert sorted(fresh.COMPONENTS) == ["gpt-bad", "gpt-nano"]
    assert fresh.preset("gpt-nano").d_model == 128
    with pytest.raises(ConfigError, match=r"gpt-bad\.yaml: unknown key 'block_size' in model preset 'gpt-bad'"):
        fresh.preset("gpt-bad")
    bad.write_text("vocab_size: 65\ncontext: 64\nn_layer: 2\nn_head: 3\nd_model: 64\nbias: false\n")
    with pytest.raises(ConfigError, match=r"gpt-bad\.yaml: model\.d_model \(64\) must be divisible"):
        fresh.preset("gpt-bad")


def test_headline_sizes():
    assert count_params(dataclasses.replace(preset("gpt-nano"), vocab_size=65)) / 1e6 == pytest.approx(0.80, abs=0.01)
    assert round(count_params(preset("gpt-1b")) / 1e9, 3) == 1.417
    assert round(count_params(preset("gpt2-small")) / 1e6) == 124


def test_build_vocab_override():
    model = build(tiny(), vocab_size=7)
    assert model.cfg.vocab_size == 7 and model.wte.weight.shape == (7, 32)
    assert build(tiny(), vocab_size=None).cfg.vocab_size == 50


def test_config_validation():
    with pytest.raises(ConfigError, match="divisible"):
        tiny(n_head=3)
    with pytest.raises(ConfigError, match="dropout"):
        tiny(dropout=1.0)


def test_forward_shape_dtype_and_loss_at_init():
    cfg = tiny()
    model = GPT(cfg)
    x, y = batch(cfg, t=10)
    logits = model(x)
    assert logits.shape == (3, 10, cfg.vocab_size) and logits.dtype == torch.float32
    # Small init: predictions start close to uniform.
    assert gpt_loss(model, (x, y)).item() == pytest.approx(math.log(cfg.vocab_size), abs=0.1)
    with pytest.raises(ValueError, match="context"):
        model(torch.zeros(1, cfg.context + 1, dtype=torch.long))


def test_token_ids_outside_the_vocabulary_are_one_line_on_the_host():
    """Library use (the CLI's data sources check their own ids): not F.embedding's 'index out of range in self'."""
    cfg = tiny()
    model = GPT(cfg)
    x = torch.zeros(2, 4, dtype=torch.long)
    x[1, 2] = cfg.vocab_size + 20
    with pytest.raises(ValueError, match=r"token id 70 is outside the model's vocabulary \[0, 50\)"):
        model(x)
    x[1, 2] = -1
    with pytest.raises(ValueError, match="token id -1 is outside .*such as -100 goes in the targets only$"):
        model(x)
    x[1, 2] = cfg.vocab_size - 1   # the last id is in
    assert model(x).shape == (2, 4, cfg.vocab_size)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])
def test_init_parameter_on_any_device_gives_the_host_built_values(device):
    """A stage materialises meta parameters on its device: the draws must be the CPU generator's."""
    cfg = tiny()
    torch.manual_seed(7)
    host = dict(GPT(cfg).named_parameters())
    torch.manual_seed(7)
    with torch.device("meta"):
        meta = GPT(cfg)
    for name, p in meta.named_parameters():
        t = torch.empty(p.shape, device=device)
        meta.init_parameter(name, t)
        assert torch.equal(t.cpu(), host[name].detach()), name


def test_low_precision_params_give_fp32_logits():
    cfg = tiny()
    model = GPT(cfg).to(torch.bfloat16)
    assert model(batch(cfg)[0]).dtype == torch.float32


def test_causal_masking():
    cfg = tiny()
    model = GPT(cfg).eval()
    x, _ = batch(cfg)
    changed = x.clone()
    changed[:, 9] = (changed[:, 9] + 1) % cfg.vocab_size
    a, b = model(x), model(changed)
    torch.testing.assert_close(a[:, :9], b[:, :9])
    assert not torch.allclose(a[:, 9:], b[:, 9:])


def test_weight_tying_shares_storage():
    tied, untied = GPT(tiny()), GPT(tiny(tie_weights=False))
    assert tied.lm_head is None and untied.lm_head.weight.data_ptr() != untied.wte.weight.data_ptr()
    assert param_count(untied) - param_count(tied) == 50 * 32
    assert param_count(tied) == count_params(tiny()) and param_count(untied) == count_params(tiny(tie_weights=False))
    # The head's gradient reaches the embedding: a token never fed in still gets a gradient.
    x = torch.zeros(2, 8, dtype=torch.long)
    gpt_loss(tied, (x, torch.ones_like(x))).backward()
    assert tied.wte.weight.grad[5].abs().sum() > 0


def test_init_scheme():
    cfg = tiny(n_layer=8, d_model=256, n_head=4)
    model = GPT(cfg)
    block = model.blocks[0]
    assert isinstance(block, Block)
    assert block.attn.qkv.weight.std().item() == pytest.approx(0.02, rel=0.05)
    for proj in (block.attn.proj, block.mlp.proj):
        assert proj.weight.std().item() == pytest.approx(0.02 / math.sqrt(16), rel=0.05)
        assert torch.count_nonzero(proj.bias) == 0
    assert model.wte.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert torch.equal(block.ln1.weight, torch.ones(256))


def test_no_bias_option():
    model = GPT(tiny(bias=False))
    assert all(not name.endswith("bias") for name, _ in model.named_parameters())


def _loss_and_grads(cfg: GPTConfig, data, seed: int = 1):
    torch.manual_seed(0)
    model = GPT(cfg).train()
    torch.manual_seed(seed)             # same dropout masks for both variants
    loss = gpt_loss(model, data)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_activation_checkpointing_same_loss_and_grads(dropout):
    data = batch(tiny())
    loss, grads = _loss_and_grads(tiny(dropout=dropout), data)
    loss_ckpt, grads_ckpt = _loss_and_grads(tiny(dropout=dropout, activation_checkpointing=True), data)
    torch.testing.assert_close(loss_ckpt, loss)
    assert grads.keys() == grads_ckpt.keys()
    for name in grads:
        torch.testing.assert_close(grads_ckpt[name], grads[name], msg=name)


def test_dropout_zero_is_deterministic_in_train_mode():
    cfg = tiny()
    model = GPT(cfg).train()
    x, _ = batch(cfg)
    torch.testing.assert_close(model(x), model(x), rtol=0, atol=0)
    noisy = GPT(tiny(dropout=0.5)).train()
    assert not torch.equal(noisy(x), noisy(x))


def test_generate():
    cfg = tiny()
    model = GPT(cfg).eval()
    prompt = torch.zeros(2, 3, dtype=torch.long)
    out = model.generate(prompt, 20, temperature=0.8, top_k=5)   # runs past the context
    assert out.shape == (2, 23) and out.dtype == torch.long
    assert torch.equal(out[:, :3], prompt) and int(out.max()) < cfg.vocab_size
    greedy = model.generate(prompt, 5, temperature=0.0)
    assert torch.equal(greedy, model.generate(prompt, 5, temperature=0.0))
    assert not model.generate(prompt, 1).requires_grad


@pytest.mark.parametrize("kwargs, needle", [
    ({"temperature": -1.0}, r"temperature must be a finite number >= 0 \(0 is greedy\), got -1.0"),
    ({"temperature": float("nan")}, "temperature must be a finite number"),
    ({"top_k": 0}, "top_k must be a whole number >= 1 or None"),
    ({"top_k": 2.5}, "top_k must be a whole number >= 1 or None"),
])
def test_generate_refuses_bad_sampling_settings(kwargs, needle):
    """A negative temperature would sample the least likely tokens, silently; top_k 0 failed inside torch."""
    model = GPT(tiny()).eval()
    with pytest.raises(ValueError, match=needle):
        model.generate(torch.zeros(1, 2, dtype=torch.long), 2, **kwargs)


def test_next_token_loss_casts_signed_integer_targets_and_refuses_others():
    """int8/int16/int32 targets train as int64 ones do; float, bool and unsigned ones (a cast would truncate 0.9
    to 0, or wrap) are one line naming the dtype, read from metadata alone (no host sync)."""
    from framework.core.errors import DataError
    from framework.models._base import next_token_loss

    logits, y = torch.randn(2, 3, 7), torch.randint(0, 7, (2, 3))
    for dtype in (torch.int8, torch.int16, torch.int32):
        assert torch.equal(next_token_loss(logits, y.to(dtype)), next_token_loss(logits, y))
    for dtype in (torch.float32, torch.bfloat16, torch.bool, torch.uint8):
        with pytest.raises(DataError) as e:
            next_token_loss(logits, y.to(dtype))
        assert f"targets y of dtype {dtype}; y must be token ids of a signed integer dtype" in str(e.value)
        assert ".long()" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(DataError, match="targets y of dtype torch.float32"):   # a model's loss: a tuple batch
        gpt_loss(GPT(tiny(vocab_size=7)), (y, y.float()))
