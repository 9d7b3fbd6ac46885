"""The functional optimizers against torch.optim (or a direct reference where torch has none)."""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Callable

import pytest
import torch
import yaml
from torch import Tensor

from framework.core.errors import ConfigError
from framework.optimizers import _transforms, apply_updates
from framework.optimizers import adagrad, adam, adamw, lion, sgd
from framework.optimizers._transforms import GradientTransformation
from framework.core.registry import registry

SIZES = (1001, 37)  # awkward sizes: not multiples of any vector width
MASK = [True, False]  # group 0 decayed, group 1 (the "1-D params") not
STEPS = 50
RTOL, ATOL = 1e-6, 1e-7
# Two correct fp32 implementations round p + u differently each step; over 50 steps the
# worst of ~1000 such random walks reaches ~7 ulp, which at |p| ~ 1 is the whole of
# rtol=1e-6. At a transformer's init scale (std 0.02) and small lrs, those walks stay well
# inside atol, while a semantic error (wrong mask, coupled decay, missing bias correction,
# dampening on the first step) is >= 1e-5: see test_tolerance_catches_a_wrong_decay_mask.
INIT_STD = 0.02
CONF = Path(__file__).resolve().parents[2] / "conf" / "optimizer"


def schedule(base_lr: float) -> Callable[[int], float]:
    """A varying lr, so that a transform that cached lr or mixed up steps would show."""
    return lambda step: base_lr * (0.3 + 0.7 * abs(math.cos(0.37 * step)))


def initial_params(seed: int = 0) -> list[Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=gen) * INIT_STD for n in SIZES]


def grad_stream(seed: int = 1) -> list[list[Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(n, generator=gen) for n in SIZES] for _ in range(STEPS)]


def run_functional(tx: GradientTransformation, lr_at: Callable[[int], float]) -> list[Tensor]:
    params = initial_params()
    state = tx.init(params)
    for step, grads in enumerate(grad_stream()):
        grads = [g.clone() for g in grads]  # the transform consumes its grads
        updates, state = tx.update(grads, state, params, lr_at(step))
        assert all(u.data_ptr() == g.data_ptr() for u, g in zip(updates, grads)), \
            "updates must reuse the grads' storage"
        apply_updates(params, updates)
    return params


def run_torch(make: Callable[[list[dict]], torch.optim.Optimizer], weight_decay: float,
              lr_at: Callable[[int], float], mask: list[bool] = MASK) -> list[Tensor]:
    params = [p.clone().requires_grad_() for p in initial_params()]
    opt = make([{"params": [p], "weight_decay": weight_decay if decayed else 0.0}
                for p, decayed in zip(params, mask)])
    for step, grads in enumerate(grad_stream()):
        for group, p, g in zip(opt.param_groups, params, grads):
            group["lr"] = lr_at(step)
            p.grad = g.clone()
        opt.step()
    return [p.detach() for p in params]


def assert_close(actual: list[Tensor], expected: list[Tensor]) -> None:
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert not torch.equal(a, initial_params()[i]), f"group {i} never moved"
        err = (a - e).abs().max().item()
        assert torch.allclose(a, e, rtol=RTOL, atol=ATOL), \
            f"group {i}: max abs err {err:.3g} exceeds fp32 tolerance rtol={RTOL} atol={ATOL}"


@pytest.fixture(params=[None, 100], ids=["one-chunk", "chunked"])
def chunk(request, monkeypatch):
    """Run the transforms that use a scratch buffer both whole and in ragged chunks."""
    if request.param is not None:
        monkeypatch.setattr(_transforms, "_CHUNK", request.param)


# --- against torch.optim ------------------------------------------------------------

@pytest.mark.parametrize("decay_1d", [False, True])
def test_adamw_matches_torch(decay_1d):
    cfg = adamw.AdamWConfig(lr=3e-3, beta2=0.99, weight_decay=0.1, decay_1d=decay_1d)
    lr_at = schedule(cfg.lr)
    mask = [True, True] if decay_1d else MASK
    expected = run_torch(lambda groups: torch.optim.AdamW(
        groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, foreach=False),
        cfg.weight_decay, lr_at, mask)
    assert_close(run_functional(adamw.build(cfg, MASK), lr_at), expected)


@pytest.mark.parametrize("weight_decay", [0.0, 0.05])
def test_adam_matches_torch(weight_decay):
    cfg = adam.AdamConfig(lr=2e-3, weight_decay=weight_decay)
    lr_at = schedule(cfg.lr)
    expected = run_torch(lambda groups: torch.optim.Adam(
        groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, foreach=False),
        cfg.weight_decay, lr_at)
    assert_close(run_functional(adam.build(cfg, MASK), lr_at), expected)


@pytest.mark.parametrize("momentum,dampening,nesterov,weight_decay", [
    (0.0, 0.0, False, 0.0),
    (0.0, 0.0, False, 0.01),
    (0.9, 0.0, False, 0.01),
    (0.9, 0.0, True, 0.01),
    (0.9, 0.3, False, 0.0),
], ids=["plain", "plain-wd", "momentum", "nesterov", "dampening"])
def test_sgd_matches_torch(momentum, dampening, nesterov, weight_decay):
    cfg = sgd.SGDConfig(lr=3e-3, momentum=momentum, dampening=dampening, nesterov=nesterov,
                        weight_decay=weight_decay)
    lr_at = schedule(cfg.lr)
    expected = run_torch(lambda groups: torch.optim.SGD(
        groups, lr=cfg.lr, momentum=momentum, dampening=dampening, nesterov=nesterov,
        foreach=False), weight_decay, lr_at)
    assert_close(run_functional(sgd.build(cfg, MASK), lr_at), expected)


@pytest.mark.usefixtures("chunk")
def test_adagrad_matches_torch():
    cfg = adagrad.AdagradConfig(lr=0.05, lr_decay=0.01, weight_decay=0.02,
                                initial_accumulator_value=0.1)
    lr_at = schedule(cfg.lr)
    expected = run_torch(lambda groups: torch.optim.Adagrad(
        groups, lr=cfg.lr, lr_decay=cfg.lr_decay, eps=cfg.eps,
        initial_accumulator_value=cfg.initial_accumulator_value, foreach=False),
        cfg.weight_decay, lr_at)
    assert_close(run_functional(adagrad.build(cfg, MASK), lr_at), expected)


# --- against direct references ------------------------------------------------------

@pytest.mark.usefixtures("chunk")
def test_lion_matches_paper_rule():
    cfg = lion.LionConfig(lr=1e-3, weight_decay=0.5)
    lr_at = schedule(cfg.lr)
    params = initial_params()
    moments = [torch.zeros_like(p) for p in params]
    for step, grads in enumerate(grad_stream()):
        lr = lr_at(step)
        for i, (p, m, g) in enumerate(zip(params, moments, grads)):
            # Chen et al. 2023, Program 1 (decoupled decay only on decayed groups).
            u = torch.sign(cfg.beta1 * m + (1 - cfg.beta1) * g)
            wd = cfg.weight_decay if MASK[i] else 0.0
            p -= lr * (u + wd * p)
            m.copy_(cfg.beta2 * m + (1 - cfg.beta2) * g)
    assert_close(run_functional(lion.build(cfg, MASK), lr_at), params)


def test_adam_without_bias_correction_matches_formula():
    cfg = adam.AdamConfig(lr=1e-3, weight_decay=0.05, bias_correction=False)
    lr_at = schedule(cfg.lr)
    params = initial_params()
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    for step, grads in enumerate(grad_stream()):
        for i, (p, g) in enumerate(zip(params, grads)):
            g = g + cfg.weight_decay * p if MASK[i] else g
            m[i] = cfg.beta1 * m[i] + (1 - cfg.beta1) * g
            v[i] = cfg.beta2 * v[i] + (1 - cfg.beta2) * g * g
            p -= lr_at(step) * m[i] / (v[i].sqrt() + cfg.eps)
    assert_close(run_functional(adam.build(cfg, MASK), lr_at), params)


def test_tolerance_catches_a_wrong_decay_mask():
    """Negative control: decaying the 1-D group too must fail the comparison."""
    cfg = adamw.AdamWConfig(lr=1e-3, weight_decay=0.1)
    lr_at = schedule(cfg.lr)
    expected = run_torch(lambda groups: torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                                                          foreach=False), cfg.weight_decay, lr_at, mask=[True, True])
    with pytest.raises(AssertionError, match="group 1"):
        assert_close(run_functional(adamw.build(cfg, MASK), lr_at), expected)


def test_chain_state_is_tuple_of_inner_states():
    tx = adamw.build(adamw.AdamWConfig(), MASK)
    state = tx.init(initial_params())
    assert isinstance(state, tuple) and len(state) == 3
    assert state[0].count == 0 and isinstance(state[0].count, int)
    _, state = tx.update([g.clone() for g in grad_stream()[0]], state, initial_params(), 1e-3)
    assert state[0].count == 1 and isinstance(state[0].count, int)


# --- configuration --------------------------------------------------------------------

@pytest.mark.parametrize("module,overrides", [
    (adamw, {"beta1": 1.0}),
    (adamw, {"beta2": -0.1}),
    (adamw, {"lr": -1e-3}),
    (adamw, {"eps": -1.0}),
    (adamw, {"eps": 0.0}),   # 0/0 where a gradient and its moments are 0 (the flat buffers' padding)
    (adam, {"eps": 0.0}),
    (adagrad, {"eps": 0.0}),
    (adam, {"weight_decay": -0.1}),
    (adam, {"beta1": float("nan")}),
    (sgd, {"nesterov": True}),
    (sgd, {"nesterov": True, "momentum": 0.9, "dampening": 0.1}),
    (sgd, {"momentum": -0.5}),
    (sgd, {"dampening": 0.9}),
    (sgd, {"momentum": 1.0}),
    (sgd, {"momentum": 1.5}),
    (sgd, {"momentum": 0.9, "dampening": 3.0}),
    (sgd, {"momentum": 0.9, "dampening": -0.5}),
    (lion, {"beta2": 1.5}),
    (adagrad, {"lr_decay": -0.1}),
    (adagrad, {"initial_accumulator_value": -1.0}),
])
def test_bad_config_raises_one_line_config_error(module, overrides):
    cfg = dataclasses.replace(module.COMPONENT.config(), **overrides)
    with pytest.raises(ConfigError) as info:
        module.COMPONENT.build(cfg, MASK)
    assert "\n" not in str(info.value)
    with pytest.raises(ConfigError) as again:   # the component's check, at compose time
        module.COMPONENT.check(cfg, "ddp", {})
    assert str(again.value) == str(info.value)


def test_adagrad_eps_0_is_allowed_with_a_positive_initial_accumulator():
    cfg = adagrad.AdagradConfig(eps=0.0, initial_accumulator_value=0.1)
    assert adagrad.COMPONENT.check(cfg, "ddp", {}) is cfg and adagrad.build(cfg, MASK) is not None
    # an accumulator that is 0 in fp32 (the state's dtype) is 0: eps must be positive, and the line says so once
    for value, eps in ((1e-50, 0.0), (0.0, -1.0)):
        with pytest.raises(ConfigError, match=r"optimizer.eps must be > 0 for adagrad"):
            adagrad.COMPONENT.check(adagrad.AdagradConfig(eps=eps, initial_accumulator_value=value), "ddp", {})


@pytest.mark.parametrize("module", [adamw, adam, adagrad])
def test_eps_positive_as_a_float_but_0_in_fp32_is_refused(module):
    # 1e-50 > 0 in Python but 0 in the fp32 state: the update would be 0/0 = NaN where a gradient is 0
    cfg = dataclasses.replace(module.COMPONENT.config(), eps=1e-50)
    with pytest.raises(ConfigError) as info:
        module.COMPONENT.check(cfg, "ddp", {})
    assert str(info.value).startswith(f"optimizer.eps must be > 0 for {module.__name__.rsplit('.', 1)[1]}, got 1e-50, "
                                      "which is 0 in fp32, the optimizer state's dtype (an eps of 0")
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("module", [adamw, adam, adagrad, sgd, lion])
@pytest.mark.parametrize("key", ["lr", "weight_decay"])
def test_lr_finite_as_a_float_but_inf_in_fp32_is_refused(module, key):
    # 1e39 is a finite Python float but inf in the fp32 state: the first update would be inf, NaN after it
    name = module.__name__.rsplit('.', 1)[1]
    with pytest.raises(ConfigError) as info:
        module.COMPONENT.check(dataclasses.replace(module.COMPONENT.config(), **{key: 1e39}), "ddp", {})
    assert str(info.value) == (f"optimizer.{key} must be finite in fp32 (the optimizer state's dtype) for {name}, "
                               f"got 1e+39, which is inf there; give at most 3.4028234663852886e+38")
    largest = float(torch.finfo(torch.float32).max)   # the largest fp32 value is accepted
    module.COMPONENT.check(dataclasses.replace(module.COMPONENT.config(), **{key: largest}), "ddp", {})
    # the bound said is exact: a value just above it (below a rounded 3.403e+38) is refused, the bound accepted
    with pytest.raises(ConfigError) as info:
        module.COMPONENT.check(dataclasses.replace(module.COMPONENT.config(), **{key: 3.4028236e38}), "ddp", {})
    bound = float(str(info.value).rpartition("give at most ")[2])
    assert bound < 3.4028236e38
    module.COMPONENT.check(dataclasses.replace(module.COMPONENT.config(), **{key: bound}), "ddp", {})


@pytest.mark.parametrize("name", ["adamw", "adam", "sgd", "lion", "adagrad"])
def test_yaml_lists_every_field_with_its_default(name):
    component = registry("optimizer").get(name)
    node = yaml.safe_load((CONF / f"{name}.yaml").read_text())
    fields = {f.name: f.default for f in dataclasses.fields(component.config)}
    assert set(node) == set(fields)
    assert node == fields   # (adamw's are nanoGPT's, not torch's: what ~optimizer.KEY gives is the YAML's)
    assert all(type(node[k]) is type(fields[k]) for k in fields), "YAML types must match the schema"


def run_fused(tx: GradientTransformation, lr_at: Callable[[int], float]) -> list[Tensor]:
    params = initial_params()
    state = tx.init(params)
    for step, grads in enumerate(grad_stream()):
        state = _transforms.step(tx, [g.clone() for g in grads], state, params, lr_at(step))
    return params


@pytest.mark.parametrize("name", ["adamw", "adam"])
def test_fused_adam_path_equals_transforms_and_torch(name):
    module = {"adamw": adamw, "adam": adam}[name]
    cfg = module.__dict__[f"{'AdamW' if name == 'adamw' else 'Adam'}Config"](lr=3e-3, weight_decay=0.05)
    tx = module.build(cfg, MASK)
    assert tx.fused is not None, "torch's fused Adam kernel should be available"
    lr_at = schedule(cfg.lr)
    fused = run_fused(tx, lr_at)
    assert_close(fused, run_functional(tx._replace(fused=None), lr_at))
    torch_cls = torch.optim.AdamW if name == "adamw" else torch.optim.Adam
    assert_close(fused, run_torch(lambda groups: torch_cls(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                                                           eps=cfg.eps, fused=True), cfg.weight_decay, lr_at))
    # Same state layout as the transforms: a later step may take either path.
    state = tx.init(initial_params())
    assert type(state) is type(tx._replace(fused=None).init(initial_params()))


@pytest.mark.parametrize("decoupled", [True, False])
def test_step_groups_gives_torchs_fused_adam_one_device(monkeypatch, decoupled):
    """A subset step beside a group on another device (meta stands in for cuda) hands torch's
    fused Adam only the stepped groups: CUDA's kernel refuses a list of mixed devices."""
    from framework.optimizers import step_groups

    monkeypatch.setenv("FRAMEWORK_OPS", "0")   # the torch fused path, not the C++ kernels
    name = "_fused_adamw_" if decoupled else "_fused_adam_"
    real, seen = getattr(torch, name), []

    def spy(*lists, **kwargs):
        seen.append([{t.device.type for t in ts} for ts in lists if ts])
        return real(*lists, **kwargs)

    monkeypatch.setattr(torch, name, spy)
    cfg = adam.AdamConfig(lr=1e-2, weight_decay=0.1)
    tx = adam.build(cfg, [True, True, False], decoupled=decoupled)
    gen = torch.Generator().manual_seed(3)
    host = [torch.randn(100, generator=gen), torch.randn(7, generator=gen)]
    params = [host[0], torch.zeros(100, device="meta"), host[1]]
    expected = [p.clone() for p in host]
    reference = adam.build(cfg, [True, False], decoupled=decoupled)._replace(fused=None)
    s_ref, state = reference.init(expected), tx.init(params)
    for _ in range(2):
        grads = [torch.randn(100, generator=gen), torch.randn(7, generator=gen)]
        s_ref = _transforms.step(reference, [g.clone() for g in grads], s_ref, expected, cfg.lr)
        state = step_groups(tx, {0: grads[0], 2: grads[1]}, state, params, cfg.lr)
    assert seen and all(devices == {"cpu"} for call in seen for devices in call), seen
    for p, e in zip(host, expected):
        torch.testing.assert_close(p, e, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("kernels", ["1", "0"])
@pytest.mark.parametrize("name", ["adamw", "adam", "lion", "adagrad", "sgd"])
def test_step_groups_equals_one_step_over_all_groups(monkeypatch, name, kernels):
    """Stepping groups one at a time (in any order) is bit-identical to one step over all of them:
    the overlapped host step relies on it. With the C++ kernels and with the fallback."""
    from framework.optimizers._subset import group_state, step_groups
    from framework.core.registry import registry

    monkeypatch.setenv("FRAMEWORK_OPS", kernels)
    comp = registry("optimizer").get(name)
    sizes, mask = [1000, 37, 4099, 70001], [True, False, True, True]
    tx = comp.build(comp.config(), decay_mask=mask)
    gen = torch.Generator().manual_seed(0)
    whole = [torch.randn(s, generator=gen) for s in sizes]
    parts = [p.clone() for p in whole]
    s_whole, s_parts = tx.init(whole), tx.init(parts)
    for _ in range(3):
        grads = [torch.randn(s, generator=gen) for s in sizes]
        s_whole = _transforms.step(tx, [g.clone() for g in grads], s_whole, whole, 1e-2)
        new = [step_groups(tx, {i: grads[i].clone()}, s_parts, parts, 1e-2) for i in (2, 0, 3, 1)]
        s_parts = new[-1]
    assert all(torch.equal(a, b) for a, b in zip(whole, parts))
    for i in range(len(sizes)):
        assert all(torch.equal(a, b) for a, b in zip(group_state(s_whole, 4, i), group_state(s_parts, 4, i)))
    assert type(s_parts) is type(s_whole)


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_step_groups_hands_the_optimizer_only_its_groups(monkeypatch, name):
    """A host piece's step sees its own group alone, not empty slices of all the others: with a small
    reduce_bucket_size a partition has thousands of pieces, one step each, and that made a training step
    quadratic in the piece count. Same numbers as the empty-slice path (a transform without ``subset``)."""
    from framework.optimizers import _subset

    seen, real = [], _subset.step
    monkeypatch.setattr(_subset, "step", lambda tx, grads, *a: (seen.append(len(grads)), real(tx, grads, *a))[1])
    comp = registry("optimizer").get(name)
    mask = [i % 3 != 1 for i in range(40)]
    runs = []
    built = comp.build(comp.config(), decay_mask=mask)
    for tx in (built, comp.build(comp.config(), decay_mask=mask)._replace(subset=None)):
        gen = torch.Generator().manual_seed(1)
        params = [torch.randn(5, generator=torch.Generator().manual_seed(i)) for i in range(40)]
        state = tx.init(params)
        for _ in range(2):
            for i in (7, 1, 30):
                state = _subset.step_groups(tx, {i: torch.randn(5, generator=gen)}, state, params, 1e-2)
        runs.append((params, state))
    assert seen[:6] == [1] * 6 and seen[6:] == [40] * 6, seen
    assert built.subset([7]) is built.subset((7,))   # built once a piece, not once a step (it holds no state)
    (a, s_a), (b, s_b) = runs
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    for i in (7, 1, 30):
        assert all(torch.equal(x, y) for x, y in zip(_subset.group_state(s_a, 40, i), _subset.group_state(s_b, 40, i)))


def _state(*leaves) -> Callable:
    """An ``init`` whose state is a tuple of ``leaves(params)``."""
    return lambda ps: tuple(leaf(ps) for leaf in leaves)


_MOMENTS = lambda ps: [torch.zeros_like(p) for p in ps]   # noqa: E731


@pytest.mark.parametrize("tx,says", [
    # dict state (torch's style): trained, then a traceback at the first checkpoint, or at step 1 offloaded
    (GradientTransformation(lambda ps: {"m": _MOMENTS(ps)}, lambda g, s, p, lr: (g, s)),
     "its init's state holds a dict at its top, which checkpoints cannot save; a state is tuples or NamedTuples"),
    # a 0-d tensor per group (a running max): not JSON, not reshardable
    (GradientTransformation(_state(_MOMENTS, lambda ps: [torch.zeros(()) for p in ps]), lambda g, s, p, lr: (g, s)),
     "its init's state holds a list at '1', which"),
    # a step count kept as a 0-d tensor may be (checkpoints save it), but not advanced in place: a host step per
    # piece updates from the same state, so it would count pieces
    (GradientTransformation(_state(lambda ps: torch.zeros(()), _MOMENTS),
                            lambda g, s, p, lr: (g, (s[0].add_(1), s[1]))),
     "its update changes the tensor at '0' of the state it was given in place: the offload tiers step each host"),
    # a norm over a group (LAMB/LARS-style): a group is a shard or piece, so each layout trained another model
    (GradientTransformation(lambda ps: (), lambda g, s, p, lr: ([-lr * x / (x.norm() + 1e-12) for x in g], s)),
     "its update is not elementwise (on a group cut in two it gives other numbers than on the whole group)"),
])
def test_an_optimizer_breaking_the_contract_is_refused_at_initialize_in_one_line(tx, says):
    """``GradientTransformation``'s contract, checked at initialize on two small groups (whole and cut in two):
    state leaves are group-aligned tensor lists or Python scalars, and ``update`` is elementwise."""
    from framework.engine._checks import check_optimizer

    with pytest.raises(ConfigError) as e:
        check_optimizer(tx, "mine", [True, False, True], torch.device("cpu"))
    assert str(e.value).startswith(f"optimizer 'mine': {says}") and "\n" not in str(e.value), str(e.value)
    elementwise = GradientTransformation(_state(_MOMENTS), lambda g, s, p, lr: ([-lr * x.sign() for x in g], s))
    assert check_optimizer(elementwise, "mine", [True], torch.device("cpu")) is elementwise
    counted = GradientTransformation(_state(lambda ps: torch.zeros(()), _MOMENTS),
                                     lambda g, s, p, lr: ([-lr * x.sign() for x in g], (s[0] + 1, s[1])))
    assert check_optimizer(counted, "mine", [True], torch.device("cpu")) is counted


@pytest.mark.parametrize("update,says", [
    (lambda g, s, p, lr: [-lr * x.sign() for x in g], "a list of {n}"),   # the updates alone
    (lambda g, s, p, lr: ([-lr * x.sign() for x in g[:1]], s), "a tuple of 2"),   # one group's only
    (lambda g, s, p, lr: ([x[:1] for x in g], s), "a tuple of 2"),   # not of the group's size
    (lambda g, s, p, lr: None, "a NoneType"),
])
@pytest.mark.parametrize("mask", [[True, False], [True, False, True]])
def test_an_update_that_returns_other_than_updates_and_state_is_refused_naming_the_pair(update, says, mask):
    """``update`` returns ``(updates, new_state)``: the updates alone of two groups were unpacked as that pair and
    refused as a state checkpoints cannot save, a misleading line."""
    from framework.engine._checks import check_optimizer

    with pytest.raises(ConfigError) as e:
        check_optimizer(GradientTransformation(_state(_MOMENTS), update), "mine", mask, torch.device("cpu"))
    assert str(e.value).startswith(f"optimizer 'mine': its update returned {says.format(n=len(mask))}, not the pair "
                                   f"(updates, new_state) with updates one tensor per group of the group's size") and \
        "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("name", ["adam", "adamw", "sgd", "lion", "adagrad"])
def test_the_built_in_optimizers_pass_the_contract_check(name):
    from framework.engine._checks import check_optimizer

    comp = registry("optimizer").get(name)
    extra = {"momentum": 0.9, "weight_decay": 0.1} if name == "sgd" else {"weight_decay": 0.1}
    for mask in ([True, False], [False] * 3, [True] * 2000):
        tx = comp.build(dataclasses.replace(comp.config(), **extra), mask)
        assert check_optimizer(tx, name, mask, torch.device("cpu")) is tx
