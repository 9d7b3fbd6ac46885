"""Estimate memory before training: DeepSpeed's model-state tables, NVMe rows, and a per-rank prediction.

    python -m framework.estimate params=2851M largest_layer=32M gpus_per_node=8      # DeepSpeed's all_cold
    python -m framework.estimate model=gpt2-medium gpus_per_node=8 nodes=2             # our preset (all_live)
    python -m framework.estimate model=path/to/config.json +stage=zero3 \\
        'stage.gather_unit=[GPT2Block]' context=512 train.micro_batch=4               # a Hugging Face config
    python -m framework.estimate model=gpt-mini +stage=zero2 offload=cpu precision=bf16 \\
        train.micro_batch=8 model.activation_checkpointing=true dist.nproc=2           # + per-rank prediction

Counts accept ``2.78e9``, ``2783M``, ``32K``, ``1.4B``. A model is built on the meta device (no memory). The
two DeepSpeed tables (model states only; "per CPU" is per node) match DeepSpeed's to the printed digit; ours
follow: ZeRO-Infinity rows (the ``offload=nvme`` keys) and, for a model, the bytes each rank will hold for the
composed config (any other ``key=value`` is a Hydra override of ``conf/train.yaml``; ``context=`` sets a
Hugging Face model's sequence length, by default training's ``model.context``). ``--json`` prints everything as JSON.
More in docs/estimate.md.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

import torch
from yaml import YAMLError

from framework.engine.build import component
from framework.memory.model import CUDA_FIXED_SLACK, SLACK_FRACTION, data_vocab, nvme_pools, predict, state_bytes
from framework.models import hf as hf_lib
from framework.memory.tables import (BUFFER_FACTOR, NVMeKeys, count_module,
                                     format_rows, nvme_rows, parse_count, zero2_rows, zero3_rows)
from framework.cli import RANK_NAMES, run_command
from framework.config import compose, override_key
from framework.config.checks import KEY_ALIASES, writable
from framework.config.plainconf import check_delete, library_line, load_yaml, parse, set_key, typed
from framework.core import files
from framework.core.errors import ConfigError, FrameworkError, typed_line
from framework.core.registry import closest_hint, registry
from framework.core.units import GiB, MiB
from framework.models.gpt import GPTConfig

NVME_KEYS = tuple(f.name for f in dataclasses.fields(NVMeKeys))   # NVMeKeys' defaults are DeepSpeed's
# Other tools' names for a rank count (plan's ranks=, torchrun's nproc, world size): a world is gpus_per_node x nodes.
ALIASES = {**dict.fromkeys(("ranks", *RANK_NAMES), "gpus_per_node"), **dict.fromkeys(("nnodes", "num_nodes"), "nodes"),
           **{a: k for a, k in KEY_ALIASES.items() if k == "context"}}   # (estimate's own context=)
OWN_KEYS = ("params", "largest_layer", "gpus_per_node", "nodes", "model", "buffer_factor", "context", *NVME_KEYS)


def hf_model_from_config(path: Path) -> torch.nn.Module:
    """A Hugging Face model built from its config.json on the meta device (nothing downloaded)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import transformers
    except ImportError:
        raise ConfigError("estimate: a config.json needs transformers (pip install -e '.[hf]')") from None
    # Read as model=hf reads it (custom model code refused in one line, never a prompt to run it).
    config_path, config = hf_lib.load_config(path, key="estimate: model")
    # The class training builds (model=hf: AutoModelForCausalLM's), whatever "architectures" names (a config
    # saved from AutoModel says LlamaModel: no LM head); another model (e.g. multimodal) for the tables alone.
    archs = getattr(config, "architectures", None) or []
    cls = getattr(transformers, archs[0], None) if archs and hf_lib.causal_lm_class(config) is None else None
    try:
        with torch.device("meta"):
            if cls is not None:
                return cls(config)
            try:
                return transformers.AutoModelForCausalLM.from_config(config)
            except ValueError:
                return transformers.AutoModel.from_config(config)
    except (ValueError, TypeError, AttributeError, KeyError, IndexError, RuntimeError) as e:
        raise ConfigError(f"estimate: cannot build a model from {config_path}: {typed_line(e)}") from None


def model_kind(value: str) -> str:
    """How ``model=value`` is read: ``hf`` (a Hugging Face config.json, a folder holding one), ``yaml`` (a GPT model
    config file) or ``name`` (conf/model/'s, or an unknown name the registry refuses)."""
    path = Path(value)
    if path.suffix in (".yaml", ".yml"):
        return "yaml"
    # Not one of conf/'s models, a path (or a Hub name, org/model) is a Hugging Face config.json: one that is not
    # there is refused in training's words (nothing is downloaded).
    hf = path.suffix == ".json" or (path / "config.json").is_file() or \
        value not in registry("model").names() and ("/" in value or path.exists())
    return "hf" if hf else "name"


def resolve_model(value: str, overrides: list[str], context: int = hf_lib.HFConfig.context):
    """(module on meta, composed Config, whether it is a Hugging Face model, its vocabulary {"size", "from"})."""
    path, models = Path(value), registry("model")
    kind = model_kind(value)
    yaml, hf = kind == "yaml", kind == "hf"
    if yaml and not path.exists():
        raise ConfigError(f"estimate: model={value}: no such file")
    model_keys = [o for o in overrides if override_key(o).split(".")[0] == "model"]
    if hf:   # our stages, precision, batch and offload keys around it
        module = hf_model_from_config(path)
        ckpt = [o for o in model_keys if override_key(o) == "model.activation_checkpointing"]
        for o in model_keys:   # a model.* key would change nothing in the config.json: refused, not ignored
            if o in ckpt:   # (typed by the compose below: false, how it is traced anyway, is accepted)
                continue
            name = override_key(o).removeprefix("model.")   # (model=hf's own keys, under training's spelling)
            hint = "; edit the config.json to change the model" if name not in ("context", "attn_implementation") \
                else (f"; {'with model=PATH use context=N, or ' if name == 'context' else ''}name it as training "
                      f"does: model=hf model.config={value} model.{name}={o.partition('=')[2]}")
            raise ConfigError(f"estimate: {o} does not apply to model={value} (a config.json given as model= is "
                              f"built as the file states it){hint}")
        # A DeepSpeed file's "auto" sizes (10*h, 0.9*h*h, h*h) take this model's hidden size, as under
        # model=hf model.config=...; not the composed default model's (None: the file's "auto" is refused).
        cfg = compose(overrides, hidden_size=hf_lib.config_hidden_size(module.config), hidden_from_model=False)
        if ckpt and cfg.model.activation_checkpointing:
            raise _no_hf_checkpointing(ckpt[-1], value)
        if hf_lib.causal_lm_class(module.config) is not None:   # one model=hf trains: the data's ids must fit it
            hf_lib.check_vocab(data_vocab(cfg, context), module.config, value)   # (its data at its context)
        size = getattr(module.config, "vocab_size", None)   # else its text part's; None where it states none
        size = getattr(hf_lib.text_config(module.config), "vocab_size", None) if size is None else size
        return module, cfg, True, {"size": size, "from": "model"}
    if yaml:   # a GPT model config in a YAML file (as conf/model/*.yaml), then the model.* overrides
        model = _yaml_model(path, model_keys)
        rest = [o for o in overrides if o not in model_keys]
        cfg = dataclasses.replace(compose(rest, hidden_size=model.d_model, hidden_from_model=False), model=model)
    else:
        models.get(value)   # an unknown name: one line, with how to name a Hugging Face model
        cfg = compose([f"model={value}", *overrides])
        if isinstance(cfg.model, hf_lib.HFConfig) and cfg.model.activation_checkpointing:   # before it is built
            raise _no_hf_checkpointing("model.activation_checkpointing=true", value)
    vocab, source = build_vocab(cfg, overrides)
    with torch.device("meta"):
        module = component(cfg, "model").build(cfg.model, vocab_size=vocab)
    return module, cfg, False, {"size": vocab, "from": source}


def build_vocab(cfg, overrides: list[str]) -> tuple[int, str]:
    """(``vocab_size`` to count the model with in the model-state tables, its source): a model's that keeps its
    own whatever the data's (model=hf: its config.json's); else the data's when ``overrides`` choose the data
    (``data=`` or a ``data.`` key) or the model config states none, else the model config's own, so a preset
    counts as its YAML states. (A per-rank prediction is always at ``data_vocab``'s, as training builds.)"""
    if (own := component(cfg, "model").vocab_size(cfg.model)) is not None:
        return own, "model"
    chosen = any(override_key(o).split(".")[0] == "data" for o in overrides)
    if chosen or getattr(cfg.model, "vocab_size", None) is None:   # (a model config stating none: as training builds)
        return data_vocab(cfg), f"data={cfg.choices['data']}"
    return cfg.model.vocab_size, "model"


def _no_hf_checkpointing(override: str, value: str) -> ConfigError:
    """The refusal of transformers' checkpointing, before the model is traced (the trace would fail, after its
    warnings)."""
    return ConfigError(f"estimate: {override} does not apply to model={value} (its activations are traced on the "
                       f"meta device, where transformers' checkpointing cannot run); drop it")


def _yaml_model(path: Path, model_keys: list[str]) -> GPTConfig:
    """The GPT config a YAML file states, typed by its schema as a preset is, with the ``model.*`` overrides."""
    fields = [f.name for f in dataclasses.fields(GPTConfig)]
    try:
        from omegaconf import OmegaConf
        from omegaconf.errors import OmegaConfBaseException
    except ImportError:   # (the GPU image: no Hydra) read as the plain composer reads a preset
        return _plain_yaml_model(path, model_keys, fields)
    try:
        files.refuse_alias_bomb(path.read_text())   # (before OmegaConf expands one)
        schema = writable(OmegaConf.structured(GPTConfig), GPTConfig)   # (the overrides go into it)
        node = OmegaConf.merge(schema, OmegaConf.load(path))
    except YAMLError as e:
        raise ConfigError(f"estimate: {path} is not YAML: {' '.join(str(e).split())}") from None
    except OmegaConfBaseException as e:
        raise ConfigError(f"estimate: {path} is not a GPT model config: {_omega_error(e)}") from None
    except ValueError as e:   # (refuse_alias_bomb's: OmegaConf's ValueErrors are caught above)
        raise ConfigError(f"estimate: {path}: {e}") from None
    for o in model_keys:
        key, _, text = o.partition("=")
        name = _model_key(o, fields)
        try:
            if key.startswith("~"):   # back to the schema's default (or missing)
                check_delete(f"model.{name}", OmegaConf.select(node, name, throw_on_missing=False), parse(o).value)
                node = OmegaConf.merge(schema, {k: v for k, v in OmegaConf.to_container(node).items() if k != name})
            else:
                OmegaConf.update(node, name, OmegaConf.from_dotlist([f"v={text}"])["v"], merge=False)
        except OmegaConfBaseException as e:
            raise ConfigError(f"config: {_omega_error(e)}") from None
    try:
        return OmegaConf.to_object(node)
    except OmegaConfBaseException as e:
        raise ConfigError(f"config: {_omega_error(e)} (model={path})") from None


def _plain_yaml_model(path: Path, model_keys: list[str], fields: list[str]) -> GPTConfig:
    """``_yaml_model`` without OmegaConf: the same checks, plainconf's typing."""
    try:
        node = load_yaml(path, tool="estimate")
    except YAMLError as e:
        raise ConfigError(f"estimate: {path} is not YAML: {' '.join(str(e).split())}") from None
    except ConfigError:   # (a ValueError too: load_yaml's line, in estimate's words already)
        raise
    except (TypeError, ValueError):
        raise ConfigError(f"estimate: {path} is not a GPT model config: not a mapping of keys") from None
    for key in node:
        if key not in fields:
            raise ConfigError(f"estimate: {path} is not a GPT model config: model.{key}: Key '{key}' not in "
                              f"'GPTConfig'{closest_hint(str(key), fields)}")
    try:   # the file's own values first, as OmegaConf merges them: their errors name the file
        typed(node, GPTConfig, "model.")
    except ConfigError as e:
        if "Missing mandatory value" not in str(e):   # (an override may give it: checked once they are in)
            raise ConfigError(f"estimate: {path} is not a GPT model config: {str(e).removeprefix('config: ')}") \
                from None
    for o in model_keys:
        name = _model_key(o, fields)
        override = parse(o)
        if override.prefix == "~":   # back to the schema's default (or missing)
            default = next(f.default for f in dataclasses.fields(GPTConfig) if f.name == name)
            check_delete(f"model.{name}", node.get(name, None if default is dataclasses.MISSING else default),
                         override.value)
            node.pop(name, None)
        else:
            set_key(node, dataclasses.replace(override, prefix="", key=name))
    try:
        return typed(node, GPTConfig, "model.")
    except ConfigError as e:   # (a value neither the file nor the command line gave names the file, as OmegaConf's)
        raise ConfigError(f"{e} (model={path})" if "Missing mandatory value" in str(e) else str(e)) from None


def _model_key(override: str, fields: list[str]) -> str:
    """A ``model.*`` override's key under GPTConfig, or one line naming the valid ones."""
    if (name := override_key(override).removeprefix("model.")) not in fields:
        hint = closest_hint(f'model.{name}', [f'model.{f}' for f in fields])
        raise ConfigError(f"config: unknown key 'model.{name}'{hint}"
                          f"; valid keys under model: {', '.join(fields)}")
    return name


def _omega_error(e) -> str:
    """``model.key: message`` of an OmegaConf error on the model's node, on one line."""
    key = getattr(e, "full_key", None) or ""
    return library_line(f"model.{key}", str(e).splitlines()[0], getattr(e, "value", None)) if key else \
        str(e).splitlines()[0]


def _count_text(n: int) -> str:
    """A parameter count in the header's words: whole millions from 10M (DeepSpeed's estimator's), else two
    decimals or thousands (a small model's read "0M")."""
    # (the unit chosen after rounding: 999,960 reads 1.00M, not 1000.0K; 9,999,999 10M, not 10.00M)
    k, m = f"{n / 1e3:.1f}K", f"{n / 1e6:.2f}M"
    if n >= 10**7 or m == "10.00M":
        return f"{max(n // 10**6, 10)}M"
    if n >= 10**6 or k == "1000.0K":
        return m
    return k if n >= 1000 else str(n)


def _count(own: dict[str, str], key: str, default: int | None = None) -> int | None:
    """``own[key]`` as a whole number >= 1 (``default`` when not given): a count of parameters or elements in any
    spelling (2.78e9, 32K), a count of anything else (nodes, GPUs, tokens, buffers) in digits."""
    if key not in own:
        return default
    elements = key in ("params", "largest_layer", "sub_group_size", "param_buffer_size")
    if (n := parse_count(own[key], f"estimate: {key}", whole=not elements)) < 1:
        raise ConfigError(f"estimate: {key}={own[key]} must be >= 1")
    return n


def _number(override: str) -> float | None:
    """An override's value as a number (dist.nproc=02 is 2), None where it is not a plain one."""
    try:
        return float(override.split("=", 1)[-1])
    except ValueError:
        return None


def report(own: dict[str, str], overrides: list[str], flags: dict) -> None:
    gpus, nodes = _count(own, "gpus_per_node", 1), _count(own, "nodes", 1)
    try:
        factor = float(own.get("buffer_factor", BUFFER_FACTOR))
    except ValueError:
        raise ConfigError(f"estimate: buffer_factor={own['buffer_factor']!r} is not a number, e.g. 1.5") from None
    if not 0 <= factor < float("inf"):
        raise ConfigError(f"estimate: buffer_factor={own['buffer_factor']} must be >= 0 (DeepSpeed's default: 1.5)")
    cfg = module = None
    out: dict = {}
    if "model" in own:
        if "params" in own or "largest_layer" in own:
            raise ConfigError("estimate: give model=... or params=/largest_layer=, not both")
        nproc = [o for o in overrides if override_key(o) == "dist.nproc"]
        world = gpus * nodes if "gpus_per_node" in own or "nodes" in own else None
        if world and not nproc:
            # The world sizes a ds_config's batch triple (and its checks) as dist.nproc does for training.
            overrides = [*overrides, f"dist.nproc={world}"]
        conflict = ConfigError(f"estimate: {nproc[-1]} conflicts with gpus_per_node=/nodes= (a world of {world}); "
                               "give one of them") if world and nproc else None
        if conflict and _number(nproc[-1]) not in (None, world):   # before what that world would refuse
            raise conflict
        hf_context = _count(own, "context", hf_lib.HFConfig.context)   # a Hugging Face model's: by default training's
        module, cfg, hf, vocab = resolve_model(own["model"], overrides, hf_context)
        if conflict and cfg.dist.nproc != world:   # (its value composed: quoted, interpolated or deleted)
            raise conflict
        if world is None:
            gpus = cfg.dist.nproc   # the tables for the world the prediction below is for (one node)
        if "context" in own and not hf:
            raise ConfigError(f"estimate: context= sets a Hugging Face model's sequence length; for "
                              f"model={own['model']} use model.context=N")
        params, largest = dataclasses.astuple(count_module(module))
        out["vocab"] = vocab
    elif "params" in own:
        if overrides:
            raise ConfigError(f"estimate: {overrides[0]!r} needs model=... (a per-rank prediction is for a model)")
        params, largest = _count(own, "params"), _count(own, "largest_layer")
        if "context" in own:
            raise ConfigError("estimate: context= needs model=... (a Hugging Face config)")
        nvme = [k for k in NVME_KEYS if k in own]
        if nvme and largest is None:   # the NVMe keys size the ZeRO-3 rows, which need largest_layer
            raise ConfigError(f"estimate: {nvme[0]}= needs largest_layer= (it sizes the ZeRO-3 NVMe rows)")
        if largest is not None and largest > params:
            raise ConfigError(f"estimate: largest_layer={own['largest_layer']} is more than params={own['params']}")
    else:
        raise ConfigError("estimate: give params=N [largest_layer=N] or model=NAME|config.json|model.yaml")
    given = {k: getattr(cfg.offload, k) for k in NVME_KEYS} if cfg and cfg.choices["offload"] == "nvme" else {}
    if own_nvme := [k for k in NVME_KEYS if k in own and given]:   # one value for the tables and the prediction
        k = own_nvme[0]
        raise ConfigError(f"estimate: {k}={own[k]} with offload=nvme: the config's offload.{k} sizes both the "
                          f"tables and the per-rank prediction; give offload.{k}={own[k]} instead")
    # Without offload=nvme the tables take our sub_group_size (10^7: it bounds the host tiles) and show DeepSpeed's.
    ours = {"sub_group_size": registry("offload").get("nvme").config.sub_group_size}
    keys = NVMeKeys(**{**ours, **given, **{k: _count(own, k) for k in NVME_KEYS if k in own}})
    out.update(params=params, largest_layer=largest, gpus_per_node=gpus, nodes=nodes)
    layer = f", {_count_text(largest)} largest layer params" if largest is not None else ""
    if "vocab" in out:
        layer += f"; vocab {out['vocab']['size']} (from {out['vocab']['from']})"
    text = [f"Model states (params, gradients, optimizer state) for {nodes} {'nodes' if nodes > 1 else 'node'} x "
            f"{gpus} {'GPUs' if gpus > 1 else 'GPU'} per node; model with {_count_text(params)} total params{layer}."]

    def table(key: str, title: str, rows: list) -> None:
        text.extend(["", title, format_rows(rows)])
        out[key] = [{k: v for k, v in r.__dict__.items() if v is not None} for r in rows]

    table("zero2", "DeepSpeed ZeRO-2 (estimate_zero2_model_states_mem_needs; model states only, sub_group_size "
                   "does not enter):", zero2_rows(params, gpus, nodes, factor))
    # The NVMe rows at the composed precision and optimizer (DeepSpeed's 16-bit Adam without a model).
    widths = dict(zip(("param_bytes", "optimizer_bytes"), state_bytes(cfg))) if cfg is not None else {}
    precision = f", precision={cfg.choices['precision']}" if cfg is not None else ""

    def nvme(keys: NVMeKeys) -> list:
        """The NVMe rows; a model's with its host pools per rank (params on NVMe, CPU, GPU) as the engine sizes them."""
        pools = {} if module is None else {"pools": tuple(
            nvme_pools(cfg, module, gpus * nodes, par, **dataclasses.asdict(keys)).host_total()
            for par in ("nvme", "cpu", "none"))}
        return nvme_rows(params, largest, gpus, nodes, keys, **widths, **pools)

    sized = ("the engine's pools for this model" if module is not None else
             "without a model's structure: every tile and parameter slot at its largest, but not the two pinned "
             "buffers that gradient partitions are copied through on their way to disk (model= counts them)")
    if largest is not None:
        table("zero3", "DeepSpeed ZeRO-3 (estimate_zero3_model_states_mem_needs; model states only, sub_group_size "
                       "does not enter):", zero3_rows(params, largest, gpus, nodes, factor))
        table("nvme", f"ZeRO-3 with offload=nvme (ours: no buffer factor; sub_group_size={keys.sub_group_size:,}, "
                      f"buffer_count={keys.buffer_count}, param_buffer_count={keys.param_buffer_count}, "
                      f"param_buffer_size={keys.param_buffer_size:,}{precision}; per CPU = pinned pools: optimizer tiles with "
                      f"their gradient, one gradient bounce, parameter slots [or the parameter shards], {sized}; the "
                      f"per-rank prediction below adds the working set):",
              nvme(keys))
        ds = NVMeKeys.sub_group_size
        if keys.sub_group_size != ds:
            table("nvme_deepspeed_sub_group_size",
                  f"The same with DeepSpeed's default sub_group_size={ds:,} (other keys as above; a "
                  f"partition under that size is one tile, resident for its whole step):",
                  nvme(dataclasses.replace(keys, sub_group_size=ds)))
        out["nvme_sub_group_size"] = keys.sub_group_size
    else:   # (params= alone: the rows would otherwise vanish without a word)
        text += ["", "ZeRO-3 and NVMe rows: give largest_layer=N (DeepSpeed's largest_layer_params: the most "
                     "parameters in one layer)"]
    if module is not None:   # a model: the per-rank prediction (for gpus = dist.nproc where neither count was given)
        context = None
        if hf:
            conf = getattr(module, "config", None)
            limit = getattr(conf, "n_positions", None) or getattr(conf, "max_position_embeddings", None)
            context = hf_context
            if limit is not None and context > limit:   # as framework.train refuses it
                default = "" if "context" in own else " (training's default model.context)"
                raise ConfigError(f"estimate: context={context}{default} exceeds the model's max_position_embeddings "
                                  f"({limit}); set context <= {limit}")
        text += ["", f"model {Path(own['model'])}"] if hf else [""]
        try:
            # (ours built by predict at the vocabulary training builds: the data's, not the model's own)
            pred = predict(cfg, gpus * nodes, module=module if hf else None, loss_fn=hf_lib.trace_loss if hf else None,
                           context=context, vocab=None if hf or vocab["from"] == "model" else vocab["size"])
        except Exception as e:   # noqa: BLE001 (a Hugging Face forward on meta fails in its own ways)
            failed = e.__cause__ if isinstance(e, FrameworkError) else e   # (predict's one line on a failed trace)
            if not hf or failed is None or isinstance(failed, FrameworkError):
                raise
            # e.g. a multimodal model, whose forward needs more than input_ids and labels: the tables stand
            why = f"{type(failed).__name__}: {str(failed).splitlines()[0] if str(failed) else ''}"
            out.update(prediction=None, prediction_error=f"no per-rank prediction: the model's forward(input_ids, "
                       f"labels) cannot be traced on the meta device ({why}); the tables above still hold")
            text.append(out["prediction_error"])
        else:
            text.append(format_prediction(cfg, pred, context=context))
            out["prediction"] = pred.as_dict()
    if cfg is not None and cfg.notices:   # the DeepSpeed file's warnings and notes, as training prints them
        print("\n".join(cfg.notices), file=sys.stderr, flush=True)   # (after the checks: a bad argument is one line)
        out["ds_config_notices"] = list(cfg.notices)
    print(json.dumps(out, indent=1) if flags["json"] else "\n".join(text))


def format_prediction(cfg, pred, context: int | None = None) -> str:
    c = cfg.choices
    ckpt = getattr(cfg.model, "activation_checkpointing", None)   # (a model of its own may have no such key)
    ckpt = "" if context or ckpt is None else f" activation_checkpointing={str(ckpt).lower()}"   # (as typed)
    head = (f"Per rank, ours: stage={c['stage']} offload={c['offload']} precision={c['precision']} "
            f"optimizer={c['optimizer']} world={pred.world} micro_batch={cfg.train.micro_batch} "
            f"context={context or cfg.model.context}{ckpt}")
    mib = lambda b: f"{b / MiB:10.1f} MiB"   # noqa: E731
    # The sums (model states, peak, slack) have a column of their own: under "device" they would read as the GPU's.
    names = [*pred.items, "allocator slack", *(f"{n} (NVMe)" for n in pred.disk), *(f"{n} (peak)" for n in pred.transient)]
    w, disk = max(24, *map(len, names)), bool(pred.disk)
    row = lambda name, device="", host="", nvme="", total="": (   # noqa: E731
        f"  {name:{w}s} {device:>14s} {host:>14s}" + (f" {nvme:>14s}" if disk else "") + f" {total:>14s}").rstrip()
    lines = [head, row("", "device", "host", "NVMe", "device+host")]
    # The model states' items above their sum; what else stays resident (buffers, zero2's bucket buffers, zero3's
    # persistent parameters) below it, counted in the peak with the transients.
    states = [name in pred.MODEL_STATES for name in pred.items]
    lines += [row(name, mib(d), mib(h)) for (name, (d, h)), s in zip(pred.items.items(), states) if s]
    lines.append(row("model states", total=mib(pred.model_states)))
    lines += [row(name, mib(d), mib(h)) for (name, (d, h)), s in zip(pred.items.items(), states) if not s]
    lines += [row(f"{name} (NVMe)", nvme=mib(b)) for name, b in pred.disk.items()]
    lines += [row(f"{name} (peak)", mib(b)) for name, b in pred.transient.items()]
    recompute = (f" + {pred.recompute_slack_fraction:.0%} of the activations under checkpointing"
                 if pred.recompute_slack_fraction else "")
    lines.append(row("allocator slack", total=mib(pred.slack)) + f"   ({pred.host_slack_fraction:.0%} of the "
                 f"transient bytes{recompute}, stated)")
    # On CUDA the device's own peak: not a part of this one, as CUDA's slack can make it the larger.
    lines.append(row("peak", total=mib(pred.peak)) + f"   ({pred.peak / GiB:.2f} GiB; on CUDA the device alone would "
                 f"peak at {pred.device_peak(cuda=True) / GiB:.2f} GiB: its items and transients plus CUDA's slack, "
                 f"{SLACK_FRACTION:.0%} of the transients and {CUDA_FIXED_SLACK // MiB} MiB)")
    lines += [f"  note: {n}" for n in pred.notes]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return run_command(__doc__, argv, "estimate", OWN_KEYS, {"json": False}, report, ALIASES)
