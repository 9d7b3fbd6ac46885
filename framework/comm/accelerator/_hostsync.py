"""The checking accelerator's watch inside ``hot(...)`` regions and ``hook(...)`` hooks (nowhere else: a torch
function mode costs every call): framework code making the host wait for device memory (a read, or a blocking
copy either way between a host buffer and device memory) raises ``HostSync``, and what torch makes there of
host buffers alone is host memory (``host.clone()``, ``host > 0``)."""
from __future__ import annotations

import os
import sys
import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

from framework.comm.accelerator._base import HostSync

# Tensor methods and torch functions that make the host wait for their first operand (device memory).
_SYNCS = frozenset({"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy", "nonzero",
                    "argwhere", "masked_select", "unique", "unique_consecutive", "equal", "allclose", "is_nonzero",
                    "bincount", "__array__", "__format__", "__repr__"})
# ... and the calls that may, depending on their operands (``_synced``)
_MAYBE = frozenset({"to", "as_tensor", "where", "__getitem__", "repeat_interleave", "copy_", "__setitem__"})
_PLAIN = (Tensor, torch.nn.Parameter)
_HERE = os.path.dirname(os.path.abspath(__file__)) + os.sep   # this package: framework/comm/accelerator/
_PACKAGE = os.path.dirname(os.path.dirname(_HERE[:-1])) + os.sep   # framework/, above comm/
_TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


def _ours(filename: str) -> bool:
    """Framework code other than this package, and not model code (that is the user's to judge)."""
    return filename.startswith(_PACKAGE) and not filename.startswith((_HERE, os.path.join(_PACKAGE, "models", "")))


def place() -> str:
    """The framework code calling the checker, up to 5 frames innermost first ("framework/x.py:5 in f <- ...")."""
    f, out = sys._getframe(1), []
    while f is not None and len(out) < 5:
        name = f.f_code.co_filename
        if name.startswith(_PACKAGE) and not name.startswith(_HERE):
            out.append(f"{os.path.relpath(name, os.path.dirname(_PACKAGE[:-1]))}:{f.f_lineno} in {f.f_code.co_name}")
        f = f.f_back
    return " <- ".join(out) or "outside the framework"


class NoHostSync(TorchFunctionMode):
    """Inside ``CheckingCpuAccelerator.hot`` (``acc``): a framework frame reading device memory on the host fails;
    a call whose tensor operands are all host buffers makes host memory (``acc._derived``)."""

    def __init__(self, acc, where: str):
        super().__init__()
        self.acc, self.where, self.off = acc, where, False

    def __enter__(self):
        # Where this thread is hot, for what the mode does not see (an event's ``synchronize``: no torch call).
        local = self.acc._local
        before = getattr(local, "hot", ())
        try:
            local.hot = (*before, self.where)
            return super().__enter__()
        except BaseException:
            # A signal's exit raised in here (Ctrl-C, SIGTERM): the with-block and __exit__ never run, so this
            # thread is not hot, and the mode, pushed or not, checks nothing while the run unwinds and closes.
            local.hot, self.off = before, True
            raise

    def __exit__(self, *exc):
        self.acc._local.hot = self.acc._local.hot[:-1]
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.off:
            return func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if name in _SYNCS or name in _MAYBE or "out" in kwargs:   # (the common call: one set lookup or two)
            t = _synced(self.acc, name, args, kwargs)
            if t is not None and framework_caller():
                what = f"blocking {name} of a {tuple(t.shape)} {t.dtype} host buffer into device memory" \
                    if self.acc._is_host(t) else f"{name} of a {tuple(t.shape)} {t.dtype} device tensor"
                raise HostSync(f"host sync ({what}) inside {self.where}, at {place()}: on CUDA the host stalls until "
                               f"the device catches up; move it out of the hook, or keep the value on the device")
        out = func(*args, **kwargs)
        if "device" in kwargs and _named_host(self.acc, kwargs["device"]):   # (``torch.empty(n, device="cpu")``)
            _register_made(self.acc, name, args, kwargs, out)
        elif self.acc._host_buffers and (isinstance(out, Tensor) or isinstance(out, (tuple, list)) and out
                                         and isinstance(out[0], Tensor)):   # (cheap tests first)
            key = _host_key(args[0] if args else None)
            if key in self.acc._host_buffers and _host_key(out) != key:   # (not a view, nor in place)
                self.acc._derived(name, args, kwargs, out)
        return out


class HostMade(TorchFunctionMode):
    """Inside ``CheckingCpuAccelerator.building`` (setup, not the step): what framework code makes on the host by
    name (``device="cpu"``, ``device=acc.host``, ``.to("cpu")``, ``.cpu()``) is host memory (pageable), so a buffer
    meant for the device but made there is caught where it is used as device memory. ``acc.device`` and the run's
    device are other ``torch.device`` objects, equal to the host's on the CPU: only these spellings tell them apart."""

    def __init__(self, acc):
        super().__init__()
        self.acc = acc

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if _named_host(self.acc, kwargs.get("device")) or name == "cpu" \
                or name == "to" and len(args) > 1 and _named_host(self.acc, args[1]):
            _register_made(self.acc, name, args, kwargs, out)
        return out


def _named_host(acc, device) -> bool:
    return device is acc.host or isinstance(device, str) and device == "cpu"


def new_outputs(args, kwargs, out) -> list[Tensor]:
    """The tensors a torch call returned whose storage none of its inputs has (not a view, nor an input returned
    as it is, nor an in-place result): what the call made."""
    inputs = {_host_key(t) for t in tensors_of(args, kwargs)}
    return [t for t in ((out,) if isinstance(out, Tensor) else out if isinstance(out, (tuple, list)) else ())
            if isinstance(t, Tensor) and _host_key(t) not in (None, *inputs)]


def _register_made(acc, name: str, args, kwargs, out) -> None:
    """``out`` of a call that named the host, made by framework code: host memory (not an input returned as it is)."""
    if framework_caller():
        acc.register_host(*[t for t in new_outputs(args, kwargs, out) if t.device.type == "cpu"], what=name)


def framework_caller(skip=None) -> bool:
    """Whether the code calling into this package or torch (beyond frames whose ``self`` is ``skip``: a subclass's
    override calling up) is framework code that is not model code."""
    f = sys._getframe(1)
    while f is not None and (f.f_code.co_filename.startswith((_HERE, _TORCH)) or skip is not None
                             and f.f_locals.get("self") is skip):
        f = f.f_back
    return f is not None and _ours(f.f_code.co_filename)


def _host_key(t) -> int | None:
    """The storage address of a tensor (the first of a list, as ``cat`` takes), if it is a plain one with a storage."""
    if isinstance(t, (list, tuple)):
        t = t[0] if t else None
    if type(t) not in _PLAIN:   # (a tensor subclass, e.g. a DTensor: not the framework's buffers)
        return None
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):   # (a sparse tensor)
        return None


def _synced(acc, name: str, args, kwargs) -> Tensor | None:
    """The device tensor that ``name(*args, **kwargs)`` makes the host wait for, if any."""
    first = args[0] if args else None
    if name in _SYNCS or name in ("to", "as_tensor") and _to_host(acc, args, kwargs) \
            or name == "where" and len(args) == 1 and not kwargs:
        t = first
    elif name == "__getitem__" and len(args) > 1:   # a boolean mask: the result's size is its count of True
        index = args[1]
        t = (index,) if isinstance(index, Tensor) else index if isinstance(index, (tuple, list)) else ()
        t = next((i for i in t if isinstance(i, Tensor) and i.dtype == torch.bool), None)
    elif name == "repeat_interleave" and kwargs.get("output_size") is None:   # the size is the repeats' sum
        t = kwargs.get("repeats", args[1] if len(args) > 1 else first)
    elif name in ("copy_", "__setitem__") or kwargs.get("out") is not None:
        return _copied(acc, name, args, kwargs)
    elif name == "to" and isinstance(first, Tensor) and acc._is_host(first):   # ``host.to(device_tensor)``
        target = kwargs.get("other", args[1] if len(args) > 1 else None)
        blocking = not kwargs.get("non_blocking", args[2] if len(args) > 2 else False)
        return first if blocking and isinstance(target, Tensor) and not acc._is_host(target) else None
    else:
        return None
    return t if isinstance(t, Tensor) and not acc._is_host(t) else None


def _copied(acc, name: str, args, kwargs) -> Tensor | None:
    """The tensor a blocking copy makes the host wait for: the device source of one into a host buffer
    (``host.copy_(dev)``, ``host[:] = dev``, ``torch.cat([dev], out=host)``), or the host buffer of one into
    device memory (``dev.copy_(host)``, ``dev[:] = host``: torch waits for the stream after it). An
    asynchronous one (``non_blocking``) is ordered by an event later."""
    if name == "copy_":
        blocking = not kwargs.get("non_blocking", args[2] if len(args) > 2 else False)
        dst, srcs = args[0], args[1:2] if blocking else ()
    elif name == "__setitem__":
        dst, srcs = args[0], args[2:3]
    else:
        dst, srcs = kwargs["out"], tensors_of(args, kwargs)
    dsts = dst if isinstance(dst, (tuple, list)) else (dst,)
    if all(isinstance(d, Tensor) and acc._is_host(d) for d in dsts):
        return next((t for t in srcs if isinstance(t, Tensor) and t.numel() and not acc._is_host(t)), None)
    if name not in ("copy_", "__setitem__") or acc._is_host(dst):
        return None
    return next((t for t in srcs if isinstance(t, Tensor) and t.numel() and acc._is_host(t)), None)


def _to_host(acc, args, kwargs) -> bool:
    target = kwargs.get("device", kwargs.get("other", args[1] if len(args) > 1 else None))
    if isinstance(target, Tensor):   # ``.to(host_buffer)``
        return acc._is_host(target)
    try:
        return isinstance(target, (str, torch.device)) and torch.device(target).type == "cpu"
    except (RuntimeError, TypeError):
        return False


def tensors_of(args, kwargs) -> list[Tensor]:
    """The tensor operands of a torch call (in lists too, as ``cat`` and the ``_foreach`` ops take them)."""
    out = []
    for a in (*args, *(v for k, v in kwargs.items() if k != "out")):
        if isinstance(a, Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out += [x for x in a if isinstance(x, Tensor)]
    return out
