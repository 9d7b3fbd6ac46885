"""Every stage x offload target, fp32, bf16 and fp16, equals a single-GPU reference (tests/gpu/_matrix.py):
one process on NCCL (world 1); two ranks over gloo with CUDA tensors sharing one GPU (the gloo
collectives the stages use there: broadcast and all-reduce); NCCL across GPUs where there are two
or more. Skipped without CUDA, except under FRAMEWORK_GPU_DRY=1 (the same code on the CPU).
What one GPU leaves unrun: NCCL's reduce-scatter, all-gather and per-owner reduce paths
(framework.comm.collectives.Nccl) and their streams, which need two GPUs."""
import pytest
import torch

from tests._pool import RankPool
from tests.gpu._matrix import CASES, DRY, PRECISIONS, compare, device_kind, record, reference, run, run_all

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = pytest.mark.skipif(not DRY and not GPUS, reason="needs CUDA (FRAMEWORK_GPU_DRY=1: on the CPU)")
OFFLOADED = {name for name, o in CASES.items() if any(x.startswith("offload=") for x in o)}


@pytest.fixture(scope="module")
def local():
    from framework.comm.distributed import connect
    return connect("gloo" if DRY else "nccl")   # world 1: no group; the device is cuda:0 (dry: the CPU)


@pytest.fixture(scope="module")
def refs(local):
    made = {}

    def get(precision: str, world: int) -> dict:
        if (precision, world) not in made:
            made[precision, world] = reference(precision, local, world)
        return made[precision, world]

    return get


def _check_all(results: dict, ref: dict, precision: str, world: int, backend: str) -> list[str]:
    failed = []
    for name, got in results.items():
        row = compare(got, ref, precision)
        record(check="equivalence", world=world, backend=backend, device=device_kind(), case=name,
               precision=precision, **row)
        if not row["ok"]:
            failed.append(f"{name}: {row}")
    return failed


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("name", list(CASES))
def test_one_process(name, precision, local, refs):
    got = run(local, name, precision)
    row = compare(got, refs(precision, 1), precision)
    record(check="equivalence", world=1, backend="nccl" if not DRY else "none", device=device_kind(), case=name,
           precision=precision, **row)
    assert row["ok"], f"{name} {precision} vs the single-device reference: {row}"
    if name in OFFLOADED:
        assert "cpu" in got["master_on"], got["master_on"]


@pytest.fixture(scope="module")
def gloo_pool():
    pool = RankPool(2, "gloo", device_kind())
    yield pool
    pool.close()


@pytest.mark.parametrize("precision", PRECISIONS)
def test_two_ranks_over_gloo_with_cuda_tensors(precision, gloo_pool, refs):
    out = gloo_pool.run(run_all, list(CASES), precision, timeout=600)
    failed = _check_all(out[0], refs(precision, 2), precision, 2, "gloo")
    assert not failed, "\n".join(failed)
    for name in CASES:   # the ranks agree
        if "params" in out[0][name]:
            assert torch.equal(out[0][name]["params"], out[1][name]["params"]), name


@pytest.mark.skipif(DRY or GPUS < 2, reason="NCCL across GPUs needs two or more")
@pytest.mark.parametrize("precision", PRECISIONS)
def test_nccl_across_gpus(precision, refs):
    world = min(GPUS, 4)
    pool = RankPool(world, "nccl")
    try:
        out = pool.run(run_all, list(CASES), precision, timeout=600)
    finally:
        pool.close()
    failed = _check_all(out[0], refs(precision, world), precision, world, "nccl")
    assert not failed, "\n".join(failed)
