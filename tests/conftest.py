import os
import sys
from pathlib import Path

import pytest

# The CPU runs of the suite check what CUDA would need (framework.comm.accelerator): host/device
# placement and stream order of every copy of the offload path. Set before any rank is spawned.
os.environ.setdefault("FRAMEWORK_ACCELERATOR", "check")
# One torch thread in every process the suite starts (the fork server of tests/cli/_forkrun.py, a recipe's
# jobs, fresh `python -m framework.*` runs), as in this one (_one_thread below): torch reads this when it is
# imported, not later. With a thread per core beside the other pytest worker, OpenMP's spinning threads
# burnt several times the CPU time (a 4-job README sweep: 18 s of CPU instead of 5 s).
os.environ.setdefault("OMP_NUM_THREADS", "1")

from tests._pool import RankPool

# The files that take longest (in this order: seconds of a run on 2 cores, slowest first), handed out
# first. `make test` runs two workers that take one file at a time (--dist loadfile, with xdist's own
# reordering by test count turned off): a long file handed out last would run alone at the end while
# the other worker idles, which is how a 2-test file of 2 minutes used to end the run.
SLOW_FIRST = ["cli/test_cli.py", "cli/test_readme.py", "cli/test_recipes.py", "dist/test_offload.py",
              "cli/test_plan.py", "dist/test_zero3.py", "dist/test_zero12.py", "cli/test_estimate.py",
              "dist/test_nvme.py", "dist/test_checkpoint.py", "unit/test_bench.py", "cli/test_gpu_check.py",
              "dist/test_footprint.py", "config/test_dsconfig.py", "dist/test_numerics.py", "dist/test_nvme_memory.py",
              "dist/test_zero3_memory.py", "dist/test_hf.py"]


def pytest_collection_modifyitems(config, items):
    gone = [f for f in SLOW_FIRST if not (Path(__file__).parent / f).is_file()]
    if gone:
        raise pytest.UsageError(f"tests/conftest.py SLOW_FIRST names files that are not there: {gone}")
    rank = {f"tests/{f}": i for i, f in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))   # stable: files stay whole


@pytest.fixture(scope="session")
def pools():
    """Shared rank pools keyed by world size; a broken pool is replaced on next use."""
    made: dict[int, RankPool] = {}

    def get(world: int) -> RankPool:
        if world not in made or not made[world].alive:
            made[world] = RankPool(world)
        return made[world]

    yield get
    for pool in made.values():   # every pool's ranks wind down at once (a few seconds each)
        pool.stop()
    for pool in made.values():
        pool.close()


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    # Test models are tiny and rank pools run beside this process: extra intra-op threads
    # only oversubscribe the cores.
    import torch
    torch.set_num_threads(1)
    # What the imports made lives as long as the process: a full collection (each test's no_collection, each
    # job's start, Python's own) skips it instead of walking torch's ~200k objects (about 0.3 s a time).
    import gc
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True)
def _threads_kept():
    # torch's intra-op thread count changes the bits of bf16 kernels (a sum split otherwise): a test that left
    # it changed would make a later bitwise comparison in the same worker fail by the order the files ran in.
    import torch
    before = torch.get_num_threads()
    yield
    if torch.get_num_threads() != before:
        torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _sigint_kept():
    # A test that changes SIGINT's handler and leaves it so (ignored, as a rank's signal block leaves it, or
    # Python's own where the suite was started in the background with SIGINT ignored) makes a later Ctrl-C
    # test in the same worker pass or fail by the order the files ran in: the test that leaks it fails.
    import signal
    before = signal.getsignal(signal.SIGINT)
    yield
    after = signal.getsignal(signal.SIGINT)
    assert after is before, f"this test left SIGINT's handler {after!r} (it was {before!r})"


@pytest.fixture(autouse=True)
def _framework_env_kept():
    # Ranks forked or spawned later in the same worker inherit this process's environment: a FRAMEWORK_* variable
    # a test left set (FRAMEWORK_OPS=0: another optimizer kernel) makes a later test's fresh ranks differ from
    # its rank pool's reference by the order the files ran in. The test that leaks one fails.
    import os
    before = {k: v for k, v in os.environ.items() if k.startswith("FRAMEWORK_")}
    yield
    after = {k: v for k, v in os.environ.items() if k.startswith("FRAMEWORK_")}
    assert after == before, f"this test left the environment's FRAMEWORK_* variables {after} (they were {before})"


@pytest.fixture
def own_component(tmp_path, monkeypatch):
    """``use(group, name, code, yaml)``: a module ``name`` of ``code`` in the group's package (a folder of its own
    added to the package's path) with conf/<group>/<name>.yaml in a folder on Hydra's search path (returned)."""
    import importlib

    from framework.core.registry import GROUPS, registry

    added = []

    def use(group, name, code, yaml):
        package = importlib.import_module(GROUPS[group])
        folder = tmp_path / f"code{len(added)}"
        folder.mkdir()
        (folder / f"{name}.py").write_text(code)
        (tmp_path / "conf" / group).mkdir(parents=True, exist_ok=True)
        (tmp_path / "conf" / group / f"{name}.yaml").write_text(yaml)
        monkeypatch.setattr(package, "__path__", [*package.__path__[:1], str(folder)])
        added.append((package, name))
        sys.modules.pop(f"{package.__name__}.{name}", None)
        registry.cache_clear()
        return f"hydra.searchpath=[file://{tmp_path / 'conf'}]"

    yield use
    for package, name in added:
        sys.modules.pop(f"{package.__name__}.{name}", None)
        vars(package).pop(name, None)
    registry.cache_clear()
