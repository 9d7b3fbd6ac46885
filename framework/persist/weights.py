"""Consolidated weights in and out of an engine, tensor by tensor, without any rank holding the model.

    framework.load_weights(engine, "path/to/folder")          # model.safetensors, an index, or a torch file
    framework.save_weights(engine, "out/", dtype=torch.bfloat16, max_shard_size="2GB")
    engine.save_pretrained("out/")                            # + config.json for a Hugging Face model

Each rank reads only the ranges its master pieces hold (``layout``). A save lays out the files on rank 0, then
every rank writes its share at its byte offsets (no rank assembles a tensor): every rank must see ``out_dir``.
"""
from __future__ import annotations

import contextlib
import copy
import math
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from framework.comm.distributed import agree
from framework.core import files
from framework.core.errors import ConfigError
from framework.models.hf import (checkpoint_names, converted, is_hf_model, tokenizer_files,
                                 write_tokenizer_files)
from framework.offload import verify_map
from framework.persist.layout import StateLayout
from framework.persist.stepfolders import check_weights16, committed_step
from framework.persist.tensorfiles import (WRITE_CHUNK, WeightsSource, Writer, is_output, nonfinite, open_weights,
                                           output_dir, plan_files, save_files)
from framework.core.utils import COMPILED, dtype_name, few, unwrapped
from framework.engine.step import Components


@dataclass(frozen=True)
class Target:
    """One tensor of the model as the files name it: a parameter (tied ones once) or a persistent buffer."""

    name: str                    # the first name in module order: what save_weights writes
    aliases: tuple[str, ...]     # every name it is registered under (name first)
    shape: tuple[int, ...]       # global shape (a zero3 parameter's logical shape)
    dtype: torch.dtype           # the values' dtype as trained (master dtype for staged parameters)
    tensor: torch.Tensor | None  # a whole tensor every rank holds (buffers, unstaged parameters); else None


def _once(named) -> list[tuple[torch.Tensor, list[str]]]:
    """Each tensor of ``named`` ((name, tensor)) once, with every name it is under (several: tied, shared), in order."""
    out: dict[int, tuple[torch.Tensor, list[str]]] = {}
    for n, t in named:
        out.setdefault(id(t), (t, []))[1].append(n)
    return list(out.values())


def _buffers_once(module: nn.Module) -> list[tuple[torch.Tensor, list[str]]]:
    # Every name, as state_dict lists them (a submodule or buffer registered twice is under both; None buffers are
    # not named); no public flag says whether a buffer is persistent, short of state_dict(), which a model may override.
    return _once((f"{m}.{b}" if m else b, buf) for m, sub in module.named_modules(remove_duplicate=False)
                 for b, buf in sub.named_buffers(recurse=False, remove_duplicate=False)
                 if b not in sub._non_persistent_buffers_set)


def persistent_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's persistent buffers by name (a shared one once, under its first name), in module order."""
    return {names[0]: buf for buf, names in _buffers_once(module)}


def _named_once(module: nn.Module) -> list[tuple[nn.Parameter, list[str]]]:
    return _once(module.named_parameters(remove_duplicate=False))


def tied_names(module: nn.Module) -> dict[str, str]:
    """``{alias: first name}`` of the tied parameters and shared buffers, saved once under the first (``state_dict``
    holds every name: a fp32 state dict restores them)."""
    return {alias: names[0] for _, names in [*_named_once(module), *_buffers_once(module)] for alias in names[1:]}


def whole_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors every rank holds whole, by checkpoint key: ``frozen.<name>`` (no stage shards them) and
    ``buffer.<name>`` (persistent; each rank's own, a checkpoint keeps rank 0's)."""
    return {**{f"frozen.{n}": p for n, p in module.named_parameters() if not p.requires_grad},
            **{f"buffer.{n}": b for n, b in persistent_buffers(module).items()}}


def _targets(engine, mapped, what: str) -> tuple[StateLayout, list[torch.Tensor], list[Target]]:
    """Every rank's holdings (collective), the ``mapped`` state's master pieces, and the model's tensors as the files
    name them: parameters, then persistent buffers."""
    c = engine.components
    layout = StateLayout.of(c.stage.piece_specs(), dist=c.dist, what=f"{what}: layout gather")
    masters = list(mapped.params)
    trained = masters[0].dtype if masters else torch.float32   # no pieces on this rank: the default
    # a parameter outside the layout (a frozen one) is whole on every rank
    tgts = [Target(a[0], tuple(a), layout.params[a[0]].shape, trained, None) if a[0] in layout.params
            else Target(a[0], tuple(a), tuple(p.shape), p.dtype, p) for p, a in _named_once(c.module)]
    tgts += [Target(a[0], tuple(a), tuple(b.shape), b.dtype, b) for b, a in _buffers_once(c.module)]
    return layout, masters, tgts


def _components(engine, what: str) -> Components:
    """``engine``'s components; one line for another first argument (the model: transformers' habit)."""
    if not isinstance(c := getattr(engine, "components", None), Components):
        hint = "a module: pass its engine" if isinstance(engine, nn.Module) else "not an engine"
        raise ConfigError(f"{what}: the first argument is the engine framework.initialize returned, got a "
                          f"{type(engine).__name__} ({hint})")
    return c


def load_weights(engine, source, *, strict: bool = True) -> None:
    """Load consolidated weights (a path or an open ``WeightsSource``) into ``engine``'s model: masters, zero3 shards,
    buffers, not the optimizer state; a tied parameter takes any of its names. Collective. Names (``strict``), shapes
    and dtype kinds that do not fit: one ``ConfigError`` before anything is written; NaN or inf (buffers, frozen
    parameters: NaN) one as read, after which the engine refuses to step or save until a load finishes."""
    if not isinstance(source, (str, os.PathLike, WeightsSource)):
        raise ConfigError(f"load_weights: source must be a path (a weights file or folder), got "
                          f"{type(source).__name__}; a {{name: tensor}} dict in memory goes into the module before "
                          f"initialize (module.load_state_dict), engine.state_dict's into engine.load_state_dict(state, "
                          f"[sd])")
    c = _components(engine, "load_weights")
    c.stage.rebind()   # (parameters replaced on the module, ``assign=True``: the load's targets are the stage's)
    # offload=nvme: the swapped masters are written where they lie, in the mapped swap file
    with engine.mapped_state(engine.state, write=True, agreed="load_weights: swap file map") as (mapped, fmap), \
            contextlib.ExitStack() as stack:
        layout, masters, tgts = _targets(engine, mapped, "weights")
        if not isinstance(source, WeightsSource):   # a checkpoint's model_16bit/: against its manifest
            agree(c.dist, lambda: check_weights16(source) if c.dist.is_main else None, "load_weights: manifest")

        def check() -> tuple[WeightsSource, dict[str, str]]:   # a source given open stays open
            src = source if isinstance(source, WeightsSource) else stack.enter_context(open_weights(source))
            return src, _chosen(src, strict, tgts, c.module)

        src, chosen = agree(c.dist, check, "load_weights")
        # From the first write on, a failure (a rank's read, non-finite values) leaves the weights partly the file's
        engine.start_load("load_weights")
        agree(c.dist, lambda: _load(src, chosen, layout, masters, tgts, fmap), "load_weights")
    # (collective: zero1/2 gather the partitions, zero3 refreshes its shards) a strict=False load of only some
    # tensors leaves an earlier failed load's mark: the others may still be that load's
    engine.finish_load(engine.state, every=len(chosen) == len(tgts))


def _chosen(src: WeightsSource, strict: bool, tgts: list[Target], module: nn.Module) -> dict[str, str]:
    """``{target name: source key}`` of what ``src`` loads into ``tgts``; a ``ConfigError`` for what does not fit."""
    names = {a for t in tgts for a in t.aliases}
    # source key -> the model name it loads into (None: ignored): a transformers model takes the checkpoint keys its
    # own from_pretrained would map; other models, each key itself
    inner = unwrapped(module)   # (a torch.compile'd transformers model maps its keys as the plain one does)
    plain = names | {n.removeprefix(COMPILED) for n in names}
    keys = checkpoint_names(inner, src.meta, plain) if is_hf_model(inner) else {k: k for k in src.meta}
    if inner is not module:   # torch.compile'd: the names a plain model of it saves load too
        keys = {k: n if n is None or n in names else COMPILED + n for k, n in keys.items()}
    by_name = {n: k for k, n in keys.items() if n is not None}   # model name -> source key
    chosen: dict[str, str] = {}        # target name -> source key
    missing, mismatched = [], []
    for t in tgts:
        found = [by_name[a] for a in t.aliases if a in by_name]
        if not found:
            missing.append(t.name if len(t.aliases) == 1 else f"{t.name} (or {', '.join(t.aliases[1:])})")
            continue
        key = chosen[t.name] = found[0]
        for k in [key, *found[1:]]:
            if src.meta[k][0] != t.shape:
                mismatched.append(f"{k}: {src.meta[k][0]} in the file, {t.shape} in the model")
            elif (dt := src.dtype(k)).is_floating_point != t.dtype.is_floating_point or \
                    (dt == torch.bool) != (t.dtype == torch.bool):
                mismatched.append(f"{k}: dtype {dtype_name(dt)} in the file, {dtype_name(t.dtype)} in the model")
            elif k != key and not _same_values(src, key, k, t):
                # The model holds one tensor for both names: loading either would drop the other's values.
                buffer = t.tensor is not None and not isinstance(t.tensor, nn.Parameter)   # (no tie setting for it)
                raise ConfigError(f"load_weights: {src.where} holds different values under {key} and {k}, which this "
                                  + ("model holds as one buffer (shared by two modules); keep one of them in the file"
                                     if buffer else "model ties into one parameter; set tie_word_embeddings=false in "
                                     "its config.json (a transformers model) to train them apart, or keep one of "
                                     "them in the file"))
    unexpected = sorted(k for k, n in keys.items() if n is not None and n not in names)
    problems = [f"{what} {len(names)}: {few(names, 20, str)}" for what, names in
                (("missing", missing if strict else []), ("unexpected", unexpected if strict else []),
                 ("mismatched", mismatched)) if names]
    if problems:
        # (a checkpoint under the hub's names of a model transformers converts on load: GPT-NeoX's embed_out)
        convert = strict and is_hf_model(inner) and converted(inner, unexpected)
        raise ConfigError(f"load_weights: {src.where} does not fit this model: " + "; ".join(problems)
                          + ("" if strict or not mismatched else " (strict=False skips only missing/unexpected)")
                          + ("; its tensor names need the key conversions transformers applies on load "
                             "(transformers.conversion_mapping), which load_weights does not: load it with "
                             "AutoModelForCausalLM.from_pretrained and pass that model to framework.initialize"
                             if convert else ""))
    return chosen


def _load(src: WeightsSource, chosen: dict[str, str], layout: StateLayout, masters: list[torch.Tensor],
          tgts: list[Target], fmap) -> None:
    """``chosen``'s values into the masters and whole tensors (``fmap``: the mapped swap file, released as written)."""
    def read(key: str, lo: int, hi: int, nan_only: bool = False) -> torch.Tensor:
        values = src.read(key, lo, hi)
        if (bad := nonfinite(values, nan_only)) is not None and bad:
            raise ConfigError(f"load_weights: non-finite values (NaN or inf) in {key!r} of {src.where}: not weights "
                              f"to train from; load ones saved before training diverged")
        return values

    for p, h in layout.mine():   # masters: only the ranges this rank's pieces hold
        if p.name in chosen:   # (strict=False: an absent one keeps its values)
            into = h.of(masters[h.piece].view(-1))
            into.copy_(read(chosen[p.name], h.lo, h.hi).to(into.dtype))
            if fmap is not None:
                fmap.release(into)
    with torch.no_grad():   # whole tensors every rank holds (buffers, frozen parameters outside the layout)
        for t in tgts:   # (an inf in one may be by design, an additive mask: a NaN only is refused)
            if t.tensor is not None and t.name in chosen:
                values = read(chosen[t.name], 0, t.tensor.numel(), nan_only=True)
                t.tensor.copy_(values.to(t.tensor.dtype).view(t.tensor.shape))


def _same_values(src: WeightsSource, a: str, b: str, t: Target) -> bool:
    """Whether ``a`` and ``b`` load the same values into ``t``, chunk by chunk (NaN equals NaN: the read names it)."""
    n = math.prod(t.shape)
    step = WRITE_CHUNK // 4
    return all(torch.allclose(src.read(a, s, min(s + step, n)).to(t.dtype), src.read(b, s, min(s + step, n)).to(t.dtype),
                              rtol=0, atol=0, equal_nan=True)
               for s in range(0, n, step))


# Another model's weights (safetensors, Hugging Face's torch files): beside a save's, a loader could take them in.
_WEIGHTS = re.compile(r".*\.safetensors(\.index\.json)?|pytorch_model.*\.bin(\.index\.json)?")


def check_output(out_dir: Path, what: str, overwrite: bool = False, config: bool = False) -> None:
    """Refuse an output folder holding other weights or, unless ``overwrite``, an earlier save's or a ``config.json``
    (with ``overwrite``: kept, with a warning; ``config``: ``what`` writes its own)."""
    if committed_step(out_dir) is not None:   # (refused as such by create_files)
        return
    try:
        names = sorted(p.name for p in out_dir.iterdir())
    except OSError:   # (made, or refused as not writable, by create_files)
        return
    ours = [n for n in names if is_output(n)]
    other = [n for n in names if _WEIGHTS.fullmatch(n) and not is_output(n)]
    config = "config.json" in names and not config
    if other:
        raise ConfigError(f"{what}: {out_dir} holds {few(other, show=str)}: weights "
                          f"{'the export' if what == 'export' else what} would leave beside its own; choose an empty "
                          f"folder (or remove them)")
    if (ours or config) and not overwrite:
        stays = f" (its config.json stays as it is: {what} writes only the weights)" if config else ""
        held = [*ours, "config.json"] if config else ours
        raise ConfigError(f"{what}: {out_dir} already holds {few(held, 2, str)}: "
                          f"choose an empty folder, or give --overwrite to replace the weights there{stays}")
    if config:
        print(f"warning: {what}: {out_dir / 'config.json'} stays as it is ({what} writes only the weights); check "
              f"that it describes the {'exported' if what == 'export' else 'saved'} model", file=sys.stderr, flush=True)


def save_weights(engine, out_dir, *, dtype: torch.dtype | None = None,
                 max_shard_size: int | str = "5GB", check: bool = True) -> list[Path]:
    """The model's weights and persistent buffers as consolidated safetensors in ``out_dir`` (tied weights once; an
    index beyond ``max_shard_size``), the masters as ``dtype`` (default theirs; a 16-bit one gives the working
    parameters bit for bit). Collective; the paths. ``check``: warn of NaN or inf written. Another model's weights
    in ``out_dir`` are refused, a ``config.json`` kept with a warning; an earlier save's files are replaced."""
    return _save_weights(engine, out_dir, dtype, max_shard_size, check, "save_weights", config=False)


def _save_weights(engine, out_dir, dtype, max_shard_size, check, what: str, config: bool) -> list[Path]:
    """``save_weights`` for the caller ``what``; ``config``: it writes a config.json (replaced, no warning)."""
    dist = _components(engine, what).dist
    out_dir = output_dir(out_dir, dtype, what)
    agree(dist, lambda: check_output(out_dir, what, overwrite=True, config=config) if dist.is_main else None,
          f"{what}: output folder")
    # offload=nvme: read from the mapped swap file, checked. (``_targets`` picks the tensors by the stage's layout,
    # not by requires_grad: a module frozen after training, as before sampling, still saves the trained weights)
    with engine.mapped_state(engine.state, agreed=f"{what}: swap file check", same_trainable=False) \
            as (mapped, fmap):
        layout, masters, tgts = _targets(engine, mapped, what)
        # (a torch.compile'd module's names without the wrapper's prefix: what the plain model loads)
        compiled = unwrapped(engine.components.module) is not engine.components.module
        out = (lambda n: n.removeprefix(COMPILED)) if compiled else (lambda n: n)   # noqa: E731
        plans = plan_files([(out(t.name), t.shape, t.dtype) for t in tgts], max_shard_size, dtype)
        entries = {e.name: e for plan in plans for e in plan.entries}
        # (entry, first element, source view) of what this rank writes
        jobs = [(entries[out(p.name)], a, h.of(masters[h.piece].view(-1), a, b))
                for p, h, a, b in layout.share()]
        # Whole on every rank: frozen parameters (the same everywhere) spread over the ranks; buffers
        # (BatchNorm's statistics differ per rank) all from rank 0, as the checkpoint keeps them.
        buffers = set(persistent_buffers(engine.components.module))
        whole = {out(t.name) for t in tgts if t.tensor is not None}   # checked for a NaN only: an inf may be a mask
        jobs += [(entries[out(t.name)], 0, t.tensor.detach().reshape(-1)) for i, t in enumerate(tgts)
                 if t.tensor is not None and (0 if t.name in buffers else i % dist.world) == dist.rank]
        jobs.sort(key=lambda j: (j[0].file, j[0].offset, j[1]))   # each file front to back

        def write(writer: Writer) -> None:
            for e, at, view in jobs:
                writer.write(e, at, view, nan_only=e.name in whole)
            # what was read from the mapped pages is what was checked: the extents again after the write
            verify_map(fmap, "checked again after the export read it")

        return save_files(out_dir, plans, what, write, dtype, dist=dist, check=check,
                          release=fmap.release if fmap is not None else None)


def save_pretrained(engine, out_dir, *, dtype: torch.dtype | None = None,
                    max_shard_size: int | str = "5GB", check: bool = True) -> list[Path]:
    """``save_weights`` plus a Hugging Face model's config (and generation config), for ``from_pretrained``."""
    c = _components(engine, "save_pretrained")
    module, dist = unwrapped(c.module), c.dist   # (a torch.compile'd model: the class from_pretrained builds)
    config = getattr(module, "config", None)
    hf = False
    if is_hf_model(module):   # (a subclass of a transformers model too; transformers is not imported otherwise)
        from transformers import PretrainedConfig
        hf = isinstance(config, PretrainedConfig)
    paths = _save_weights(engine, out_dir, dtype, max_shard_size, check, "save_pretrained", config=hf)
    if not hf:
        return paths

    def write_configs() -> None:
        tokenizer = tokenizer_files(module)   # a model.pretrained folder's, carried as its generation config
        files.refuse_links(*(Path(out_dir) / n for n in ("config.json", "generation_config.json", *tokenizer)))
        # As transformers' own save_pretrained: the config names the dtype actually written (from_pretrained
        # casts to it, so a source config's bfloat16 would round fp32 trained values) and the class.
        written = copy.deepcopy(config)
        written.dtype = dtype if dtype is not None else engine.components.policy.master_dtype
        written.architectures = [type(module).__name__]
        written.save_pretrained(out_dir)
        gen = getattr(module, "generation_config", None)
        if gen is not None and type(gen).__name__ == "GenerationConfig":
            gen.save_pretrained(out_dir)
        write_tokenizer_files(Path(out_dir), tokenizer)   # (and an earlier save's it does not carry removed)

    # Agreed: every rank returns once the folder is complete, or all raise (not rank 0 alone).
    agree(dist, write_configs if dist.is_main else (lambda: None), "save_pretrained: config files")
    return paths + [Path(out_dir) / "config.json"]


def save_on_model_save(engine, out_dir, check: bool = True) -> list[Path] | None:
    """``save_pretrained`` of the working-dtype weights where ``stage3_gather_16bit_weights_on_model_save`` is set.
    Collective on the default group: call it from the training thread."""
    c = engine.components
    return save_pretrained(engine, out_dir, dtype=c.policy.param_dtype, check=check) if c.stage.weights_on_save() \
        else None
