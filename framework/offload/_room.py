"""The NVMe pre-flight agreed by every rank: room summed over the ranks sharing a file system.

    agree_swap_room(dist, folder, {"optim": store, "params": None}, check=lambda: ...)

Every rank raises the same one-line ConfigError, so none dies alone while the others wait for it.
"""
from __future__ import annotations

import os
from typing import Callable, Mapping

from framework.core.errors import ConfigError, FrameworkError
from framework.offload._swapfile import reserved_bytes, swap_path
from framework.core.room import Claim, shortfalls


def _allocated(path) -> int:
    """Bytes already reserved by an existing swap file (taken over: its space is not needed again)."""
    try:
        return os.lstat(path).st_blocks * 512
    except FileNotFoundError:
        return 0


def agree_swap_room(dist, folder: str, stores: Mapping[str, object], check: Callable[[], None], *,
                    collective: bool = True) -> None:
    """``check()`` on this rank, then (``collective``: with every rank of ``dist``) the room the swap
    files of ``stores`` (kind -> ``DiskStore`` or None) still need, summed per file system."""
    rank = dist.rank if dist is not None else 0
    error, claim = None, None
    try:
        need = sum(max(0, reserved_bytes(store.extents()) - _allocated(swap_path(folder, rank, kind)))
                   for kind, store in stores.items() if store is not None)
        claim = Claim.of(folder, need, rank)
        check()
    except (FrameworkError, OSError) as e:
        error = f"rank {rank}: {e}"
        mine = e
    if collective and dist is not None and dist.world > 1:
        everyone = dist.all_gather_object((claim, error), what="nvme pre-flight")
    else:
        everyone = [(claim, error)]
    shorts = shortfalls([c for c, _ in everyone if c is not None])
    if shorts:
        raise ConfigError(f"offload.nvme_path={shorts[0].describe('the swap files')}; free space or point "
                          "offload.nvme_path at a larger disk (each rank of a host needs its own files there)")
    if error is not None:
        raise mine
    errors = [e for _, e in everyone if e]
    if errors:
        raise ConfigError(f"nvme pre-flight failed on another rank ({errors[0]}); this rank stops too")
