"""A tiny synchronous stand-in for contract B (framework.offload.aio / swapfile), used only until the IO
engine lands on main: installed by ``install()`` when ``framework.offload.aio`` cannot be imported."""
import os
import sys
import types

import torch

from framework.errors import ConfigError, FrameworkError


class SwapIOError(FrameworkError):
    pass


def aligned_empty(numel, dtype, *, pin, acc):
    size = torch.empty(0, dtype=dtype).element_size()
    raw = acc.empty_host(numel * size + 4096, torch.uint8, pinned=pin)
    skip = (-raw.data_ptr()) % 4096
    out = raw[skip:skip + numel * size].view(dtype)
    out.keep = raw   # the checking accelerator tracks ``raw`` by a weak reference
    return out


class _Done:
    def __init__(self, error=None):
        self.error = error

    def wait(self):
        if self.error is not None:
            raise self.error

    def done(self):
        return True


class AsyncIO:
    def __init__(self, block_size, queue_depth, intra_op_parallelism, direct=True):
        pass

    def pread(self, file, offset, dst, what):
        data = os.pread(file.fd, dst.numel() * dst.element_size(), offset)
        dst.view(torch.uint8).copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        return _Done()

    def pwrite(self, file, offset, src, what):
        try:
            os.pwrite(file.fd, src.view(torch.uint8).numpy().tobytes(), offset)
        except OSError as e:
            return _Done(SwapIOError(f"{file.path}: write of {what} at {offset}: {e}"))
        return _Done()

    def close(self):
        pass


class SwapFile:
    def __init__(self, path, offsets):
        self.path, self.offsets = path, offsets
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)

    @classmethod
    def create(cls, path, extents, *, layout_hash, world_size, rank, dtype=None):
        offsets, at = {}, 0
        for name, nbytes in extents.items():
            offsets[name] = (at, nbytes)
            at += nbytes
        f = cls(path, offsets)
        os.ftruncate(f.fd, at)
        return f

    def extent(self, name):
        return self.offsets[name]

    def remove(self):
        os.close(self.fd)
        os.unlink(self.path)


def preflight(path, total_bytes, largest_tile_bytes, buffer_bytes, buffer_count):
    if buffer_bytes < largest_tile_bytes:
        raise ConfigError(f"buffer too small: {buffer_bytes} < {largest_tile_bytes}")


def install():
    try:
        import framework.offload.aio  # noqa: F401 - the real engine has landed
        return
    except ImportError:
        pass
    aio = types.ModuleType("framework.offload.aio")
    aio.AsyncIO, aio.aligned_empty, aio.preflight, aio.SwapIOError = AsyncIO, aligned_empty, preflight, SwapIOError
    swap = types.ModuleType("framework.offload.swapfile")
    swap.SwapFile = SwapFile
    sys.modules["framework.offload.aio"], sys.modules["framework.offload.swapfile"] = aio, swap
