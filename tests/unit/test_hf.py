"""model=hf on one process: initialisation from the meta device, the loss, and clear errors."""
from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import pytest
import torch
from torch import nn

import framework
from framework import ConfigError
from framework.engine.build import component
from framework.models.hf import HFConfig, HFInit, causal_lm_loss, config_vocab, materialize
from framework.models.hf import build as hf_build
from framework.models._base import all_on_meta
from tests._hf import BASE, CONFIGS, build, hf_cfg, write_config


def _meta(arch, tmp_path, **overrides):
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = {**CONFIGS[arch], **overrides}
    config = AutoConfig.for_model(raw.pop("model_type"), **raw)
    with framework.zero_init():
        return AutoModelForCausalLM.from_config(config)


def test_zero_init_builds_on_meta_and_materialize_is_seeded_per_tensor(tmp_path):
    model = _meta("gpt2", tmp_path)
    assert all(p.is_meta for p in model.parameters())
    a = dict(materialize(_meta("gpt2", tmp_path), seed=5).named_parameters())
    b = dict(materialize(_meta("gpt2", tmp_path), seed=5).named_parameters())
    c = dict(materialize(_meta("gpt2", tmp_path), seed=6).named_parameters())
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert not torch.equal(a["transformer.h.0.attn.c_attn.weight"], c["transformer.h.0.attn.c_attn.weight"])
    # Order-independent: one tensor initialised alone (others never materialised) gets the same values.
    init = HFInit(_meta("gpt2", tmp_path), seed=5)
    for name in reversed(list(a)):
        t = torch.empty_like(a[name])
        init.init_parameter(name, t)
        assert torch.equal(t, a[name]), name
    # The tie survives: one tensor under both names.
    tied = materialize(_meta("gpt2", tmp_path), seed=5)
    assert tied.lm_head.weight is tied.transformer.wte.weight


def test_init_follows_the_models_own_init_weights(tmp_path):
    p = dict(materialize(_meta("gpt2", tmp_path, n_embd=128, n_layer=4), seed=1).named_parameters())
    # GPT-2's scheme: the attention/MLP modules (parents) rescale their c_proj (child) weights.
    assert p["transformer.h.0.mlp.c_proj.weight"].std().item() == pytest.approx(0.02 / math.sqrt(8), rel=0.05)
    assert p["transformer.h.0.mlp.c_fc.weight"].std().item() == pytest.approx(0.02, rel=0.05)
    assert torch.all(p["transformer.h.1.ln_1.weight"] == 1) and torch.all(p["transformer.h.1.attn.c_attn.bias"] == 0)


def test_conv1d_initialised_by_its_constructor_alone_materialises(tmp_path):
    """OpenAI GPT's _init_weights leaves transformers' Conv1D to its constructor (weight N(0, 0.02),
    bias zero), which the meta device skips: under model=hf it gets that scheme, and a zero3 step runs."""
    import json

    raw = dict(CONFIGS["gpt2"], model_type="openai-gpt", n_embd=128)
    for k in ("bos_token_id", "eos_token_id"):
        raw.pop(k)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    cfg = hf_cfg(tmp_path / "config.json", "model.attn_implementation=eager")
    model, _ = build(cfg, meta=False)
    p = dict(model.named_parameters())
    for name in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"):
        assert p[f"transformer.h.1.{name}.weight"].std().item() == pytest.approx(0.02, rel=0.1), name
        assert torch.all(p[f"transformer.h.1.{name}.bias"] == 0), name
    cfg = hf_cfg(tmp_path / "config.json", "model.attn_implementation=eager", "+stage=zero3")
    model, data = build(cfg)
    with framework.initialize(model, component(cfg, "model").loss, cfg) as engine:
        _, m = engine.train_step(engine.state, data.train_batch(0, micro_batch=2, grad_accum=1, rank=0, world=1))
    assert math.isfinite(m["loss"])


def test_xlnet_parameters_of_legacy_constructors_follow_its_init_not_memory(tmp_path):
    """XLNet makes mask_emb and its attention tensors with nn.Parameter(torch.FloatTensor(...)), which ignores the
    meta device: under zero_init they go on meta all the same and get its _init_weights' N(0, initializer_range),
    as in transformers' own construction on the CPU, not whatever memory held (NaN at step 1, or finite garbage)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = dict(model_type="xlnet", vocab_size=96, d_model=32, n_layer=1, n_head=2, d_inner=64, attn_type="uni")
    (tmp_path / "config.json").write_text(json.dumps(raw))
    legacy = ["transformer.mask_emb", *(f"transformer.layer.0.rel_attn.{k}" for k in
                                        ("q", "k", "v", "o", "r", "r_r_bias", "r_s_bias", "r_w_bias", "seg_embed"))]
    torch.manual_seed(0)
    eager = AutoModelForCausalLM.from_config(AutoConfig.for_model(**raw))   # the rule: std 0.02 (initializer_range)
    assert eager.get_parameter(legacy[1]).std().item() == pytest.approx(0.02, rel=0.15)
    for stage in ("zero2", "zero3"):
        cfg = hf_cfg(tmp_path / "config.json", "model.attn_implementation=eager", f"+stage={stage}")
        model, data = build(cfg)
        with framework.initialize(model, causal_lm_loss, cfg) as engine:
            if stage == "zero2":
                for n in legacy:
                    t = model.get_parameter(n)
                    assert 0.01 < t.std().item() < 0.04 and t.abs().max().item() < 0.2, (n, t.std(), t.abs().max())
                assert model.get_parameter(legacy[1]).std().item() == pytest.approx(0.02, rel=0.15)
            _, m = engine.train_step(engine.state, data.train_batch(0, micro_batch=2, grad_accum=1, rank=0, world=1))
        assert math.isfinite(m["loss"]) and m["loss"] < 6, m   # ln(96) = 4.56 at init


def test_all_on_meta_keeps_a_shared_legacy_parameter_shared():
    """``build``'s move of legacy-made parameters to meta: one meta parameter per real one, in each module that
    held it, with its requires_grad; a model built on a real device is left as it is."""
    with framework.zero_init():
        m = nn.ModuleDict(dict(a=nn.Linear(4, 4), b=nn.Linear(4, 4)))
        m.a.bias = m.b.bias = nn.Parameter(torch.FloatTensor(4))   # real memory, tied
        m.a.register_parameter("fixed", nn.Parameter(torch.FloatTensor(2), requires_grad=False))
    assert not m.a.bias.is_meta
    all_on_meta(m)
    assert all(p.is_meta for p in m.parameters()) and len(list(m.parameters())) == 4
    assert m.a.bias is m.b.bias and m.a.bias.requires_grad and not m.a.fixed.requires_grad
    real = nn.Linear(2, 2)
    weight = real.weight
    assert all_on_meta(real).weight is weight and not weight.is_meta


def test_meta_buffers_equal_eager_construction(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = dict(CONFIGS["llama"])
    eager = AutoModelForCausalLM.from_config(AutoConfig.for_model(raw.pop("model_type"), **raw))
    ours = materialize(_meta("llama", tmp_path))
    assert [n for n, _ in ours.named_buffers()] == [n for n, _ in eager.named_buffers()]
    for (n, a), (_, b) in zip(ours.named_buffers(), eager.named_buffers()):
        assert torch.equal(a, b), n


def test_uncovered_parameter_fails_naming_it(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    class WithExtra(GPT2LMHeadModel):
        def __init__(self, config):
            super().__init__(config)
            self.extra = nn.Parameter(torch.empty(3))   # not covered by _init_weights

    raw = dict(CONFIGS["gpt2"])
    raw.pop("model_type")
    with framework.zero_init():
        model = WithExtra(GPT2Config(**raw))
    with pytest.raises(ConfigError, match="parameter 'extra' of WithExtra is not initialised by its _init_weights"):
        materialize(model)


def test_an_init_reading_a_sibling_tensor_fails_naming_it():
    """RWKV's _init_weights computes one tensor from another of its module: still on meta one at a time."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("rwkv", hidden_size=32, num_hidden_layers=1, vocab_size=96,
                                  attention_hidden_size=32, intermediate_size=64)
    with framework.zero_init():
        model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(ConfigError) as e:
        materialize(model)
    assert "of RwkvForCausalLM cannot be materialised from the meta device: its _init_weights failed on " \
           "RwkvSelfAttention" in str(e.value) and "\n" not in str(e.value)


def test_loss_is_hf_causal_lm_loss(tmp_path):
    cfg = hf_cfg(write_config("llama", tmp_path))
    model, data = build(cfg, meta=False)
    x, y = data.train_batch(0, micro_batch=3, grad_accum=1, rank=0, world=1).micro[0]
    seq = torch.cat([x, y[:, -1:]], dim=1)    # y is x shifted by one
    theirs = model(input_ids=seq, labels=seq).loss   # transformers shifts the labels itself
    assert causal_lm_loss(model, (x, y)).item() == pytest.approx(theirs.item(), rel=1e-6)
    assert component(cfg, "model").loss is causal_lm_loss


def test_a_transformers_dict_batch_is_shifted_as_transformers_does(tmp_path):
    """{input_ids, labels (unshifted, -100 ignored), attention_mask}: the loss is transformers' own; a tuple keeps
    meaning (x, y) with y already shifted; any other dict is one line naming the keys taken."""
    from framework import DataError

    model, _ = build(hf_cfg(write_config("gpt2", tmp_path)), meta=False)
    ids = torch.randint(0, 96, (3, 10))
    mask = torch.ones_like(ids)
    mask[0, 7:] = 0   # right padding
    labels = ids.masked_fill(mask == 0, -100)
    labels[1, :4] = -100   # a prompt left out of the loss
    batch = {"input_ids": ids, "labels": labels, "attention_mask": mask}
    assert torch.equal(causal_lm_loss(model, batch), model(**batch).loss)
    unlabelled = {"input_ids": ids}   # labels absent: the input ids, as transformers' collator gives them
    assert torch.equal(causal_lm_loss(model, unlabelled), model(input_ids=ids, labels=ids).loss)
    assert causal_lm_loss(model, (ids[:, :-1], ids[:, 1:])).item() == pytest.approx(
        model(input_ids=ids[:, :-1], labels=ids[:, :-1]).loss.item(), abs=1.0)   # a tuple: still (x, y)
    for bad, needle in (({**batch, "token_type_ids": ids}, "has key(s) ['token_type_ids'] it does not take"),
                        ({"labels": ids}, "has no 'input_ids'"),
                        ({"input_ids": ids, "labels": ids[:, 1:]}, "has labels of shape [3, 9] (input_ids: [3, 10])")):
        with pytest.raises(DataError) as e:
            causal_lm_loss(model, bad)
        assert needle in str(e.value) and "'input_ids': [B, T] ids" in str(e.value) and "\n" not in str(e.value)


def test_dict_batch_ids_and_labels_dtypes_through_the_engine():
    """Signed integer labels (int32, int8...) train as int64 ones do (cast on the device); ids an embedding does
    not take, and labels that cannot hold -100 (unsigned, bool), are one line naming the dtype; the run goes on."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from framework import DataError

    torch.manual_seed(0)
    raw = dict(CONFIGS["gpt2"])
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(raw.pop("model_type"), **raw))
    x = torch.randint(0, 96, (2, 9))
    reference = causal_lm_loss(model, {"input_ids": x, "labels": x}).item()
    cfg = framework.compose(["+stage=zero2", "train.micro_batch=2", "logger=none", "optimizer.lr=0"])
    with framework.initialize(model, causal_lm_loss, cfg) as engine:
        state = engine.state
        for ids_dtype, labels_dtype in ((torch.int32, torch.int32), (torch.int64, torch.int8),
                                        (torch.int64, torch.int16)):
            state, m = engine.train_step(state, [{"input_ids": x.to(ids_dtype), "labels": x.to(labels_dtype)}])
            assert m["loss"] == pytest.approx(reference, rel=1e-5)
        state, m = engine.train_step(state, [(x[:, :-1], x[:, 1:].int())])   # a tuple's int32 y too
        assert math.isfinite(m["loss"])
        for key, dtype in (("input_ids", torch.uint8), ("input_ids", torch.int16), ("input_ids", torch.bool),
                           ("labels", torch.uint8), ("labels", torch.bool)):
            batch = {"input_ids": x, "labels": x, key: x.to(dtype)}
            with pytest.raises(DataError) as e:
                engine.train_step(state, [batch])
            assert f"has {key} of dtype {dtype}; {key} must be token ids of a signed integer dtype" in str(e.value)
            assert ".long()" in str(e.value) and "\n" not in str(e.value)
        assert "each holds -100" in str(e.value)
        state, m = engine.train_step(state, [{"input_ids": x, "labels": x}])
        assert m["loss"] == pytest.approx(reference, rel=1e-5) and state.step == 5


def test_model_keys_reach_transformers(tmp_path):
    cfg = hf_cfg(write_config("llama", tmp_path), "model.attn_implementation=eager",
                 "model.activation_checkpointing=true")
    model, _ = build(cfg)
    assert model.config._attn_implementation == "eager"
    assert all(layer.gradient_checkpointing for layer in model.model.layers)


def test_library_api_takes_an_eager_pretrained_model(tmp_path):
    """Any PreTrainedModel, built whole, goes through framework.initialize like any nn.Module."""
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = dict(CONFIGS["gpt2"])
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(raw.pop("model_type"), **raw))
    cfg = framework.compose(["+stage=zero3", "train.steps=2", "train.micro_batch=2", "logger=none"])
    x = torch.randint(0, 96, (2, 9))
    with framework.initialize(model, causal_lm_loss, cfg) as engine:
        state = engine.state
        for _ in range(2):
            state, m = engine.train_step(state, [(x[:, :-1], x[:, 1:])])
    assert math.isfinite(m["loss"]) and state.step == 2


@pytest.mark.parametrize("overrides,needle", [
    ([], "needs exactly one of model.config"),
    (["model.pretrained=/nonexistent"], "needs exactly one of model.config"),
    (["model.context=64"], "model.context=64 exceeds the model's max_position_embeddings (32)"),
    (["data.vocab_size=200"], "the data has 200 token ids but the model's vocabulary has 96"),
])
def test_bad_hf_config_is_one_clear_line(tmp_path, overrides, needle):
    path = write_config("gpt2", tmp_path)
    args = [o for o in ["model=hf", "model.context=16", "data.vocab_size=64", *overrides]]
    if overrides != []:
        args.append(f"model.config={path}")
    with pytest.raises(ConfigError) as e:   # by compose: before the run folder, not on each rank
        framework.compose(args)
    assert needle in str(e.value) and "\n" not in str(e.value)
    assert "its YAML file" not in str(e.value)   # (the hint for a gpt*.yaml preset: hf's file is the framework's)


def test_a_multimodal_config_is_checked_at_its_text_models_sizes(tmp_path):
    """gemma3 (as llama4, mllama) keeps vocab_size, max_position_embeddings and hidden_size in text_config only."""
    text = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, head_dim=16, max_position_embeddings=32)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32,
                  patch_size=16)
    (tmp_path / "config.json").write_text(json.dumps(dict(model_type="gemma3", text_config=text,
                                                          vision_config=vision)))
    base = ["model=hf", f"model.config={tmp_path}", "model.context=16"]
    for extra, needle in ((["data.vocab_size=200"], "the data has 200 token ids but the model's vocabulary has 96"),
                          (["model.context=64"], "max_position_embeddings (32)")):
        with pytest.raises(ConfigError, match=re.escape(needle)):
            framework.compose([*base, *extra])
    ds = {"zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"}}   # its hidden size too, as transformers
    assert framework.compose([*base, "data.vocab_size=64"], ds_config=ds).stage.reduce_bucket_size == 32 * 32
    assert config_vocab(HFConfig(config=str(tmp_path), context=16)) == 96


def test_a_config_with_several_text_parts_is_read_as_it_is():
    """musicgen's config has a text encoder and a decoder: transformers' get_text_config raises; the sizes are then
    the config's own (initialize reads its hidden size for "auto" bucket sizes, with or without a DeepSpeed file)."""
    from transformers import EncodecConfig, MusicgenConfig, T5Config
    from transformers.models.musicgen.configuration_musicgen import MusicgenDecoderConfig

    from framework.models.hf import config_hidden_size, text_config
    cfg = MusicgenConfig(text_encoder=T5Config(d_model=8, num_layers=1, num_heads=2, vocab_size=32).to_dict(),
                         audio_encoder=EncodecConfig(num_filters=2, hidden_size=8, upsampling_ratios=[2, 2]).to_dict(),
                         decoder=MusicgenDecoderConfig(hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                                                       vocab_size=32).to_dict())
    assert text_config(cfg) is cfg
    assert config_hidden_size(cfg) == getattr(cfg, "hidden_size", None)


def test_missing_paths_and_conversions_fail_before_any_download(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):   # when the config is checked
        framework.compose(["model=hf", f"model.config={tmp_path / 'nope.json'}"])
    cfg = framework.compose(["model=hf", f"model.config={write_config('gpt2', tmp_path)}", "model.context=16"])
    with pytest.raises(ConfigError, match="no such file"):   # (a config made without the checks)
        component(cfg, "model").build(dataclasses.replace(cfg.model, config=str(tmp_path / "nope.json")))
    folder = tmp_path / "mixtral"
    write_config("llama", folder, model_type="mixtral", num_local_experts=2, num_experts_per_tok=1)
    # A folder with a config.json but no weights: refused when the config is checked, not on each rank's load.
    with pytest.raises(ConfigError) as e:
        framework.compose(["model=hf", f"model.pretrained={folder}", "model.context=16"])
    assert str(e.value) == (f"model.pretrained={folder}: the folder holds no weights (none of "
                            f"model.safetensors.index.json, model.safetensors, pytorch_model.bin); give a "
                            f"save_pretrained folder with its weights, or model.config={folder} to train a new "
                            f"model from its config.json")
    # Sharded torch .bin weights (not read sharded): refused there too, before any rank loads (and fails) alike.
    (folder / "pytorch_model.bin.index.json").write_text('{"weight_map": {"a": "pytorch_model-00001-of-00001.bin"}}')
    with pytest.raises(ConfigError) as e:
        framework.compose(["model=hf", f"model.pretrained={folder}", "model.context=16"])
    assert str(e.value).startswith(f"model.pretrained={folder}: its only weights are torch .bin shards "
                                   f"(pytorch_model.bin.index.json), which are not read sharded; convert")
    from safetensors.torch import save_file

    # The hub's layout: experts unfused under block_sparse_moe, which transformers renames and fuses on load.
    save_file({"model.layers.0.block_sparse_moe.experts.0.w1.weight": torch.zeros(2, 2)}, folder / "model.safetensors")
    # Refused by compose (read from the header, before launch: one line, not one per rank), and by build (a config
    # not composed).
    cfg = HFConfig(pretrained=str(folder), context=16)
    hub = r".model.layers.0.block_sparse_moe.experts.0.w1.weight."
    for refuse in (lambda: framework.compose(["model=hf", f"model.pretrained={folder}", "model.context=16"]),
                   lambda: hf_build(cfg)):
        with pytest.raises(ConfigError, match=rf"^model.pretrained: this mixtral checkpoint.s tensor names \(e.g. "
                                              rf"{hub}\) need key[^\n]*$"):
            with framework.zero_init():
                refuse()
    # Mappings keyed by class name are found too (GPTNeoXForCausalLM renames embed_out to lm_head).
    neox = tmp_path / "neox"
    write_config("llama", neox, model_type="gpt_neox", num_attention_heads=4)
    torch.save({"embed_out.weight": torch.zeros(2)}, neox / "pytorch_model.bin")
    with pytest.raises(ConfigError, match=r"this gpt_neox checkpoint.s tensor names \(e.g. .embed_out.weight.\) "
                                          r"need key conversions on load"):
        framework.compose(["model=hf", f"model.pretrained={neox}", "model.context=16"])
    # Another model's names (a llama folder under a gpt_neox config) match no conversion: not blamed on one.
    torch.save({"model.embed_tokens.weight": torch.zeros(2)}, neox / "pytorch_model.bin")
    framework.compose(["model=hf", f"model.pretrained={neox}", "model.context=16"])
    # From scratch the same architecture builds (no checkpoint keys to convert).
    cfg = framework.compose(["model=hf", f"model.config={folder}", "model.context=16"])
    with framework.zero_init():
        assert component(cfg, "model").build(cfg.model) is not None


def test_deepspeed_auto_bucket_sizes_use_the_hf_hidden_size(tmp_path):
    # GPT-2 names it n_embd (32 here): DeepSpeed's "auto" reduce_bucket_size is hidden * hidden.
    ds = {"zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"}}
    path = write_config("gpt2", tmp_path)
    cfg = framework.compose(["model=hf", f"model.config={path}", "model.context=16"], ds_config=ds)
    assert cfg.stage.reduce_bucket_size == 32 * 32


def _engine(cfg):
    model, _ = build(cfg)
    return framework.initialize(model, component(cfg, "model").loss, cfg)


def test_save_pretrained_config_names_the_written_dtype_and_class(tmp_path):
    """A source config saying bfloat16 must not make from_pretrained round the fp32 values written."""
    import json

    from transformers import AutoModelForCausalLM

    cfg = hf_cfg(write_config("llama", tmp_path / "src", dtype="bfloat16"), "+stage=zero3")
    with _engine(cfg) as engine:
        engine.save_pretrained(tmp_path / "out")
        with framework.gathered(list(engine.components.module.parameters())):
            params = {n: p.detach().clone() for n, p in engine.components.module.named_parameters()}
        engine.save_pretrained(tmp_path / "out16", dtype=torch.bfloat16)
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["dtype"] == "float32" and written["architectures"] == ["LlamaForCausalLM"]
    assert json.loads((tmp_path / "out16" / "config.json").read_text())["dtype"] == "bfloat16"
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "out", local_files_only=True)
    assert all(torch.equal(p, params[n]) for n, p in hf.named_parameters())


def test_save_pretrained_writes_the_config_of_a_subclass_of_a_transformers_model(tmp_path):
    """A user's class deriving from a transformers model is one too: its folder loads with from_pretrained."""
    from transformers import GPT2Config, GPT2LMHeadModel

    class MyLM(GPT2LMHeadModel):
        pass

    model = MyLM(GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2, bos_token_id=0,
                            eos_token_id=0))
    model.generation_config.max_new_tokens = 7
    with framework.initialize(model, causal_lm_loss, framework.compose(["scheduler=constant"])) as engine:
        engine.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["MyLM"]
    back = MyLM.from_pretrained(tmp_path, local_files_only=True)
    assert back.generation_config.max_new_tokens == 7
    assert all(torch.equal(p, q) for p, q in zip(back.parameters(), model.parameters()))


@pytest.mark.parametrize("raw,needle", [
    (dict(model_type="gpt_neo", num_layers=2, attention_types=[[["global", "local"], 1]], hidden_size=32,
          num_heads=4, vocab_size=96, max_position_embeddings=32),
     "model.attn_implementation=sdpa is not supported by GPTNeoForCausalLM; set model.attn_implementation=eager"),
    (dict(model_type="t5", d_model=32, num_layers=2, num_heads=4, vocab_size=96, d_ff=64, d_kv=8),
     "model_type t5 is not a causal language model"),
    # Rejected by the config class's validators (an exception type of huggingface_hub's), by the model's
    # constructor (an assert), or a flag the class has no support for.
    ({**CONFIGS["llama"], "model_type": "qwen3", "layer_types": ["full_attention"] * 4},
     "config.json is not a valid qwen3 config: Class validation error for validator 'validate_layer_type': "
     "ValueError: `num_hidden_layers` (2) must be equal to the number of `layer_types` (4)"),
    ({**CONFIGS["llama"], "pad_token_id": 100},
     "LlamaForCausalLM cannot be built from"),
    # Accepted by transformers, which would build a model of embeddings only
    (dict(model_type="gpt2", n_layer=-1, n_head=4, n_embd=32, vocab_size=96, n_positions=32),
     "config.json: num_hidden_layers=-1 must be >= 1 (n_layer in the file)"),
    (dict(model_type="ctrl", n_embd=32, n_layer=2, n_head=4, dff=64, vocab_size=96, n_positions=64,
          activation_checkpointing=True),
     "model.activation_checkpointing=true is not supported by CTRLLMHeadModel"),
    # Custom model code: one short line (not transformers' list of every model type it knows)
    (dict(model_type="mymodel", hidden_size=32, auto_map={"AutoConfig": "configuration_my.MyConfig",
                                                          "AutoModelForCausalLM": "modeling_my.MyLM"}),
     "has model_type 'mymodel', which transformers"),
])
def test_unsupported_model_is_one_clear_line(tmp_path, raw, needle):
    import json

    checkpointing = raw.pop("activation_checkpointing", False)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    args = ["model=hf", f"model.config={tmp_path}", "model.context=16", f"model.activation_checkpointing={checkpointing}"]
    unchecked = HFConfig(config=str(tmp_path), context=16, activation_checkpointing=checkpointing)   # (not composed)
    with pytest.raises(ConfigError) as e:
        with framework.zero_init():
            hf_build(unchecked)
    assert needle in str(e.value) and "\n" not in str(e.value)
    if "cannot be built from" in needle:   # only the model's constructor tells
        framework.compose(args)
    else:   # the config alone decides: refused by compose, before the run folder (not on each rank)
        with pytest.raises(ConfigError) as checked:
            framework.compose(args)
        assert str(checked.value) == str(e.value)
    if raw["model_type"] == "mymodel":
        assert "names custom model code (auto_map); custom model code is not supported" in str(e.value)
        assert len(str(e.value).replace(str(tmp_path), "")) < 250, str(e.value)   # (not the 12 KB list of types)
    if raw["model_type"] == "gpt_neo":   # eager builds
        cfg = framework.compose(["model=hf", f"model.config={tmp_path}", "model.context=16",
                                 "model.attn_implementation=eager"])
        with framework.zero_init():
            assert component(cfg, "model").build(cfg.model) is not None


def test_pretrained_folder_generation_config_reaches_the_model(tmp_path):
    import json

    write_config("llama", tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 7], "max_new_tokens": 5}))
    (tmp_path / "model.safetensors").touch()   # (build reads no weights)
    cfg = framework.compose(["model=hf", f"model.pretrained={tmp_path}", "model.context=16"])
    with framework.zero_init():
        model = component(cfg, "model").build(cfg.model)
    assert model.generation_config.eos_token_id == [0, 7] and model.generation_config.max_new_tokens == 5


def test_pretrained_folder_tokenizer_files_are_carried_to_its_exports(tmp_path):
    """model_16bit/ and save_pretrained of a model.pretrained run load with AutoTokenizer as the source did."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    src = tmp_path / "src"
    model, _ = build(hf_cfg(write_config("gpt2", src)), meta=False)
    model.save_pretrained(src)
    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(96)}, unk_token="w0"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="w0")
    carried = [Path(f).name for f in tokenizer.save_pretrained(src)]
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(carried), carried
    with _engine(framework.compose([*BASE, f"model.pretrained={src}"])) as engine:
        engine.save_pretrained(tmp_path / "out")
    assert all((tmp_path / "out" / n).read_bytes() == (src / n).read_bytes() for n in carried)
    assert AutoTokenizer.from_pretrained(tmp_path / "out", local_files_only=True)("w3 w5").input_ids == [3, 5]
    # A model without a tokenizer saved into the same folder: the earlier save's tokenizer files go (AutoTokenizer
    # would pair them with these weights), a file of the user's stays, and so does one the user changed since.
    out = tmp_path / "out"
    (out / "README.md").write_text("mine")
    (out / "vocab.txt").write_text("mine")   # a tokenizer file name the earlier save did not write
    edited = (out / "tokenizer_config.json").read_bytes() + b" "
    (out / "tokenizer_config.json").write_bytes(edited)
    with _engine(hf_cfg(write_config("gpt2", tmp_path / "scratch"))) as engine:
        engine.save_pretrained(out)
    left = {n for n in carried if (out / n).exists()}
    assert left == {"tokenizer_config.json"} and (out / "tokenizer_config.json").read_bytes() == edited, left
    assert (out / "README.md").read_text() == (out / "vocab.txt").read_text() == "mine"
    assert not any(p.name.startswith(".") for p in out.iterdir())   # (the record of what it wrote: gone with them)


def test_pretrained_takes_a_base_model_checkpoint_as_from_pretrained_does(tmp_path):
    """The hub GPT-2 layout: a GPT2Model's keys (no ``transformer.`` prefix) plus old ``attn.bias`` buffers the
    class ignores on load; anything else unexpected is still refused."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, GPT2Config, GPT2Model

    raw = dict(CONFIGS["gpt2"])
    raw.pop("model_type")
    torch.manual_seed(3)
    GPT2Model(GPT2Config(**raw)).save_pretrained(tmp_path / "hub")
    tensors = load_file(tmp_path / "hub" / "model.safetensors")
    assert "wte.weight" in tensors and not any(k.startswith("transformer.") for k in tensors)
    tensors["h.0.attn.bias"] = torch.ones(1, 1, 32, 32)
    save_file(tensors, tmp_path / "hub" / "model.safetensors", metadata={"format": "pt"})
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hub", local_files_only=True)
    cfg = framework.compose(["model=hf", f"model.pretrained={tmp_path / 'hub'}", "model.context=16", "logger=none"])
    with _engine(cfg) as engine:
        framework.load_weights(engine, tmp_path / "hub")
        got = dict(engine.components.module.named_parameters())
        assert all(torch.equal(got[n], p) for n, p in hf.named_parameters())
        save_file({**tensors, "h.0.extra": torch.zeros(2)}, tmp_path / "hub" / "model.safetensors",
                  metadata={"format": "pt"})
        with pytest.raises(ConfigError, match=r"unexpected 1: h\.0\.extra"):
            framework.load_weights(engine, tmp_path / "hub")


def test_auto_bucket_sizes_without_a_hidden_size_in_config_json_use_transformers_default(tmp_path):
    """A config.json may leave hidden_size to transformers' default for its model_type (llama: 4096)."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 1, "num_attention_heads": 2,
                                "num_key_value_heads": 2, "intermediate_size": 64, "vocab_size": 128}))
    ds = {"zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"}}
    cfg = framework.compose(["model=hf", f"model.config={path}", "model.context=16"], ds_config=ds)
    assert cfg.stage.reduce_bucket_size == 4096 * 4096


def _llama_folder(tmp_path, **overrides):
    """A save_pretrained folder of a tiny Llama (transformers' own save) and its tensors."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = {**CONFIGS["llama"], **overrides}
    torch.manual_seed(1)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(raw.pop("model_type"), **raw)).save_pretrained(tmp_path)
    return load_file(tmp_path / "model.safetensors")


def test_tied_names_with_different_values_in_the_file_are_refused(tmp_path):
    """transformers unties such a checkpoint; the built model holds one tensor, so either value would be lost."""
    from safetensors.torch import save_file

    tensors = _llama_folder(tmp_path, tie_word_embeddings=True)
    cfg = framework.compose(["model=hf", f"model.pretrained={tmp_path}", "model.context=16", "logger=none"])
    with _engine(cfg) as engine:
        embed = tensors["model.embed_tokens.weight"]
        save_file({**tensors, "lm_head.weight": embed.clone()}, tmp_path / "model.safetensors",
                  metadata={"format": "pt"})
        framework.load_weights(engine, tmp_path)   # the same values under both names: one tensor
        assert torch.equal(engine.components.module.lm_head.weight, embed)
        save_file({**tensors, "lm_head.weight": embed + 1}, tmp_path / "model.safetensors", metadata={"format": "pt"})
        with pytest.raises(ConfigError) as e:
            framework.load_weights(engine, tmp_path)
    assert "set tie_word_embeddings=false in its config.json" in str(e.value) and "\n" not in str(e.value)


def test_old_rotary_inv_freq_and_position_ids_keys_are_ignored_as_from_pretrained_does(tmp_path):
    from safetensors.torch import save_file

    tensors = _llama_folder(tmp_path)
    old = {f"model.layers.{i}.self_attn.rotary_emb.inv_freq": torch.ones(4) for i in range(2)}
    save_file({**tensors, **old}, tmp_path / "model.safetensors", metadata={"format": "pt"})
    cfg = framework.compose(["model=hf", f"model.pretrained={tmp_path}", "model.context=16", "logger=none"])
    with _engine(cfg) as engine:
        framework.load_weights(engine, tmp_path)
        got = dict(engine.components.module.named_parameters())
        assert all(torch.equal(got[n], t) for n, t in tensors.items())
    # An old persistent position_ids is ignored where the model has such a buffer now (Llama has none:
    # unexpected there, as in transformers).
    from framework.models.hf import checkpoint_names

    key = "model.embed.position_ids"
    assert checkpoint_names(engine.components.module, [key], set())[key] == key
    with_ids = nn.Module()
    with_ids.register_buffer("position_ids", torch.arange(4), persistent=False)
    assert checkpoint_names(with_ids, [key], set())[key] is None


MIXTRAL = dict(model_type="mixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=96, max_position_embeddings=32, num_local_experts=4,
               num_experts_per_tok=2, router_aux_loss_coef=0.5, output_router_logits=True)


def test_moe_loss_adds_the_router_load_balancing_loss_as_transformers_does(tmp_path):
    """A Mixtral with output_router_logits trains on cross-entropy + router_aux_loss_coef * aux_loss
    (transformers' own loss), under zero3 too; without output_router_logits, on the cross-entropy alone."""
    from framework.models._base import next_token_loss

    (tmp_path / "config.json").write_text(json.dumps(MIXTRAL))
    cfg = hf_cfg(tmp_path / "config.json")
    model, data = build(cfg, meta=False)
    x, _ = data.train_batch(0, micro_batch=3, grad_accum=1, rank=0, world=1).micro[0]
    # transformers shifts labels=x itself and ignores the last position: y is x shifted, its last target ignored
    y = torch.cat([x[:, 1:], torch.full_like(x[:, :1], -100)], dim=1)
    theirs = model(input_ids=x, labels=x)
    assert theirs.aux_loss.item() > 0
    ours = causal_lm_loss(model, (x, y))
    assert ours.item() == pytest.approx(theirs.loss.item(), rel=1e-6)
    plain = next_token_loss(model(input_ids=x).logits, y)
    assert ours.item() == pytest.approx(plain.item() + 0.5 * theirs.aux_loss.item(), rel=1e-6)
    batch = data.train_batch(0, micro_batch=2, grad_accum=1, rank=0, world=1)
    expected = causal_lm_loss(model, batch.micro[0]).item()
    zcfg = hf_cfg(tmp_path / "config.json", "+stage=zero3")
    zmodel, _ = build(zcfg)
    with framework.initialize(zmodel, component(zcfg, "model").loss, zcfg) as engine:
        _, m = engine.train_step(engine.state, batch)
    assert m["loss"] == pytest.approx(expected, rel=1e-5)

    model.config.output_router_logits = False
    out = model(input_ids=x)
    assert getattr(out, "aux_loss", None) is None
    assert causal_lm_loss(model, (x, y)).item() == pytest.approx(next_token_loss(out.logits, y).item(), rel=1e-6)


def test_an_hf_model_is_built_in_fp32_and_a_16bit_config_dtype_in_an_fp32_run_is_a_note(tmp_path):
    """Most hub configs say bfloat16 and transformers 5 builds in it: the model is built in fp32 whatever the
    file says (no initialize note listing every parameter, masters initialised unrounded); a note says only that
    a 16-bit file trains in fp32 under precision=fp32, never advising away from bf16/fp16 mixed precision."""
    from framework.models.hf import architecture

    for key, stated, precision, note in (("dtype", "bfloat16", "fp32", "set precision=bf16 to train in 16-bit"),
                                         ("torch_dtype", "float16", "fp32", "set precision=fp16 to train in 16-bit"),
                                         ("dtype", "float32", "bf16", None), ("dtype", "float16", "bf16", None),
                                         ("torch_dtype", "bfloat16", "fp16", None),
                                         ("dtype", "bfloat16", "bf16", None), ("dtype", "float32", "fp32", None),
                                         (None, None, "fp32", None)):
        path = write_config("llama", tmp_path, **({key: stated} if key else {}))
        cfg = hf_cfg(path, f"precision={precision}")
        notices = [n for n in cfg.notices if "config.json says" in n]
        if note is None:
            assert notices == [], notices
        else:
            assert notices == [f"note: model.config: {path} says dtype {stated}; training in fp32 "
                               f"(precision=fp32); {note}"]
        model, _ = build(cfg)
        assert {p.dtype for p in model.parameters()} == {torch.float32}, (stated, precision)
        # (not part of what the model is: a checkpoint of a build that recorded the file's dtype still resumes)
        assert "dtype" not in architecture(model) and "torch_dtype" not in architecture(model)


def test_jetmoe_router_loss_takes_its_aux_loss_coef():
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("jetmoe", hidden_size=32, num_hidden_layers=1, num_key_value_heads=2, kv_channels=8,
                                  intermediate_size=64, vocab_size=96, max_position_embeddings=32, num_local_experts=4,
                                  num_experts_per_tok=2, output_router_logits=True, aux_loss_coef=0.3)
    model = AutoModelForCausalLM.from_config(config)
    x = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(0))
    theirs = model(input_ids=x, labels=x).loss
    y = torch.cat([x[:, 1:], torch.full_like(x[:, :1], -100)], dim=1)
    assert causal_lm_loss(model, (x, y)).item() == pytest.approx(theirs.item(), rel=1e-6)


def test_a_config_folder_holding_weights_says_they_are_not_loaded(tmp_path):
    """model.config= naming a save_pretrained folder builds a new model: one note says its weights are unused and
    names model.pretrained=; a folder with only a config.json, or the config.json file itself, says nothing."""
    path = write_config("llama", tmp_path)
    assert not [n for n in hf_cfg(tmp_path).notices if "not loaded" in n]
    (tmp_path / "model.safetensors").touch()
    notes = [n for n in hf_cfg(tmp_path).notices if "not loaded" in n]
    assert notes == [f"note: model.config={tmp_path} holds weights (model.safetensors) that are not loaded: "
                     f"model.config builds a new model; use model.pretrained={tmp_path} to start from them"]
    assert not [n for n in hf_cfg(path).notices if "not loaded" in n]


def test_pretrained_takes_a_folder_already_under_the_models_names_whatever_its_conversion_mapping(tmp_path):
    """Mixtral's class has a conversion mapping (the hub's unfused experts), but a folder whose tensors already
    carry the model's own names (as framework's export writes them) needs none: it loads, as from_pretrained
    loads it."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = {**CONFIGS["llama"], "model_type": "mixtral", "num_local_experts": 2, "num_experts_per_tok": 1}
    write_config("llama", tmp_path, **raw)
    raw.pop("model_type")
    torch.manual_seed(5)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("mixtral", **raw), dtype=torch.float32)
    assert any(".mlp.experts.gate_up_proj" in n for n in model.state_dict())
    save_file({n: t.detach().clone().contiguous() for n, t in model.state_dict().items()},
              tmp_path / "model.safetensors", metadata={"format": "pt"})
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True, dtype=torch.float32)
    cfg = framework.compose(["model=hf", f"model.pretrained={tmp_path}", "model.context=16", "logger=none"])
    with _engine(cfg) as engine:
        framework.load_weights(engine, tmp_path)
        got = dict(engine.components.module.named_parameters())
        assert all(torch.equal(got[n], p) for n, p in hf.named_parameters())


def test_a_config_json_nested_too_deeply_is_one_line(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "gpt2", "x": ' + '[' * 100_000 + ']' * 100_000 + '}')
    with pytest.raises(ConfigError, match="is not a transformers config.json"):
        framework.compose(["model=hf", f"model.pretrained={tmp_path}", "model.context=16"])


def _pretrained_with_generation_config(folder: Path, text: bytes):
    write_config("llama", folder)
    (folder / "generation_config.json").write_bytes(text)
    (folder / "model.safetensors").touch()   # (build reads no weights)
    return framework.compose(["model=hf", f"model.pretrained={folder}", "model.context=16"])


def test_an_unreadable_generation_config_is_skipped_with_a_warning_as_transformers_does(tmp_path, capsys, monkeypatch):
    """Said by rank 0 only: every rank builds the model."""
    for i, text in enumerate((b"{not json", b"\xff\xfe")):
        cfg = _pretrained_with_generation_config(tmp_path / str(i), text)
        capsys.readouterr()
        with framework.zero_init():
            assert component(cfg, "model").build(cfg.model) is not None
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and re.match(r"warning: model.pretrained: .*generation_config.json is skipped: .*not a "
                                          r"valid JSON file.*fix it .*or remove it$", err[0]), err
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with framework.zero_init():
        assert component(cfg, "model").build(cfg.model) is not None
    assert capsys.readouterr().err == ""


def test_a_generation_config_nested_too_deeply_is_one_line(tmp_path):
    cfg = _pretrained_with_generation_config(tmp_path, ('{"x": ' + '[' * 100_000 + ']' * 100_000 + '}').encode())
    with framework.zero_init(), pytest.raises(ConfigError, match=r"generation_config.json is not a valid generation "
                                                                  r"config \(nested too deeply to parse\); fix or"):
        component(cfg, "model").build(cfg.model)


def test_a_layer_count_no_host_could_build_is_refused_at_compose_not_built_for_hours(tmp_path):
    write_config("gpt2", tmp_path, n_layer=10**12)
    with pytest.raises(ConfigError, match=r"config.json: 1000000000000 hidden layers, more than this host's .* of "
                                          r"available memory holds even as bare modules; check its layer count"):
        framework.compose(["model=hf", f"model.config={tmp_path / 'config.json'}", "model.context=16"])


BERT = dict(model_type="bert", hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            vocab_size=96, max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def test_an_encoder_config_without_is_decoder_is_refused_not_trained_bidirectionally(tmp_path):
    """BertLMHeadModel (AutoModelForCausalLM's class for bert) attends both ways unless is_decoder=true: as a
    causal LM each position would see its target. Refused by compose (before the run folder); with is_decoder=true
    it is causal (a later token leaves an earlier position's logits bitwise equal) and trains."""
    (tmp_path / "config.json").write_text(json.dumps(BERT))
    for key in ("model.config", "model.pretrained"):
        if key == "model.pretrained":
            from safetensors.torch import save_file
            save_file({"x": torch.zeros(1)}, tmp_path / "model.safetensors")
        with pytest.raises(ConfigError) as e:
            framework.compose([*BASE, f"{key}={tmp_path}"])
        assert str(e.value) == (f"{key}: BertLMHeadModel with is_decoder=false attends to later tokens too (each "
                                f"position would see its target): not a causal LM; set \"is_decoder\": true in "
                                f"{tmp_path / 'config.json'} to train it as one")
    (tmp_path / "model.safetensors").unlink()
    # GPT-NeoX's config carries is_decoder=false too, but its model is causal whatever it says: not refused.
    framework.compose([*BASE, f"model.config={write_config('llama', tmp_path / 'neox', model_type='gpt_neox')}"])
    (tmp_path / "config.json").write_text(json.dumps({**BERT, "is_decoder": True}))
    cfg = hf_cfg(tmp_path, "+stage=zero3")
    model, data = build(cfg)
    with framework.initialize(model, component(cfg, "model").loss, cfg) as engine:
        _, m = engine.train_step(engine.state, data.train_batch(0, micro_batch=2, grad_accum=1, rank=0, world=1))
    assert math.isfinite(m["loss"])
    model, _ = build(cfg, meta=False)
    x = torch.arange(8)[None]
    changed = x.clone()
    changed[0, 1] = 9
    with torch.no_grad():
        assert torch.equal(model(input_ids=x).logits[0, 0], model(input_ids=changed).logits[0, 0])


def test_xlm_and_xlnet_configs_that_attend_both_ways_are_refused_with_the_flag_that_makes_them_causal(tmp_path):
    """XLMWithLMHeadModel is causal only with causal=true (XLMModel reads it; the hub's xlm-mlm-* say false),
    XLNetLMHeadModel only with attn_type="uni" ("bi" by default). XLNet's max_position_embeddings -1 is no limit,
    not a bound on model.context."""
    xlm = dict(model_type="xlm", emb_dim=32, n_layers=2, n_heads=4, vocab_size=96, max_position_embeddings=32)
    xlnet = dict(model_type="xlnet", d_model=32, n_layer=2, n_head=4, d_inner=64, vocab_size=96)
    for config, cls, flag, bad, good in ((xlm, "XLMWithLMHeadModel", "causal", "false", True),
                                         (xlnet, "XLNetLMHeadModel", "attn_type", '"bi"', "uni")):
        folder = tmp_path / config["model_type"]
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config))
        with pytest.raises(ConfigError) as e:
            framework.compose([*BASE, f"model.config={folder}"])
        assert str(e.value) == (f"model.config: {cls} with {flag}={bad} "
                                f"attends to later tokens too (each position would see its target): not a causal LM; "
                                f"set \"{flag}\": {json.dumps(good)} in {folder / 'config.json'} to train it as one")
        (folder / "config.json").write_text(json.dumps({**config, flag: good}))
        framework.compose([*BASE, f"model.config={folder}", "model.attn_implementation=eager"])


def test_load_weights_of_a_checkpoint_needing_transformers_key_conversions_says_so(tmp_path):
    """GPT-NeoX as transformers' save_pretrained writes it (embed_out.weight; the model's name is lm_head.weight):
    load_weights (the zero_init + from_config recipe) names the conversion and the way out, not only the keys."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = {**CONFIGS["llama"], "num_attention_heads": 4}
    raw.pop("model_type")
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("gpt_neox", **raw), dtype=torch.float32)
    state = {("embed_out.weight" if n == "lm_head.weight" else n): t.detach().clone().contiguous()
             for n, t in model.state_dict().items()}
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    cfg = framework.compose([*BASE, f"model.config={write_config('llama', tmp_path / 'c', model_type='gpt_neox')}"])
    with _engine(cfg) as engine, pytest.raises(ConfigError) as e:
        framework.load_weights(engine, tmp_path)
    assert "missing 1: lm_head.weight; unexpected 1: embed_out.weight; its tensor names need the key conversions " \
           "transformers applies on load (transformers.conversion_mapping), which load_weights does not: load it " \
           "with AutoModelForCausalLM.from_pretrained and pass that model to framework.initialize" in str(e.value)
    assert "\n" not in str(e.value)
    # Another model's name (no conversion matches it): the keys alone, no conversion blamed.
    save_file({**model.state_dict(), "model.embed_tokens.weight": torch.zeros(2)}, tmp_path / "model.safetensors",
              metadata={"format": "pt"})
    with _engine(cfg) as engine, pytest.raises(ConfigError) as e:
        framework.load_weights(engine, tmp_path)
    assert "unexpected 1: model.embed_tokens.weight" in str(e.value) and "conversion" not in str(e.value)


def test_a_transformers_without_its_conversion_internals_means_no_conversions_not_an_import_error(tmp_path,
                                                                                                   monkeypatch):
    """The key-conversion checks read transformers 5's loader modules (not public API): a release without them must
    leave every HF model loadable (no conversions known), not fail each check with an ImportError."""
    from framework.models.hf import converted, has_conversions
    model, _ = build(hf_cfg(write_config("llama", tmp_path, model_type="gpt_neox", num_attention_heads=4)))
    assert has_conversions(model)   # (this transformers knows GPT-NeoX's embed_out renaming)
    from framework.models.hf import class_converts
    assert class_converts(type(model).__name__, "gpt_neox")
    monkeypatch.setitem(__import__("sys").modules, "transformers.conversion_mapping", None)
    monkeypatch.setitem(__import__("sys").modules, "transformers.core_model_loading", None)
    assert has_conversions(model) is False
    assert converted(model, ["lm_head.weight"]) is None
    assert class_converts(type(model).__name__, "gpt_neox") is False
