"""framework.ops: the C++ CPU optimizer kernels and their pure-PyTorch fallback.

Both paths of every optimizer (the kernel where it is built; the transforms, forced) must match
torch.optim, or a direct reference where torch has none, over 100 steps on sizes that are not
multiples of any vector width. Cases that need the built kernels skip with the reason when the
build fails here; the fallback cases always run.
"""
from __future__ import annotations

import ast
import contextlib
import errno
import functools
import math
import os
import shutil
import socket
import subprocess
import sys
import types
import warnings
from pathlib import Path
from typing import Callable

import pytest
import torch
from torch import Tensor
from torch.utils import cpp_extension

from framework import ops
from framework.ops import _loader
from framework.optimizers import _transforms, adagrad, adam, adamw, lion
from framework.optimizers._transforms import GradientTransformation

SIZES = (1, 15, 17, 100_003)  # none a multiple of 8 or 16 lanes; 100_003 spans several of the kernel's
# parallel grains (16 blocks of 2048) and ends in a tail
MASK = [True, False, True, True]  # group 1 is a "1-D params" group: no weight decay
STEPS = 100
# Two correct fp32 implementations round differently (ATen's sqrt is not correctly rounded, the
# transforms order the AdamW decay differently); over 100 steps at init scale the worst element
# drifts ~5e-8, while a semantic error (mask, decay form, bias correction) is >= 1e-5.
RTOL, ATOL = 1e-6, 1e-7
INIT_STD = 0.02
REPO = Path(__file__).resolve().parents[2]


def schedule(base_lr: float) -> Callable[[int], float]:
    return lambda step: base_lr * (0.3 + 0.7 * abs(math.cos(0.37 * step)))


def initial_params(sizes=SIZES) -> list[Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(n, generator=gen) * INIT_STD for n in sizes]


def grads_at(step: int, sizes=SIZES) -> list[Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(n, generator=gen) for n in sizes]


def run_ours(tx: GradientTransformation, lr_at: Callable[[int], float], steps: int = STEPS, sizes=SIZES,
             out16: list[Tensor] | None = None) -> list[Tensor]:
    params = initial_params(sizes)
    state = tx.init(params)
    for step in range(steps):
        state = _transforms.step(tx, grads_at(step, sizes), state, params, lr_at(step), out16=out16)
    return params


@functools.cache
def run_torch(name: str, lr: float, weight_decay: float, **kwargs) -> tuple[Tensor, ...]:
    make = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "adagrad": torch.optim.Adagrad}[name]
    params = [p.requires_grad_() for p in initial_params()]
    opt = make([{"params": [p], "weight_decay": weight_decay if decayed else 0.0}
                for p, decayed in zip(params, MASK)], lr=lr, foreach=False, **kwargs)
    lr_at = schedule(lr)
    for step in range(STEPS):
        for group, p, g in zip(opt.param_groups, params, grads_at(step)):
            group["lr"] = lr_at(step)
            p.grad = g
        opt.step()
    return tuple(p.detach() for p in params)


def _torch_all_decayed(name: str, lr: float, weight_decay: float, **kwargs) -> list[Tensor]:
    params = [p.requires_grad_() for p in initial_params()]
    opt = {"adamw": torch.optim.AdamW}[name](params, lr=lr, weight_decay=weight_decay, foreach=False, **kwargs)
    lr_at = schedule(lr)
    for step in range(STEPS):
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        for p, g in zip(params, grads_at(step)):
            p.grad = g
        opt.step()
    return [p.detach() for p in params]


def assert_close(actual, expected, what: str) -> None:
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert not torch.equal(a, initial_params()[i]), f"{what}: group {i} never moved"
        err = (a - e).abs().max().item()
        assert torch.allclose(a, e, rtol=RTOL, atol=ATOL), \
            f"{what}: group {i} (n={a.numel()}): max abs err {err:.3g} exceeds rtol={RTOL} atol={ATOL}"


def kernel_reason() -> str | None:
    return _loader.status().reason


@pytest.fixture
def kernels():
    """The built extension; skips (with the reason) where it cannot be built here."""
    module = ops.cpu_optim()
    if module is None:
        pytest.skip(f"C++ CPU optimizer kernels not built here: {kernel_reason()}")
    yield module
    module.set_isa("auto")
    module.set_prefetch(-1)


@pytest.fixture(params=["kernel", "fallback"])
def path(request, monkeypatch):
    """Run an optimizer through the C++ kernels, or force the pure-PyTorch transforms."""
    if request.param == "kernel":
        if not _loader.kernels_enabled():
            pytest.skip("FRAMEWORK_OPS=0: the kernels are off, only the fallback runs")
        if ops.cpu_optim() is None:
            pytest.skip(f"C++ CPU optimizer kernels not built here: {kernel_reason()}")
        calls = []

        def spy(real):
            def kernel(*args, **kwargs):
                calls.append(real.__name__)
                return real(*args, **kwargs)
            return kernel

        for name in ops.KERNELS:  # prove the kernel ran, not a silent fallback
            monkeypatch.setattr(ops, name, spy(getattr(ops, name)))
        yield request.param
        assert calls, "the C++ kernel was never called"
    else:
        monkeypatch.setattr(ops, "cpu_optim", lambda: None)
        yield request.param


@pytest.fixture
def fresh_loader(monkeypatch, tmp_path):
    """An empty cache and a fresh per-process load, restored afterwards (kernels on: these tests
    are about loading them, also in a FRAMEWORK_OPS=0 run of the suite)."""
    monkeypatch.setenv("FRAMEWORK_OPS_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("FRAMEWORK_OPS", raising=False)
    _loader.status.cache_clear()
    yield tmp_path
    _loader.status.cache_clear()


# --- both paths against torch.optim and references -------------------------------------------

@pytest.mark.parametrize("decay_1d", [False, True])
def test_adamw_matches_torch(path, decay_1d):
    cfg = adamw.AdamWConfig(lr=3e-3, beta2=0.99, weight_decay=0.1, decay_1d=decay_1d)
    ours = run_ours(adamw.build(cfg, MASK), schedule(cfg.lr))
    if decay_1d:  # every group decayed: torch with one weight decay for all
        expected = _torch_all_decayed("adamw", cfg.lr, cfg.weight_decay, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    else:
        expected = run_torch("adamw", cfg.lr, cfg.weight_decay, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    assert_close(ours, expected, f"adamw ({path})")


@pytest.mark.parametrize("weight_decay", [0.0, 0.05])
def test_adam_matches_torch(path, weight_decay):
    cfg = adam.AdamConfig(lr=2e-3, weight_decay=weight_decay)
    ours = run_ours(adam.build(cfg, MASK), schedule(cfg.lr))
    expected = run_torch("adam", cfg.lr, weight_decay, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    assert_close(ours, expected, f"adam wd={weight_decay} ({path})")


def test_adagrad_with_lr_decay_matches_torch(path):
    cfg = adagrad.AdagradConfig(lr=0.05, lr_decay=0.01, weight_decay=0.02, initial_accumulator_value=0.1)
    ours = run_ours(adagrad.build(cfg, MASK), schedule(cfg.lr))
    expected = run_torch("adagrad", cfg.lr, cfg.weight_decay, lr_decay=cfg.lr_decay, eps=cfg.eps,
                         initial_accumulator_value=cfg.initial_accumulator_value)
    assert_close(ours, expected, f"adagrad ({path})")


def test_lion_matches_paper_rule(path):
    cfg = lion.LionConfig(lr=1e-3, weight_decay=0.5)
    lr_at = schedule(cfg.lr)
    params, moments = initial_params(), [torch.zeros(n) for n in SIZES]
    for step in range(STEPS):
        lr = lr_at(step)
        for p, m, g, decayed in zip(params, moments, grads_at(step), MASK):
            # Chen et al. 2023, Program 1, with decoupled decay on decayed groups only. sign() is
            # discontinuous: over 1e8 evaluations a 1-ulp difference in the interpolation flips a
            # few signs, so both interpolations are rounded as ATen rounds b*x + y*alpha (one fma).
            u = torch.sign(torch.mul(m, cfg.beta1).add_(g, alpha=1 - cfg.beta1))
            p -= lr * (u + (cfg.weight_decay if decayed else 0.0) * p)
            m.mul_(cfg.beta2).add_(g, alpha=1 - cfg.beta2)
    assert_close(run_ours(lion.build(cfg, MASK), lr_at), params, f"lion ({path})")


@pytest.mark.parametrize("name", ["adam", "adamw"])
def test_adam_without_bias_correction_matches_formula(path, name):
    """torch has no switch for bias correction: against the formula directly."""
    module, config = {"adam": (adam, adam.AdamConfig), "adamw": (adamw, adamw.AdamWConfig)}[name]
    cfg = config(lr=1e-3, weight_decay=0.05, bias_correction=False)
    lr_at = schedule(cfg.lr)
    params = initial_params()
    m, v = [torch.zeros(n) for n in SIZES], [torch.zeros(n) for n in SIZES]
    for step in range(STEPS):
        lr = lr_at(step)
        for i, (p, g) in enumerate(zip(params, grads_at(step))):
            wd = cfg.weight_decay if MASK[i] else 0.0
            if name == "adam":
                g = g + wd * p
            m[i] = cfg.beta1 * m[i] + (1 - cfg.beta1) * g
            v[i] = cfg.beta2 * v[i] + (1 - cfg.beta2) * g * g
            direction = m[i] / (v[i].sqrt() + cfg.eps)
            p -= lr * (direction + wd * p if name == "adamw" else direction)
    assert_close(run_ours(module.build(cfg, MASK), lr_at), params, f"{name} without bias correction ({path})")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_step_with_16bit_copy_equals_params_to(path, dtype):
    cfg = adamw.AdamWConfig(lr=3e-3, weight_decay=0.1)
    tx, lr_at = adamw.build(cfg, MASK), schedule(cfg.lr)
    params = initial_params()
    out16 = [torch.full((n,), 7.0, dtype=dtype) for n in SIZES]
    state = tx.init(params)
    for step in range(5):
        state = _transforms.step(tx, grads_at(step), state, params, lr_at(step), out16=out16)
        for i, (o, p) in enumerate(zip(out16, params)):
            assert torch.equal(o, p.to(dtype)), f"step {step} group {i}: out16 != params.to({dtype})"
    # Writing the copy does not change the step (same path without out16).
    assert all(torch.equal(a, b) for a, b in zip(params, run_ours(tx, lr_at, steps=5)))


# --- the kernels themselves --------------------------------------------------------------------

def _one_kernel_run(kernel: str, sizes, steps: int = 3, out_dtype=None) -> list[Tensor]:
    gen = torch.Generator().manual_seed(5)
    params = [torch.randn(n, generator=gen) for n in sizes]
    state = [[torch.rand(n, generator=gen) for n in sizes] for _ in range(2)]
    out16 = [torch.empty(n, dtype=out_dtype) for n in sizes] if out_dtype else None
    for step in range(1, steps + 1):
        grads = [torch.randn(n, generator=gen) for n in sizes]
        if kernel == "adam":
            ops.adam_step(params, grads, state[0], state[1], step=step, lr=1e-2, weight_decay=0.1, decoupled=step % 2 == 0,
                          out16=out16)
        elif kernel == "lion":
            ops.lion_step(params, grads, state[0], lr=1e-2, weight_decay=0.1, out16=out16)
        else:
            ops.adagrad_step(params, grads, state[0], step=step, lr=1e-2, lr_decay=0.1, weight_decay=0.1,
                             out16=out16)
    return params + state[0] + state[1] + (out16 or [])


@pytest.mark.parametrize("kernel", ["adam", "lion", "adagrad"])
def test_every_isa_and_thread_count_gives_identical_bits(kernels, kernel):
    """Vector bodies, scalar tails and the thread split all round identically."""
    sizes = (1, 15, 17, 33, 2048 * 16 + 5, 300_001)
    detected = kernels.detected_isa()
    isas = {"avx512": ["scalar", "avx2", "avx512"], "avx2": ["scalar", "avx2"]}.get(detected, ["scalar"])
    threads = torch.get_num_threads()
    runs = {}
    try:
        for isa in isas:
            kernels.set_isa(isa)
            for n_threads in (1, 2):
                torch.set_num_threads(n_threads)
                runs[isa, n_threads] = _one_kernel_run(kernel, sizes, out_dtype=torch.bfloat16)
    finally:
        torch.set_num_threads(threads)
    (first_key, first), *rest = runs.items()
    for key, tensors in rest:
        assert all(torch.equal(a, b) for a, b in zip(first, tensors)), f"{key} differs from {first_key}"
    assert len(runs) == 2 * len(isas) and kernels.isa() == isas[-1]


@pytest.mark.parametrize("kernel", ["adam", "lion", "adagrad"])
def test_prefetch_distance_changes_no_bits(kernels, kernel):
    """Software prefetch (on or off per CPU vendor, or set for a benchmark) only moves data early."""
    sizes = (15, 2048 * 3 + 5, 300_001)
    runs = {}
    for ahead in (0, 16, 256, 4096):
        kernels.set_prefetch(ahead)
        assert kernels.prefetch_distance() == ahead
        runs[ahead] = _one_kernel_run(kernel, sizes, out_dtype=torch.bfloat16)
    for ahead, tensors in runs.items():
        assert all(torch.equal(a, b) for a, b in zip(runs[0], tensors)), f"prefetch {ahead} changed the result"


def test_default_prefetch_follows_the_cpu_vendor(kernels):
    """On (256 floats, 1 KiB) where measured faster (Intel), off elsewhere (see cpu_optim.cpp)."""
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.is_file() or os.environ.get("FRAMEWORK_OPS_PREFETCH"):
        pytest.skip("needs /proc/cpuinfo and no FRAMEWORK_OPS_PREFETCH override")
    vendor = next((line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                   if line.startswith("vendor_id")), "")
    kernels.set_prefetch(0)
    kernels.set_prefetch(-1)
    assert kernels.prefetch_distance() == (256 if vendor == "GenuineIntel" else 0), vendor
    with pytest.raises(ValueError, match="floats >= 0"):
        kernels.set_prefetch(-2)


@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "unaligned"])
def test_16bit_rounding_of_special_values(kernels, isa, dtype, offset):
    """lr=0 leaves params as they are, so out16 is the pure conversion: ties, overflow, subnormals.
    An aligned copy is written with non-temporal stores, an unaligned one (offset) with plain ones."""
    order = ["scalar", "avx2", "avx512"]
    if order.index(isa) > order.index(kernels.detected_isa()):
        pytest.skip(f"this CPU has no {isa}")
    bits = torch.tensor([0x3F808000, 0x3F818000, 0x3F80FFFF, 0x7F7FFFFF, 0x477FF000, 0x477FE000, 0x00000001,
                         0x33800000, 0x387FC000, 0x80000000, 0x7F800000, 0xFF800000, 0xC0490FDB],
                        dtype=torch.int64).to(torch.int32)
    values = torch.cat([bits.view(torch.float32), torch.randn(1000) * 1e4, torch.randn(37) * 1e-6])
    params = [values.clone()]
    out16 = [torch.empty(values.numel() + offset, dtype=dtype)[offset:]]
    zeros = [torch.zeros_like(values)]
    kernels.set_isa(isa)
    ops.adam_step(params, [torch.zeros_like(values)], zeros, [torch.zeros_like(values)], step=1, lr=0.0,
                  out16=out16)
    assert torch.equal(params[0], values)
    expected = values.to(dtype)
    mismatch = (out16[0].view(torch.int16) != expected.view(torch.int16)).nonzero().flatten().tolist()
    assert not mismatch, f"{isa}: {dtype} copy differs from Tensor.to at {mismatch[:5]}"
    nan, out = [torch.full((19,), float("nan"))], [torch.zeros(19, dtype=dtype)]
    ops.lion_step(nan, [torch.zeros(19)], [torch.zeros(19)], lr=0.0, out16=out)
    assert out[0].isnan().all(), f"{isa}: NaN must stay NaN in {dtype}"


def test_kernels_reject_bad_tensors_with_clear_errors(kernels):
    p, g, m, v = (torch.zeros(10) for _ in range(4))
    with pytest.raises(TypeError, match=r"grads\[0\] must be a CPU float32 tensor, got Double"):
        ops.adam_step([p], [g.double()], [m], [v], step=1, lr=1e-3)
    with pytest.raises(ValueError, match=r"exp_avg_sqs\[0\] must be contiguous"):
        ops.adam_step([p], [g], [m], [torch.zeros(20)[::2]], step=1, lr=1e-3)
    with pytest.raises(ValueError, match=r"exp_avgs\[0\] has 9 elements but params\[0\] has 10"):
        ops.lion_step([p], [g], [torch.zeros(9)], lr=1e-3)
    with pytest.raises(ValueError, match="grads has 2 tensors but params has 1"):
        ops.adagrad_step([p], [g, g], [m], step=1, lr=1e-3)
    with pytest.raises(TypeError, match=r"out16\[0\] must be a CPU bfloat16 or float16 tensor"):
        ops.adam_step([p], [g], [m], [v], step=1, lr=1e-3, out16=[torch.zeros(10)])
    with pytest.raises(ValueError, match="step must be >= 1"):
        ops.adam_step([p], [g], [m], [v], step=0, lr=1e-3)
    with pytest.raises(ValueError, match="unknown ISA"):
        kernels.set_isa("sse9")


def test_non_strict_kernels_decline_without_changing_anything(kernels):
    """strict=False (the optimizers' dispatch): a tensor that does not fit, anywhere in the list,
    makes the call return False before any tensor is touched."""
    gen = torch.Generator().manual_seed(3)
    p, g, m, v = ([torch.randn(n, generator=gen) for n in (40, 33)] for _ in range(4))
    before = [t.clone() for t in p + m + v]
    bad_grads = [g[0], g[1].double()]
    assert ops.adam_step(p, bad_grads, m, v, step=1, lr=1e-2, strict=False) is False
    assert ops.adam_step(p, g, m, [v[0], torch.zeros(66)[::2]], step=1, lr=1e-2, strict=False) is False
    assert ops.lion_step(p, g, [m[0]], lr=1e-2, strict=False) is False
    assert ops.adagrad_step(p, g, m, step=1, lr=1e-2, out16=[torch.zeros(40), torch.zeros(33)], strict=False) is False
    assert ops.adam_step(p, g, m, v, step=1, lr=1e-2, decay_mask=[True], strict=False) is False
    assert all(torch.equal(a, b) for a, b in zip(p + m + v, before))
    assert ops.adam_step(p, g, m, v, step=1, lr=1e-2, strict=False) is True
    assert not torch.equal(p[0], before[0])
    with pytest.raises(ValueError, match="decay_mask has 1 entries but params has 2"):
        ops.adam_step(p, g, m, v, step=1, lr=1e-2, decay_mask=[True])


def test_kernels_refuse_tensors_that_share_memory(kernels):
    """The threads split the work by tensor: one tensor twice, or overlapping views, where the op writes
    one of them, would race (results changing from run to run). Refused like the other bad inputs;
    grads, which are only read, may share memory."""
    base = torch.zeros(100)
    p, g, m, v = (torch.zeros(10) for _ in range(4))
    q = torch.zeros(10)
    with pytest.raises(ValueError, match=r"params\[0\] and params\[1\] share memory"):
        ops.adam_step([p, p], [g, g], [m, torch.zeros(10)], [v, torch.zeros(10)], step=1, lr=1e-3)
    with pytest.raises(ValueError, match=r"exp_avgs\[0\] and exp_avg_sqs\[0\] share memory"):
        ops.adam_step([p], [g], [base[:10]], [base[5:15]], step=1, lr=1e-3)
    with pytest.raises(ValueError, match=r"params\[0\] and grads\[0\] share memory"):
        ops.lion_step([p], [p], [m], lr=1e-3)
    with pytest.raises(ValueError, match=r"state_sums\[0\] and out16\[0\] share memory"):
        ops.adagrad_step([p], [g], [base[:10]], step=1, lr=1e-3, out16=[base[:10].view(torch.bfloat16)[:10]])
    before = [t.clone() for t in (p, m, v)]
    assert ops.adam_step([p, q], [g, g], [m, m], [v, torch.zeros(10)], step=1, lr=1e-3, strict=False) is False
    assert all(torch.equal(a, b) for a, b in zip((p, m, v), before))
    # Adjacent (touching, not overlapping) views and one grad for two params are fine.
    assert ops.adam_step([base[:10], base[10:20]], [g, g], [base[20:30], base[30:40]], [base[40:50], base[50:60]],
                         step=1, lr=1e-3) is True


def test_kernels_bump_the_version_of_every_tensor_they_write(kernels):
    """As torch's in-place ops: autograd then refuses a backward through a saved tensor the step changed."""
    w = torch.randn(8, requires_grad=True)
    x = w * 1.0
    loss = (x * x).sum()   # saves x
    p, g, m, v, o = x.detach(), torch.randn(8), torch.zeros(8), torch.zeros(8), torch.zeros(8, dtype=torch.bfloat16)
    versions = [t._version for t in (p, g, m, v, o)]
    ops.adam_step([p], [g], [m], [v], step=1, lr=0.1, out16=[o])
    assert [t._version for t in (p, g, m, v, o)] == [versions[0] + 1, versions[1], versions[2] + 1,
                                                    versions[3] + 1, versions[4] + 1]
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    ops.lion_step([p], [g], [m], lr=0.1)
    ops.adagrad_step([p], [g], [v], step=1, lr=0.1)
    assert (p._version, m._version, v._version, g._version) == (versions[0] + 3, versions[2] + 2,
                                                                 versions[3] + 2, versions[1])
    assert ops.lion_step([p], [g.double()], [m], lr=0.1, strict=False) is False
    assert p._version == versions[0] + 3, "a declined call changed nothing, its version included"


@pytest.mark.parametrize("kernel", ["adam", "lion", "adagrad"])
def test_decay_mask_equals_one_call_per_part(kernels, kernel):
    """One call with decay_mask = the decayed tensors with weight_decay plus the others without."""
    sizes, mask = (17, 2048 * 3 + 5, 300), [True, False, True]
    gen = torch.Generator().manual_seed(9)
    init = [torch.randn(n, generator=gen) for n in sizes]
    grads = [torch.randn(n, generator=gen) for n in sizes]
    states = [[torch.rand(n, generator=gen) for n in sizes] for _ in range(2)]

    def run(parts):
        p, s = [t.clone() for t in init], [[t.clone() for t in ts] for ts in states]
        for idx, wd, dm in parts:
            pick = lambda ts: [ts[i] for i in idx]  # noqa: E731
            if kernel == "adam":
                ops.adam_step(pick(p), pick(grads), pick(s[0]), pick(s[1]), step=2, lr=1e-2, weight_decay=wd,
                              decay_mask=dm)
            elif kernel == "lion":
                ops.lion_step(pick(p), pick(grads), pick(s[0]), lr=1e-2, weight_decay=wd, decay_mask=dm)
            else:
                ops.adagrad_step(pick(p), pick(grads), pick(s[0]), step=2, lr=1e-2, weight_decay=wd, decay_mask=dm)
        return p + s[0] + s[1]

    one_call = run([([0, 1, 2], 0.1, mask)])
    per_part = run([([0, 2], 0.1, None), ([1], 0.0, None)])
    assert all(torch.equal(a, b) for a, b in zip(one_call, per_part))
    assert not torch.equal(one_call[1], run([([0, 1, 2], 0.1, None)])[1])  # the mask did something


# --- dispatch ------------------------------------------------------------------------------------

def test_state_layout_is_shared_so_paths_can_switch(kernels):
    """50 steps on the kernel, then 50 on the transforms, equals torch over all 100."""
    cfg = adam.AdamConfig(lr=2e-3, weight_decay=0.05)
    tx, lr_at = adam.build(cfg, MASK), schedule(cfg.lr)
    params = initial_params()
    state = tx.init(params)
    assert type(state) is type(tx._replace(fused=None).init(initial_params()))
    for step in range(STEPS):
        path = tx if step < STEPS // 2 else tx._replace(fused=None)
        state = _transforms.step(path, grads_at(step), state, params, lr_at(step))
    assert state[1].count == STEPS and isinstance(state[1].count, int)
    assert_close(params, run_torch("adam", cfg.lr, cfg.weight_decay, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps),
                 "kernel then transforms")


def test_tensors_the_kernel_cannot_take_use_the_transforms(kernels, monkeypatch):
    monkeypatch.setattr(ops, "adam_step", lambda *a, **k: pytest.fail("kernel called on fp64 tensors"))
    cfg = adamw.AdamWConfig(lr=1e-3)
    tx = adamw.build(cfg, [True])
    params = [torch.randn(33, dtype=torch.float64)]
    expected = params[0].clone().requires_grad_()
    opt = torch.optim.AdamW([expected], lr=1e-3, betas=(cfg.beta1, cfg.beta2), weight_decay=cfg.weight_decay,
                            foreach=False)
    state = tx.init(params)
    for step in range(3):
        g = torch.randn(33, dtype=torch.float64)
        expected.grad = g.clone()
        opt.step()
        state = _transforms.step(tx, [g], state, params, 1e-3)
    torch.testing.assert_close(params[0], expected.detach(), rtol=1e-12, atol=1e-14)


def _kernel_answers(monkeypatch) -> list:
    """Kernels on; the list each ``ops.adam_step`` call's answer (True: stepped, False: declined) is added to."""
    monkeypatch.delenv("FRAMEWORK_OPS", raising=False)
    calls = []
    real = ops.adam_step
    monkeypatch.setattr(ops, "adam_step", lambda *a, **k: calls.append(real(*a, **k)) or calls[-1])
    return calls


def test_a_list_the_kernel_declines_is_stepped_whole_by_the_fallback(kernels, monkeypatch):
    """One tensor the kernel cannot take (here the second, not contiguous) sends the whole step to
    the fallback; nothing is stepped twice or half-way."""
    calls = _kernel_answers(monkeypatch)
    cfg = adamw.AdamWConfig(lr=1e-2, weight_decay=0.1)
    tx = adamw.build(cfg, [True, False])
    gen = torch.Generator().manual_seed(4)
    params = [torch.randn(40, generator=gen), torch.randn(66, generator=gen)[::2]]
    expected = [p.clone().requires_grad_() for p in params]
    opt = torch.optim.AdamW([{"params": [expected[0]], "weight_decay": cfg.weight_decay},
                             {"params": [expected[1]], "weight_decay": 0.0}], lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                            foreach=False)
    state = tx.init(params)
    for _ in range(3):
        grads = [torch.randn(40, generator=gen), torch.randn(33, generator=gen)]
        for e, g in zip(expected, grads):
            e.grad = g.clone()
        opt.step()
        state = _transforms.step(tx, grads, state, params, cfg.lr)
    assert calls == [False, False, False]  # asked every step, declined every step
    for p, e in zip(params, expected):
        torch.testing.assert_close(p, e.detach(), rtol=RTOL, atol=ATOL)


def test_subset_step_beside_a_device_piece_runs_the_kernel(kernels, monkeypatch):
    """``step_groups`` on a host piece while another group lives on the device (meta stands in for
    cuda): the other group's empty slice must not make the kernel decline the host piece."""
    from framework.optimizers import step_groups

    calls = _kernel_answers(monkeypatch)
    cfg = adamw.AdamWConfig(lr=1e-2, weight_decay=0.1)
    tx = adamw.build(cfg, [False, True])
    gen = torch.Generator().manual_seed(5)
    host, device = torch.randn(1000, generator=gen), torch.zeros(1000, device="meta")
    expected = host.clone().requires_grad_()
    opt = torch.optim.AdamW([expected], lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), weight_decay=0.0, foreach=False)
    state = tx.init([host, device])
    for _ in range(3):
        grad = torch.randn(1000, generator=gen)
        expected.grad = grad.clone()
        opt.step()
        state = step_groups(tx, {0: grad}, state, [host, device], cfg.lr)
    assert calls == [True, True, True], calls
    assert state[0].count == 3
    torch.testing.assert_close(host, expected.detach(), rtol=RTOL, atol=ATOL)


# --- the loader ------------------------------------------------------------------------------------

def _train_adamw(steps: int = 3) -> list[Tensor]:
    cfg = adamw.AdamWConfig(lr=1e-3, weight_decay=0.1)
    tx = adamw.build(cfg, MASK[:2])
    params = initial_params(SIZES[:2])
    state = tx.init(params)
    for step in range(steps):
        state = _transforms.step(tx, grads_at(step, SIZES[:2]), state, params, 1e-3)
    return params


def fallback_lines(capsys) -> list[str]:
    """The fallback's warning lines this test printed on stderr."""
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: framework.ops")]


def test_build_disabled_warns_once_and_still_trains(fresh_loader, monkeypatch, capsys):
    """One line on stderr (no source line of ours under it), saying what runs instead."""
    monkeypatch.setenv("FRAMEWORK_OPS_BUILD", "0")
    params = _train_adamw()
    tx = lion.build(lion.LionConfig(), [True])  # a second optimizer: no second warning
    _transforms.step(tx, [torch.ones(3)], tx.init([torch.ones(3)]), [torch.ones(3)], 1e-3)
    assert not ops.available()
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("warning: framework.ops: "), "warn one line once per process"
    assert "FRAMEWORK_OPS_BUILD=0" in err and "with bias_correction=false their pure-PyTorch transforms" in err, err
    assert all(torch.isfinite(p).all() for p in params)
    assert not torch.equal(params[0], initial_params(SIZES[:2])[0])
    with pytest.raises(ops.BuildUnavailable, match="FRAMEWORK_OPS_BUILD=0"):
        ops.adam_step([torch.zeros(1)], [torch.zeros(1)], [torch.zeros(1)], [torch.zeros(1)], step=1, lr=1.0)


def test_missing_compiler_falls_back_with_one_warning(fresh_loader, monkeypatch, capsys):
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    _train_adamw()
    _train_adamw()
    lines = fallback_lines(capsys)
    assert len(lines) == 1 and "no C++ compiler" in lines[0], lines


@pytest.mark.parametrize("env, says", [({"RANK": "1"}, False), ({"RANK": "1", "LOCAL_RANK": "1"}, False),
                                       ({"RANK": "4", "LOCAL_RANK": "0"}, True)])
def test_the_fallback_warning_comes_from_each_machines_first_rank_only(fresh_loader, monkeypatch, capsys, env,
                                                                         says):
    """A machine's ranks share its cache and environment: one line per machine (another node's first rank, with
    its own cache, says it too), not one per rank."""
    monkeypatch.setenv("FRAMEWORK_OPS_BUILD", "0")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ops.cpu_optim() is None and "FRAMEWORK_OPS_BUILD=0" in ops.unavailable_reason()
    assert len(fallback_lines(capsys)) == says


def test_failed_build_falls_back_and_a_stale_lock_is_cleared(fresh_loader, monkeypatch, capsys):
    """A compile error (and a lock file left by a killed build) must not hang or raise."""
    csrc = fresh_loader / "csrc"
    for rel in _loader.SOURCES + _loader.HEADERS:
        (csrc / rel).parent.mkdir(parents=True, exist_ok=True)
        (csrc / rel).write_text("")
    (csrc / _loader.SOURCES[0]).write_text("#error simulated build failure\n")
    monkeypatch.setattr(_loader, "csrc_dir", lambda: csrc)
    directory = _loader.build_dir()
    directory.mkdir(parents=True)
    (directory / "lock").write_text("")  # what a build killed midway leaves behind
    assert ops.cpu_optim() is None and ops.cpu_optim() is None
    params = _train_adamw()
    messages = fallback_lines(capsys)
    assert len(messages) == 1 and "build failed" in messages[0] and "simulated build failure" in messages[0], messages
    assert not (directory / "lock").exists()
    assert (directory / "build_error.log").is_file()
    assert all(torch.isfinite(p).all() for p in params)


def test_missing_sources_fall_back(fresh_loader, monkeypatch, capsys):
    monkeypatch.setattr(_loader, "csrc_dir", lambda: fresh_loader / "nowhere")
    assert ops.cpu_optim() is None
    assert "FileNotFoundError" in fallback_lines(capsys)[0]
    assert ops.status()["built"] is False


class _FakeBuild:
    """Stands in for the compile step (tests of the loader's logic build nothing): ``load`` writes an
    extension file as a link step would and returns a module that records what it was set to."""

    def __init__(self, monkeypatch, directory: Path, tools: bool = False):
        self.directory, self.builds, self.imported, self.set, self.paths = directory, [], [], [], []
        if not tools:
            monkeypatch.setattr(_loader, "_tools_on_path", contextlib.nullcontext)
        monkeypatch.setattr(cpp_extension, "load", self.load)
        monkeypatch.setattr(_loader, "_import", self.import_)

    def module(self):
        return types.SimpleNamespace(detected_isa=lambda: "avx2", isa=lambda: "avx2", prefetch_distance=lambda: 0,
                                     set_isa=lambda name: self.set.append(("isa", name)),
                                     set_prefetch=lambda n: self.set.append(("prefetch", n)))

    def load(self, **kwargs):
        leftovers = [p.name for p in self.directory.iterdir() if p.name in (".ninja_log", f"{_loader.NAME}.so")]
        self.builds.append(leftovers)
        self.paths.append(os.environ.get("PATH"))
        (self.directory / f"{_loader.NAME}.so").write_bytes(b"\x7fELF" + bytes(4000))
        return self.module()

    def import_(self, directory):
        self.imported.append((directory / f"{_loader.NAME}.so").read_bytes())
        return self.module()


def test_a_damaged_build_is_rebuilt_from_scratch_never_imported(fresh_loader, monkeypatch):
    directory = _loader.build_dir()
    fake = _FakeBuild(monkeypatch, directory.parent.mkdir(parents=True) or directory)
    _loader.load()   # the first build records the extension's size and checksum
    assert fake.builds == [[]] and fake.imported == []
    so = directory / f"{_loader.NAME}.so"
    good = so.read_bytes()
    (directory / ".ninja_log").write_text("ninja would keep the .so it lists\n")
    so.write_bytes(good[:100])   # truncated: mapping it would crash the process (SIGBUS)
    assert "is damaged" in ops.status()["reason"]   # status never compiles, and says what it found
    _loader.load()
    assert fake.imported == [], "a truncated extension was imported"
    assert fake.builds[-1] == [], "the rebuild kept outputs ninja would not redo"
    _loader.load()
    assert fake.imported == [good]   # the rebuilt one is verified and imported
    # A complete file that does not import (e.g. built against another torch) is also rebuilt.
    (directory / ".ninja_log").write_text("")
    monkeypatch.setattr(_loader, "_import", lambda d: (_ for _ in ()).throw(ImportError("undefined symbol")))
    _loader.load()
    assert len(fake.builds) == 3 and fake.builds[-1] == []


def test_the_build_puts_its_tools_on_path_for_the_build_only(fresh_loader, monkeypatch):
    """The interpreter's bin folder (a venv's ninja) is on PATH while the build runs; after it, built or
    failed, the process's PATH is the user's again (its later subprocesses run what the user's finds)."""
    user = os.pathsep.join(["/usr/bin", "/bin"])
    monkeypatch.setenv("PATH", user)
    monkeypatch.setenv("CXX", "no-such-c++")
    with pytest.raises(_loader.BuildUnavailable, match=r"no C\+\+ compiler"):
        _loader.load()
    assert os.environ["PATH"] == user
    monkeypatch.setenv("CXX", sys.executable)   # any program: only found on PATH, never run here
    directory = _loader.build_dir()
    fake = _FakeBuild(monkeypatch, directory.parent.mkdir(parents=True) or directory, tools=True)
    try:
        _loader.load()
    except _loader.BuildUnavailable as e:
        pytest.skip(str(e))   # no ninja on this machine
    assert fake.paths[0].split(os.pathsep)[0] == os.path.dirname(sys.executable), fake.paths
    assert os.environ["PATH"] == user


def test_ops_build_compiles_again_over_a_finished_build(fresh_loader, monkeypatch):
    directory = _loader.build_dir()
    fake = _FakeBuild(monkeypatch, directory.parent.mkdir(parents=True) or directory)
    ops.build()
    ops.build()
    assert len(fake.builds) == 2 and fake.imported == []


def test_ops_build_if_needed_compiles_once_and_then_imports(fresh_loader, monkeypatch, capsys):
    """``make test`` runs it before the tests: a fresh cache is built there, a finished build kept."""
    from framework.ops.__main__ import main

    directory = _loader.build_dir()
    fake = _FakeBuild(monkeypatch, directory.parent.mkdir(parents=True) or directory)
    assert main(["build", "--if-needed"]) == 0
    assert len(fake.builds) == 1
    _loader.status.cache_clear()
    assert main(["build", "--if-needed"]) == 0
    assert len(fake.builds) == 1 and len(fake.imported) >= 1
    assert "framework.ops: ready in" in capsys.readouterr().out


def test_ops_help_says_what_status_and_build_do_in_plain_text(capsys):
    from framework.ops.__main__ import main

    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0 and "status (the default) never compiles" in out and "--if-needed only" in out, out
    for var in ("FRAMEWORK_OPS=0", "FRAMEWORK_OPS_BUILD", "FRAMEWORK_OPS_CACHE", "FRAMEWORK_OPS_VERBOSE",
                "FRAMEWORK_OPS_ISA", "FRAMEWORK_OPS_PREFETCH"):
        assert f"\n  {var}" in out, f"--help does not list {var}"
    assert "``" not in out


def _built_under_umask_022(monkeypatch) -> Path:
    """A fake finished build made under umask 022 (a usual shell's); its folder."""
    directory = _loader.build_dir()
    _FakeBuild(monkeypatch, directory.parent.mkdir(parents=True) or directory)
    old = os.umask(0o022)
    try:
        _loader.load()
    finally:
        os.umask(old)
    return directory


def test_a_finished_build_is_readable_per_the_umask(fresh_loader, monkeypatch):
    """A build in a shared cache serves every user: BUILT is not owner-only."""
    directory = _built_under_umask_022(monkeypatch)
    assert (directory / "BUILT").stat().st_mode & 0o777 == 0o644


_NO_DAC = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--inh-caps=-dac_override,-dac_read_search"]


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root and setpriv (util-linux)")
def test_another_users_build_is_used_and_a_needed_build_says_why_not(fresh_loader, monkeypatch):
    """As root without the capability to override file modes, a cache owned by uid 1234: its finished
    build is found; an owner-only BUILT (made under a umask such as 077) or a missing one gives a reason
    saying what to do, not a failure to open the lock file."""
    _built_under_umask_022(monkeypatch)
    caches = {}
    for case in ("usable", "private", "missing"):
        root = fresh_loader / case
        shutil.copytree(fresh_loader / "cache", root)
        monkeypatch.setenv("FRAMEWORK_OPS_CACHE", str(root))
        built = _loader.build_dir() / "BUILT"
        if case == "private":
            built.chmod(0o600)
        elif case == "missing":
            built.unlink()
        for path in [root, *root.rglob("*")]:
            os.chown(path, 1234, 1234, follow_symlinks=False)
        caches[case] = str(root)
    code = ("import os, sys; from framework.ops import _loader\n"
            "for root in sys.argv[1:]:\n"
            "    os.environ['FRAMEWORK_OPS_CACHE'] = root\n"
            "    try: print(_loader._finished(_loader.build_dir()))\n"
            "    except _loader.BuildUnavailable as e: print(e)\n"
            "    print(_loader.attempt(build=True).reason if root.endswith('missing') else '')\n")
    out = subprocess.run([*_NO_DAC, sys.executable, "-c", code, *caches.values()], capture_output=True, text=True,
                         cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    usable, _, private, _, missing, needed = out.stdout.splitlines()
    assert usable == "True"
    assert "cannot read the build in" in private and "FRAMEWORK_OPS_CACHE" in private, private
    assert missing == "False"
    assert "this user cannot build there" in needed and "FRAMEWORK_OPS_CACHE" in needed, needed


def test_a_failed_build_is_recorded_and_not_compiled_again(fresh_loader, monkeypatch, capsys):
    """Processes that waited for a failing build, and later runs, fall back at once with its reason
    (each compiling again took the ranks of one launch in turn, past its timeout); the same sources
    with another compiler, or ``python -m framework.ops build`` (also ``--if-needed``: the failure may
    have been transient), compile again."""
    from framework.ops.__main__ import main

    counter = fresh_loader / "calls"
    compilers = []
    for name in ("cc-a", "cc-b"):
        script = fresh_loader / name
        script.write_text(f"#!/bin/sh\nfor a; do [ \"$a\" = -c ] && {{ echo {name} >> {counter}; "   # a compile
                          f"echo 'error: {name} fails' >&2; exit 1; }}; done\necho '{name} 1.0'\n")
        script.chmod(0o755)
        compilers.append(str(script))
    calls = lambda: counter.read_text().split() if counter.exists() else []   # noqa: E731
    monkeypatch.setenv("CXX", compilers[0])
    first = _loader.attempt(build=True).reason
    if "ninja is not on PATH" in first:
        pytest.skip(first)
    assert "the build failed" in first and len(calls()) >= 1, first
    assert (_loader.build_dir() / "FAILED").is_file()
    ran = len(calls())
    again = _loader.attempt(build=True).reason
    assert len(calls()) == ran, "a recorded failure was compiled again"
    assert again.startswith(first) and "recorded by an earlier build" in again
    assert ops.status()["reason"] == again, "status hid the recorded failure"
    # Retried (torch itself does not run the compiler again within one process for the same sources).
    assert main(["build", "--if-needed"]) == 1
    err = capsys.readouterr().err
    assert "the build failed" in err and "recorded" not in err, err
    with pytest.raises(ops.BuildUnavailable, match="the build failed") as forced:
        ops.build()
    assert "recorded" not in str(forced.value)
    monkeypatch.setenv("CXX", compilers[1])   # another compiler: its own attempt
    assert "recorded" not in _loader.attempt(build=True).reason


@pytest.mark.parametrize("var, value", [("FRAMEWORK_OPS_ISA", "avx3"), ("FRAMEWORK_OPS_PREFETCH", "-3"),
                                        ("FRAMEWORK_OPS_PREFETCH", "lots"), ("FRAMEWORK_OPS_PREFETCH", "9" * 20),
                                        ("FRAMEWORK_OPS", "disable"), ("FRAMEWORK_OPS_BUILD", "2"),
                                        ("FRAMEWORK_OPS_VERBOSE", "loud")])
def test_a_bad_environment_value_falls_back_with_one_line(fresh_loader, monkeypatch, capsys, var, value):
    """Checked before anything is built or imported (the kernels raised at the first step; a prefetch
    distance past an int gave a multi-line TypeError; a mistyped switch meant "on")."""
    monkeypatch.setenv(var, value)
    monkeypatch.setattr(_loader, "_compile", lambda *a, **k: pytest.fail("built despite a bad value"))
    allowed = {"FRAMEWORK_OPS_ISA": "one of auto, scalar, avx2, avx512",
               "FRAMEWORK_OPS_PREFETCH": "auto or a number of floats >= 0"}.get(var, "one of 1/0, true/false")
    assert ops.cpu_optim() is None
    lines = fallback_lines(capsys)
    assert len(lines) == 1 and f"{var}='{value}' is not {allowed}" in lines[0], lines
    assert ops.status()["reason"].startswith(f"{var}='{value}'")
    params = _train_adamw()
    assert all(torch.isfinite(p).all() for p in params)


def test_switches_take_true_false_yes_no_on_off(fresh_loader, monkeypatch):
    directory = _loader.build_dir()
    _FakeBuild(monkeypatch, directory.parent.mkdir(parents=True) or directory)
    for value, on in (("1", True), (" True", True), ("yes", True), ("ON", True), ("0", False), ("false", False),
                      ("No", False), ("off", False)):
        monkeypatch.setenv("FRAMEWORK_OPS", value)
        monkeypatch.setenv("FRAMEWORK_OPS_VERBOSE", value)
        assert _loader.kernels_enabled() is on and _loader._flag("FRAMEWORK_OPS_VERBOSE", False) is on
        assert _loader.load() is not None


def test_status_never_compiles_and_says_so(fresh_loader, monkeypatch):
    """Not "building is off (FRAMEWORK_OPS_BUILD=0)" where nobody set it."""
    monkeypatch.delenv("FRAMEWORK_OPS_BUILD", raising=False)
    monkeypatch.setattr(_loader, "_tools_on_path", contextlib.nullcontext)
    monkeypatch.setattr(_loader, "_compile", lambda *a, **k: pytest.fail("status compiled"))
    reason = ops.status()["reason"]
    assert reason.startswith("not built yet (status never compiles") and "FRAMEWORK_OPS_BUILD" not in reason, reason


def test_a_cache_that_cannot_be_made_is_one_line_naming_it(fresh_loader, monkeypatch, capsys):
    """A read-only cache: what to set, not a traceback (build) or a bare OSError (a file in its place: below)."""
    from framework.ops.__main__ import main

    def refuse(path, *args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

    monkeypatch.setattr(Path, "mkdir", refuse)
    monkeypatch.setattr(_loader, "_tools_on_path", contextlib.nullcontext)
    assert main(["build"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot write the kernel cache" in err and "FRAMEWORK_OPS_CACHE" in err, err
    assert ops.cpu_optim() is None
    assert "set FRAMEWORK_OPS_CACHE to a writable folder" in fallback_lines(capsys)[0]


@pytest.mark.parametrize("code", [errno.EROFS, errno.ENOSPC])
def test_a_read_only_or_full_cache_is_one_line_naming_it(fresh_loader, monkeypatch, capsys, code):
    """The build lock's file cannot be made (a read-only mount, a full disk): build, build --if-needed and
    training say what to set in one line (build ended in an OSError traceback)."""
    from framework.ops.__main__ import main

    def refuse(path, *args, **kwargs):
        raise OSError(code, os.strerror(code), str(path))

    monkeypatch.setattr(_loader, "open_nofollow", refuse)
    monkeypatch.setattr(_loader, "_tools_on_path", contextlib.nullcontext)
    for args in (["build"], ["build", "--if-needed"]):
        assert main(args) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1, err
        assert err.startswith("framework.ops: build failed: cannot write the kernel cache"), err
        assert f".flock ({os.strerror(code)}); set FRAMEWORK_OPS_CACHE to a writable folder" in err, err
    assert ops.cpu_optim() is None
    lines = fallback_lines(capsys)
    assert len(lines) == 1 and "set FRAMEWORK_OPS_CACHE to a writable folder" in lines[0], lines


@pytest.mark.parametrize("below", [False, True])
def test_a_file_for_the_cache_folder_is_one_line_in_status_build_and_training(fresh_loader, monkeypatch, capsys,
                                                                              below):
    """Not "not built yet ... training builds it on first use" (status) or "(Not a directory)" (build)."""
    from framework.ops.__main__ import main

    afile = fresh_loader / "afile"
    afile.write_text("")
    root = afile / "cache" if below else afile
    monkeypatch.setenv("FRAMEWORK_OPS_CACHE", str(root))
    monkeypatch.setattr(_loader, "_compile", lambda *a, **k: pytest.fail("built into a file"))
    says = f"the kernel cache {root} is not a folder{f' ({afile} is a file)' if below else ''}; set FRAMEWORK_OPS_CACHE"
    assert ops.status()["reason"].startswith(says)
    assert main(["build"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err, err
    assert ops.cpu_optim() is None
    lines = fallback_lines(capsys)
    assert len(lines) == 1 and says in lines[0], lines


def test_an_unknown_users_home_for_the_cache_is_one_line_in_status_build_and_training(fresh_loader, monkeypatch,
                                                                                     capsys):
    """``~nouser/x``: pathlib's RuntimeError was a traceback from ``python -m framework.ops``."""
    from framework.ops.__main__ import main

    monkeypatch.setenv("FRAMEWORK_OPS_CACHE", "~no_such_user_fd4/x")
    monkeypatch.setattr(_loader, "_compile", lambda *a, **k: pytest.fail("built"))
    says = "FRAMEWORK_OPS_CACHE='~no_such_user_fd4/x' names the home of a user this machine does not know"
    info = ops.status()
    assert info["reason"].startswith(says) and info["build_dir"] == "-"
    assert main([]) == 0 and main(["build"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err, err
    assert ops.cpu_optim() is None
    lines = fallback_lines(capsys)
    assert len(lines) == 1 and says in lines[0], lines


def test_a_compile_and_a_wait_for_another_build_each_say_so_in_one_line(fresh_loader, monkeypatch, capsys):
    """The first use's compile (about a minute) and a wait on another process's build lock (up to
    LOCK_TIMEOUT_S) were silent."""
    import fcntl
    import threading
    import time

    monkeypatch.delenv("LOCAL_RANK", raising=False)   # (a suite run inside a launcher's step: rank 0 says it)
    monkeypatch.delenv("RANK", raising=False)
    directory = _loader.build_dir()
    _FakeBuild(monkeypatch, directory.parent.mkdir(parents=True) or directory)
    flock = directory.parent / f"{directory.name}.flock"
    with open(flock, "a+") as other:   # another builder: holds the lock, and said who it is
        fcntl.flock(other, fcntl.LOCK_EX)
        other.write("pid 4242 on elsewhere")
        other.flush()
        # The other builder finishes during the loader's first wait, however slow the machine.
        finished = types.SimpleNamespace(monotonic=time.monotonic, sleep=lambda s: fcntl.flock(other, fcntl.LOCK_UN))
        monkeypatch.setattr(_loader, "time", finished)
        late = threading.Timer(30, fcntl.flock, (other, fcntl.LOCK_UN))   # (a loader that blocks silently: fails)
        late.start()
        try:
            ops.build()
        finally:
            late.cancel()
    err = capsys.readouterr().err.splitlines()
    assert err == [f"framework.ops: waiting for pid 4242 on elsewhere to finish building the C++ CPU optimizer "
                   f"kernels in {directory} (up to {_loader.LOCK_TIMEOUT_S:.0f} s)",
                   f"framework.ops: compiling the C++ CPU optimizer kernels (about a minute, once) into {directory}"]
    assert flock.read_text() == f"pid {os.getpid()} on {socket.gethostname()}"   # what a waiter would say


def test_in_use_says_which_path_ran_without_building(fresh_loader, monkeypatch):
    """For a run's summary.json: the two paths differ in the last bits."""
    monkeypatch.setattr(_loader, "_compile", lambda *a, **k: pytest.fail("in_use built"))
    assert ops.in_use() is None   # no step asked for the kernels
    monkeypatch.setenv("FRAMEWORK_OPS_BUILD", "0")
    _train_adamw(1)
    assert ops.in_use().startswith("fallback (not built yet and building is off (FRAMEWORK_OPS_BUILD=0)")
    _loader.status.cache_clear()
    fake = _FakeBuild(monkeypatch, _loader.build_dir())
    monkeypatch.setattr(_loader, "load", lambda **kwargs: fake.module())   # a finished build
    assert ops.available()   # (as an optimizer step on CPU fp32 tensors asks)
    assert ops.in_use() == f"kernels (isa avx2, {torch.get_num_threads()} threads)"
    monkeypatch.setenv("FRAMEWORK_OPS", "0")
    assert ops.in_use() == ops.OFF


def test_isa_and_prefetch_from_the_environment_are_applied(fresh_loader, monkeypatch):
    """Any case; the ISA is a cap (this CPU's best where it asks for more)."""
    directory = _loader.build_dir()
    fake = _FakeBuild(monkeypatch, directory.parent.mkdir(parents=True) or directory)
    monkeypatch.setenv("FRAMEWORK_OPS_ISA", " AVX2")
    monkeypatch.setenv("FRAMEWORK_OPS_PREFETCH", "128")
    assert ops.cpu_optim() is not None
    assert fake.set == [("isa", "avx2"), ("prefetch", 128)]
    monkeypatch.setenv("FRAMEWORK_OPS_ISA", "AVX512")
    monkeypatch.delenv("FRAMEWORK_OPS_PREFETCH")
    _loader.load()
    assert fake.set[-1] == ("isa", "avx2")   # the fake CPU has avx2 at most


def test_framework_ops_0_builds_nothing_and_says_off(fresh_loader, monkeypatch):
    monkeypatch.setenv("FRAMEWORK_OPS", "0")
    monkeypatch.setattr(_loader, "_compile", lambda *a, **k: pytest.fail("built under FRAMEWORK_OPS=0"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # and no warning: the kernels are off on purpose
        assert ops.cpu_optim() is None and not ops.available()
        assert ops.status()["reason"] == "off (FRAMEWORK_OPS turns them off: 0, false, no or off)"
        with pytest.raises(ops.BuildUnavailable, match="FRAMEWORK_OPS turns them off"):
            ops.adam_step([torch.zeros(1)], [torch.zeros(1)], [torch.zeros(1)], [torch.zeros(1)], step=1, lr=1.0)


def test_importing_framework_does_not_build():
    code = ("import framework, framework.optimizers, framework.ops, sys; "
            "from framework.ops import _loader; "
            "assert _loader.status.cache_info().currsize == 0; "
            "assert 'framework_cpu_optim' not in sys.modules; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr


def _framework_imports(path: Path, root: Path) -> set[str]:
    """The framework modules ``path`` imports anywhere in it (function-level imports included),
    as dotted names; ``from framework import ops`` counts as framework.ops."""
    module = ".".join(path.relative_to(root).with_suffix("").parts)
    package = module.rsplit(".", 1)[0] if path.name != "__init__.py" else module.removesuffix(".__init__")
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - (node.level - 1)] + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names)
    return {n for n in names if n.startswith("framework.")}


def _path_to_optimizers(root: Path) -> list[str] | None:
    """An import chain from framework.ops to framework.optimizers under ``root``, or None.
    Follows every import of framework/ops' files transitively; the root package ``framework``
    (whose __init__ imports the whole public API) is not followed."""
    start = [".".join(f.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
             for f in sorted((root / "framework" / "ops").glob("*.py"))]
    chains = {name: [name] for name in start}
    todo, seen = list(start), set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        base = root.joinpath(*name.split("."))
        path = next((c for c in (base.with_suffix(".py"), base / "__init__.py") if c.is_file()), None)
        if path is None:  # a name imported from a module, not a module
            continue
        for dep in sorted(_framework_imports(path, root)):
            chain = chains[name] + [dep]
            if dep == "framework.optimizers" or dep.startswith("framework.optimizers."):
                return chain
            chains.setdefault(dep, chain)
            todo.append(dep)
    return None


def test_the_kernels_do_not_import_the_optimizers():
    """framework.ops must not know framework.optimizers (which imports ops): no import circle."""
    chain = _path_to_optimizers(REPO)
    assert chain is None, f"framework.ops imports the optimizers: {' -> '.join(chain)}"


def test_the_import_check_finds_a_lazy_import(tmp_path):
    """The check above can fail: an import inside a function, two modules away, reached through a
    relative import."""
    ops_dir = tmp_path / "framework" / "ops"
    ops_dir.mkdir(parents=True)
    (ops_dir / "__init__.py").write_text("from .. import _helper\n")
    (tmp_path / "framework" / "_helper.py").write_text(
        "def f():\n    from framework.optimizers._transforms import step\n")
    assert _path_to_optimizers(tmp_path) == ["framework.ops", "framework._helper",
                                             "framework.optimizers._transforms"]


def test_cli_prints_status_and_exits_0():
    env = {**os.environ, "FRAMEWORK_OPS_BUILD": "0"}
    out = subprocess.run([sys.executable, "-m", "framework.ops"], capture_output=True, text=True, cwd=REPO,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    for field in ("built:", "isa:", "detected:", "prefetch:", "threads:"):
        assert field in out.stdout, out.stdout
    if ops.available():  # built in this session's cache: the status shows it usable
        assert "yes, usable: adam_step, lion_step, adagrad_step" in out.stdout, out.stdout
    # (`build` compiles again whatever is there: test_ops_build_compiles_again_over_a_finished_build)


def test_framework_ops_0_turns_the_kernels_off(monkeypatch):
    t = [torch.zeros(8)]
    monkeypatch.setenv("FRAMEWORK_OPS", "0")
    assert not ops.usable(t, t)
    monkeypatch.delenv("FRAMEWORK_OPS")
    assert ops.usable(t, t) == ops.available()


def test_the_build_lock_is_free_once_its_holder_leaves_even_with_a_forked_child(tmp_path):
    """A flock belongs to the open file, which a child forked during the build shares: the holder unlocks it
    on leaving (closing its copy alone left the lock held while the child lived, and waiting ranks polled
    for up to LOCK_TIMEOUT_S before falling back)."""
    import fcntl
    import time

    d = tmp_path / "build"
    with _loader._exclusive(d):
        pid = os.fork()
        if pid == 0:
            time.sleep(2)
            os._exit(0)
    try:
        lock = os.open(d.parent / "build.flock", os.O_RDWR)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)   # raises BlockingIOError while held
        finally:
            os.close(lock)
    finally:
        os.waitpid(pid, 0)
