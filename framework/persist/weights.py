"""Consolidated weights in and out of an engine, tensor by tensor, without any rank holding the model.

    framework.load_weights(engine, "path/to/folder")          # model.safetensors, an index, or a torch file
    framework.save_weights(engine, "out/", dtype=torch.bfloat16, max_shard_size="2GB")
    engine.save_pretrained("out/")                            # + config.json for a Hugging Face model

Loading: each rank reads, for each of its master pieces (``stage.piece_specs()``), only the
element ranges the piece holds (safetensors ``get_slice``; a torch state dict is memory-mapped),
writes them into the fp32 masters (zero3: its parameter shards too, through the stage's publish)
and the stage rebuilds the working parameters exactly as after an optimizer step. Under zero1/2
the working parameters are whole on every rank by design; under zero3 no rank ever holds more
than its shards plus one parameter range. Everything is checked before anything is written.

Saving: the output is ordinary safetensors (one file, or shards plus
``model.safetensors.index.json``), under the module's parameter names, tied weights once (the
first name in module order). Every rank writes the ranges its master pieces hold straight into
the output files at their byte offsets (``os.pwrite``), converted to the output dtype in chunks:
no collective moves parameter bytes, no rank assembles even one whole tensor, and peak memory per
rank is one chunk. Rank 0 lays out the files (the headers only need global shapes, which every
rank knows) before anyone writes. Why not gather each tensor to rank 0: that sends the whole
model through one rank's link and memory and serialises the writes; the price of writing in
place is that every rank must see ``out_dir`` (a shared filesystem across nodes, as for the
checkpoint folders DCP writes).
"""
from __future__ import annotations

import contextlib
import json
import os
import pickle
import re
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch import nn

from framework.core import files
from framework.comm.distributed import agree
from framework.core.errors import ConfigError, FrameworkError
from framework.core.units import MiB
from framework.offload import verify_map
from framework.stages import cover

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# Elements converted and written per call: bounds the memory a save needs beyond the model states.
WRITE_CHUNK = 4 * MiB

# safetensors dtype names (the format's spec) <-> torch dtypes.
_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool}
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}


# ============================================================================ sources ====


class WeightsSource:
    """Tensors by name, read by flat element range. ``bytes_read`` counts the bytes handed out
    (what the reads asked the file for), so tests can check a rank read only its ranges."""

    def __init__(self, where: str):
        self.where = where
        self.bytes_read = 0

    def keys(self) -> list[str]:
        raise NotImplementedError

    def shape(self, name: str) -> tuple[int, ...]:
        raise NotImplementedError

    def dtype(self, name: str) -> torch.dtype:
        raise NotImplementedError

    def read(self, name: str, lo: int, hi: int) -> torch.Tensor:
        """Elements [lo, hi) of the flattened tensor ``name``: a 1-D host tensor in its stored dtype."""
        out = self._read(name, lo, hi)
        self.bytes_read += out.numel() * out.element_size()
        return out

    def _read(self, name: str, lo: int, hi: int) -> torch.Tensor:
        raise NotImplementedError

    def close(self) -> None:
        pass

    def __enter__(self) -> "WeightsSource":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class SafetensorsSource(WeightsSource):
    """One ``.safetensors`` file or the shards an index names. ``safe_open`` checks each file and
    lists its tensors; values are then read with positioned reads of exactly the requested bytes
    (a flat range of a row-major tensor is one byte range), never through a map of the file: a
    map's touched pages would stay in this process's resident set until the file is closed, so
    loading a model larger than memory would not be bounded by one range."""

    def __init__(self, paths: Sequence[Path], where: str, weight_map: dict[str, Path] | None = None):
        """``paths``: the files; ``weight_map`` (an index's): which file holds each name."""
        super().__init__(where)
        from safetensors import safe_open  # the hf extra

        self._fds: list[int] = []
        self._info: dict[str, tuple[tuple[int, ...], str, int, int]] = {}   # name -> shape, dtype, fd, offset
        try:
            for path in paths:
                try:
                    fd = os.open(path, os.O_RDONLY)   # (a hub cache's files are links: followed)
                    self._fds.append(fd)
                    # checked through this descriptor: the file read below is the file checked
                    with safe_open(f"/proc/self/fd/{fd}", framework="pt", device="cpu") as h:
                        names = [n for n in h.keys() if weight_map is None or weight_map.get(n) == path]
                        meta = {n: (tuple(h.get_slice(n).get_shape()), h.get_slice(n).get_dtype()) for n in names}
                    header, data = _safetensors_header(fd)
                except ConfigError:
                    raise
                except Exception as e:  # noqa: BLE001 - the library raises its own types for bad files
                    raise ConfigError(f"load_weights: cannot read {path}: {e}") from None
                for n, (shape, dt) in meta.items():
                    self._info[n] = (shape, dt, fd, data + int(header[n]["data_offsets"][0]))
            missing = sorted(set(weight_map or ()) - set(self._info))
            if missing:
                raise ConfigError(f"load_weights: {where} names {len(missing)} tensor(s) that are not in their "
                                  f"files: {_short(missing)}")
        except BaseException:
            self.close()
            raise

    def keys(self) -> list[str]:
        return list(self._info)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._info[name][0]

    def dtype(self, name: str) -> torch.dtype:
        d = self._info[name][1]
        if d not in _ST_DTYPES:
            raise ConfigError(f"load_weights: tensor {name!r} has dtype {d}, which this loader does not read")
        return _ST_DTYPES[d]

    def _read(self, name: str, lo: int, hi: int) -> torch.Tensor:
        _, _, fd, offset = self._info[name]
        dtype = self.dtype(name)
        size = _itemsize(dtype)
        out = torch.empty(max(hi - lo, 0), dtype=dtype)
        if not out.numel():
            return out
        view = memoryview(out.view(torch.uint8).numpy())
        pos, want = 0, len(view)
        while pos < want:
            n = os.preadv(fd, [view[pos:]], offset + lo * size + pos)
            if n <= 0:
                raise ConfigError(f"load_weights: {self.where}: tensor {name!r} ends before its stated size "
                                  f"(a truncated file)")
            pos += n
        return out

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()
        self._info.clear()


def _safetensors_header(fd: int) -> tuple[dict, int]:
    """(header, offset of the data) of the safetensors file open as ``fd`` (``safe_open`` has
    checked it: an 8-byte little-endian length, that many bytes of JSON, then the data)."""
    (n,) = struct.unpack("<Q", os.pread(fd, 8, 0))
    return json.loads(os.pread(fd, n, 8)), 8 + n


class StateDictSource(WeightsSource):
    """A torch state-dict file, loaded with ``weights_only=True`` (a pickle that would run code is
    refused) and memory-mapped where the file format allows, so reads touch only their ranges."""

    def __init__(self, path: Path):
        super().__init__(str(path))
        try:
            try:
                sd = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as e:
                if "mmap" not in str(e):  # legacy (non-zip) files cannot be mapped: read them whole
                    raise
                sd = torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ConfigError(f"load_weights: refused {path}: it is not a plain tensor state dict (loaded with "
                              f"weights_only=True, nothing in it ran): {first}") from None
        except (RuntimeError, OSError, EOFError) as e:
            raise ConfigError(f"load_weights: cannot read {path} as a torch state dict: "
                              f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
        bad = [k for k, v in sd.items() if not isinstance(v, torch.Tensor)] if isinstance(sd, dict) else None
        if bad is None or bad:
            what = type(sd).__name__ if bad is None else f"non-tensor entries {_short(bad)}"
            raise ConfigError(f"load_weights: {path} holds {what}; expected a flat {{name: tensor}} state dict "
                              f"(e.g. model.state_dict())")
        self._sd = sd

    def keys(self) -> list[str]:
        return list(self._sd)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._sd[name].shape)

    def dtype(self, name: str) -> torch.dtype:
        return self._sd[name].dtype

    def _read(self, name: str, lo: int, hi: int) -> torch.Tensor:
        t = self._sd[name]
        flat = t.reshape(-1) if t.is_contiguous() else t.contiguous().reshape(-1)
        return flat[lo:hi]

    def close(self) -> None:
        self._sd = {}


def open_weights(source: str | os.PathLike) -> WeightsSource:
    """A reader for ``source``: a ``.safetensors`` file, a ``model.safetensors.index.json`` (or a
    folder holding it, or ``model.safetensors``, or ``pytorch_model.bin``), or a torch state-dict file."""
    path = Path(source)
    if path.is_dir():
        for name in (INDEX, SINGLE, "pytorch_model.bin"):
            if (path / name).is_file():
                return open_weights(path / name)
        raise ConfigError(f"load_weights: {path} holds none of {INDEX}, {SINGLE}, pytorch_model.bin")
    if not path.is_file():
        raise ConfigError(f"load_weights: {path} does not exist")
    if path.name.endswith(".index.json"):
        try:
            weight_map = json.loads(path.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"load_weights: {path} is not a safetensors index ({e})") from None
        files = {name: path.parent / f for name, f in weight_map.items()}
        absent = sorted({str(f) for f in files.values() if not f.is_file()})
        if absent:
            raise ConfigError(f"load_weights: {path} names shard(s) that do not exist: {_short(absent)}")
        return SafetensorsSource(list(dict.fromkeys(files.values())), str(path), files)
    if path.suffix == ".safetensors":
        return SafetensorsSource([path], str(path))
    return StateDictSource(path)


# ============================================================================ the model's names ====


@dataclass(frozen=True)
class Target:
    """One tensor of the model as the files name it: a parameter (tied ones once, under every
    name it is registered under) or a persistent buffer."""

    name: str                    # the first name in module order: what save_weights writes
    aliases: tuple[str, ...]     # every name it is registered under (name first)
    shape: tuple[int, ...]       # global shape (a zero3 parameter's logical shape)
    dtype: torch.dtype           # the values' dtype as trained (master dtype for staged parameters)
    tensor: torch.Tensor | None  # a whole tensor every rank holds (buffers, unstaged parameters); else None


def targets(module: nn.Module, staged: dict[str, tuple[int, ...]], master_dtype: torch.dtype) -> list[Target]:
    """The model's tensors in module order: parameters (``staged``: names the stage holds in its
    master pieces, with global shapes) then persistent buffers."""
    names: dict[int, list[str]] = {}
    params: dict[int, nn.Parameter] = {}
    for n, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
        params[id(p)] = p
    out = []
    for pid, aliases in names.items():
        first, p = aliases[0], params[pid]
        if first in staged:
            out.append(Target(first, tuple(aliases), tuple(staged[first]), master_dtype, None))
        else:  # a frozen parameter outside the stage's layout: whole on every rank
            out.append(Target(first, tuple(aliases), tuple(p.shape), p.dtype, p))
    seen: set[int] = set()
    for mod_name, sub in module.named_modules():
        for b_name, buf in sub.named_buffers(recurse=False):
            if buf is None or b_name in sub._non_persistent_buffers_set or id(buf) in seen:
                continue
            seen.add(id(buf))
            full = f"{mod_name}.{b_name}" if mod_name else b_name
            out.append(Target(full, (full,), tuple(buf.shape), buf.dtype, buf))
    return out


def _staged(specs, dist) -> dict[str, tuple[int, ...]]:
    """Every parameter the stage holds in master pieces on any rank, with its global shape (a
    rank's own pieces may hold only some of them). Collective."""
    mine = {s.name: tuple(s.shape) for spec in specs for s in spec.spans}
    out: dict[str, tuple[int, ...]] = {}
    for names in dist.all_gather_object(mine, what="weights: parameter names gather"):
        out.update(names)
    return out


# ============================================================================ load ====


def load_weights(engine, source, *, strict: bool = True) -> None:
    """Load consolidated weights into ``engine``'s model: master parameters (fp32), working
    parameters and zero3 shards, buffers too. Collective: every rank calls it.

    ``source``: a path (see ``open_weights``) or an open ``WeightsSource``. Each rank reads only
    the element ranges of its own master pieces. Tied parameters take any one of their names.
    Values are converted to each target's dtype (floating to floating, integer to integer).
    Missing and unexpected names (only with ``strict``), shape and dtype-kind mismatches are
    reported together in one ``ConfigError`` before anything is written. The optimizer state is
    left as it is: load before training."""
    c = engine.components
    specs = c.stage.piece_specs()
    # offload=nvme: the swapped masters are written where they lie, in the mapped swap file
    with engine.mapped_state(engine.state, write=True) as view:
        masters = list(view.state.params)
        master_dtype = masters[0].dtype if masters else torch.float32
        tgts = targets(c.module, _staged(specs, c.dist), master_dtype)

        def load() -> None:
            src = source if isinstance(source, WeightsSource) else open_weights(source)
            try:
                _load(src, strict, specs, masters, tgts, view.fmap.release if view.fmap is not None else None)
            finally:
                if src is not source:
                    src.close()

        _agree(c.dist, load, "load_weights")   # a rank that cannot read its ranges stops every rank
    engine.sync_working(engine.state)   # collective: zero1/2 gather the partitions, zero3 refreshes its shards


def _load(src: WeightsSource, strict: bool, specs, masters: list[torch.Tensor], tgts: list[Target],
          release: Callable[[torch.Tensor], None] | None = None) -> None:
    """``release(t)``: called with each master range once written (a mapped swap file's pages
    leave the process range by range)."""
    available = set(src.keys())
    chosen: dict[str, str] = {}        # target name -> source key
    missing, mismatched = [], []
    for t in tgts:
        key = next((a for a in t.aliases if a in available), None)
        if key is None:
            missing.append(t.name if len(t.aliases) == 1 else f"{t.name} (or {', '.join(t.aliases[1:])})")
            continue
        chosen[t.name] = key
        if src.shape(key) != t.shape:
            mismatched.append(f"{key}: {src.shape(key)} in the file, {t.shape} in the model")
        elif src.dtype(key).is_floating_point != t.dtype.is_floating_point or \
                (src.dtype(key) == torch.bool) != (t.dtype == torch.bool):
            mismatched.append(f"{key}: dtype {_dt(src.dtype(key))} in the file, {_dt(t.dtype)} in the model")
    known = {a for t in tgts for a in t.aliases}
    unexpected = sorted(available - known)
    problems = []
    if strict and missing:
        problems.append(f"missing {len(missing)}: {_short(missing)}")
    if strict and unexpected:
        problems.append(f"unexpected {len(unexpected)}: {_short(unexpected)}")
    if mismatched:
        problems.append(f"mismatched {len(mismatched)}: {_short(mismatched)}")
    if problems:
        raise ConfigError(f"load_weights: {src.where} does not fit this model: " + "; ".join(problems)
                          + ("" if strict or not mismatched else " (strict=False skips only missing/unexpected)"))
    # Masters: only the ranges this rank's pieces hold.
    for master, spec in zip(masters, specs):
        flat = master.view(-1)
        for span in spec.spans:
            key = chosen.get(span.name)
            if key is None:  # strict=False and absent: keeps its values
                continue
            a, b = span.piece
            flat[a:b].copy_(src.read(key, *span.param).to(flat.dtype))
            if release is not None:
                release(flat[a:b])
    # Whole tensors every rank holds (buffers, frozen parameters outside the stage's layout).
    with torch.no_grad():
        for t in tgts:
            if t.tensor is not None and t.name in chosen:
                values = src.read(chosen[t.name], 0, t.tensor.numel()).to(t.tensor.dtype)
                t.tensor.copy_(values.view(t.tensor.shape))


# ============================================================================ safetensors files ====


def parse_size(size: int | str) -> int:
    """Bytes from ``5GB``, ``500MB``, ``1.5GiB`` or an integer (Hugging Face's convention:
    KB/MB/GB are powers of 1000, KiB/MiB/GiB of 1024)."""
    if isinstance(size, int) and not isinstance(size, bool):
        n = size
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", str(size), re.IGNORECASE)
        if not m:
            raise ConfigError(f"max_shard_size={size!r}: expected bytes as an integer or like '5GB', '500MB', '2GiB'")
        unit = (m.group(2) or "B").upper()
        base = 1024 if "I" in unit else 1000
        n = int(float(m.group(1)) * base ** "BKMGT".index(unit[0]))
    if n < 1:
        raise ConfigError(f"max_shard_size={size!r} must be at least 1 byte")
    return n


@dataclass(frozen=True)
class Entry:
    """One tensor of an output file: where its bytes go."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    file: str
    offset: int      # byte offset of its data in the file (header included)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * _itemsize(self.dtype)


@dataclass(frozen=True)
class FilePlan:
    name: str
    header: bytes    # length prefix + JSON header (padded to 8 bytes)
    size: int        # total file size
    entries: tuple[Entry, ...]


def plan_files(tensors: Sequence[tuple[str, tuple[int, ...], torch.dtype]],
               max_shard_size: int | str) -> list[FilePlan]:
    """Split ``tensors`` (name, shape, dtype; in order) into safetensors files of at most
    ``max_shard_size`` bytes each (a larger tensor gets a file of its own) and lay out each file.
    Pure arithmetic: every rank computes the same plan."""
    limit = parse_size(max_shard_size)
    groups: list[list] = [[]]
    used = 0
    for name, shape, dtype in tensors:
        nbytes = _numel(shape) * _itemsize(dtype)
        if groups[-1] and used + nbytes > limit:
            groups.append([])
            used = 0
        groups[-1].append((name, tuple(shape), dtype))
        used += nbytes
    n = len(groups)
    plans = []
    for i, group in enumerate(groups):
        fname = SINGLE if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        meta, pos = {"__metadata__": {"format": "pt"}}, 0
        for name, shape, dtype in group:
            nbytes = _numel(shape) * _itemsize(dtype)
            meta[name] = {"dtype": _ST_NAMES[dtype], "shape": list(shape), "data_offsets": [pos, pos + nbytes]}
            pos += nbytes
        body = json.dumps(meta, separators=(",", ":")).encode()
        body += b" " * (-len(body) % 8)   # data starts 8-byte aligned
        header = struct.pack("<Q", len(body)) + body
        entries = tuple(Entry(name, shape, dtype, fname, len(header) + meta[name]["data_offsets"][0])
                        for name, shape, dtype in group)
        plans.append(FilePlan(fname, header, len(header) + pos, entries))
    return plans


def create_files(out_dir: Path, plans: Sequence[FilePlan]) -> None:
    """Create each planned file as ``<name>.tmp`` at its final size with its header written
    (data left as a hole the writers fill), after removing outputs of an earlier save there."""
    files.make_dirs(out_dir)
    for old in out_dir.iterdir():
        if old.name == INDEX or re.fullmatch(r"model(-\d{5}-of-\d{5})?\.safetensors(\.tmp)?", old.name):
            old.unlink()   # a link is removed, never followed
    for plan in plans:
        with os.fdopen(files.create_new(out_dir / (plan.name + ".tmp")), "wb") as f:
            f.write(plan.header)
            f.truncate(plan.size)


def write_at(fd: int, offset: int, values: torch.Tensor) -> None:
    """The bytes of the contiguous host tensor ``values`` -> the file at ``offset``."""
    view = memoryview(values.view(torch.uint8).numpy())
    while len(view):
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def finish_files(out_dir: Path, plans: Sequence[FilePlan]) -> list[Path]:
    """Flush and rename the ``.tmp`` files, then write the index when there are several files."""
    paths = []
    for plan in plans:
        tmp = out_dir / (plan.name + ".tmp")
        fd = files.open_nofollow(tmp, os.O_RDWR)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, out_dir / plan.name)
        paths.append(out_dir / plan.name)
    if len(plans) > 1:
        index = {"metadata": {"total_size": sum(e.nbytes for p in plans for e in p.entries)},
                 "weight_map": {e.name: p.name for p in plans for e in p.entries}}
        files.write_atomic(out_dir / INDEX, (json.dumps(index, indent=2) + "\n").encode())
        paths.append(out_dir / INDEX)
    return paths


# ============================================================================ save ====


def save_weights(engine, out_dir, *, dtype: torch.dtype | None = None,
                 max_shard_size: int | str = "5GB") -> list[Path]:
    """Write the model's weights to ``out_dir`` as consolidated safetensors (``model.safetensors``,
    or ``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json`` beyond
    ``max_shard_size``), under the module's parameter names (tied weights once) and persistent
    buffers. Values come from the masters, converted to ``dtype`` (default: the master dtype,
    fp32: the exact trained values; a 16-bit dtype gives the working parameters bit for bit).
    Collective; every rank writes its own ranges in place (see the module docstring), so every
    rank must see ``out_dir``. Returns the written paths (on every rank)."""
    c = engine.components
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise ConfigError(f"save_weights: dtype={dtype!r} must be a floating torch dtype (torch.bfloat16, ...)")
    with contextlib.ExitStack() as stack:   # offload=nvme: read from the mapped swap file, checked
        views = []
        _agree(c.dist, lambda: views.append(stack.enter_context(engine.mapped_state(engine.state))),
               "save_weights: swap file check")
        # what was read from the mapped pages is what was checked: the extents again after the write
        recheck = lambda: verify_map(views[0].fmap, "checked again after the export read it")  # noqa: E731
        release = views[0].fmap.release if views[0].fmap is not None else None
        return _save_weights(engine, list(views[0].state.params), Path(out_dir), dtype, max_shard_size, recheck,
                             release)


def _save_weights(engine, masters: list[torch.Tensor], out_dir: Path, dtype: torch.dtype | None,
                  max_shard_size: int | str, recheck=lambda: None, release=None) -> list[Path]:
    c = engine.components
    dist = c.dist
    specs = c.stage.piece_specs()
    master_dtype = masters[0].dtype if masters else torch.float32
    tgts = targets(c.module, _staged(specs, c.dist), master_dtype)

    def out_dtype(t: Target) -> torch.dtype:
        return dtype if dtype is not None and t.dtype.is_floating_point else t.dtype

    plans = plan_files([(t.name, t.shape, out_dtype(t)) for t in tgts], max_shard_size)
    # What this rank holds: per name, (lo, hi) ranges of the flattened tensor and where they are.
    held: dict[str, list[tuple[int, int, torch.Tensor]]] = {}
    for master, spec in zip(masters, specs):
        flat = master.view(-1)
        for span in spec.spans:
            (lo, hi), (a, b) = span.param, span.piece
            held.setdefault(span.name, []).append((lo, hi, flat[a:b]))
    for t in tgts:
        if t.tensor is not None:
            held[t.name] = [(0, t.tensor.numel(), t.tensor.detach().reshape(-1))]
    ranges = dist.all_gather_object({n: [(lo, hi) for lo, hi, _ in v] for n, v in held.items()},
                                    what="save_weights: ranges gather")
    order = {t.name: i for i, t in enumerate(tgts)}
    jobs = []   # (file name, file offset, source view) of what this rank writes
    for plan in plans:
        for e in plan.entries:
            parts = _writers(e, ranges, order[e.name], dist.world)
            for rank, a, b in parts:
                if rank != dist.rank:
                    continue
                for lo, hi, view in held[e.name]:
                    x, y = max(a, lo), min(b, hi)
                    if x < y:
                        jobs.append((plan.name, e.offset + x * _itemsize(e.dtype), view[x - lo:y - lo], e.dtype))
    _agree(dist, lambda: create_files(out_dir, plans) if dist.is_main else None, "save_weights: create files")
    _agree(dist, lambda: (_write_jobs(out_dir, jobs, release), recheck()), "save_weights: write")
    paths = [out_dir / p.name for p in plans] + ([out_dir / INDEX] if len(plans) > 1 else [])
    _agree(dist, lambda: finish_files(out_dir, plans) if dist.is_main else None, "save_weights: finish files")
    return paths


def _writers(e: Entry, ranges: list[dict], index: int, world: int) -> list[tuple[int, int, int]]:
    """Which rank writes which elements of ``e``: (rank, lo, hi) tiling [0, numel). Each element
    once; where several ranks hold it (replicated stages, buffers) the tensors are spread over the
    ranks, starting with rank ``index % world``. Every rank computes the same answer."""
    ranks = [(index + k) % world for k in range(world)]
    flat = [(r, lo, hi) for r in ranks for lo, hi in ranges[r].get(e.name, [])]
    try:
        parts = cover(0, e.numel, [(lo, hi) for _, lo, hi in flat])
    except LookupError as err:
        raise FrameworkError(f"save_weights: {e.name!r}: {err} of any rank") from None
    return [(flat[i][0], a, b) for i, a, b in parts]


def _write_jobs(out_dir: Path, jobs: list, release: Callable[[torch.Tensor], None] | None = None) -> None:
    """Write each job's view at its offset; ``release(view)`` after each (a mapped swap file's pages
    leave the process as they are written)."""
    fds: dict[str, int] = {}
    try:
        for fname, offset, view, dtype in jobs:
            if fname not in fds:
                fds[fname] = files.open_nofollow(out_dir / (fname + ".tmp"), os.O_WRONLY)
            step = _itemsize(dtype)
            for s in range(0, view.numel(), WRITE_CHUNK):
                chunk = view[s:s + WRITE_CHUNK].to(dtype)   # convert where the values are, then move
                write_at(fds[fname], offset + s * step, chunk.to("cpu").contiguous())
                if release is not None:
                    release(view[s:s + WRITE_CHUNK])
        for fd in fds.values():
            os.fsync(fd)
    finally:
        for fd in fds.values():
            os.close(fd)


def _agree(dist, fn: Callable[[], object], what: str) -> None:
    """``fn`` on every rank, its outcome agreed on over ``dist`` (``framework.comm.distributed.agree``)."""
    agree(lambda obj: dist.all_gather_object(obj, what=what), dist.rank, fn, what)


def save_pretrained(engine, out_dir, *, dtype: torch.dtype | None = None,
                    max_shard_size: int | str = "5GB") -> list[Path]:
    """``save_weights`` plus, for a Hugging Face model, its ``config.json`` (and generation
    config), so ``AutoModelForCausalLM.from_pretrained(out_dir)`` loads it. Collective."""
    paths = save_weights(engine, out_dir, dtype=dtype, max_shard_size=max_shard_size)
    module = engine.components.module
    config = _hf_config(module)
    if config is not None and engine.components.dist.is_main:
        files.refuse_links(*(Path(out_dir) / n for n in ("config.json", "generation_config.json")))   # HF opens by path
        config.save_pretrained(out_dir)
        paths.append(Path(out_dir) / "config.json")
        gen = getattr(module, "generation_config", None)
        if gen is not None and type(gen).__name__ == "GenerationConfig":
            gen.save_pretrained(out_dir)
    return paths


def _hf_config(module: nn.Module):
    """The module's Hugging Face config, if it is a transformers model (transformers is only
    imported when it is installed and the model comes from it)."""
    if not type(module).__module__.startswith("transformers."):
        return None
    from transformers import PretrainedConfig
    config = getattr(module, "config", None)
    return config if isinstance(config, PretrainedConfig) else None


def save_on_model_save(engine, out_dir) -> list[Path] | None:
    """What a save does for ``stage.stage3_gather_16bit_weights_on_model_save`` (DeepSpeed's key):
    when set, the working-dtype weights (16-bit under bf16/fp16 precision) go to ``out_dir`` as
    consolidated safetensors, each rank writing its own ranges (with config.json for a Hugging Face
    model); otherwise nothing. Collective on the default group: call it from the training thread
    (e.g. in a checkpoint save, before handing the rest to an asynchronous writer), never from a
    background thread."""
    c = engine.components
    if not c.stage.weights_on_save():
        return None
    # A Hugging Face model also gets its config.json: the folder loads with from_pretrained.
    return save_pretrained(engine, out_dir, dtype=c.policy.param_dtype)


# ============================================================================ helpers ====


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _short(items: Sequence[str], n: int = 20) -> str:
    shown = ", ".join(items[:n])
    return shown + (f" and {len(items) - n} more" if len(items) > n else "")


if sys.byteorder != "little":  # safetensors stores little-endian bytes; tensors are written as they lie
    raise ImportError("framework.persist.weights writes safetensors from memory as is: it needs a little-endian host")
