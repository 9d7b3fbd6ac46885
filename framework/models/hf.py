"""Hugging Face causal language models as the ``model`` component (``model=hf``).

    python -m framework.train model=hf model.config=path/to/config.json +stage=zero3 dist.nproc=2
    python -m framework.train model=hf model.pretrained=path/to/save_pretrained_folder +stage=zero3

``model.config``: a new model from a ``config.json`` (or its folder); ``model.pretrained``: the folder's config,
then its weights loaded once the stage has partitioned it. Nothing is downloaded. Models are built on meta and
materialised by the stage through ``HFInit``. Transformers is an optional extra (``pip install -e '.[hf]'``).
"""
from __future__ import annotations

import copy
import dis
import functools
import inspect
import json
import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partialmethod
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from framework.core.errors import ConfigError, FrameworkError, one_line
from framework.core.files import parse_json
from framework.core import room, units
from framework.core.paths import READ_WEIGHT_FILES, WEIGHTS_READ, user_path, weights_file
from framework.models._base import ModelComponent, all_on_meta, name_seed, next_token_loss
from framework.models._hf_batch import dict_forward
from framework.models._hf_names import (  # noqa: F401 (checkpoint_names, converted, has_conversions: public)
    checkpoint_names, class_converts, converted, has_conversions, refuse_unconverted)
from framework.models._hf_files import (  # noqa: F401 (TOKENIZER_FILES: public here)
    TOKENIZER_FILES, carry_tokenizer_files, read_generation_config, tokenizer_files, write_tokenizer_files)


@dataclass(frozen=True, kw_only=True)
class HFConfig:
    config: str | None = None        # config.json (or a folder with one): a model initialised from scratch
    pretrained: str | None = None    # a save_pretrained folder: its config and (after partitioning) its weights
    context: int = 256               # training sequence length (at most the model's max_position_embeddings)
    attn_implementation: str = "sdpa"  # transformers' attention kernel: sdpa | eager
    activation_checkpointing: bool = False  # recompute each decoder layer in backward (non-reentrant)

    def __post_init__(self) -> None:
        if (self.config is None) == (self.pretrained is None):
            raise ConfigError("model=hf needs exactly one of model.config=path/to/config.json (a new model) or "
                              "model.pretrained=path/to/folder (a save_pretrained folder)")
        if self.context < 1:
            raise ConfigError(f"model.context must be >= 1, got {self.context}")
        if self.attn_implementation not in ("sdpa", "eager"):
            raise ConfigError(f"model.attn_implementation must be sdpa or eager, got {self.attn_implementation!r}")


def is_hf_model(module: nn.Module) -> bool:
    """A transformers ``PreTrainedModel`` (no import: one cannot exist unless transformers was imported)."""
    transformers = sys.modules.get("transformers")
    return transformers is not None and isinstance(module, transformers.PreTrainedModel)


def architecture(module: nn.Module) -> dict | None:
    """An HF model's resolved config, ``without_dtype``, that a checkpoint records (a resume compares what the
    model is, not where its file lies); None for another model."""
    if not is_hf_model(module):
        return None
    return without_dtype(module.config.to_dict())


# The config key naming a model's class: model=hf builds AutoModelForCausalLM's class whatever it says (an export
# writes that class there), so configs that differ only in it describe the same weights.
CLASS_KEY = "architectures"


def without_dtype(config: dict) -> dict:
    """A config dict as JSON gives it back, without the transformers version, private keys and the dtype at any
    depth: it trains in the precision's dtype, and ``build`` makes it in fp32."""
    def strip(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: strip(v) for k, v in node.items()
                    if not k.startswith("_") and k not in ("transformers_version", "dtype", "torch_dtype")}
        return [strip(v) for v in node] if isinstance(node, list) else node

    return strip(json.loads(json.dumps(config, sort_keys=True, default=str)))


def _raw_config(cfg: HFConfig, key: str | None = None) -> tuple[str, Path, dict]:
    """(key, file, contents) of the config.json named by ``model.config`` or ``model.pretrained`` (or ``key``)."""
    own, where = ("model.pretrained", cfg.pretrained) if cfg.pretrained is not None else ("model.config", cfg.config)
    key = key or own
    path = Path(user_path(where))
    file = path / "config.json" if path.is_dir() else path
    want = "a save_pretrained folder" if cfg.pretrained is not None else "a config.json or a folder holding one"
    if path.is_dir() and not file.is_file():   # a folder that is there: not a Hub name
        raise ConfigError(f"{key}={where}: {where} has no config.json; give {want}"
                          + ("" if cfg.pretrained is not None else f", or the path of a config of another "
                             f"name: {where.rstrip('/')}/NAME.json"))
    if not file.is_file():
        # Never let transformers read a missing path as a Hub repository id.
        raise ConfigError(f"{key}={where}: no such file (a Hub name? nothing is downloaded; give a local folder: "
                          f"{want})")
    if cfg.pretrained is not None and not path.is_dir():
        raise ConfigError(f"model.pretrained={where} must be a folder written by save_pretrained")
    try:
        raw = parse_json(file.read_bytes())
    except ValueError:
        raw = None
    if not isinstance(raw, dict) or "model_type" not in raw:
        raise ConfigError(f"{key}: {file} is not a transformers config.json (JSON with a model_type)")
    return key, file, raw


def check(cfg: HFConfig, stage: str, nodes: Mapping[str, Any]) -> HFConfig:
    """Refused before the run folder is made: a missing ``model.config`` / ``model.pretrained`` file, a
    ``model.pretrained`` folder without weights or with tensor names that need transformers' conversion
    (``_check_names``), and what ``_checked_config`` finds in the config (nothing else is built; the data's
    vocabulary where its config states one, as synthetic data does)."""
    _raw_config(cfg)
    if cfg.pretrained is not None:
        found = weights_file(Path(user_path(cfg.pretrained)))
        if found is None:
            raise ConfigError(f"model.pretrained={cfg.pretrained}: the folder holds no weights (none of "
                              f"{WEIGHTS_READ}); give a save_pretrained folder with its weights, or "
                              f"model.config={cfg.pretrained} to train a new model from its config.json")
        if found.name not in READ_WEIGHT_FILES:   # here, not on each rank's load
            raise ConfigError(f"model.pretrained={cfg.pretrained}: its only weights are torch .bin shards "
                              f"({found.name}), which are not read sharded; convert the checkpoint to safetensors "
                              f"(transformers' from_pretrained, then save_pretrained) and load that")
    _, file, config, cls = _checked_config(cfg, getattr(nodes["data"], "vocab_size", None))
    if cfg.pretrained is not None:   # (one line before launch, not the same from every rank's build)
        _check_names(file, config, cls)
    return cfg


def notes(cfg: HFConfig, config: Any) -> list[str]:
    """A ``model.config`` folder that holds weights: say they are not loaded (a pretrained folder under the wrong
    key would otherwise train from scratch unremarked). A config.json naming a 16-bit dtype (most hub configs say
    bfloat16) in an fp32 run: say it trains in fp32."""
    key, file, raw = _raw_config(cfg)
    out = []
    folder = Path(user_path(cfg.config)) if cfg.config is not None else None
    if folder is not None and folder.is_dir() and (found := weights_file(folder)) is not None:
        out.append(f"note: model.config={cfg.config} holds weights ({found.name}) that are not loaded: model.config "
                   f"builds a new model; use model.pretrained={cfg.config} to start from them")
    stated = raw.get("dtype", raw.get("torch_dtype"))
    want = {"bfloat16": "bf16", "float16": "fp16"}.get(str(stated).removeprefix("torch."))
    if want is not None and config.choices["precision"] == "fp32":
        out.append(f"note: {key}: {file} says dtype {stated}; training in fp32 (precision=fp32); set precision={want} "
                   f"to train in 16-bit")
    return out


def hidden_size(cfg: HFConfig) -> int | None:
    """The hidden size of config.json read as transformers reads it (its default for the model_type where the file
    states none; nothing built)."""
    try:
        return config_hidden_size(_transformers_config(*_raw_config(cfg)))
    except Exception:  # noqa: BLE001 - build() says what is wrong
        return None


def config_hidden_size(config: Any) -> int | None:
    """A model config's hidden size as transformers' DeepSpeed integration reads it for the "auto" bucket sizes:
    ``hidden_size`` (or ``n_embd`` / ``d_model``, of configs not from transformers), else the largest of
    ``hidden_sizes``, else the same of its text config (a multimodal model's); None when it states none."""
    for conf in (config, text_config(config)):
        value = next((v for v in (getattr(conf, k, None) for k in ("hidden_size", "n_embd", "d_model"))
                      if isinstance(v, int) and not isinstance(v, bool)), None)
        sizes = getattr(conf, "hidden_sizes", None)
        if value is None and isinstance(sizes, (list, tuple)) and sizes \
                and all(isinstance(v, int) and not isinstance(v, bool) for v in sizes):
            value = max(sizes)
        if value is not None:
            return value
    return None


def config_vocab(cfg: HFConfig) -> int:
    """The model's own ``vocab_size`` from config.json (nothing built): ``build`` keeps it whatever the data's."""
    return text_config(_transformers_config(*_raw_config(cfg))).vocab_size


def load_config(path: str | Path, key: str = "model.config") -> tuple[Path, Any]:
    """(file, transformers config) of a ``config.json`` or its folder, read as ``build`` reads it; ``key`` names
    the path in errors."""
    _, file, raw = _raw_config(HFConfig(config=str(path)), key)
    return file, _transformers_config(key, file, raw)


def causal_lm_class(config: Any) -> type | None:
    """``AutoModelForCausalLM``'s class for a transformers config, or None."""
    import transformers

    mapping = transformers.MODEL_FOR_CAUSAL_LM_MAPPING
    return mapping[type(config)] if type(config) in mapping else None


_LAYER_FLOOR = 1 << 10   # host bytes one layer's module objects take at least, even on meta (a llama layer: 33 KB)


def _transformers_config(key: str, file: Path, raw: Mapping[str, Any]) -> Any:
    """The transformers config of a config.json's contents; an unknown model_type (custom code) is refused
    before transformers is asked (it would list every type, or offer to download and run the code)."""
    try:
        import transformers
    except ImportError:
        raise ConfigError("model=hf needs the hf extra: pip install -e '.[hf]' (transformers, safetensors)") from None
    raw = dict(raw)
    model_type = raw.pop("model_type")
    if not isinstance(model_type, str) or model_type not in transformers.CONFIG_MAPPING:
        code = " and names custom model code (auto_map)" if "auto_map" in raw else ""
        raise ConfigError(f"{key}: {file} has model_type {model_type!r}, which transformers {transformers.__version__} "
                          f"does not know{code}; custom model code is not supported: build the model yourself "
                          f"and pass it to framework.initialize")
    try:
        config = transformers.AutoConfig.for_model(model_type, **raw)
    except Exception as e:  # noqa: BLE001 - the config classes raise their own types (strict dataclass validators)
        raise ConfigError(f"{key}: {file} is not a valid {model_type} config: {one_line(e)}") from None
    # transformers accepts a layer count below 1 (a model of embeddings only would train) and one no host could build
    # (a typo: modules are built for hours, even on meta). (A multimodal config keeps its sizes in text_config.)
    text, free = text_config(config), room.available_ram()
    for conf in {id(c): c for c in (config, text)}.values():
        for name in ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size"):
            value = getattr(conf, name, None)
            if isinstance(value, int) and value < 1:
                raw = conf.attribute_map.get(name, name)   # the file's own name for it (GPT-2: n_layer)
                raise ConfigError(f"{key}: {file}: {name}={value} must be >= 1"
                                  + (f" ({raw} in the file)" if raw != name else ""))
        layers = getattr(conf, "num_hidden_layers", None)
        if isinstance(layers, int) and free is not None and layers * _LAYER_FLOOR > free:
            raise ConfigError(f"{key}: {file}: {layers} hidden layers, more than this host's {units.size(free)} of "
                              f"available memory holds even as bare modules; check its layer count")
    return config


def text_config(config: Any) -> Any:
    """The config holding the text model's sizes: a multimodal one (gemma3, llama4) keeps them in text_config; the
    config itself where it has none or several (musicgen's text encoder and decoder: transformers raises)."""
    try:
        return config.get_text_config() if hasattr(config, "get_text_config") else config
    except ValueError:
        return config


def check_vocab(vocab_size: int | None, config: Any, where: str | Path) -> None:
    """The data's ``vocab_size`` token ids must all be ids of the model (``config``, read from ``where``)."""
    model = text_config(config).vocab_size
    if vocab_size is not None and vocab_size > model:
        raise ConfigError(f"the data has {vocab_size} token ids but the model's vocabulary has {model} "
                          f"(vocab_size in {where}); use data whose tokenizer fits the model "
                          f"(e.g. data.vocab_size <= {model})")


def _checked_config(cfg: HFConfig, vocab_size: int | None) -> tuple[str, Path, Any, type]:
    """(key, file, transformers config, ``AutoModelForCausalLM`` class) of ``cfg``, refusing what the config alone
    decides: a model_type transformers does not know, data ``vocab_size`` ids the model lacks, a context over its
    positions, no causal LM class (or an encoder's without is_decoder), or a ``model.*`` kernel or checkpointing the
    class does not support."""
    key, file, raw = _raw_config(cfg)
    config = _transformers_config(key, file, raw)
    check_vocab(vocab_size, config, cfg.pretrained or cfg.config)
    limit = getattr(text_config(config), "max_position_embeddings", None)   # absent for some architectures
    if limit is not None and limit >= 1 and cfg.context > limit:   # (XLNet's -1: no limit)
        raise ConfigError(f"model.context={cfg.context} exceeds the model's max_position_embeddings ({limit}); "
                          f"set model.context <= {limit}")
    cls = causal_lm_class(config)
    if cls is None:
        raise ConfigError(f"{key}: model_type {config.model_type} is not a causal language model (transformers has "
                          f"no AutoModelForCausalLM class for it); model=hf trains causal LMs only")
    for flag, causal in _CAUSAL_WHEN:
        value = getattr(config, flag, None)
        if value is not None and value != causal and (_needs_is_decoder(cls) if flag == "is_decoder" else
                                                      _family_reads(cls, flag)):
            raise ConfigError(f"{key}: {cls.__name__} with {flag}={json.dumps(value)} attends to later tokens too "
                              f"(each position would see its target): not a causal LM; set \"{flag}\": "
                              f"{json.dumps(causal)} in {file} to train it as one")
    if cfg.attn_implementation == "sdpa" and getattr(cls, "_supports_sdpa", True) is False:
        raise ConfigError(f"model.attn_implementation=sdpa is not supported by {cls.__name__}; "
                          f"set model.attn_implementation=eager")
    if cfg.activation_checkpointing and not getattr(cls, "supports_gradient_checkpointing", False):
        raise ConfigError(f"model.activation_checkpointing=true is not supported by {cls.__name__} (transformers has "
                          f"no gradient checkpointing for it); set model.activation_checkpointing=false")
    return key, file, config, cls


def _check_names(file: Path, config: Any, cls: type) -> None:
    """``refuse_unconverted`` before launch, on the model built on meta, where the class or its model_type has a
    conversion mapping (a cheap look-up; a sub-model's or a fused module's mapping is found by ``build``)."""
    import transformers

    if not class_converts(cls.__name__, config.model_type):
        return
    try:
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    except Exception:  # noqa: BLE001 - build() says what is wrong with the config
        return
    refuse_unconverted(model, file.parent, config.model_type)


# The config flags that make a causal-LM class attend one way only, and the value that does: an encoder's
# is_decoder; XLM's causal (false for the hub's xlm-mlm-*); XLNet's attn_type ("bi" by default).
_CAUSAL_WHEN = (("is_decoder", True), ("causal", True), ("attn_type", "uni"))


@functools.cache   # (a class's bytecode does not change: read once per class and flag)
def _family_reads(cls: type, flag: str) -> bool:
    """Whether a module class of ``cls``'s modeling file reads ``flag`` in its constructor (XLMModel reads
    ``config.causal``, which XLMWithLMHeadModel builds): a config carrying an unread key decides nothing."""
    def reads(o) -> bool:
        code = dis.get_instructions(inspect.unwrap(o.__init__))
        return any(i.opname == "LOAD_ATTR" and i.argval == flag for i in code)
    return any(isinstance(o, type) and issubclass(o, nn.Module) and "__init__" in vars(o) and reads(o)
               for o in vars(sys.modules[cls.__module__]).values())


@functools.cache
def _needs_is_decoder(cls: type) -> bool:
    """Whether ``cls``'s constructor reads ``config.is_decoder`` without setting it. That is where transformers'
    encoder families (BERT, RoBERTa, ELECTRA, ...) decide that their causal-LM class is causal only with it (they
    warn "add is_decoder=True", Reformer asserts); classes that set it themselves (TrOCR, BART's decoder) and
    configs that only carry the key (GPT-NeoX) do not depend on it. Read from the bytecode: no source needed."""
    ops = {i.opname for i in dis.get_instructions(inspect.unwrap(cls.__init__)) if i.argval == "is_decoder"}
    return "LOAD_ATTR" in ops and "STORE_ATTR" not in ops


def build(cfg: HFConfig, vocab_size: int | None = None) -> nn.Module:
    """An ``AutoModelForCausalLM`` from local files on the default device; ``vocab_size`` (the data's) must fit."""
    key, file, config, cls = _checked_config(cfg, vocab_size)
    import transformers

    try:
        # In fp32 whatever config.json names: the precision casts to its working dtype and keeps fp32 masters,
        # which so start unrounded.
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=cfg.attn_implementation,
                                                              dtype=torch.float32)
    except FrameworkError:
        raise
    except Exception as e:  # noqa: BLE001 - a config the model's constructor rejects (asserts, shape errors)
        raise ConfigError(f"{key}: {cls.__name__} cannot be built from {file}: {one_line(e)}") from None
    if cfg.pretrained is None:   # a new model: no values of a user's (pretrained: the files' overwrite them all)
        all_on_meta(model)
    else:
        refuse_unconverted(model, file.parent, config.model_type)
        if (file.parent / "generation_config.json").is_file():   # e.g. a chat model's eos ids, kept on export
            read_generation_config(model, file.parent)
        carry_tokenizer_files(model, file.parent)   # (so are its tokenizer's files)
    if cfg.activation_checkpointing:   # (transformers 5 calls it activation_checkpointing, older ones gradient_)
        what = "activation" if hasattr(model, "activation_checkpointing_enable") else "gradient"
        getattr(model, f"{what}_checkpointing_enable")(**{f"{what}_checkpointing_kwargs": {"use_reentrant": False}})
    return model


def causal_lm_loss(model: nn.Module, batch: tuple[Tensor, Tensor] | Mapping[str, Tensor]) -> Tensor:
    """``gpt_loss`` for an HF causal LM: a tuple ``(x, y)``, ``y`` already the next tokens (the data sources'), or
    transformers' dict (``_hf_batch``: unshifted ``labels``, shifted here); a mixture-of-experts model's router
    ``aux_loss`` is added times ``router_aux_loss_coef``, as transformers' own loss does."""
    if isinstance(batch, Mapping):
        out, loss = dict_forward(model, batch)
    else:
        x, y = batch
        out = model(input_ids=x, use_cache=False)
        loss = next_token_loss(out.logits, y)
    aux = getattr(out, "aux_loss", None)
    if aux is not None:
        loss = loss + _router_aux_loss_coef(model) * aux.to(loss.device)
    return loss


def _router_aux_loss_coef(model: nn.Module) -> float:
    """The weight of ``aux_loss``: ``router_aux_loss_coef`` (JetMoe: ``aux_loss_coef``) of the model, its config
    or its text config."""
    config = getattr(model, "config", None)
    owners = (model, config, config.get_text_config() if hasattr(config, "get_text_config") else None)
    coef = next((getattr(o, name) for name in ("router_aux_loss_coef", "aux_loss_coef") for o in owners
                 if o is not None and getattr(o, name, None) is not None), None)
    if coef is None:
        raise ConfigError(f"{type(model).__name__} returns a router aux_loss but states no router_aux_loss_coef; "
                          f"set router_aux_loss_coef in its config.json (or output_router_logits=false)")
    return float(coef)


def trace_loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    """The model's own loss, for the trace on meta (``causal_lm_loss``'s ``use_cache=False`` makes transformers'
    packed-sequence check read a value); the activations are the same."""
    x, y = batch
    return model(input_ids=x, labels=y).loss


# --- initialisation of one tensor at a time -----------------------------------------------------


class HFInit:
    """Initialises any one tensor of an HF model built on meta with the model's own ``_init_weights`` (run on
    the module, then each ancestor, as transformers does) on a meta copy (the shadow) in which only that
    tensor is real. Each draws from the CPU generator seeded by (seed, name): independent of the order of
    materialisation and the world size (``materialize`` gives the same values)."""

    def __init__(self, model: nn.Module, seed: int):
        self.seed = seed
        self.shadow = copy.deepcopy(model)   # all meta: init functions never see a stage's shards
        self.modules = dict(self.shadow.named_modules(remove_duplicate=False))
        pretrained = sys.modules["transformers"].PreTrainedModel
        self.init_of: dict[str, nn.Module] = {}   # module path -> the PreTrainedModel whose _init_weights applies
        for path, mod in self.modules.items():    # parents come before children
            self.init_of[path] = mod if isinstance(mod, pretrained) else self.init_of[path.rpartition(".")[0]]

    def _init(self, name: str, t: Tensor, parameter: bool) -> None:
        path, _, key = name.rpartition(".")
        kind = "parameter" if parameter else "buffer"
        chain = [path]   # the owner, then each ancestor up to the root ("")
        while chain[-1]:
            chain.append(chain[-1].rpartition(".")[0])
        owner = self.modules[path]
        # (the slots themselves: setattr would run the registration hooks and checks of a new parameter or buffer)
        slots = owner._parameters if parameter else owner._buffers
        host = t if t.device.type == "cpu" else torch.empty(t.shape, dtype=t.dtype, device="cpu")
        _poison(host)
        tensor = nn.Parameter(host, requires_grad=False) if parameter else host
        old, slots[key] = slots[key], tensor
        try:
            with torch.random.fork_rng(devices=[]), torch.no_grad():
                torch.default_generator.manual_seed(name_seed(self.seed, name))
                for p in chain:
                    self.init_of[p]._init_weights(self.modules[p])
                written = slots[key]
                _constructor_init(owner, key, written)
        except Exception as e:  # noqa: BLE001 - e.g. an init that reads a sibling tensor, still on meta here
            raise ConfigError(f"{kind} {name!r} of {type(self.shadow).__name__} cannot be materialised from the meta "
                              f"device: its _init_weights failed on {type(owner).__name__} with only this tensor real "
                              f"({one_line(e)}); build the model on a real device instead") from None
        finally:
            slots[key] = old
        if written is not tensor:  # an init that assigned a new tensor instead of writing in place
            host.copy_(written.detach())
        if _poisoned(host):
            raise ConfigError(f"{kind} {name!r} of {type(self.shadow).__name__} is not initialised by its "
                              f"_init_weights ({type(owner).__name__} is not covered), so it cannot be materialised "
                              f"from the meta device; build the model on a real device instead")
        if host is not t:
            t.copy_(host)

    init_parameter = partialmethod(_init, parameter=True)
    init_buffer = partialmethod(_init, parameter=False)


def _constructor_init(module: nn.Module, key: str, t: Tensor) -> None:
    """The constructor's values where ``_init_weights`` left ``t`` unwritten: transformers' ``Conv1D`` draws
    N(0, 0.02) and zeroes its bias in ``__init__``, which OpenAI GPT relies on."""
    from transformers.pytorch_utils import Conv1D

    if isinstance(module, Conv1D) and _poisoned(t):
        if key == "weight":
            t.normal_(mean=0.0, std=0.02)
        elif key == "bias":
            t.zero_()


def _poison(t: Tensor) -> None:
    """Fill with values no init writes: an uncovered tensor is detected, not trained on garbage."""
    t.fill_(math.nan if t.is_floating_point() else (torch.iinfo(t.dtype).min if t.dtype != torch.bool else False))


def _poisoned(t: Tensor) -> bool:
    # Reductions: no temporary as large as the tensor (a NaN left makes the sum NaN).
    if t.is_floating_point():
        return bool(t.sum().isnan())
    return t.dtype != torch.bool and t.numel() > 0 and int(t.min()) == torch.iinfo(t.dtype).min


def materialize(model: nn.Module, device: torch.device | str = "cpu", seed: int | None = None) -> nn.Module:
    """Materialise a meta model whole with the values a stage gives it (seed: ``torch.initial_seed()``)."""
    init = HFInit(model, torch.initial_seed() if seed is None else seed)
    done: dict[int, Tensor] = {}   # a tensor registered under several names (tied weights) stays one
    for parameter, named in ((True, model.named_parameters(remove_duplicate=False)),
                             (False, model.named_buffers(remove_duplicate=False))):
        for name, old in list(named):
            if old.is_meta:
                if id(old) not in done:
                    t = torch.empty(old.shape, dtype=old.dtype, device=device)
                    init._init(name, t, parameter)
                    done[id(old)] = nn.Parameter(t, requires_grad=old.requires_grad) if parameter else t
                path, _, key = name.rpartition(".")
                sub = model.get_submodule(path)
                # (the slot itself: setattr would run the registration hooks and checks of a new parameter or buffer)
                (sub._parameters if parameter else sub._buffers)[key] = done[id(old)]
    return model


def declared_layers(module: nn.Module) -> list[str]:
    """An HF model's ``_no_split_modules`` (layers transformers never splits): the ZeRO-3 gather units."""
    return list(module._no_split_modules or []) if is_hf_model(module) else []


COMPONENT = ModelComponent(config=HFConfig, build=build, loss=causal_lm_loss, weights=lambda cfg: cfg.pretrained,
                           hidden_size=hidden_size, vocab_size=config_vocab, trace_loss=trace_loss, check=check,
                           notes=notes)
