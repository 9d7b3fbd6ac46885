"""offload=nvme (ZeRO-Infinity): the disk tier gives the same numbers as the host tier.

zero1/2/3 + offload=nvme are bitwise equal to offload=cpu (the same host kernels step the same
values; only where they live between steps differs) and within 1e-6 of offload=none, on 1 and 2
ranks (one nvme case of each stage on 4 too), fp32, bf16 and fp16, with gradient accumulation (2 micro
batches), with pipeline_read and pipeline_write on and off (bitwise equal to each other), and zero3
parameter shards on none, cpu and nvme (also with the optimizer in host memory). Tiles are small
(sub_group_size=1024, a few buffers) so every step swaps many of them. One pool call per world size
runs every case. Also: an IO error on one rank (a corrupted extent of the
optimizer's or of zero3's parameter swap file) fails every rank with the error, not a hang, in a step, a
checkpoint save or a weights export (both read the mapped swap file after checking it), as do a
failed zero3 shard read before eval_step, framework.gathered or consolidated_state_dict hands out its
values and a zero3 gradient write failing in a backward hook (raised once backward ends); a full
disk ends a CLI run with one line and an intact run directory; a too-small parameter buffer fails at
start-up, as does a max_in_cpu below the largest shard (in the estimate too). zero3's swapped gradients
read back on later micro batches reach the device without a host sync in the backward hook; their
read-back buffers exist only with more than one micro batch a step.
"""
import dataclasses
import os
import shutil
import tempfile

import pytest
import torch

import framework
from framework.comm.accelerator import CheckingCpuAccelerator
from framework.comm.distributed import Dist
from framework.core.errors import ConfigError, SwapIOError
from framework.persist.checkpoint import Checkpointer
from framework.models.gpt import gpt_loss
from tests._helpers import build_gpt, no_collection, tiny_config

BASE = ["model.d_model=33", "model.n_head=3", "train.steps=3", "train.micro_batch=2", "train.grad_accum=2",
        "train.grad_clip=0.05"]
NVME = ["offload=nvme", "offload.sub_group_size=1024", "offload.buffer_count=3"]
RTOL = 1e-6
# The 16-bit cases at the full lr: in the warm-up a 16-bit weight near 1.0 (LayerNorm's) moves less than half
# an ulp in three steps, so a 16-bit working copy that was never written back would equal the reference.
BF16 = ["precision=bf16", "scheduler=constant"]
FP16 = ["precision=fp16", "precision.initial_scale_power=8", "scheduler=constant"]   # 2^8: no step overflows

# name -> (overrides, reference name it must equal bitwise, or None)
CASES = {
    "zero1 none": (["+stage=zero1"], None),
    "zero1 cpu": (["+stage=zero1", "offload=cpu"], None),
    "zero1 nvme": (["+stage=zero1", *NVME], "zero1 cpu"),
    "zero2 cpu": (["+stage=zero2", "stage.reduce_bucket_size=1500", "offload=cpu"], None),
    "zero2 nvme piped": (["+stage=zero2", "stage.reduce_bucket_size=1500", *NVME, "offload.pipeline_read=true",
                          "offload.pipeline_write=true"], "zero2 cpu"),
    "zero2 nvme": (["+stage=zero2", "stage.reduce_bucket_size=1500", *NVME], "zero2 nvme piped"),
    "zero2 bf16 none": (["+stage=zero2", *BF16], None),
    "zero2 bf16 cpu": (["+stage=zero2", *BF16, "offload=cpu"], None),
    "zero2 bf16 nvme": (["+stage=zero2", *BF16, *NVME, "offload.pipeline_read=true"], "zero2 bf16 cpu"),
    "zero3 none": (["+stage=zero3"], None),
    "zero3 cpu": (["+stage=zero3", "offload=cpu"], None),
    "zero3 nvme": (["+stage=zero3", *NVME, "offload.params=none"], "zero3 cpu"),
    "zero3 cpu params=cpu": (["+stage=zero3", "offload=cpu", "offload.params=cpu"], None),
    "zero3 nvme params=cpu": (["+stage=zero3", *NVME, "offload.params=cpu"], "zero3 cpu params=cpu"),
    "zero3 nvme params=nvme": (["+stage=zero3", *NVME, "offload.param_buffer_count=2",
                                "offload.pipeline_write=true"], "zero3 cpu params=cpu"),
    # (the tile keys are refused with the optimizer in host memory: they would do nothing)
    "zero3 nvme optimizer=cpu params=nvme": (["+stage=zero3", "offload=nvme", "offload.optimizer=cpu", "offload.params=nvme",
                                              "offload.param_buffer_count=2"], "zero3 cpu params=cpu"),
    "zero3 bf16 none": (["+stage=zero3", *BF16], None),
    "zero3 bf16 cpu params=cpu": (["+stage=zero3", *BF16, "offload=cpu", "offload.params=cpu"], None),
    "zero3 bf16 nvme params=nvme": (["+stage=zero3", *BF16, *NVME], "zero3 bf16 cpu params=cpu"),
    # fp16 (loss scaling, unscaled in the host step) and zero1's 16-bit host path against no offload
    "zero1 fp16 none": (["+stage=zero1", *FP16], None),
    "zero1 fp16 nvme": (["+stage=zero1", *FP16, *NVME], None),
}
# offload=nvme within 1e-6 of offload=none (the reference of each nvme case's reference chain)
PLAIN = {"zero1 nvme": "zero1 none", "zero2 nvme": "zero1 none", "zero2 nvme piped": "zero1 none",
         "zero2 bf16 nvme": "zero2 bf16 none", "zero3 nvme": "zero3 none", "zero3 nvme params=nvme": "zero3 none",
         "zero3 bf16 nvme params=nvme": "zero3 bf16 none", "zero1 fp16 nvme": "zero1 fp16 none"}
# (a misspelt reference would skip its comparison, not fail)
assert {r for _, r in CASES.values()} - {None} <= set(CASES) >= set(PLAIN) | set(PLAIN.values())


def _run(dist, overrides, folder):
    extra = [f"offload.nvme_path={folder}"] if "offload=nvme" in overrides else []
    if "+stage=zero3" in overrides:
        extra.append("stage.stage3_param_persistence_threshold=0")
    cfg = tiny_config(*BASE, *overrides, *extra)
    module, data = build_gpt(cfg)
    losses = []
    with framework.initialize(module, gpt_loss, cfg, dist) as engine:
        state = engine.state
        for _ in range(cfg.train.steps):
            batch = data.train_batch(state.data, micro_batch=2, grad_accum=2, rank=dist.rank, world=dist.world)
            state, m = engine.train_step(state, batch)
            assert not m["skipped"], f"{overrides}: step {state.step} skipped (it would compare no update)"
            losses.append(m["loss"])
        with framework.gathered(list(module.parameters())):
            full = torch.cat([p.detach().reshape(-1).float() for p in module.parameters()])
        masters = [t.clone() for t in state.params] if "offload=nvme" not in overrides else None
    return losses, full, masters, sorted(os.listdir(folder)) if extra else []


def _matrix(dist, names):
    out = {}
    with tempfile.TemporaryDirectory(prefix="nvme-test-") as folder:
        for name in names:
            out[name] = _run(dist, CASES[name][0], folder)
    return out


def _local():
    from framework.comm.distributed import connect
    return connect("gloo")


# On 4 ranks (gloo reduces to each owner; 2 ranks all-reduce) one nvme case of each stage against offload=none
# (PLAIN), and zero2 cpu = nvme bitwise. zero1 cpu = nvme and zero3 params=cpu = params=nvme bitwise are checked
# on 1 and 2 ranks; test_offload compares offload=cpu with none on 4 ranks for zero2 (offload ratio 0.5) and
# zero3 params=cpu only.
WORLD_4 = ("zero1 none", "zero1 nvme", "zero2 cpu", "zero2 nvme piped", "zero3 none", "zero3 nvme params=nvme")


@pytest.mark.parametrize("world", [1, 2, 4])
def test_nvme_equals_cpu_bitwise_and_none_within_1e6(pools, world):
    names = WORLD_4 if world == 4 else tuple(CASES)
    results = [_matrix(_local(), names)] if world == 1 else pools(world).run(_matrix, names, timeout=400)
    for rank, res in enumerate(results):
        for name in names:
            losses, full, _, left = res[name]
            assert left == [], f"{name}: swap files left behind: {left}"
            if (ref := CASES[name][1]) is not None and (world < 4 or ref in res):   # (not all run on 4 ranks)
                assert losses == res[ref][0], f"rank {rank} {name} vs {ref}: losses differ"
                assert torch.equal(full, res[ref][1]), f"rank {rank} {name} vs {ref}: parameters differ (bitwise)"
        for name, plain in PLAIN.items():
            if world == 4 and (name not in res or plain not in res):
                continue
            for i, (a, b) in enumerate(zip(res[name][0], res[plain][0])):
                assert a == pytest.approx(b, rel=RTOL), f"rank {rank} {name} step {i}: {a} vs {plain} {b}"
            torch.testing.assert_close(res[name][1], res[plain][1], rtol=RTOL, atol=1e-7)


def _corrupt_one_rank(dist, folder, stage, kind, then="step"):
    """Rank 1 corrupts its swap file after the first step: every rank must raise, none hang, in the
    next step (``then``="step"), checkpoint save ("save") or weights export ("save_weights")."""
    extra = ["stage.stage3_param_persistence_threshold=0"] if stage == "zero3" else []
    cfg = tiny_config(*BASE, f"+stage={stage}", *NVME, f"offload.nvme_path={folder}/r{dist.rank}", *extra,
                      f"checkpoint.dir={folder}/ckpt", "checkpoint.timeout_s=60")
    module, data = build_gpt(cfg)
    with framework.initialize(module, gpt_loss, cfg, dist) as engine:
        state = engine.state
        batch = data.train_batch(0, micro_batch=2, grad_accum=2, rank=dist.rank, world=dist.world)
        state, _ = engine.train_step(state, batch)
        if dist.rank == 1:
            path = os.path.join(folder, "r1", f"rank00001.{kind}.swap")
            with open(path, "r+b") as f:
                f.seek(0 if kind == "params" else 8192)
                f.write(os.urandom(64))
        ckpt = Checkpointer(cfg, engine)
        try:
            if then == "step":
                engine.train_step(state, batch)
            elif then == "save":
                ckpt.save(state)
            else:
                engine.save_pretrained(os.path.join(folder, "weights"))
        except framework.FrameworkError as e:
            return type(e).__name__, str(e)
        finally:
            ckpt.close()
    return None


@pytest.mark.parametrize("stage,kind", [("zero2", "optim"), ("zero3", "params")])
def test_io_error_on_one_rank_fails_every_rank(pools, tmp_path, stage, kind):
    """A corrupted extent (checksum mismatch on read) of the optimizer's swap file (read by the host
    step) or of zero3's parameter file (read before a gather, in forward)."""
    results = pools(2).run(_corrupt_one_rank, str(tmp_path), stage, kind, timeout=120)
    assert results[0] is not None and results[1] is not None, results
    assert all(name == "SwapIOError" for name, _ in results), results
    assert f"rank00001.{kind}.swap" in results[1][1], results[1]   # the failing rank names file and offset
    assert "another rank failed" in results[0][1], results[0]


def _read_after_corrupting_params(dist, folder):
    """Rank 1 corrupts its zero3 parameter swap file after a step; then eval_step, framework.gathered,
    consolidated_state_dict, a bare forward, close: None or (error name, message) of each."""
    cfg = tiny_config(*BASE, "+stage=zero3", *NVME, f"offload.nvme_path={folder}/r{dist.rank}",
                      "stage.stage3_param_persistence_threshold=0")
    module, data = build_gpt(cfg)
    engine = framework.initialize(module, gpt_loss, cfg, dist)
    batch = data.train_batch(0, micro_batch=2, grad_accum=2, rank=dist.rank, world=dist.world)
    state, _ = engine.train_step(engine.state, batch)
    if dist.rank == 1:
        with open(os.path.join(folder, "r1", "rank00001.params.swap"), "r+b") as f:
            f.write(os.urandom(64))
    out = []
    for call in (lambda: engine.eval_step(state, batch.micro), lambda: framework.gathered(list(module.parameters())).__enter__(),
                 engine.consolidated_state_dict, lambda: gpt_loss(module, batch.micro[0]), engine.close):
        try:
            with torch.no_grad():
                call()
            out.append(None)
        except framework.FrameworkError as e:
            out.append((type(e).__name__, str(e)))
    engine.close()
    return out


def test_a_failed_shard_read_fails_eval_gathered_and_consolidation_on_every_rank(pools, tmp_path):
    """A failed read gives its gather zeros (so no peer waits in it); the zeros never reach a caller:
    eval_step, framework.gathered and consolidated_state_dict raise on every rank (the failing one
    naming the file), and a failure no agreement saw (a bare forward) is raised by close."""
    results = pools(2).run(_read_after_corrupting_params, str(tmp_path), timeout=120)
    for rank0, rank1 in zip(*(r[:3] for r in results)):
        assert rank0 is not None and "another rank failed" in rank0[1] and rank0[0] == "SwapIOError", results[0]
        assert rank1 is not None and rank1[0] == "SwapIOError" and "rank00001.params.swap" in rank1[1], results[1]
    assert results[0][3:] == [None, None] and results[1][3] is None and results[1][4][0] == "SwapIOError", results


def _fail_a_gradient_write_on_one_rank(dist, folder):
    """zero3 with its gradients in the swap file: rank 1's writes fail (EIO) from the second step on,
    first inside a backward hook; (error name, message) of what each rank raised."""
    import errno

    from framework.offload._store import Tier
    from framework.offload._swapfile import Syscalls

    class Failing(Syscalls):
        armed = False

        def pwritev(self, fd, bufs, offset):
            if self.armed:
                raise OSError(errno.EIO, "injected")
            return super().pwritev(fd, bufs, offset)

    cfg = tiny_config(*BASE, "+stage=zero3", *NVME, f"offload.nvme_path={folder}/r{dist.rank}",
                      "stage.stage3_param_persistence_threshold=0")
    module, data = build_gpt(cfg)
    with framework.initialize(module, gpt_loss, cfg, dist) as engine:
        fail = engine.components.stage.offload.stores[Tier.DISK].file.syscalls = Failing()
        batch = data.train_batch(0, micro_batch=2, grad_accum=2, rank=dist.rank, world=dist.world)
        state, _ = engine.train_step(engine.state, batch)
        fail.armed = dist.rank == 1
        try:
            engine.train_step(state, batch)
        except framework.FrameworkError as e:
            return type(e).__name__, str(e)
        finally:
            fail.armed = False
    return None


def test_a_gradient_write_failing_in_backward_fails_every_rank(pools, tmp_path):
    """The failure is kept until backward ends (the hook that met it must not raise on one rank only,
    leaving the others in the next reduction): then every rank raises SwapIOError, the failing one
    naming the file."""
    results = pools(2).run(_fail_a_gradient_write_on_one_rank, str(tmp_path), timeout=120)
    assert results[1] is not None and results[1][0] == "SwapIOError", results
    assert "swap write of" in results[1][1] and "rank00001.optim.swap" in results[1][1], results[1]
    assert results[0] is not None and results[0][0] == "SwapIOError", results
    assert "another rank failed while writing or reading back zero3's gradients" in results[0][1], results[0]


def _fail_copy_back_on_one_rank(dist, folder, overlap):
    """zero3 with its shards on NVMe and the optimizer in host memory: rank 1's read of a shard for the
    copy back after the host step fails (the forward's reads succeeded); with ``overlap`` the pieces
    stepped during backward are copied back first."""
    cfg = tiny_config(*BASE, "+stage=zero3", "offload=nvme", "offload.optimizer=cpu", f"offload.nvme_path={folder}/r{dist.rank}",
                      "stage.stage3_param_persistence_threshold=0", f"offload.overlap_step={overlap}",
                      *(["train.grad_clip=0"] if overlap else []))   # (a clipped step is never speculated)
    module, data = build_gpt(cfg)
    with framework.initialize(module, gpt_loss, cfg, dist) as engine:
        batch = data.train_batch(0, micro_batch=2, grad_accum=2, rank=dist.rank, world=dist.world)
        state, _ = engine.train_step(engine.state, batch)
        if dist.rank == 1:
            def fail(group):
                raise SwapIOError(f"injected: reading group {group}'s shard on rank 1")
            engine.components.stage.offload.shards._hold = fail
        try:
            for _ in range(2):   # (without agreement rank 0 finishes this step and waits in the next one's gather)
                state, _ = engine.train_step(state, batch)
        except framework.FrameworkError as e:
            return type(e).__name__, str(e), engine.components.update.kept
    return None


@pytest.mark.parametrize("overlap", [False, True])
def test_a_shard_read_failing_at_the_copy_back_fails_every_rank(pools, tmp_path, overlap):
    """The copy back reads the shard it writes into; a rank whose read fails must not leave the other
    waiting in the gather that follows the host step."""
    results = pools(2).run(_fail_copy_back_on_one_rank, str(tmp_path), overlap, timeout=120)
    assert results[1] is not None and "injected" in results[1][1], results
    assert results[0] is not None and "another rank failed" in results[0][1], results
    assert (results[1][2] > 0) == overlap, results   # with overlap: the speculated pieces' copy back failed


@pytest.mark.parametrize("then", ["save", "save_weights"])
def test_a_damaged_swap_file_fails_a_save_on_every_rank(pools, tmp_path, then):
    """A checkpoint save (or weights export) reads the swapped state from the mapped swap file after
    checking it against the IO engine's checksums: a corrupted extent on rank 1 fails every rank at
    once, naming the file, and nothing is committed."""
    results = pools(2).run(_corrupt_one_rank, str(tmp_path), "zero2", "optim", then, timeout=120)
    assert results[0] is not None and results[1] is not None, results
    assert results[1][0] == "SwapIOError" and "rank00001.optim.swap" in results[1][1], results[1]
    assert "checksum mismatch" in results[1][1] and "another rank" in results[0][1], results[0]
    assert not (tmp_path / "ckpt" / "latest").exists() and not (tmp_path / "weights").exists()


def test_too_small_parameter_buffer_fails_at_start_up_and_in_the_estimate_alike(tmp_path):
    """param_buffer_size is a floor (the slots hold the largest shard): below it the engine and the estimate refuse
    with the same line (the estimate printed a prediction); the floor advised is exact: it is accepted, one less not."""
    from framework.memory.model import predict

    def cfg(size):
        return tiny_config(*BASE, "+stage=zero3", "offload=nvme", f"offload.param_buffer_size={size}",
                           f"offload.nvme_path={tmp_path}")

    def refused(size):
        with pytest.raises(framework.ConfigError, match=rf"offload.param_buffer_size={size} is smaller than the "
                                                        r"largest parameter shard \((\d+) elements\): set "
                                                        r"offload.param_buffer_size >= \1$") as engine:
            framework.initialize(build_gpt(cfg(size))[0], gpt_loss, cfg(size), _local())
        assert [p for p in tmp_path.iterdir() if p.suffix == ".swap"] == []
        with pytest.raises(framework.ConfigError) as estimate:
            predict(cfg(size), 1)
        assert str(estimate.value) == str(engine.value)
        return int(str(engine.value).rsplit(">= ", 1)[1])

    floor = refused(10)
    assert refused(floor - 1) == floor
    predict(cfg(floor), 1)
    framework.initialize(build_gpt(cfg(floor))[0], gpt_loss, cfg(floor), _local()).close()


def test_max_in_cpu_below_the_largest_shard_is_refused_by_the_engine_and_the_estimate_alike(tmp_path):
    """offload.params=nvme with max_in_cpu below the largest shard leaves the parameter pool no slot:
    the engine's pre-flight refuses it, and the estimator refuses it with the same line (it printed a
    0-slot pool)."""
    from framework.memory.model import predict

    cfg = tiny_config(*BASE, "+stage=zero3", "offload=nvme", "offload.max_in_cpu=10", f"offload.nvme_path={tmp_path}")
    with pytest.raises(framework.ConfigError, match=r"offload.max_in_cpu=10 is smaller than the largest") as engine:
        framework.initialize(build_gpt(cfg)[0], gpt_loss, cfg, _local())
    with pytest.raises(framework.ConfigError) as estimate:
        predict(cfg, 1)
    assert str(estimate.value) == str(engine.value)


def test_the_ram_bound_counts_an_optimizer_tile_pool_only_where_one_exists(tmp_path, monkeypatch):
    """zero3's early host-memory bound (before any file or pool exists) counts the optimizer's tile pool
    only for offload.optimizer=nvme: with optimizer=cpu the state lives in host memory as under
    offload=cpu and no such pool is made, so a host that holds the parameter pool is not refused."""
    import framework.offload._disk as disk

    tiles = ["offload.sub_group_size=4096", "offload.buffer_count=64", "offload.param_buffer_count=2",
             "offload.param_buffer_size=30000", f"offload.nvme_path={tmp_path}"]
    # room for the parameter pool (at most 2 x 30,000 fp32 elements: 240 kB), not also for the optimizer's
    # 64 tiles of 4096 fp32 elements (1 MiB)
    monkeypatch.setattr(disk, "available_ram", lambda: 512 << 10)
    for optimizer, refused in (("nvme", True), ("cpu", False)):
        # (optimizer=cpu refuses the tile keys: its pool would be 4 tiles of 10^7, if it were counted)
        keys = tiles if optimizer == "nvme" else tiles[2:]
        cfg = tiny_config(*BASE, "+stage=zero3", "offload=nvme", f"offload.optimizer={optimizer}", *keys)
        if refused:
            with pytest.raises(framework.ConfigError, match="swap buffer pools need at least"):
                framework.initialize(build_gpt(cfg)[0], gpt_loss, cfg, _local())
        else:
            framework.initialize(build_gpt(cfg)[0], gpt_loss, cfg, _local()).close()


def test_the_early_ram_bound_counts_the_pools_zero3_makes(tmp_path, monkeypatch):
    """zero3's early host-memory bound cuts tiles and counts slots as the engine does (in each unit group's
    partition, no more slots than tiles): with DeepSpeed's sub_group_size of 10^9 and a buffer_count far
    above the tiles, a host with room for exactly the pools the engine allocates is not refused."""
    import framework.offload._disk as disk

    cfg = tiny_config(*BASE, "+stage=zero3", "offload=nvme", "offload.sub_group_size=1000000000",
                      "offload.buffer_count=100000", f"offload.nvme_path={tmp_path}")
    with framework.initialize(build_gpt(cfg)[0], gpt_loss, cfg, _local()) as engine:
        items = engine.memory(engine.state).nonzero()[0]
    pools = sum(host for name, (_, host) in items.items() if name.startswith("nvme_"))
    assert {"nvme_optimizer_pool", "nvme_param_pool"} <= items.keys(), items
    monkeypatch.setattr(disk, "available_ram", lambda: pools)
    framework.initialize(build_gpt(cfg)[0], gpt_loss, cfg, _local()).close()


def _refused_on_rank_1(dist, folder, why):
    import errno

    import framework.offload._disk as disk
    import framework.offload._diskshards as diskshards

    path = f"{folder}/afile/r1" if dist.rank == 1 and why == "path" else f"{folder}/r{dist.rank}"
    cfg = tiny_config(*BASE, "+stage=zero3", "stage.stage3_param_persistence_threshold=0", "offload=nvme",
                      f"offload.nvme_path={path}", *(["offload.params=nvme"] if why == "spill" else []))
    real, write_at = disk.available_ram, diskshards.write_at
    if dist.rank == 1 and why == "ram":   # this rank's host has no room for the swap pools; rank 0's has
        disk.available_ram = lambda: 1 << 10
    if dist.rank == 1 and why == "spill":   # this rank's disk fills after the pre-flight
        def full(*args):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        diskshards.write_at = full
    try:
        framework.initialize(build_gpt(cfg)[0], gpt_loss, cfg, dist).close()
    except framework.FrameworkError as e:
        return type(e).__name__, str(e)
    finally:
        disk.available_ram, diskshards.write_at = real, write_at
    return None


@pytest.mark.parametrize("why,says", [("ram", "offload: the swap buffer pools need at least"),
                                      ("path", "offload.nvme_path={}/afile/r1: cannot create it"),
                                      ("spill", "nvme: cannot spill the zero3 parameter shards to {}/r1 while")])
def test_a_rank_refused_by_the_early_bound_stops_every_rank(pools, tmp_path, why, says):
    """zero3's early disk, swap folder and host-memory check is judged per rank: a rank it refuses must not
    leave the others waiting in the set-up's collectives; every rank raises, rank 0 naming rank 1's reason,
    and the swap folder rank 0 made is removed. So does a failed spill of the parameter shards while the model
    is built (after that check: the disk filled since), at the parameter swap file's pre-flight."""
    (tmp_path / "afile").write_text("")
    says = says.format(tmp_path)
    results = pools(2).run(_refused_on_rank_1, str(tmp_path), why, timeout=120)
    assert results[1] is not None and results[1][0] == ("SwapIOError" if why == "spill" else "ConfigError") \
        and results[1][1].startswith(says), results
    assert results[0] is not None and f"failed on another rank: rank 1: {says}" in results[0][1], results
    assert os.listdir(tmp_path) == ["afile"]


def test_disk_full_ends_with_one_clear_line_and_an_intact_run_directory(tmp_path):
    """A file system without room for the swap file (here: a 256 KiB file size limit, RLIMIT_FSIZE, on
    the training process) stops the CLI run before the first step with one line naming the swap file
    and the fix, exit code 1; the run directory (there before: a folder made for a refused run is
    removed) keeps what it had and no swap file remains."""
    import resource
    import subprocess
    import sys
    from pathlib import Path

    from tests._helpers import TINY

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "notes.txt").write_text("the user's")
    root = Path(__file__).resolve().parents[2]

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 1024, 256 * 1024))

    cmd = [sys.executable, "-m", "framework.train", *TINY, "train.steps=2", "+stage=zero2", "offload=nvme",
           f"hydra.run.dir={run_dir}"]
    out = subprocess.run(cmd, cwd=root, env={**os.environ, "PYTHONPATH": str(root)}, capture_output=True, text=True,
                         timeout=120, preexec_fn=limit)
    assert out.returncode == 1, out.stderr[-2000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "cannot reserve" in errors[0] and "rank00000.optim.swap" in errors[0] \
        and "offload.nvme_path" in errors[0], out.stderr[-2000:]
    left = sorted(p.name for p in run_dir.iterdir())
    # refused before its first step: no record of a run that never trained (train.log says why)
    assert "notes.txt" in left and "train.log" in left and ".hydra" not in left and "nvme" not in left, left
    assert not list(run_dir.rglob("*.swap")), left


def _checkpoint_round_trip(dist, folder, precision):
    """Both directions between offload=cpu and offload=nvme after 2 steps: a cpu run's state_dict
    loaded into a fresh nvme engine, and an nvme run's state_dict loaded into a fresh cpu engine, each
    continue for 2 steps with the losses and parameters of the run they were saved from."""
    def engine(overrides):
        cfg = tiny_config(*BASE, "+stage=zero2", f"precision={precision}", *overrides)
        module, data = build_gpt(cfg)
        return framework.initialize(module, gpt_loss, cfg, dist), data, module

    def steps(eng, data, state, n):
        losses = []
        for _ in range(n):
            batch = data.train_batch(state.data, micro_batch=2, grad_accum=2, rank=dist.rank, world=dist.world)
            state, m = eng.train_step(state, batch)
            losses.append(m["loss"])
        return state, losses

    def flat(module):
        return torch.cat([p.detach().reshape(-1).float() for p in module.parameters()])

    cpu, nvme = ["offload=cpu"], [*NVME, f"offload.nvme_path={folder}/r{dist.rank}"]
    out = []
    for src, dst in ((cpu, nvme), (nvme, cpu)):
        e_src, d_src, m_src = engine(src)
        s_src, _ = steps(e_src, d_src, e_src.state, 2)
        saved = dist.all_gather_object(e_src.state_dict(s_src), what="test state gather")
        e_dst, d_dst, m_dst = engine(dst)
        s_dst = e_dst.load_state_dict(e_dst.state, saved)
        _, l_src = steps(e_src, d_src, s_src, 2)
        _, l_dst = steps(e_dst, d_dst, s_dst, 2)
        out += [l_src == l_dst, torch.equal(flat(m_src), flat(m_dst))]
        e_src.close()
        e_dst.close()
    return out


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_checkpoint_of_an_nvme_run(pools, tmp_path, precision):
    for rank, res in enumerate(pools(2).run(_checkpoint_round_trip, str(tmp_path), precision, timeout=180)):
        assert res == [True] * 4, f"rank {rank}: cpu->nvme losses, parameters; nvme->cpu losses, parameters: {res}"


def test_checkpointer_resume_of_an_nvme_run_is_bitwise(pools, tmp_path):
    """framework.persist.checkpoint with zero3 + offload=nvme (master, Adam state and parameter shards on disk),
    bf16, gradient accumulation: the resumed run continues with the same losses and the same state
    (the save reads the swapped tiles, the load writes them back)."""
    from tests.dist.test_checkpoint import K, _same_state, _train

    over = ["+stage=zero3", "precision=bf16", "train.grad_accum=2", "stage.stage3_param_persistence_threshold=0",
            *NVME]
    a = pools(2).run(_train, over, str(tmp_path), timeout=240)
    b = pools(2).run(_train, over, str(tmp_path / f"step-{K}"), resume=str(tmp_path / f"step-{K}"), seed=99,
                     timeout=240)
    for rank in range(2):
        assert b[rank][0] == a[rank][0][K:], f"rank {rank}: losses {b[rank][0]} vs {a[rank][0][K:]}"
    _same_state([r[1] for r in a], [r[1] for r in b], "zero3 bf16 nvme")


def _start(capsys, *overrides) -> tuple[str, str]:
    """Build an engine (its swap files written), close it; (stdout, stderr)."""
    cfg = tiny_config(*BASE, "+stage=zero2", *NVME, *overrides)
    with framework.initialize(build_gpt(cfg)[0], gpt_loss, cfg, _local()):
        pass
    out = capsys.readouterr()
    return out.out, out.err


def test_an_empty_nvme_path_is_refused_at_engine_build(tmp_path, monkeypatch):
    """A config made without framework.config's checks (library use): no swap files in the working directory."""
    monkeypatch.chdir(tmp_path)
    cfg = tiny_config(*BASE, "+stage=zero2", *NVME)
    cfg = dataclasses.replace(cfg, offload=dataclasses.replace(cfg.offload, nvme_path=""))
    with pytest.raises(ConfigError, match="offload.nvme_path is empty: give a folder"):
        framework.initialize(build_gpt(cfg)[0], gpt_loss, cfg, _local())
    assert list(tmp_path.iterdir()) == []


def test_the_start_up_line_names_a_relative_swap_folder_in_full(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    out, _ = _start(capsys, "offload.nvme_path=swap")
    assert f" to {tmp_path / 'swap' / 'rank00000.optim.swap'}; host pool " in out, out


def test_a_swap_folder_in_memory_is_one_warning_line(tmp_path, capsys):
    """tmpfs/ramfs keep the "swap" files in RAM (shared memory, not in the resident set): a model larger
    than host memory would silently not fit. A warning, not a refusal (small runs use such folders)."""
    from framework.offload._swapfolder import memory_fs

    if memory_fs("/dev/shm") is None:
        pytest.skip("no tmpfs at /dev/shm")
    _, err = _start(capsys, f"offload.nvme_path={tmp_path}")
    assert "offload.nvme_path" not in err or memory_fs(tmp_path)   # a disk: no warning
    folder = tempfile.mkdtemp(prefix="nvme-test-", dir="/dev/shm")
    try:
        _, err = _start(capsys, f"offload.nvme_path={folder}")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    assert [line for line in err.splitlines() if "offload.nvme_path" in line] == [
        f"warning: offload.nvme_path={folder} is on tmpfs, which keeps files in host memory: the swap files "
        "will take RAM, not disk; set offload.nvme_path to a folder on a disk"]


def test_without_nvme_path_swap_files_avoid_a_temp_folder_in_memory(tmp_path, monkeypatch, capsys):
    """Library use without offload.nvme_path: the temporary folder, or /var/tmp when that one is in memory,
    said in one line; never a tmpfs when a disk folder is at hand."""
    from framework.offload._swapfolder import memory_fs

    if memory_fs("/dev/shm") is None or memory_fs("/var/tmp") or not os.access("/var/tmp", os.W_OK):
        pytest.skip("needs a tmpfs at /dev/shm and a writable /var/tmp on a disk")
    monkeypatch.setattr(tempfile, "tempdir", "/dev/shm")   # (tempfile's documented override)
    out, err = _start(capsys)
    said = [line for line in out.splitlines() if "offload.nvme_path is not set" in line]
    assert len(said) == 1 and " the swap files go to /var/tmp/framework-nvme-" in said[0], out
    assert "offload.nvme_path" not in err
    assert not [p for p in os.listdir("/var/tmp") if p.startswith("framework-nvme-") and said[0].find(p) > 0]


_UNCLOSED = """
import os, sys
import framework
from framework.comm.distributed import connect
from framework.models.gpt import gpt_loss
from tests._helpers import build_gpt, tiny_config

def start(*extra):
    cfg = tiny_config("+stage=zero3", "offload=nvme", *extra)   # the optimizer's and the shards' files
    module, data = build_gpt(cfg)
    engine = framework.initialize(module, gpt_loss, cfg, connect("gloo"))
    engine.train_step(engine.state, data.train_batch(0, micro_batch=2, grad_accum=1, rank=0, world=1))
    return engine, module

made = sys.argv[1]
kept = [start(f"offload.nvme_path={made}"), start()]   # a folder pre-flight makes; the private temporary one
print("made:", sorted(os.listdir(made)), flush=True)
raise RuntimeError("the script dies with its engines never closed")
"""


def test_an_engine_never_closed_leaves_no_swap_file_or_folder(tmp_path):
    """Library use without ``with`` or ``close``, the script ended by an uncaught error: at exit the
    engines' swap files are removed, with the folder pre-flight made for them and the private temporary
    folder (offload.nvme_path unset)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    made, tmp = tmp_path / "made", tmp_path / "tmp"
    tmp.mkdir()
    out = subprocess.run([sys.executable, "-c", _UNCLOSED, str(made)], cwd=root, capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": str(root), "TMPDIR": str(tmp)})
    assert out.returncode == 1 and "the script dies" in out.stderr, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert "made: ['rank00000.optim.swap', 'rank00000.optim.swap.manifest.json', 'rank00000.params.swap', " \
           "'rank00000.params.swap.manifest.json']" in lines, out.stdout
    assert not made.exists(), os.listdir(made)
    said = [line for line in lines if "offload.nvme_path is not set" in line]
    assert len(said) == 1, out.stdout
    private = said[0].split(" the swap files go to ")[1].split(" ")[0]
    assert "framework-nvme-" in private and not os.path.exists(private), out.stdout
    assert not os.listdir(tmp), os.listdir(tmp)


def test_state_dict_reads_the_swapped_masters_that_the_state_holds_as_placeholders(tmp_path):
    """Under offload.optimizer=nvme the state's swapped master pieces and moments are placeholders between
    steps (zero strides; docs/library.md, docs/nvme.md): ``engine.state_dict(state)`` is the way to read
    them, and gives offload=cpu's values bitwise."""
    def whole(sd):   # name -> (master, moments...) over the fragments, whatever the tiling
        out = {}
        for name, entry in sd["params"].items():
            for f in entry["fragments"]:
                parts = out.setdefault(name, {})
                for key, t in (("master", f["master"]), *f["optim"].items()):
                    parts.setdefault(key, []).append((f["range"], t))
        return {(name, key): torch.cat([t for _, t in sorted(frags, key=lambda x: x[0])])
                for name, parts in out.items() for key, frags in parts.items()}

    def run(*offload):
        cfg = tiny_config(*BASE, "+stage=zero2", *offload)
        module, data = build_gpt(cfg)
        with framework.initialize(module, gpt_loss, cfg, _local()) as engine:
            state, _ = engine.train_step(engine.state, data.train_batch(0, micro_batch=2, grad_accum=2, rank=0, world=1))
            return [t.stride() for t in state.params], whole(engine.state_dict(state))
    strides, cpu = run("offload=cpu")
    parked, nvme = run(*NVME, f"offload.nvme_path={tmp_path}")
    assert all(s != (0,) for s in strides) and all(s == (0,) for s in parked), parked
    assert cpu.keys() == nvme.keys() and all(t.abs().sum() > 0 for t in nvme.values())
    for key, t in cpu.items():
        assert torch.equal(t, nvme[key]), key


@pytest.mark.parametrize("pin", ["true", "false"])
def test_zero3_gradients_read_back_from_the_swap_file_reach_the_device_without_a_host_sync(tmp_path, pin):
    """zero3's swapped gradient partitions, read back on every micro batch after the first: the backward
    hook waits for the read (IO) only; the copies to and from the device are queued (pinned, on the H2D
    and D2H streams, even with offload.pin_memory=false) and ordered by events, which the checker verifies."""
    cfg = tiny_config(*BASE, "+stage=zero3", *NVME, "offload.params=none", f"offload.nvme_path={tmp_path}",
                      "stage.stage3_param_persistence_threshold=0", f"offload.pin_memory={pin}")
    module, data = build_gpt(cfg)
    acc = CheckingCpuAccelerator()
    with framework.initialize(module, gpt_loss, cfg, Dist(0, 1, 0, torch.device("cpu"), None, 60.0,
                                                          accelerator=acc)) as engine:
        off, used, latest = engine.components.stage.offload, [], [None]
        load_grad, read_back = off.load_grad, off._read_back

        def loaded(group):   # the event of the copy to the device queued last
            before = [ev for _, ev in off.landings]
            out = load_grad(group)
            latest[0] = next((ev for (_, ev), old in zip(off.landings, before) if ev is not old), latest[0])
            return out

        def read(group):   # the landing a read takes, and whether it waits for that copy
            future, k = read_back(group)
            used.append((k, off.landings[k][1] is not None and off.landings[k][1] is latest[0]))
            return future, k
        off.load_grad, off._read_back = loaded, read
        state = engine.state
        for _ in range(2):   # (the second step reads ahead in the order the first one learned)
            state, _ = engine.train_step(state, data.train_batch(state.data, micro_batch=2, grad_accum=2,
                                                                 rank=0, world=1))
        landings = off.landings
    acc.verify()
    assert len(landings) == 2   # pinned buffers for the read back, reused: one read ahead, one read now
    # both in turn: a read never waits for the copy the hook just queued (on CUDA: for the device to reach it)
    assert {k for k, _ in used} == {0, 1} and not any(waits for _, waits in used), used


def test_zero3_swapped_gradients_summed_in_bf16_step_under_the_check(tmp_path):
    """A swapped gradient partition summed in bf16 reaches the host step as an fp32 copy that torch makes on
    the host: host memory, as the pipeline tells the checking accelerator (which stopped the run before)."""
    cfg = tiny_config(*BASE, "+stage=zero3", *NVME, f"offload.nvme_path={tmp_path}", "precision=bf16",
                      "precision.grad_accum_dtype=bf16")
    module, data = build_gpt(cfg)
    acc = CheckingCpuAccelerator()
    with framework.initialize(module, gpt_loss, cfg, Dist(0, 1, 0, torch.device("cpu"), None, 60.0,
                                                          accelerator=acc)) as engine:
        assert engine.components.stage.offload.grad_swap
        state = engine.state
        for _ in range(2):
            state, metrics = engine.train_step(state, data.train_batch(state.data, micro_batch=2, grad_accum=2,
                                                                       rank=0, world=1))
    acc.verify()
    assert torch.isfinite(torch.tensor(metrics["loss"]))


def test_zero3_read_back_buffers_exist_only_with_accumulation(tmp_path, monkeypatch):
    """With one micro batch a step each swapped gradient partition is written once, final, and never
    read back: no pinned read-back buffers (measured as the accelerator's pinned host bytes at setup),
    no reader thread, no footprint entry and no room for them in the pre-flight's host-memory check;
    with two, all of them. Either way the steps equal offload=cpu's bitwise."""
    from framework.offload._disk import DiskPlacement

    checked = []   # the pre-flight's host-memory bound (bytes), per engine built
    early = []     # staging buffers and landings that exist at that check (none may)
    real = DiskPlacement.check_ram

    def check_ram(self, pools, bound):
        if bound == "":   # (the exact check, once the pool's layout is known)
            checked.append(pools)
            early.append(len(self.staging) + len(self.landings))   # pinned before it: counted twice
        return real(self, pools, bound)
    monkeypatch.setattr(DiskPlacement, "check_ram", check_ram)
    dist, out = _local(), {}
    nvme = [*NVME, "offload.params=none", f"offload.nvme_path={tmp_path}"]
    for accum, offload in ((1, nvme), (2, nvme), (1, ["offload=cpu"])):
        cfg = tiny_config(*BASE, "+stage=zero3", *offload, "stage.stage3_param_persistence_threshold=0",
                          f"train.grad_accum={accum}")
        module, data = build_gpt(cfg)
        with no_collection():   # (an earlier engine's buffers freed in between would count)
            before = dist.acc.pinned_stats()["requested"]
            engine = framework.initialize(module, gpt_loss, cfg, dist)
            pinned = dist.acc.pinned_stats()["requested"] - before
        with engine:
            state, losses = engine.state, []
            for _ in range(2):
                batch = data.train_batch(state.data, micro_batch=2, grad_accum=accum, rank=0, world=1)
                state, m = engine.train_step(state, batch)
                losses.append(m["loss"])
            items = engine.memory(state).nonzero()[0]
            reader = engine.components.stage.offload.reader if offload is nvme else None
            with framework.gathered(list(module.parameters())):
                full = torch.cat([p.detach().reshape(-1).float() for p in module.parameters()])
        out[accum, offload[0]] = pinned, items, reader, losses, full
    (pinned1, items1, reader1, losses1, full1), (pinned2, items2, reader2, *_) = out[1, "offload=nvme"], out[2, "offload=nvme"]
    assert early == [0, 0], early
    assert "nvme_grad_read_back" not in items1 and reader1 is None, items1
    read_back = items2["nvme_grad_read_back"][1]   # two pinned partitions and an unpinned bounce buffer
    assert reader2 is not None
    # (each pinned arena holds up to 4 KiB more than it hands out: its alignment, never touched)
    assert 0 < pinned2 - pinned1 <= read_back + 2 * 4096, (pinned1, pinned2, read_back)
    # either way two pinned buffers the partitions are copied into on their way to the swap file
    staging = items1["nvme_grad_staging"][1]
    assert staging == items2["nvme_grad_staging"][1] > 0, (items1, items2)
    pool = items1["nvme_optimizer_pool"][1]
    assert checked == [pool + staging, items2["nvme_optimizer_pool"][1] + staging + read_back], (checked, items2)
    _, _, _, cpu_losses, cpu_full = out[1, "offload=cpu"]
    assert losses1 == cpu_losses and torch.equal(full1, cpu_full)


def test_zero3_set_up_for_one_micro_batch_refuses_a_read_back(tmp_path):
    """A stage set up for one micro batch a step (no read-back buffers) driven through two: the second
    reduction of a swapped partition is an internal error, not an allocation in the backward hook."""
    cfg = tiny_config(*BASE, "+stage=zero3", *NVME, "offload.params=none", f"offload.nvme_path={tmp_path}",
                      "stage.stage3_param_persistence_threshold=0", "train.grad_accum=1")
    module, data = build_gpt(cfg)
    with framework.initialize(module, gpt_loss, cfg, _local()) as engine:
        stage = engine.components.stage
        micro = data.train_batch(0, micro_batch=2, grad_accum=2, rank=0, world=1).micro
        with pytest.raises(framework.FrameworkError, match="internal error: zero3's swapped gradient partition"):
            for x in micro:   # (as train_step would with train.grad_accum=2)
                with stage.forward_pass(train=True):
                    loss = gpt_loss(module, x)
                stage.backward(loss, sync=x is micro[-1])
        stage.zero_grads()
