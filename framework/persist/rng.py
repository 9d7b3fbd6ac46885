"""Per-rank random generator states as JSON (nothing pickled): python, numpy, torch CPU and CUDA."""
from __future__ import annotations

import base64
import random
from typing import Sequence

import numpy as np
import torch

from framework.data import seeded

RNG_STREAM = 7  # a key of its own for re-derived generators (framework.data._base.seeded)
FRESH_STREAM = 8   # and one for a new run's


def fresh_seed(seed: int, rank: int) -> int:
    """The torch seed of ``rank`` at a run's start, keyed by (seed, rank): no two pairs share a stream (``seed + rank``
    gave rank 1 of seed 1 rank 0 of seed 2's dropout masks, reused across a multi-rank seed sweep)."""
    return seeded(FRESH_STREAM, seed, rank).initial_seed()


def seed_all(seed: int) -> None:
    """Seed torch's, python's and numpy's global generators from ``seed`` (a checkpoint saves and restores all
    three): a plugin drawing from ``random`` or ``np.random`` repeats with the seed, and a sweep's job does not go on
    from what an earlier job of its process left."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2 ** 32)


def _host(py: tuple, np_state: tuple) -> dict:
    kind, keys, pos, has_gauss, cached = np_state
    return {"python": [py[0], list(py[1]), py[2]],
            "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)]}


def capture(torch_states: Sequence[torch.Tensor]) -> dict:
    """``torch_states``: ``TrainState.rng`` (CPU generator, then the device's)."""
    return {"torch": [base64.b64encode(t.contiguous().numpy().tobytes()).decode() for t in torch_states],
            **_host(random.getstate(), np.random.get_state())}


def restore_host(saved: dict) -> None:
    """Set python's and numpy's global generators (torch's travel in ``TrainState.rng``)."""
    version, keys, gauss = saved["python"]
    random.setstate((version, tuple(keys), gauss))
    kind, keys, pos, has_gauss, cached = saved["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))


def torch_states(saved: dict) -> tuple[torch.Tensor, ...]:
    return tuple(torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8) for s in saved["torch"])


def derive(seed: int, step: int, rank: int, device: torch.device) -> tuple[tuple[torch.Tensor, ...], dict]:
    """Generators for a rank without saved ones (the world size changed), seeded from (seed, step, rank):
    reproducible, but not the numbers an uninterrupted run would draw."""
    gen = seeded(RNG_STREAM, seed, step, rank)
    h = int(torch.randint(0, 2 ** 62, (1,), generator=gen, device="cpu"))
    states = [torch.Generator().manual_seed(h).get_state()]
    if device.type == "cuda":
        states.append(torch.Generator(device).manual_seed(h).get_state())
    return tuple(states), _host(random.Random(h).getstate(), np.random.RandomState(h % (2 ** 32)).get_state())
