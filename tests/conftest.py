import os

import pytest

# The CPU runs of the suite check what CUDA would need (framework.comm.accelerator): host/device
# placement and stream order of every copy of the offload path. Set before any rank is spawned.
os.environ.setdefault("FRAMEWORK_ACCELERATOR", "check")

from tests._pool import RankPool


@pytest.fixture(scope="session")
def pools():
    """Shared rank pools keyed by world size; a broken pool is replaced on next use."""
    made: dict[int, RankPool] = {}

    def get(world: int) -> RankPool:
        if world not in made or not made[world].alive:
            made[world] = RankPool(world)
        return made[world]

    yield get
    for pool in made.values():
        pool.close()


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    # Test models are tiny and rank pools run beside this process: extra intra-op threads
    # only oversubscribe the cores.
    import torch
    torch.set_num_threads(1)
