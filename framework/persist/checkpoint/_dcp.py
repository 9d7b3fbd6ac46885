"""torch.distributed.checkpoint glue: flat fragments as rectangular chunks, a reader that never
unpickles code, and DCP's errors unpacked into one line.

ZeRO's master pieces are ranges of *flattened* parameters, which a ``DTensor`` shard cannot hold. A flat
range of a row-major tensor is a few contiguous rectangular boxes, each one chunk of the parameter's global
shape: ordinary DCP files. ``Boxes`` implements the hooks DCP's planners call (the protocol ``DTensor`` uses).
"""
from __future__ import annotations

import io
import math
import pickle
import warnings
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed.checkpoint as dcp  # noqa: F401 - the package reaches DCP only through this module
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, StorageMeta, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from framework.core.errors import CheckpointError, FrameworkError, one_line


def boxes(shape: Sequence[int], lo: int, hi: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Rectangular boxes ``(offsets, sizes)`` of a row-major tensor of ``shape``, each contiguous, that tile its
    flattened elements [lo, hi) in order."""
    shape = tuple(shape)
    if lo >= hi:
        return []
    if not shape:
        return [((), ())]
    inner = math.prod(shape[1:])
    (a, ra), (b, rb) = divmod(lo, inner), divmod(hi, inner)

    def row(i: int, x: int, y: int):
        return [((i, *o), (1, *s)) for o, s in boxes(shape[1:], x, y)]

    if ra and a == b:  # inside one row
        return row(a, ra, rb)
    out = []
    if ra:
        out += row(a, ra, inner)
        a += 1
    if b > a:
        out.append(((a, *(0,) * (len(shape) - 1)), (b - a, *shape[1:])))
    if rb:
        out += row(b, 0, rb)
    return out


class Boxes:
    """A parameter's global shape and this rank's boxes of it, views of ``pieces`` (((lo, hi), flat)) that DCP reads
    or writes; ``take(box)``: the tensor to use instead of a view."""

    def __init__(self, shape: Sequence[int], pieces: Sequence[tuple[tuple[int, int], torch.Tensor]],
                 take: Callable[[torch.Tensor], torch.Tensor] | None = None):
        self.shape = torch.Size(shape)
        self.chunks: dict[torch.Size, torch.Tensor] = {}   # a box's offsets in the parameter -> the box
        for (lo, hi), flat in pieces:
            pos = 0
            for offsets, sizes in boxes(self.shape, lo, hi):
                n = math.prod(sizes)
                box = flat[pos:pos + n]
                self.chunks[torch.Size(offsets)] = (box if take is None else take(box)).view(sizes)
                pos += n

    def tensors(self) -> list[torch.Tensor]:
        return list(self.chunks.values())

    def size(self) -> torch.Size:  # DCP compares it with the saved global shape on load
        return self.shape

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        return [WriteItem(index=MetadataIndex(fqn, c.offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=c, properties=TensorProperties.create_from_tensor(t),
                                                      size=self.shape))
                for c, t in zip(self.__create_chunk_list__(), self.tensors())]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=offsets, sizes=t.size()) for offsets, t in self.chunks.items()]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        return self.chunks[index.offset]


def _lookup(state_dict: dict, index: MetadataIndex, default: Callable[[MetadataIndex], Any]):
    obj = state_dict[index.fqn]
    return obj.__get_tensor_shard__(index) if isinstance(obj, Boxes) else default(index)


class SavePlanner(DefaultSavePlanner):
    """DCP's default save planner for ``Boxes``; ``release(t)``: each value once the writer asked for the next."""

    def __init__(self, release: Callable[[torch.Tensor], None] | None = None) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.release, self._last = release, None

    def lookup_object(self, index: MetadataIndex) -> Any:
        return _lookup(self.state_dict, index, super().lookup_object)

    def resolve_data(self, write_item: WriteItem) -> Any:
        data = super().resolve_data(write_item)
        if self.release is not None and isinstance(data, torch.Tensor):
            if self._last is not None:
                self.release(self._last)
            self._last = data
        return data


class LoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner for ``Boxes``, never unpickling; ``release(t)``: each target once filled."""

    def __init__(self, release: Callable[[torch.Tensor], None] | None = None) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False, allow_partial_load=True)
        self.release = release

    def set_up_planner(self, state_dict: dict, metadata: Any = None, is_coordinator: bool = False) -> None:
        # (the default one maps the values through a walk that drops ``Boxes``; ours are flat already)
        self.original_state_dict = self.state_dict = state_dict
        self.mappings, self.metadata, self.is_coordinator = {}, metadata, is_coordinator

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return _lookup(self.state_dict, index, super().lookup_tensor)

    def commit_tensor(self, read_item, tensor: torch.Tensor) -> None:
        super().commit_tensor(read_item, tensor)
        if self.release is not None:
            self.release(tensor)

    def load_bytes(self, read_item, value) -> None:
        raise CheckpointError(f"checkpoint: refusing to unpickle the object {read_item.dest_index.fqn!r} "
                             f"(only tensors are loaded from a checkpoint)")


# --- metadata without code execution: DCP pickles .metadata, and pickle.load runs what a crafted file asks
# for; ours unpickles it with an allow-list of the plain data classes DCP's metadata is made of.
_ALLOWED = {
    ("collections", "OrderedDict"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"),
    ("torch", "Size"), ("torch.serialization", "_get_layout"),  # looks a layout up by name
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    *(("torch.distributed.checkpoint.metadata", n) for n in (
        "Metadata", "MetadataIndex", "ChunkStorageMetadata", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "StorageMeta", "_MEM_FORMAT_ENCODING")),
}


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's metadata")


def read_metadata(path) -> Any:
    """DCP's ``.metadata`` of a checkpoint folder, unpickled with the allow-list above."""
    try:
        with open(path, "rb") as f:
            return _Unpickler(f).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, TypeError, ValueError, KeyError) as e:
        raise CheckpointError(f"checkpoint: {path}: refused to read the DCP metadata ({e}); the file is damaged "
                             f"or was not written by torch.distributed.checkpoint") from None


class SafeReader(FileSystemReader):
    """``FileSystemReader`` with the metadata ``read_metadata`` read (DCP loads tensor data weights_only)."""

    def __init__(self, path, metadata) -> None:
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any):
        if getattr(self._metadata, "storage_meta", None) is None:
            self._metadata.storage_meta = StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata


def quiet_no_dist() -> None:
    """Ignore DCP's one-process warning (on each one-rank save or load: what no_dist asks for) from now on, once. Not
    ``catch_warnings`` around each call: it restores the filter list on leaving, dropping another thread's filter
    added meanwhile; not added again: each filterwarnings call clears every module's once-per-place warning registry."""
    text = "torch.distributed is disabled"
    if not any(act == "ignore" and getattr(message, "pattern", None) == text for act, message, *_ in warnings.filters):
        warnings.filterwarnings("ignore", message=text)


def read(folder: Path, metadata, targets: dict, release: Callable[[torch.Tensor], None] | None = None,
         **kwargs: Any) -> None:
    """DCP's load of ``targets`` from ``folder`` (``kwargs``: the group or ``no_dist``); a failure is one
    CheckpointError."""
    try:
        if kwargs.get("no_dist"):
            quiet_no_dist()
        dcp.load(targets, storage_reader=SafeReader(folder, metadata), planner=LoadPlanner(release), **kwargs)
    except FrameworkError:
        raise
    except (Exception, CheckpointException) as e:   # noqa: BLE001 - DCP wraps per-rank failures
        # (a shard torch refuses to unpickle with weights_only ends here: a BaseException)
        if any(isinstance(x, pickle.UnpicklingError) for x in causes(e)):
            where = _unpicklable(folder, metadata) or f"a DCP file in {folder}"
            raise CheckpointError(f"checkpoint {folder}: {where}: torch refuses to unpickle it with "
                                  f"weights_only=True (not plain tensor data: a crafted or foreign file); "
                                  f"it is never loaded") from None
        raise CheckpointError(f"checkpoint {folder}: reading the DCP files failed: {describe(e)}") from None


def _unpicklable(folder, metadata) -> str | None:
    """The first record ``torch.load(weights_only=True)`` refuses (DCP does not say which), by file, key and offset."""
    storage = getattr(metadata, "storage_data", None) or {}
    for index, info in sorted(storage.items(), key=lambda kv: (str(kv[1].relative_path), kv[1].offset)):
        if getattr(info, "transform_descriptors", None):
            continue   # compressed records are not ours to decode here
        path = Path(folder) / info.relative_path
        try:
            with open(path, "rb") as f:
                f.seek(info.offset)
                data = f.read(info.length)
            torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except pickle.UnpicklingError:
            return f"{path} (record {index.fqn!r} at offset {info.offset})"
        except Exception:  # noqa: BLE001 - another kind of damage: not what is looked for
            continue
    return None


def describe(e: BaseException) -> str:
    """One line for an error, DCP's per-rank wrapping unpacked: its first real cause."""
    first = next((c for c in causes(e) if not isinstance(c, CheckpointException)), e)
    text = one_line(first)
    if isinstance(first, FrameworkError):
        return text[:500]
    where = f" ({first.filename})" if isinstance(first, OSError) and first.filename else ""
    return f"{type(first).__name__}{where}: {text[:400]}"


def causes(e: BaseException, implicit: bool = True) -> list[BaseException]:
    """``e``, the per-rank failures DCP wrapped in it and their causes (``implicit``: their ``__context__`` too)."""
    out, todo = [], [e]
    while todo:
        c = todo.pop()
        if c is None or any(c is x for x in out):
            continue
        out.append(c)
        if isinstance(c, CheckpointException):
            todo += [pair[0] for pair in c.failures.values()]
        todo += [c.__cause__, c.__context__ if implicit else None]
    return out
