import time

import pytest


@pytest.fixture(scope="session")
def nvme_reference(pools, tmp_path_factory):
    """An uninterrupted 2-rank run (zero2, offload=nvme, 6 steps), every step saved and kept: the
    per-rank results of ``tests.dist.test_integrity._run``, its checkpoint folder, and how long
    the run took (the window in which the fault campaign's faults land)."""
    from tests.dist.test_checkpoint import NVME
    from tests.dist.test_integrity import _run

    root = tmp_path_factory.mktemp("nvme-reference") / "ckpt"
    t0 = time.monotonic()
    runs = pools(2).run(_run, ["+stage=zero2", *NVME], str(root), steps=6, keep_last=0, seed=99, timeout=240)
    return {"root": root, "runs": runs, "seconds": time.monotonic() - t0}
