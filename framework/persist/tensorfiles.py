"""Safetensors files and weight sources: tensors read by flat element range; output files laid out
before anyone writes, then written in place at byte offsets (by ``weights`` and ``export``)."""
from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import pickle
import re
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from framework.comm.distributed import agree
from framework.core import files, units
from framework.core.errors import ConfigError, FrameworkError, first_line
from framework.core.paths import WEIGHTS_INDEX as INDEX, WEIGHTS_READ, WEIGHTS_SINGLE as SINGLE, weights_file
from framework.core.room import FULL, free_bytes, free_note
from framework.core.units import MiB, size
from framework.core.utils import counted, dtype_name, few, ignoring
from framework.persist import stepfolders

# Elements converted and written per call: bounds the memory a save needs beyond the model states.
WRITE_CHUNK = 4 * MiB

# safetensors dtype names (the format's spec) <-> torch dtypes.
_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool}
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}


class WeightsSource(contextlib.AbstractContextManager):
    """Tensors by name (``meta``: name -> (shape, dtype or its unread name)) from ``tensors`` or the safetensors
    ``paths`` (``weight_map``: an index's file of each), read by flat element range with a positioned read, never a
    map: a map's touched pages stay resident, so a model larger than memory would not load."""

    def __init__(self, where: str, tensors: dict[str, torch.Tensor] | None = None, paths: Sequence[Path] = (),
                 weight_map: dict[str, Path] | None = None):
        self.where, self.bytes_read = where, 0
        self._tensors = tensors or {}
        self.meta: dict[str, tuple[tuple[int, ...], torch.dtype | str]] = {
            k: (tuple(v.shape), v.dtype) for k, v in self._tensors.items()}
        self._fds: list[int] = []
        self._at: dict[str, tuple[int, int]] = {}   # name -> fd, offset of its data in a safetensors file
        if paths or weight_map is not None:
            from safetensors import safe_open  # the hf extra
        try:
            for path in paths:
                try:
                    fd = os.open(path, os.O_RDONLY)   # (a hub cache's files are links: followed)
                    self._fds.append(fd)
                    # the library checks the file through this descriptor: the file read below is the file checked
                    with safe_open(f"/proc/self/fd/{fd}", framework="pt", device="cpu"):
                        pass
                    # an 8-byte little-endian length, that many bytes of JSON header, then the data
                    (size,) = struct.unpack("<Q", os.pread(fd, 8, 0))
                    header = json.loads(os.pread(fd, size, 8))
                except Exception as e:  # noqa: BLE001 - the library raises its own types for bad files
                    raise ConfigError(f"load_weights: cannot read {path}: {e}") from None
                for name, m in header.items():
                    if name != "__metadata__" and (weight_map is None or weight_map.get(name) == path):
                        self.meta[name] = (tuple(m["shape"]), _ST_DTYPES.get(m["dtype"], m["dtype"]))
                        self._at[name] = (fd, 8 + size + int(m["data_offsets"][0]))
            missing = sorted(set(weight_map or ()) - set(self.meta))
            if missing:
                raise ConfigError(f"load_weights: {self.where} names {counted(len(missing), 'tensor')} that "
                                  f"{'is' if len(missing) == 1 else 'are'} not in their files: {few(missing, 20, str)}")
        except BaseException:
            self.close()
            raise

    def dtype(self, name: str) -> torch.dtype:
        d = self.meta[name][1]
        if isinstance(d, str):
            raise ConfigError(f"load_weights: tensor {name!r} has dtype {d}, which this loader does not read")
        return d

    def read(self, name: str, lo: int, hi: int) -> torch.Tensor:
        """Elements [lo, hi) of the flattened tensor ``name``: a 1-D host tensor in its stored dtype."""
        if name in self._at:
            fd, offset = self._at[name]
            dtype = self.dtype(name)
            out = torch.empty(max(hi - lo, 0), dtype=dtype, device="cpu")   # file reads land in host memory
            if files.read_into(fd, out, offset + lo * dtype.itemsize) is not None:
                raise ConfigError(f"load_weights: {self.where}: tensor {name!r} ends before its stated size "
                                  f"(a truncated file)")
        else:
            out = self._tensors[name].reshape(-1)[lo:hi]
        self.bytes_read += out.numel() * out.element_size()
        return out

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()
        self._at.clear()
        self.meta.clear()
        self._tensors = {}

    def __exit__(self, *exc) -> None:
        self.close()


def _torch_file(path: Path) -> dict[str, torch.Tensor]:
    """A torch state-dict file, loaded ``weights_only`` (nothing in it runs), memory-mapped where the format allows
    (reads touch only their ranges). Another format's bytes, read as pickle, raise bare errors too."""
    try:   # (torch 2.11 warns on rebuilding a sparse tensor, refused below: noise above the refusal)
        with ignoring("Sparse invariant checks are implicitly disabled"):
            try:
                sd = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as e:
                if "mmap" not in str(e):  # legacy (non-zip) files cannot be mapped: read them whole
                    raise
                sd = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, LookupError, ValueError, TypeError, struct.error) as e:
        if "GLOBAL" not in (why := _unpickle_reason(e)):
            raise ConfigError(f"load_weights: cannot read {path}: not a torch state-dict file (corrupt or another "
                              f"format; torch says: {why or first_line(e)})") from None
        raise ConfigError(f"load_weights: refused {path}: it holds objects other than tensors (torch says: {why}; "
                          f"read with weights_only=True, so nothing in it ran); if you trust the file, load it "
                          f"yourself and save its flat {{name: tensor}} state dict (e.g. obj['model'])") from None
    except (RuntimeError, OSError, EOFError) as e:
        raise ConfigError(f"load_weights: cannot read {path} as a torch state dict: {first_line(e)}") from None
    bad = [k for k, v in sd.items() if not isinstance(v, torch.Tensor)] if isinstance(sd, dict) else None
    if bad is None or bad:
        what = type(sd).__name__ if bad is None else f"non-tensor entries {few(bad, 20, str)}"
        raise ConfigError(f"load_weights: {path} holds {what}; expected a flat {{name: tensor}} state dict "
                          f"(e.g. model.state_dict())")
    # (the reads below reshape and check values: a tensor without dense values fails there, after the load began)
    for name, t in sd.items():
        if t.is_meta or t.is_nested or t.layout != torch.strided:
            kind = "on the meta device" if t.is_meta else "nested" if t.is_nested else str(t.layout)[len("torch."):]
            raise ConfigError(f"load_weights: {path}: tensor {name!r} is {kind}, not dense weights; save a dense "
                              f"tensor in its place (t.to_dense() of a sparse one; a materialized model's, not meta)")
    return sd


def _unpickle_reason(error: BaseException) -> str:
    """torch's reason for a ``weights_only`` refusal, first sentence, without its colour codes or its advice (which
    offers the unsafe ``weights_only=False``); a bare error, named."""
    said = str(error) if isinstance(error, pickle.UnpicklingError) else f"{type(error).__name__}: {error}"
    advice = ("Weights only load failed", "(1)", "(2)", "Please file an issue", "Check the documentation")
    lines = (re.sub(r"\x1b\[[0-9;]*m", "", ln).strip().removeprefix("WeightsUnpickler error:").strip()
             for ln in said.splitlines())
    return re.split(r"\.(?:\s|$)", next((ln for ln in lines if ln and not ln.startswith(advice)), ""))[0]


def open_weights(source: str | os.PathLike) -> WeightsSource:
    """A reader for a ``.safetensors`` file, an index, a torch state-dict file, or a folder holding one."""
    path = Path(source)
    if path.is_dir():
        if (found := weights_file(path)) is None:
            raise ConfigError(f"load_weights: {path} holds none of {WEIGHTS_READ}")
        return open_weights(found)
    if not path.is_file():
        raise ConfigError(f"load_weights: {path} does not exist")
    if path.name.endswith(".index.json"):
        try:
            index = files.parse_json(path.read_bytes())
        except ValueError as e:
            raise ConfigError(f"load_weights: {path} is not a safetensors index ({e})") from None
        top = type(index).__name__
        if not isinstance(weight_map := index.get("weight_map") if top == "dict" else None, dict):
            why = "no weight_map object in it" if top == "dict" else f"its top level is a {top}"
            raise ConfigError(f"load_weights: {path} is not a safetensors index ({why})")
        if (odd := next((f for f in weight_map.values() if not isinstance(f, str)), None)) is not None:
            raise ConfigError(f"load_weights: {path} is not a safetensors index (its weight_map maps a tensor to "
                              f"{json.dumps(odd)[:40]}, not a shard's file name)")
        if (out := next((f for f in weight_map.values() if os.path.isabs(f) or ".." in Path(f).parts), None)):
            raise ConfigError(f"load_weights: {path} names a shard outside its folder ({out!r}); an index names its "
                              f"shards by file name in its own folder: put the shards there and name them so")
        if any(not f.endswith(".safetensors") for f in weight_map.values()):
            raise ConfigError(f"load_weights: {path} indexes torch .bin shards, which load_weights does not read "
                              f"sharded; convert the checkpoint to safetensors (transformers' from_pretrained, then "
                              f"save_pretrained) and load that")
        shards = {name: path.parent / f for name, f in weight_map.items()}
        if absent := sorted({str(f) for f in shards.values() if not f.is_file()}):
            raise ConfigError(f"load_weights: {path} names shard(s) that do not exist: {few(absent, 20, str)}")
        return WeightsSource(str(path), paths=list(dict.fromkeys(shards.values())), weight_map=shards)
    if path.suffix == ".safetensors":
        return WeightsSource(str(path), paths=[path])
    return WeightsSource(str(path), _torch_file(path))


def parse_size(size: int | str) -> int:
    """Bytes from ``5GB``, ``1.5GiB`` or an integer (Hugging Face's convention: KB, MB, GB are powers of 1000)."""
    try:
        n = size if isinstance(size, int) and not isinstance(size, bool) else units.parse_size(size)
    except ValueError:
        raise ConfigError(f"max_shard_size={size!r}: expected bytes as an integer or like '5GB', '500MB', '2GiB'") from None
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
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class FilePlan:
    name: str
    header: bytes    # length prefix + JSON header (padded to 8 bytes)
    size: int        # total file size
    entries: tuple[Entry, ...]


def plan_files(tensors: Sequence[tuple[str, tuple[int, ...], torch.dtype]], max_shard_size: int | str,
               as_dtype: torch.dtype | None = None) -> list[FilePlan]:
    """Lay out ``tensors`` ((name, shape, dtype); floating ones as ``as_dtype`` if given) in safetensors files of at
    most ``max_shard_size`` bytes (a larger tensor alone): pure arithmetic, the same on every rank."""
    limit = parse_size(max_shard_size)
    groups: list[list] = [[]]
    used = 0   # (of the last group)
    for name, shape, dtype in tensors:
        dtype = as_dtype if as_dtype is not None and dtype.is_floating_point else dtype
        nbytes = math.prod(shape) * dtype.itemsize
        if groups[-1] and used + nbytes > limit:
            groups.append([])
            used = 0
        groups[-1].append((name, tuple(shape), dtype, used, used + nbytes))   # its data's offsets in the file
        used += nbytes
    n = len(groups)
    plans = []
    for i, group in enumerate(groups):
        fname = SINGLE if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        meta = {"__metadata__": {"format": "pt"}}
        meta.update({name: {"dtype": _ST_NAMES[dt], "shape": list(shape), "data_offsets": [lo, hi]}
                     for name, shape, dt, lo, hi in group})
        body = json.dumps(meta, separators=(",", ":")).encode()
        body += b" " * (-len(body) % 8)   # data starts 8-byte aligned
        header = struct.pack("<Q", len(body)) + body
        entries = tuple(Entry(name, shape, dt, fname, len(header) + lo) for name, shape, dt, lo, _ in group)
        plans.append(FilePlan(fname, header, len(header) + (group[-1][4] if group else 0), entries))
    return plans


def output_dir(out_dir: str | os.PathLike, dtype: torch.dtype | None, what: str) -> Path:
    """``out_dir`` as a Path, once ``dtype`` is one safetensors has. An empty name is refused: Path("") is the
    current directory, where the save would replace a model already there."""
    allowed = [t for t in _ST_NAMES if t.is_floating_point]
    if dtype is not None and dtype not in allowed:
        raise ConfigError(f"{what}: dtype={dtype} cannot be written; use one of {', '.join(str(t) for t in allowed)}")
    if not os.fspath(out_dir).strip():
        raise ConfigError(f"{what}: the output folder is empty ({os.fspath(out_dir)!r}); name a folder")
    path = Path(out_dir)
    if path.suffix.lower() in (".safetensors", ".bin", ".pt", ".pth", ".ckpt"):   # (a folder so named would confuse)
        raise ConfigError(f"{what} takes a folder, not a file name: {os.fspath(out_dir)} ends in {path.suffix}; pass "
                          f"the folder to write model.safetensors (or its shards) into, e.g. {path.parent / path.stem}")
    return path


_OUTPUT = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors")
LOCK = ".save.lock"   # a save's while it writes the folder (no output name: passed over by scans and clean-up)


def is_output(name: str) -> bool:
    """Whether ``name`` is a file a save writes, replaces or removes: ``model[-<i>-of-<n>].safetensors``, the index."""
    return name == INDEX or _OUTPUT.fullmatch(name) is not None


@contextlib.contextmanager
def create_files(out_dir: Path, plans: Sequence[FilePlan], what: str = "save_weights"):
    """While held: each planned file as ``<name>.tmp`` at its final size with its header (the data a hole), the folder
    locked (``LOCK``) against another save; an earlier save's outputs stay until ``finish_files``. Refused: a folder
    in a committed step, one another save writes, a disk without room. On leaving, the ``.tmp`` files and lock go."""
    with _writing(out_dir, plans, what):
        step = stepfolders.committed_step(out_dir)
        if step is not None:
            raise ConfigError(f"{what}: {out_dir} is in the committed checkpoint {step}: writing there would make it "
                              f"differ from its {stepfolders.MANIFEST}; choose a folder outside the checkpoint")
        made = files.make_dirs(out_dir)   # removed again if the save fails (or is interrupted): nothing left
        try:   # (no note where locks are unsupported: a checkpoint's 16-bit copy would say it at every save)
            fd = files.lock(out_dir / LOCK, lambda holder: f"{what}: {out_dir} is being written by another save"
                            f"{holder}: wait for it to end or choose another output folder", None)
        except PermissionError as e:
            if not os.path.lexists(out_dir / LOCK):
                raise
            raise FrameworkError(f"{what}: cannot open {out_dir / LOCK} ({e.strerror}): another user's save holds "
                                 "or left it; remove it only if none of theirs is running, or choose another output "
                                 "folder") from None
        except BaseException:
            files.remove_made(made)
            raise
    done = False
    try:
        with _writing(out_dir, plans, what):
            remove_tmp(out_dir)   # an interrupted save's
            need, free = sum(p.size for p in plans), free_bytes(out_dir)
            if need > free:
                raise OSError(errno.ENOSPC, f"no room: the files need {size(need)} but the file system has "
                                            f"{size(free)} free", str(out_dir))
            for plan in plans:
                with os.fdopen(files.create_new(out_dir / (plan.name + ".tmp")), "wb") as f:
                    f.write(plan.header)
                    f.truncate(plan.size)
        yield
        done = True
    finally:
        remove_tmp(out_dir)
        with contextlib.suppress(OSError):   # (removed while locked: the next save locks a file of its own)
            os.unlink(out_dir / LOCK)
        os.close(fd)
        if not done:
            files.remove_made(made)


def remove_tmp(out_dir: Path) -> None:
    """Remove the ``.tmp`` outputs and a new index not yet renamed (a link is removed, never followed)."""
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):   # (no folder: no files)
        for old in out_dir.iterdir():
            if old.name == INDEX + ".new" or (old.name.endswith(".tmp") and _OUTPUT.fullmatch(old.name[:-4])):
                old.unlink(missing_ok=True)


def finish_files(out_dir: Path, plans: Sequence[FilePlan], what: str = "save_weights") -> list[Path]:
    """Flush and rename the ``.tmp`` files, write the index of several, then remove an earlier save's other outputs."""
    with _writing(out_dir, plans, what):
        for plan in plans:
            with os.fdopen(files.open_nofollow(out_dir / (plan.name + ".tmp"), os.O_RDWR), "rb") as f:
                os.fsync(f)
        # (an error before here leaves the earlier save whole; the renames cannot run out of room)
        if len(plans) > 1:
            index = {"metadata": {"total_size": sum(e.nbytes for p in plans for e in p.entries)},
                     "weight_map": {e.name: p.name for p in plans for e in p.entries}}
            files.write_atomic(out_dir / (INDEX + ".new"), (json.dumps(index, indent=2) + "\n").encode())
        paths = [out_dir / plan.name for plan in plans]
        for plan in plans:
            os.replace(out_dir / (plan.name + ".tmp"), out_dir / plan.name)
        if len(plans) > 1:
            os.replace(out_dir / (INDEX + ".new"), out_dir / INDEX)
            paths.append(out_dir / INDEX)
        for old in out_dir.iterdir():
            if (old.name == INDEX and len(plans) == 1) or (_OUTPUT.fullmatch(old.name) and old not in paths):
                old.unlink()   # a link is removed, never followed
        files.fsync_dir(out_dir)
        return paths


def save_files(out_dir: Path, plans: Sequence[FilePlan], what: str, write, dtype: torch.dtype | None, *,
               dist=None, **writer_options) -> list[Path]:
    """The files of ``plans``, filled by ``write(writer)``, then warnings on what was written; the paths. With ``dist``
    every rank writes its share, rank 0 creates and finishes the files. An earlier save stays whole on a failure."""
    main = dist is None or dist.is_main

    def phase(fn, name: str):
        return fn() if dist is None else agree(dist, fn, f"{what}: {name}")

    def fill() -> tuple[int, list[str]]:
        with Writer(out_dir, plans, what, **writer_options) as writer:
            write(writer)
            return writer.finish()

    # rank 0's .tmp files and lock, removed on leaving (every rank is past its writes: ``agree`` exchanged the outcomes)
    with contextlib.ExitStack() as held:
        phase(lambda: held.enter_context(create_files(out_dir, plans, what)) if main else None, "create files")
        counts = phase(fill, "write")
        phase(lambda: finish_files(out_dir, plans, what) if main else None, "finish files")
    everyone = [counts] if dist is None else dist.all_gather_object(
        counts, what=f"{what}: overflow count, non-finite names")
    overflow, bad = sum(n for n, _ in everyone), {n for _, names in everyone for n in names}
    if main and overflow:
        print(f"warning: {what}: {counted(overflow, 'finite value')} beyond the {dtype_name(dtype)} range (largest "
              f"{torch.finfo(dtype).max:g}) {'was' if overflow == 1 else 'were'} written as inf; save as bf16 or fp32 "
              f"to keep them", file=sys.stderr, flush=True)
    if main and bad:
        print(f"warning: {what}: NaN or inf values in {few(sorted(bad))} were written as they are: the weights hold "
              f"a diverged state (save from a checkpoint before it to get usable ones)", file=sys.stderr, flush=True)
    return [out_dir / p.name for p in plans] + ([out_dir / INDEX] if len(plans) > 1 else [])


class Writer(contextlib.AbstractContextManager):
    """Values into ``create_files``' ``.tmp`` files, converted ``WRITE_CHUNK`` elements at a time where they lie;
    overflows and (``check``) NaN or inf flagged on their devices, read in ``finish``; ``release(part)`` after each."""

    def __init__(self, out_dir: Path, plans: Sequence[FilePlan], what: str, check: bool = True, release=None):
        self.out_dir, self.plans, self.what, self.check, self.release = out_dir, plans, what, check, release
        self._open: tuple[str, int] | None = None   # (file, descriptor): one at a time, whatever the file count
        self._flags: list[tuple[str | None, torch.Tensor]] = []   # (None, overflow count) or (name, non-finite flag)

    def write(self, e: Entry, at: int, values: torch.Tensor, nan_only: bool = False) -> None:
        """Flat ``values`` as elements [at, at + len) of ``e``; ``nan_only``: as ``nonfinite``'s."""
        with _writing(self.out_dir, self.plans, self.what):
            if self._open is None or self._open[0] != e.file:
                self._close()
                self._open = (e.file, files.open_nofollow(self.out_dir / (e.file + ".tmp"), os.O_WRONLY))
            for s in range(0, values.numel(), WRITE_CHUNK):
                part = values[s:s + WRITE_CHUNK]
                chunk = part.to(e.dtype)   # convert where the values are, then move
                if (n := overflowed(part, chunk)) is not None:
                    self._flags.append((None, n))
                if self.check and (n := nonfinite(part, nan_only)) is not None:
                    self._flags.append((e.name, n))
                files.write_at(self._open[1], chunk.to("cpu").contiguous(), e.offset + (at + s) * e.dtype.itemsize)
                if self.release is not None:
                    self.release(part)

    def finish(self) -> tuple[int, list[str]]:
        """Flush the files; the overflow count, and the names of the tensors written with NaN or inf."""
        with _writing(self.out_dir, self.plans, self.what):
            self._close()
        got = read_per_device(self._flags)
        return sum(n for name, n in got if name is None), sorted({name for name, n in got if name is not None and n})

    def _close(self, sync: bool = True) -> None:
        if self._open is not None:
            fd, self._open = self._open[1], None
            try:
                if sync:
                    os.fsync(fd)
            finally:
                os.close(fd)

    def __exit__(self, *exc) -> None:
        self._close(sync=False)   # (after an error: not synced, the .tmp files are removed)


def overflowed(src: torch.Tensor, out: torch.Tensor) -> torch.Tensor | None:
    """How many finite values of ``src`` are infinite in ``out`` (its conversion), on their device; None where none
    can be (float32 to bfloat16: the same exponent range)."""
    a, b = src.dtype, out.dtype
    if a.is_floating_point and b.is_floating_point and torch.finfo(b).max < torch.finfo(a).max / 2:
        return (torch.isinf(out) & torch.isfinite(src)).sum()
    return None


def read_per_device(items: Sequence[tuple[Any, torch.Tensor]]) -> list[tuple[Any, int]]:
    """(key, value) of each one-element tensor of ``items`` (key, tensor), read with one host sync per device."""
    by_device: dict[torch.device, list] = {}
    for k, t in items:
        by_device.setdefault(t.device, []).append((k, t))
    return [(k, v) for pairs in by_device.values()
            for (k, _), v in zip(pairs, torch.stack([t.long() for _, t in pairs]).tolist())]


def nonfinite(src: torch.Tensor, nan_only: bool = False) -> torch.Tensor | None:
    """A flag on its device: ``src`` holds NaN or inf (``nan_only``: NaN; an inf may be by design, an additive
    mask), from its min and max (no temporary of ``src``'s size); None: nothing to flag."""
    if not src.is_floating_point() or not src.numel():
        return None
    mm = _min_max(src)
    return torch.isnan(mm).any() if nan_only else ~torch.isfinite(mm).all()


_CHUNK = 1 << 22   # elements upcast at a time where a dtype has no min/max kernel


_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}   # (a constant: built once, read per tensor)


def bits_sum(src: torch.Tensor) -> torch.Tensor:
    """An int64 on ``src``'s device: its raw bits summed as integers of their own width (no wider copy), wrapping:
    a bit-exact digest, independent of the order."""
    bits = _BITS[src.element_size()]
    return src.reshape(-1).view(bits).sum(dtype=bits).to(torch.int64)


def _min_max(t: torch.Tensor) -> torch.Tensor:
    """[min, max] of ``t`` (NaN if any is); float8, which has no aminmax kernel, upcast a chunk at a time."""
    if t.element_size() > 1:
        return torch.stack(t.aminmax())
    flat = t.reshape(-1)
    parts = torch.stack([torch.stack(flat[i:i + _CHUNK].float().aminmax()) for i in range(0, flat.numel(), _CHUNK)])
    return torch.stack([parts[:, 0].min(), parts[:, 1].max()])


@contextlib.contextmanager
def _writing(out_dir: Path, plans: Sequence[FilePlan], what: str):
    """Around writes (not reads): an OSError as one line naming the folder, with the room needed on a full disk."""
    try:
        yield
    except OSError as e:
        hint = "; choose a writable folder"
        if e.errno in FULL:   # no room: the sizes and the fix
            hint = (f"; no room on the disk or a file size limit (the files need {size(sum(p.size for p in plans))}"
                    f"{free_note(out_dir, ', {} free')}): free space or choose a folder on a larger disk")
        raise FrameworkError(f"{what}: cannot write {e.filename or out_dir} ({e.strerror or e}){hint}"
                             "; nothing there was replaced") from None


if sys.byteorder != "little":  # safetensors stores little-endian bytes; tensors are written as they lie
    raise ImportError("framework.persist.tensorfiles writes safetensors from memory as is: it needs a little-endian host")
