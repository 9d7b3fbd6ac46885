"""Flat-buffer layout: parameters of one group laid end to end, padded, and partitioned.

One contiguous buffer per group (parameters are views into it) makes communication one call per bucket
and optimizer kernels one call per group. A ``PieceSpec`` says what a master piece holds by parameter
name, so saved state re-slices into any other layout (world size, stage, offload, bucket sizes).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence, runtime_checkable

import torch
from torch import nn

from framework.comm.distributed import Dist
from framework.core.errors import ConfigError, FrameworkError
from framework.core.footprint import Footprint
from framework.core.room import available_ram
from framework.core.units import size
from framework.core.utils import dtype_name, replace_parameter


# Pad every flat buffer to a multiple of this many elements per rank: partitions start 256-byte aligned
# for 16-bit dtypes, 512-byte for fp32 (NCCL and vectorised kernels prefer aligned starts).
ALIGN = 128


@dataclass(frozen=True)
class Slot:
    name: str
    shape: torch.Size
    offset: int
    numel: int


@dataclass(frozen=True)
class Layout:
    """Where each parameter of a group sits in its flat buffer, and the rank partitions."""

    slots: tuple[Slot, ...]
    numel: int        # real elements
    padded: int       # buffer length: a multiple of world * ALIGN
    world: int

    @property
    def shard(self) -> int:
        return self.padded // self.world

    def partition(self, rank: int) -> tuple[int, int]:
        return rank * self.shard, (rank + 1) * self.shard

    def real(self, rank: int) -> int:
        """The elements of ``rank``'s partition that hold parameters (the rest is padding)."""
        lo, hi = self.partition(rank)
        return max(0, min(hi, self.numel) - lo)

    def nonfinite_names(self, values: torch.Tensor, start: int = 0) -> list[str]:
        """The parameters with a non-finite element among ``values`` (the buffer's elements from ``start``
        on), in layout order. One reduction per slot and one host read, however many elements are NaN."""
        end = start + values.numel()
        hits = [(s.name, values[max(s.offset, start) - start:min(s.offset + s.numel, end) - start])
                for s in self.slots if s.numel and s.offset < end and s.offset + s.numel > start]
        if not hits:
            return []
        # min and max read the slot in place and are both finite exactly when every element is
        extremes = torch.stack([torch.stack(torch.aminmax(v)) for _, v in hits])
        finite = torch.isfinite(extremes).all(dim=1)
        # host sync: slow path, only to name the parameters in an error message
        return [name for (name, _), ok in zip(hits, finite.tolist()) if not ok]


def refuse_sparse_grads(module: nn.Module, stage: str) -> None:
    """zero2 and zero3 copy each gradient into a dense flat buffer: refuse sparse embeddings before any collective."""
    for name, sub in module.named_modules():
        if getattr(sub, "sparse", False) is True and isinstance(sub, (nn.Embedding, nn.EmbeddingBag)) \
                and sub.weight.requires_grad:
            raise FrameworkError(f"{stage}: module {name or '<root>'!r} ({type(sub).__name__}) has sparse=True, and "
                                 f"{stage}'s flat gradient buffers cannot take sparse gradients: set sparse=False "
                                 f"(ddp and zero1 accumulate them into a dense buffer)")


def make_layout(named: list[tuple[str, nn.Parameter]], world: int) -> Layout:
    slots, offset = [], 0
    for name, p in named:
        slots.append(Slot(name, p.shape, offset, p.numel()))
        offset += p.numel()
    unit = world * ALIGN
    return Layout(tuple(slots), offset, -(-max(offset, 1) // unit) * unit, world)


def param_groups(module: nn.Module) -> list[tuple[str, list[tuple[str, nn.Parameter]]]]:
    """Trainable parameters in ``unit_groups`` (tied ones once)."""
    return unit_groups([(name, p) for name, p in module.named_parameters() if p.requires_grad])


def unit_groups(named: list[tuple[str, nn.Parameter]]) -> list[tuple[str, list[tuple[str, nn.Parameter]]]]:
    """Matrices ('decay') and vectors ('no_decay') as flat groups, empty ones dropped."""
    return [(kind, members) for kind, members in (("decay", [x for x in named if x[1].ndim >= 2]),
                                                  ("no_decay", [x for x in named if x[1].ndim < 2]))
            if members]


def param_count(module: nn.Module, recurse: bool = True) -> int:
    """Elements of the module's distinct parameters (``recurse=False``: only those it registers itself, not its
    children's), a ZeRO-3 one (empty between uses) at its full shape."""
    return sum(getattr(p, "logical_shape", p.shape).numel() for p in module.parameters(recurse=recurse))


@runtime_checkable
class ParameterInit(Protocol):
    """A model that can initialise any one parameter by name (order-independent init)."""

    def init_parameter(self, name: str, t: torch.Tensor) -> None: ...


class ModuleInit:
    """A module's own ``init_parameter`` (our GPT's) and ``init_buffer``; without one, fails naming the fix."""

    def __init__(self, module: nn.Module):
        self.module, self.kind = module, type(module).__name__

    def init_parameter(self, name: str, t: torch.Tensor) -> None:
        if isinstance(self.module, ParameterInit):
            return self._filled("init_parameter", name, t, self.module.init_parameter(name, t))
        raise ConfigError(f"parameter {name!r} is on the meta device but {self.kind} has no "
                          f"init_parameter(name, tensor) method to initialise it; add that method (the training "
                          f"command always builds its model on the meta device) or, calling framework.initialize "
                          f"yourself, build the model on a real device")

    def init_buffer(self, name: str, t: torch.Tensor) -> None:
        own = getattr(self.module, "init_buffer", None)
        if callable(own):
            return self._filled("init_buffer", name, t, own(name, t))
        raise ConfigError(f"buffer {name!r} of {self.kind} is on the meta device; add an init_buffer(name, tensor) "
                          f"method (the training command always builds its model on the meta device) or, calling "
                          f"framework.initialize yourself, build the model on a real device")

    def _filled(self, method: str, name: str, t: torch.Tensor, returned: object) -> None:
        # A returned tensor would be dropped and training would start from the uninitialised buffer (``t`` itself,
        # as ``nn.init.normal_(t)`` returns, is in place and fine; so is another tensor over t's own elements, as
        # ``t.data.normal_()`` or ``t.view(-1)`` filled returns).
        if returned is not None and returned is not t and not _same_elements(returned, t):
            raise ConfigError(f"{self.kind}.{method}({name!r}, tensor) returned a {type(returned).__name__}; it "
                              f"must fill `tensor` in place (e.g. tensor.copy_(values)) and return None")


def _same_elements(returned: object, t: torch.Tensor) -> bool:
    """Whether ``returned`` is a tensor over exactly ``t``'s elements (an alias or a view, ``t.T`` too: from t's
    first element, each once, none outside; no host sync)."""
    if not (isinstance(returned, torch.Tensor) and returned.layout == torch.strided   # (a sparse one has no storage)
            and returned.dtype == t.dtype and returned.device == t.device and returned.numel() == t.numel()
            and t.is_contiguous()
            and returned.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
            and returned.storage_offset() == t.storage_offset()):
        return False
    step = 1   # dense and non-overlapping in some order of its dimensions: strides 1, n1, n1*n2, ...
    for stride, n in sorted((st, n) for st, n in zip(returned.stride(), returned.shape) if n > 1):
        if stride != step:
            return False
        step *= n
    return True


def initializer(module: nn.Module):
    """What materialises ``module``'s meta tensors as a stage builds its layout (``init_parameter``,
    ``init_buffer``): the module's own (our GPT's), or a Hugging Face model's ``framework.models.hf.HFInit``
    (``framework.zero_init`` builds a model on the meta device; ``engine/materialize.py``)."""
    from framework.models.hf import HFInit, is_hf_model

    if not isinstance(module, ParameterInit) and is_hf_model(module) and any(
            t.is_meta for t in (*module.parameters(), *module.buffers())):
        return HFInit(module, torch.initial_seed())
    return ModuleInit(module)


def initial_values(init: ParameterInit, name: str, p: torch.Tensor, device: torch.device,
                   scratch: torch.Tensor | None = None) -> torch.Tensor:
    """Parameter ``name``'s initial values (its own dtype) on ``device``; a meta one is initialised by ``init``,
    into ``scratch`` when given (so repeated temporaries cannot fragment the heap)."""
    if not p.is_meta:
        return p.detach().to(device)
    full = (torch.empty(p.shape, dtype=p.dtype, device=device) if scratch is None
            else scratch[:p.numel()].view(p.shape))
    with torch.no_grad():
        init.init_parameter(name, full)
    return full


def bind_groups(module: nn.Module, world: int, dtype: torch.dtype, dist: Dist, init: ParameterInit,
                order=lambda named: named) -> tuple[list[str], list[Layout], list[torch.Tensor], list]:
    """Make each trainable parameter a view into a new flat buffer per ``param_groups`` group, laid out for
    ``world`` ranks in ``order(named)``, with rank 0's initial values. Returns the kinds, layouts and buffers
    per group, and (parameter, (group, slot)) in registration order (buckets are planned from it)."""
    groups = param_groups(module)
    check_room(module, dtype, dist.device, dist.acc.free_memory())
    layouts, flats, entries = [], [], []
    for g, (_, named) in enumerate(groups):
        placed = order(named)
        layout = make_layout(placed, world)
        flat = torch.zeros(layout.padded, dtype=dtype, device=dist.device)
        bound = {}
        for (name, p), s in zip(placed, layout.slots):
            v = flat[s.offset:s.offset + s.numel].view(s.shape)
            v.copy_(initial_values(init, name, p, flat.device))
            bound[name] = (_bind(module, p, v), (g, s))
        dist.broadcast(flat, what="initial parameter broadcast")
        layouts.append(layout)
        flats.append(flat)
        entries += [bound[name] for name, _ in named]
    bind_frozen(module, dtype, dist, init)
    return [kind for kind, _ in groups], layouts, flats, entries


def check_room(module: nn.Module, dtype: torch.dtype, device: torch.device, free: int | None) -> None:
    """Refuse, before allocating, parameters whose ``dtype`` values alone exceed the memory where they are laid
    out: ``free`` bytes of device memory (the accelerator's count; None: the device is the host, whose available
    memory is read here). The allocation would fail with an allocator traceback, or swap (a config.json with a
    typo in a width builds such a model on meta in no time). Counted: what binding allocates, the trainable
    parameters' flats and each frozen parameter ``bind_frozen`` cannot keep in place (one already on ``device``
    in the dtype it is kept in, contiguous, is memory in use already)."""
    room = free if free is not None else available_ram() if device.type == "cpu" else None
    if room is None:
        return
    kept = [(p, dtype if p.is_floating_point() else p.dtype) for p in module.parameters()]
    new = [(p, d) for p, d in kept if p.requires_grad or p.is_meta or p.device != device or p.dtype != d
           or not p.is_contiguous()]
    count = sum(p.numel() for p, _ in new)
    where, has = ("the host", f"this host's {size(room)} of available memory") if free is None else \
        (str(device), f"the {size(room)} free on {device}")
    if (need := sum(p.numel() * d.itemsize for p, d in new)) > room:
        raise ConfigError(f"the model declares {count:,} parameters to lay out on {where}: {size(need)} as "
                          f"{dtype_name(dtype)} for the weights alone, more than {has}; build a smaller model "
                          f"(check its config's layer count and widths) or run where there is more memory")


def _bind(module: nn.Module, p: nn.Parameter, v: torch.Tensor) -> nn.Parameter:
    """``p`` holding ``v``; a meta one (whose .data cannot move) replaced by a new Parameter everywhere. Either way
    the parameter keeps a version counter of its own, which the stage's writes into ``v``'s buffer leave alone
    (``BaseStage.watch``)."""
    if not p.is_meta:
        p.data = v
        return p
    return replace_parameter(module, p, nn.Parameter(v.data, requires_grad=p.requires_grad))


def bind_frozen(module: nn.Module, dtype: torch.dtype, dist: Dist, init: ParameterInit) -> None:
    """Every frozen parameter whole on every rank (zero3 too) with rank 0's values, in the working ``dtype``
    when floating; no gradient, master or optimizer state. Then the buffers take rank 0's values too."""
    for name, p in [(n, p) for n, p in module.named_parameters() if not p.requires_grad]:
        v = initial_values(init, name, p, dist.device).to(dtype if p.is_floating_point() else p.dtype).contiguous()
        dist.broadcast(v, what=f"initial values of frozen {name!r}")
        _bind(module, p, v)
    broadcast_buffers(module, dist)


def buffer_dtypes(module: nn.Module, dtype: torch.dtype) -> dict[int, torch.dtype]:
    """The dtype each distinct buffer (by id) is kept in: a floating buffer of a module with own parameters of
    its dtype follows them into the working ``dtype`` (BatchNorm's running statistics); any other keeps its
    own (a rotary ``inv_freq``, an integer count). Idempotent."""
    out: dict[int, torch.dtype] = {}
    for sub in module.modules():
        own = {p.dtype for p in sub.parameters(recurse=False) if p.is_floating_point()}
        for b in sub.buffers(recurse=False):
            cast = b.is_floating_point() and b.dtype in own
            if cast or id(b) not in out:   # (a buffer shared with such a module follows it)
                out[id(b)] = dtype if cast else b.dtype
    return out


def whole_memory(fp: Footprint, module: nn.Module, dtype: torch.dtype) -> None:
    """Add to ``fp`` what every stage keeps whole on every rank: "frozen_params" (as ``bind_frozen``) and
    "buffers" (as ``buffer_dtypes``), each distinct one once; items with no bytes are left out."""
    frozen = sum(p.numel() * ((dtype if p.is_floating_point() else p.dtype).itemsize if p.is_meta else p.element_size())
                 for p in module.parameters() if not p.requires_grad)
    kept = buffer_dtypes(module, dtype)
    buffers = sum(b.numel() * kept[id(b)].itemsize for b in module.buffers())
    for name, nbytes in (("frozen_params", frozen), ("buffers", buffers)):
        if nbytes:
            fp.add(name, device=nbytes)


def broadcast_buffers(module: nn.Module, dist: Dist) -> None:
    """Every buffer takes rank 0's values, as torch DDP and DeepSpeed do (one initialised per rank would train
    differently on each, silently); one registered under several names is sent once."""
    if dist.world == 1:
        return
    dense: dict[int, torch.Tensor] = {}   # NCCL sends contiguous memory only: a view (an expanded one
    for name, buf in list(module.named_buffers(remove_duplicate=False)):   # cannot be written) is replaced
        path, _, key = name.rpartition(".")
        if id(buf) not in dense:
            dense[id(buf)] = buf if buf.is_contiguous() else buf.contiguous()
            dist.broadcast(dense[id(buf)], what=f"initial values of buffer {name!r}")
        # (the slot itself: it keeps the buffer's persistence, and no registration hook runs for a swap)
        module.get_submodule(path)._buffers[key] = dense[id(buf)]


@dataclass(frozen=True)
class Span:
    """Elements ``param`` [lo, hi) of the flattened parameter ``name`` sit at ``piece`` [lo, hi)."""

    name: str
    shape: tuple[int, ...]    # the parameter's global shape
    param: tuple[int, int]
    piece: tuple[int, int]


@dataclass(frozen=True)
class PieceSpec:
    """One master piece: its length and the parameter spans it holds (padding holds none)."""

    numel: int
    spans: tuple[Span, ...]


def piece_spec(layout: Layout, start: int, end: int) -> PieceSpec:
    """The spec of a piece holding elements [start, end) of a flat buffer laid out by ``layout``."""
    if not 0 <= start <= end <= layout.padded:
        raise ValueError(f"piece [{start}, {end}) is outside the flat buffer [0, {layout.padded})")
    return PieceSpec(end - start, tuple(   # (slots are in offset order; a few hundred at most)
        Span(s.name, tuple(s.shape), (a - s.offset, b - s.offset), (a - start, b - start)) for s in layout.slots
        if (a := max(start, s.offset)) < (b := min(end, s.offset + s.numel))))


def cover(lo: int, hi: int, ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """Saved ranges covering [lo, hi), as ``(index, a, b)`` tiling it in order, the one reaching furthest
    first (few copies); ``LookupError`` names the first element range no saved range holds."""
    out: list[tuple[int, int, int]] = []
    pos = lo
    while pos < hi:
        live = [i for i, (a, b) in enumerate(ranges) if a <= pos < b]
        if not live:
            nxt = min((a for a, _ in ranges if a > pos), default=hi)
            raise LookupError(f"elements [{pos}, {min(nxt, hi)}) are in no saved fragment")
        best = max(live, key=lambda i: (ranges[i][1], -ranges[i][0], -i))   # ties: the earliest start, then index
        out.append((best, pos, min(hi, ranges[best][1])))
        pos = out[-1][2]
    return out


def check_shape(name: str, saved: Sequence[int], here: Sequence[int]) -> None:
    if tuple(saved) != tuple(here):
        raise FrameworkError(f"load_state_dict: parameter {name!r} has shape {tuple(saved)} in the saved state "
                             f"but {tuple(here)} in this model")
