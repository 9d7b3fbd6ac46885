"""train_step on one process equals a plain PyTorch loop (same init, batches, torch AdamW, clipping)."""
import collections
import copy
import math
import dataclasses

import numpy as np
import pytest
import torch
from torch import nn

import framework
from framework.engine.step import Batch
import framework.core.utils
from framework.models.gpt import gpt_loss
from tests._helpers import build_gpt, flat_params, reference_losses, run_engine, tiny_config

RTOL = 1e-6  # fp32, relative, per step


@pytest.mark.parametrize("extra", [
    ["scheduler.warmup_steps=2"],                        # clipping at 1.0, warmup_cosine past its peak
    ["train.grad_accum=3", "train.grad_clip=0.05", "scheduler.warmup_steps=2"],   # accumulation, clipping always active
    ["optimizer.decay_1d=true", "scheduler=constant"],
    # Plain SGD at a constant lr, no clipping: the update is the gradient times the lr, so a wrong
    # gradient scale shows in the parameters (AdamW and clipping cancel a constant factor).
    ["optimizer=sgd", "optimizer.lr=0.5", "scheduler=constant", "train.grad_clip=0", "train.grad_accum=3"],
])
def test_matches_plain_pytorch(extra):
    cfg = tiny_config(*extra)
    metrics, ref_norms = [], []
    ours, engine, state = run_engine(cfg, metrics=metrics)
    ref, ref_module = reference_losses(cfg, norms=ref_norms)
    for i, (a, b) in enumerate(zip(ours, ref)):
        assert a == pytest.approx(b, rel=RTOL), f"step {i}: {a} vs {b} (rel tol {RTOL})"
    for i, (m, b) in enumerate(zip(metrics, ref_norms, strict=True)):   # before clipping, as clip_grad_norm_'s
        assert m["grad_norm"] == pytest.approx(b, rel=RTOL), f"step {i} grad norm: {m['grad_norm']} vs {b}"
    torch.testing.assert_close(flat_params(engine.components.module), flat_params(ref_module),
                               rtol=1e-5, atol=1e-6)
    assert state.step == cfg.train.steps and state.data == cfg.train.steps


def test_state_is_returned_and_functional():
    cfg = tiny_config("train.steps=2")
    _, engine, state = run_engine(cfg)
    assert dataclasses.is_dataclass(state)
    with pytest.raises(dataclasses.FrozenInstanceError):
        state.step = 0  # type: ignore[misc]


def test_fp16_overflow_skips_step_and_leaves_everything_untouched():
    cfg = tiny_config("precision=fp16", "precision.initial_scale_power=4", "train.steps=3")
    module, data = build_gpt(cfg)
    bomb = {"on": False}

    def loss_fn(m, micro):
        loss = gpt_loss(m, micro)
        return loss * float("inf") if bomb["on"] else loss

    engine = framework.initialize(module, loss_fn, cfg)
    state = engine.state
    batch = data.train_batch(0, micro_batch=4, grad_accum=1, rank=0, world=1)
    state, m = engine.train_step(state, batch)
    assert not m["skipped"]
    before = [p.clone() for p in state.params]
    moments = [t.clone() for t in framework.core.utils.tensors_in(state.opt_state)]
    lr_index = state.applied_steps
    bomb["on"] = True
    state, m = engine.train_step(state, batch)
    assert m["skipped"] and state.precision.skipped_steps == 1
    assert state.applied_steps == lr_index  # LR schedule did not advance
    for a, b in zip(before, state.params):
        assert torch.equal(a, b)
    for a, b in zip(moments, framework.core.utils.tensors_in(state.opt_state)):
        assert torch.equal(a, b)
    bomb["on"], lr_skipped = False, m["lr"]
    state, m = engine.train_step(state, batch)
    assert not m["skipped"] and m["lr"] == lr_skipped   # the next applied step takes the skipped step's lr


def _first_sgd_step(*over):
    # Plain SGD, constant lr, clipping active: a gradient (or a norm) off by the loss scale shows in the
    # parameters and the logged norm (Adam's scale invariance would hide it).
    cfg = tiny_config("optimizer=sgd", "optimizer.lr=0.5", "scheduler=constant", "train.grad_clip=0.05",
                      "train.steps=1", *over)
    module, data = build_gpt(cfg)
    engine = framework.initialize(module, gpt_loss, cfg)
    batch = data.train_batch(0, micro_batch=cfg.train.micro_batch, grad_accum=cfg.train.grad_accum, rank=0, world=1)
    _, m = engine.train_step(engine.state, batch)
    return m, flat_params(module)


def test_fp16_grad_norm_and_clipping_are_of_the_unscaled_gradients():
    ref, ref_p = _first_sgd_step()
    m, p = _first_sgd_step("precision=fp16", "precision.initial_scale_power=8")
    assert m["loss_scale"] == 256 and not m["skipped"]
    assert ref["grad_norm"] > 0.05   # so clipping is active in both runs
    assert m["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-2)
    torch.testing.assert_close(p, ref_p, rtol=0, atol=5e-4)   # (the fp32 update is up to 5.4e-3; fp16 is 1.1e-4 off)


def test_an_overflowing_step_has_one_number_with_and_without_loss_scaling():
    # The first step is step 1 in both messages: at the fp16 scale floor and without loss scaling.
    errors = []
    for precision in (["precision=fp16", "precision.initial_scale_power=0", "precision.min_loss_scale=1",
                       "precision.hysteresis=1"], ["precision=fp32"]):
        cfg = framework.compose(["optimizer=sgd", "scheduler=constant", "train.micro_batch=4", "logger=none",
                                 *precision])
        torch.manual_seed(0)
        engine = framework.initialize(
            TwoLayer(), lambda m, mb: nn.functional.mse_loss(m(mb[0].to(m.a.weight.dtype)).float(), mb[1]) * float("inf"),
            cfg)
        with pytest.raises(framework.TrainingError) as e:
            engine.train_step(engine.state, Batch(((torch.randn(4, 5), torch.randn(4, 1)),)))
        errors.append(str(e.value))
    assert "gradients still overflow at step 1 " in errors[0] and errors[1].startswith("step 1: "), errors


def test_fp16_a_nonfinite_loss_with_finite_gradients_is_no_overflow_but_goes_to_on_nonfinite():
    """Loss scaling counts only non-finite gradients as an overflow (DeepSpeed's rule): an infinite loss whose
    gradients are finite neither halves the scale nor spends hysteresis; it stops the run, or with
    train.on_nonfinite=warn is skipped and counted, as without loss scaling."""
    def loss_fn(m, mb):   # a constant infinity: the gradients stay finite
        return nn.functional.mse_loss(m(mb[0].half()).float(), mb[1]) + torch.tensor(float("inf"))

    batch = Batch(((torch.randn(4, 5), torch.randn(4, 1)),))
    for mode in ("stop", "warn"):
        cfg = framework.compose(["precision=fp16", "precision.initial_scale_power=8", "precision.hysteresis=2",
                                 "optimizer=sgd", "scheduler=constant", "train.micro_batch=4", "logger=none",
                                 f"train.on_nonfinite={mode}"])
        torch.manual_seed(0)
        with framework.initialize(TwoLayer(), loss_fn, cfg) as engine:
            if mode == "stop":
                with pytest.raises(framework.TrainingError, match=r"^step 1: the loss is inf and the gradients are "
                                                                  r"finite \(global norm [0-9.]+\); stopping before"):
                    engine.train_step(engine.state, batch)
                continue
            before = [p.clone() for p in engine.state.params]
            state, m = engine.train_step(engine.state, batch)
            state, m = engine.train_step(state, batch)
    assert m["skipped"] and m["nonfinite"] and math.isfinite(m["grad_norm"])
    p = state.precision
    assert (p.cur_scale, p.cur_hysteresis, p.last_overflow_iter, p.skipped_steps) == (256.0, 2, -1, 2), p
    assert state.applied_steps == 0 and all(torch.equal(a, b) for a, b in zip(before, state.params))


def test_a_micro_batch_with_every_target_ignored_stops_with_a_hint_not_a_learning_rate(capsys):
    """cross_entropy's mean over no targets (all ignore_index, as padded data can give) is nan with a zero
    gradient: the line says the gradients are finite and points at the empty mean, not at the learning rate."""
    def loss_fn(m, mb):
        return nn.functional.cross_entropy(m(mb[0]), mb[1], ignore_index=-100)

    torch.manual_seed(0)
    batch = Batch(((torch.randn(4, 5), torch.tensor([0, 2, -100, 1])), (torch.randn(4, 5), torch.full((4,), -100))))
    for mode in ("stop", "warn"):
        cfg = framework.compose(["optimizer=sgd", "scheduler=constant", "train.micro_batch=4", "train.grad_accum=2",
                                 "logger=none", f"train.on_nonfinite={mode}"])
        with framework.initialize(nn.Linear(5, 3), loss_fn, cfg) as engine:
            if mode == "stop":
                with pytest.raises(framework.TrainingError) as e:
                    engine.train_step(engine.state, batch)
                continue
            m = engine.train_step(engine.state, batch)[1]
    msg = str(e.value)
    assert msg.startswith("step 1: the loss is nan and the gradients are finite (global norm "), msg
    assert "a mean over no elements is nan" in msg and "count.clamp(min=1)" in msg, msg
    assert "non-finite gradients in" not in msg and "learning rate" not in msg, msg
    assert m["skipped"] and m["nonfinite"] and math.isfinite(m["grad_norm"]), m
    assert "a mean over no elements is nan" in capsys.readouterr().err


class _InfGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g * float("inf")


@pytest.mark.parametrize("precision,offload", [("bf16", []), ("fp32", []), ("fp32", ["+stage=zero2", "offload=cpu"]),
                                               ("bf16", ["+stage=zero3", "offload=cpu", "offload.params=cpu"])])
def test_a_nonfinite_step_without_loss_scaling_names_the_parameters_and_counts_skips(precision, offload, capsys):
    """As fp16 at its scale floor does: the parameters whose gradients are non-finite are named (only
    a.weight's here), and train.on_nonfinite=warn says how many steps were skipped so far. With
    offload=cpu the names are read from the host gradients once their copies from the device are done
    (the checking accelerator refuses an earlier read)."""
    def loss_fn(m, mb):   # a finite loss; an infinite gradient reaches a.weight only
        out = m(mb[0].to(m.a.weight.dtype)) + _InfGrad.apply(m.a.weight).sum() * 0
        return nn.functional.mse_loss(out.float(), mb[1])

    batch = Batch(((torch.randn(4, 5), torch.randn(4, 1)),))
    for mode in ("stop", "warn"):
        cfg = framework.compose(["optimizer=sgd", "scheduler=constant", "train.micro_batch=4", "logger=none",
                                 f"precision={precision}", f"train.on_nonfinite={mode}", *offload])
        torch.manual_seed(0)
        with framework.initialize(TwoLayer(), loss_fn, cfg) as engine:
            if mode == "stop":
                with pytest.raises(framework.TrainingError, match=r"non-finite gradients in: a\.weight\)"):
                    engine.train_step(engine.state, batch)
                continue
            state = engine.train_step(engine.state, batch)[0]
            engine.train_step(state, batch)
    err = capsys.readouterr().err
    assert "(1 skipped step so far)" in err and "(2 skipped steps so far)" in err, err
    assert "non-finite gradients in: a.weight)" in err and "b.weight" not in err, err


class TwoLayer(nn.Module):
    """A user's own model, not a framework component."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(5, 7)
        self.b = nn.Linear(7, 1)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def mse(module, micro):
    x, y = micro
    return nn.functional.mse_loss(module(x), y)


def test_library_use_with_own_module_and_loss():
    cfg = framework.compose(["optimizer=sgd", "optimizer.lr=0.1", "optimizer.momentum=0.9", "scheduler=constant",
                             "train.steps=30", "train.micro_batch=8", "train.grad_clip=0", "logger=none"])
    torch.manual_seed(0)
    model = TwoLayer()
    ref = copy.deepcopy(model)
    engine = framework.initialize(model, mse, cfg)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 5, generator=g)
    y = x.sum(1, keepdim=True).sin()
    state = engine.state
    with torch.no_grad():
        initial = mse(model, (x, y)).item()
    for step in range(30):
        micro = (x[step % 8 * 8:(step % 8 + 1) * 8], y[step % 8 * 8:(step % 8 + 1) * 8])
        state, m = engine.train_step(state, Batch((micro,)))
        loss = mse(ref, micro)
        loss.backward()
        opt.step()
        opt.zero_grad()
        assert m["loss"] == pytest.approx(loss.item(), rel=RTOL)
    with torch.no_grad():
        assert mse(engine.components.module, (x, y)).item() < 0.5 * initial  # it learned


def test_model_built_on_meta_gets_the_same_values():
    cfg = tiny_config()
    real, _ = build_gpt(cfg)
    torch.manual_seed(cfg.seed)
    with torch.device("meta"):
        meta, _ = build_gpt(cfg)
    engine = framework.initialize(meta, gpt_loss, cfg)
    assert not any(p.is_meta for p in engine.components.module.parameters())
    torch.testing.assert_close(flat_params(engine.components.module), flat_params(real), rtol=0, atol=0)
    assert engine.components.module.lm_head is None   # still tied: the head is the embedding


class _RealValues(nn.Module):
    """Parameters given real values in a zero_init block: made on the CPU, one of them held by two modules, and a
    fixed table from numpy."""

    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.full((5, 7), 0.5, device="cpu"))
        self.b = nn.Parameter(torch.from_numpy(np.arange(7, dtype=np.float32)), requires_grad=False)
        self.lin, self.twin = nn.Linear(7, 1), nn.Linear(7, 1)
        self.lin.bias = self.twin.bias = nn.Parameter(torch.full((1,), 3.0, device="cpu"))   # tied

    def init_parameter(self, name, t):
        t.fill_(len(name) / 10)

    def forward(self, x):
        h = x @ self.a + self.b
        return self.lin(h) + self.twin(h)


def test_zero_init_keeps_real_values_and_ties_registered_in_it():
    """Only what the default device makes goes on meta: real values put in the block (a constructor's, a
    ``load_state_dict(assign=True)``'s) are kept through initialize, and a tie stays one parameter."""
    pretrained = nn.Linear(7, 1)
    with torch.no_grad():
        pretrained.weight.fill_(7.0)
    with framework.zero_init():
        model = _RealValues()
        model.lin.load_state_dict({"weight": pretrained.weight, "bias": model.lin.bias}, assign=True)
    assert [n for n, p in model.named_parameters() if p.is_meta] == ["twin.weight"]
    assert model.lin.bias is model.twin.bias and not model.b.requires_grad
    with framework.initialize(model, mse, framework.compose(["logger=none"])) as engine:
        assert model.lin.bias is model.twin.bias and len(list(model.parameters())) == 5
        values = dict(a=0.5, b=torch.arange(7.0), **{"lin.weight": 7.0, "lin.bias": 3.0, "twin.weight": 1.1})
        for name, p in model.named_parameters():
            assert torch.all(p == values[name]), (name, p)
        _, m = engine.train_step(engine.state, Batch(((torch.ones(4, 5), torch.ones(4, 1)),)))
    assert math.isfinite(m["loss"])


def _sq_norm_bound(tensors, lam: float = 8.0) -> float:
    """Relative error bound of ``sq_norm`` on CPU tensors, from an error analysis that holds for
    ANY order of the fp32 additions (the SIMD width, and with it the order, differs by CPU).

    sq_norm sums each row of k = SQ_NORM_ROW elements as an fp32 norm, then adds the squared
    row norms in float64. With u = 2**-24: each fp32 square is off by at most u (relative), a
    sum of k non-negative terms in any order by at most gamma(k - 1) = (k - 1) u / (1 - (k - 1) u)
    (Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., §4.2), the square root by
    u, and squaring the row norm doubles its error; so row r is off by delta_r * S_r, S_r its
    exact sum of squares, with |delta_r| <= c = gamma(k + 2). The float64 work adds ~1e-16.
    Worst case, every rounding the same way: |error| <= c * S (1.5e-5 for k = 256). Rounding
    errors of different rows are independent with mean zero (the standard probabilistic model,
    Higham & Mary, SIAM J. Sci. Comput. 2019), so by Hoeffding's inequality
    |error| <= lam * c * sqrt(sum_r S_r**2) except with probability 2 exp(-lam**2 / 2):
    3e-14 for lam = 8. The smaller of the two bounds is returned, relative to S.
    """
    k, u = framework.core.utils.SQ_NORM_ROW, 2.0 ** -24
    c = (k + 2) * u / (1 - (k + 2) * u)
    rows = []
    for t in tensors:
        sq = t.double().reshape(-1).square()
        m = sq.numel() - sq.numel() % k
        rows += [sq[:m].reshape(-1, k).sum(1), sq[m:]]  # tail: elements added exactly in float64
    rows = torch.cat(rows)
    return min(c, lam * c * rows.square().sum().sqrt().item() / rows.sum().item())


@pytest.mark.parametrize("data", ["normal", "heavy-tailed"])
def test_sq_norm_is_accurate_on_millions_of_elements(data):
    # The gradient norm feeds clipping and the overflow check on every rank. Measured on a Xeon
    # (AVX-512): relative error 2.5e-10 (normal) and 2.0e-8 (log-normal) against bounds of
    # 6.2e-7 and 9.5e-6 from _sq_norm_bound. One fp32 dot over the same elements is off by
    # 1.1e-5 and 1.1e-4, one fp32 vector_norm by 7.3e-4 and 1.4e-3: past the bound, so the
    # test can fail. (The old bound, a flat 1e-7, failed on an AMD EPYC at 1.32e-7.)
    gen = torch.Generator().manual_seed(0)
    n = 10_000_003
    g = (torch.randn(n, generator=gen) * 1e-3 if data == "normal"
         else torch.empty(n).log_normal_(0, 2, generator=gen) * 1e-4)
    parts = [g[:7], g[7:]]
    truth = g.double().square().sum().item()
    got = framework.core.utils.sq_norm(parts, torch.device("cpu"))
    assert got.dtype == torch.float64
    bound = _sq_norm_bound(parts)
    assert abs(got.item() - truth) / truth <= bound


def test_sq_norm_small_cases_and_device_path():
    cpu = torch.device("cpu")
    half = framework.core.utils.sq_norm([torch.ones(5, dtype=torch.bfloat16)], cpu)
    assert half.item() == 5.0 and framework.core.utils.sq_norm([], cpu).item() == 0.0
    # A bf16 tensor longer than one widening block: the same rows as its fp32 copy.
    b = (torch.randn(300_000, generator=torch.Generator().manual_seed(1))).bfloat16()
    assert framework.core.utils.sq_norm([b], cpu).item() == framework.core.utils.sq_norm([b.float()], cpu).item()
    # The accelerator path (one _foreach_norm per dtype class), run here on CPU tensors: small
    # integers whose norms are integers, so every step is exact.
    ts = [torch.tensor([3.0, 4.0]), torch.full((4,), 2.0, dtype=torch.bfloat16),
          torch.tensor([12.0, 5.0], dtype=torch.float64)]
    parts = framework.core.utils._device_sq_norms(ts)
    assert len(parts) == 2 and all(p.dtype == torch.float64 for p in parts)
    assert sum(p.item() for p in parts) == 25 + 16 + 169


def test_batch_of_another_length_than_grad_accum_or_empty_is_refused_before_any_work():
    # A DeepSpeed config's accumulation (train_batch_size 32 = micro 8 x accum 4) must not be dropped
    # by a one-micro-batch Batch; empty input divides by 0. A bare (x, y) (or a dict, or a tensor) is one micro
    # batch, whatever its length: iterated, each tensor (or key, or row) would be a loss_fn call; so are a
    # tensor and a dict given to Batch (a tuple of tensors there is that many tensor micro batches).
    ds = {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 8, "optimizer": {"type": "AdamW"}}
    torch.manual_seed(0)
    engine = framework.initialize(TwoLayer(), mse, ds_config=ds)
    assert engine.config.train.grad_accum == 4
    x, y = torch.randn(8, 5), torch.randn(8, 1)
    state = engine.state
    for batch, n in ((Batch(((x, y),)), "1 micro batch"), (Batch(()), "0 micro batches")):
        with pytest.raises(framework.DataError, match=rf"has {n} but train.grad_accum=4"):
            engine.train_step(state, batch)
    for bare, what in (((x, y, x, y), r"a tuple of 4 tensors"), ([x, y], "a list of 2 tensors"),
                       ({"x": x, "y": y, "a": x, "b": y}, "a dict"), (torch.ones(4, 5), r"a tensor of shape \[4, 5\]"),
                       (Batch(torch.ones(4, 5)), r"a tensor of shape \[4, 5\]"), (Batch(dict.fromkeys("abcd", x)), "a dict")):
        with pytest.raises(framework.DataError, match=rf"^train_step: the batch is one micro batch \({what}\), .*"
                                                      rf"pass Batch\(\(\(x, y\),\)\) .*, Batch\(\(x,\)\) for one tensor x"):
            engine.train_step(state, bare)
    for bare, what in (((x, y), "a tuple of 2 tensors"), ({"x": x, "y": y}, "a dict"),
                       (x, r"a tensor of shape \[8, 5\]")):
        with pytest.raises(framework.DataError, match=rf"^eval_step: batches is one micro batch \({what}\), .*"
                                                      rf"\[\(x, y\)\] for one, \[x\] for one tensor x"):
            engine.eval_step(state, bare)
    assert engine.state is state and state.step == 0 and engine.device == torch.device("cpu")
    with pytest.raises(framework.DataError, match="eval_step: no batches"):
        engine.eval_step(state, [])
    with pytest.raises(framework.DataError, match="eval_step: pass a list of micro batches .* not Batch objects"):
        engine.eval_step(state, [Batch(((x, y),))])
    with pytest.raises(RuntimeError):   # a loss_fn that raises (wrong width) leaves the module training
        engine.eval_step(state, [(x, y), (x[:, :3], y)])
    assert engine.components.module.training
    with pytest.raises(framework.DataError, match="^train_step: a batch is an iterable of micro batches .* got int$"):
        engine.train_step(state, Batch(4))
    state, _ = engine.train_step(state, Batch(((x, y),) * 4))
    assert state.step == 1
    # Batch(any iterable): a generator or a list of micro batches is one step too
    state, _ = engine.train_step(state, Batch((x, y) for _ in range(4)))
    state, _ = engine.train_step(state, Batch([(x, y)] * 4, position=7))
    assert state.step == 3 and state.data == 7


@dataclasses.dataclass(frozen=True)
class _Inputs:
    x: torch.Tensor
    ids: torch.Tensor


def test_fp16_auto_cast_casts_the_floating_tensors_of_each_micro_batch():
    # DeepSpeed's fp16.auto_cast (precision.auto_cast): float inputs meet fp16 weights; token ids stay
    # integers; a static loss scale beside it is no reason to drop it.
    ds = {"fp16": {"enabled": True, "auto_cast": True, "loss_scale": 128}, "train_micro_batch_size_per_gpu": 2,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    targets = []

    def mse_seen(module, micro):   # the forward's inputs are cast, the targets beside it are not (as DeepSpeed)
        targets.append(micro[1].dtype)   # (so the loss compares in fp32: torch 2.11's mse backward refuses mixed)
        return nn.functional.mse_loss(module(micro[0]).float(), micro[1])

    torch.manual_seed(0)
    with framework.initialize(TwoLayer(), mse_seen, ds_config=ds, overrides=["scheduler=constant"]) as engine:
        assert engine.config.precision.auto_cast and engine.config.sources["precision.auto_cast"] == "DeepSpeed file"
        x, y = torch.randn(2, 5), torch.randn(2, 1)
        state, m = engine.train_step(engine.state, Batch(((x, y),)))
        assert targets == [torch.float32]
        assert math.isfinite(m["loss"]) and math.isfinite(engine.eval_step(state, [(x, y)]))
        ids = torch.arange(3)
        cast = engine.components.policy.cast_inputs({"x": [x], "ids": ids, "n": 1})
        assert cast["x"][0].dtype == torch.float16 and cast["ids"] is ids and cast["n"] == 1
        # a forward taking a dataclass of inputs (a Hugging Face style ModelInput), or a defaultdict: cast alike
        inputs = _Inputs(x=x, ids=ids)
        (cast,), _ = engine.components.policy.cast_forward(None, (inputs,), {})
        assert type(cast) is _Inputs and cast.x.dtype == torch.float16 and cast.ids is ids and inputs.x is x
        cast = engine.components.policy.cast_inputs(collections.defaultdict(list, x=x))
        assert type(cast) is collections.defaultdict and cast.default_factory is list and cast["x"].dtype == torch.float16
    ds["fp16"].pop("auto_cast")   # without it float inputs fail in the model, as under DeepSpeed
    with framework.initialize(TwoLayer(), mse, ds_config=ds, overrides=["scheduler=constant"]) as engine:
        assert engine.components.policy.cast_inputs(x) is x
        with pytest.raises(RuntimeError, match="dtype"):
            engine.train_step(engine.state, Batch(((x, y),)))


class WithFrozen(nn.Module):
    """A middle layer with requires_grad=False (a frozen embedding, a LoRA base), and its own initialiser."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(5, 7)
        self.f = nn.Linear(7, 7)
        self.b = nn.Linear(7, 1)
        self.f.requires_grad_(False)

    def forward(self, x):
        return self.b(torch.tanh(self.f(torch.tanh(self.a(x)))))

    def init_parameter(self, name, t):
        t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(len(name) + t.numel())) * 0.3)


@pytest.mark.parametrize("stage", ["ddp", "zero1", "zero2", "zero3"])
def test_frozen_parameters_stay_whole_are_cast_and_materialised(stage, tmp_path):
    over = ([] if stage == "ddp" else [f"+stage={stage}"]) + [
        "optimizer=sgd", "optimizer.lr=0.1", "scheduler=constant", "train.steps=3", "train.grad_clip=0", "logger=none"]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 5, generator=g)
    y = x.sum(1, keepdim=True).sin()
    torch.manual_seed(0)
    model = WithFrozen()
    ref = copy.deepcopy(model)
    frozen = model.f.weight.detach().clone()
    opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.1)
    with framework.initialize(model, mse, framework.compose(over)) as engine:   # fp32: as plain PyTorch
        state = engine.state
        for _ in range(3):
            state, m = engine.train_step(state, Batch(((x, y),)))
            loss = mse(ref, (x, y))
            loss.backward()
            opt.step()
            opt.zero_grad()
            assert m["loss"] == pytest.approx(loss.item(), rel=RTOL)
        assert torch.equal(model.f.weight, frozen)
        full = engine.consolidated_state_dict()
        assert set(full) == {n for n, _ in ref.named_parameters()} and torch.equal(full["f.weight"], frozen)
        framework.save_weights(engine, tmp_path)
        with torch.no_grad():
            model.f.weight.zero_()
        framework.load_weights(engine, tmp_path)   # the frozen layer is read back too
        assert torch.equal(model.f.weight, frozen)
    # bf16: cast to the working dtype like every other parameter (else: "mat1 and mat2 must have the same dtype")
    model = WithFrozen()
    with framework.initialize(model, mse, framework.compose([*over, "precision=bf16"])) as engine:
        assert model.f.weight.dtype == torch.bfloat16 and not model.f.weight.requires_grad
        engine.train_step(engine.state, Batch(((x.bfloat16(), y.bfloat16()),)))
        # An fp32 input: torch's error from deep in the model, with a note naming the setting (once).
        note = ("note: precision=bf16: the module's trainable parameters are bfloat16; cast float inputs to it in "
                "loss_fn (x.to(torch.bfloat16)) and return a float32 loss (docs/library.md)")
        for call in (lambda: engine.train_step(engine.state, Batch(((x, y),))),
                     lambda: engine.eval_step(engine.state, [(x, y)])):
            with pytest.raises(RuntimeError, match="same dtype") as e:
                call()
            assert e.value.__notes__ == [note], e.value.__notes__
    def long_wanted(module, micro):   # torch's words for an index dtype, no 16-bit type named: not the precision's
        raise RuntimeError("expected scalar type Long but found Float")
    with framework.initialize(WithFrozen(), long_wanted, framework.compose([*over, "precision=bf16"])) as engine:
        with pytest.raises(RuntimeError, match="Long but found Float") as e:
            engine.train_step(engine.state, Batch(((x.bfloat16(), y.bfloat16()),)))
        assert not getattr(e.value, "__notes__", None), e.value.__notes__
    with framework.zero_init():   # materialised by the model's initialiser, like the trainable ones
        model = WithFrozen()
    with framework.initialize(model, mse, framework.compose(over)) as engine:
        expect = torch.empty(7, 7)
        model.init_parameter("f.weight", expect)
        assert model.f.weight.device.type == "cpu" and torch.equal(model.f.weight, expect)
        engine.train_step(engine.state, Batch(((x, y),)))


class _Norm(nn.Module):
    """BatchNorm, and a floating buffer in a module without parameters (as a rotary embedding's inv_freq)."""

    def __init__(self):
        super().__init__()
        self.lin, self.bn, self.rot = nn.Linear(6, 6), nn.BatchNorm1d(6), nn.Module()
        self.rot.register_buffer("inv_freq", torch.linspace(0.5, 1, 6))

    def forward(self, x):
        return self.bn(self.lin(x.to(self.lin.weight.dtype))) * self.rot.inv_freq.to(x.dtype)


@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_batch_norm_trains_in_16_bit_and_its_buffers_load_across_precisions(stage, tmp_path):
    # BatchNorm's running statistics follow its weight into the working dtype (else torch's kernel refuses
    # the mix); a buffer of a module without parameters keeps its own. A 16-bit run's state and weights
    # load into a float32 engine, and its consolidated state dict into a plain module.
    def loss(m, mb):
        return (m(mb[0]).float() - mb[1]).square().mean()

    torch.manual_seed(0)
    x, y = torch.randn(8, 6), torch.randn(8, 6)
    for precision in ("bf16", "fp16"):
        model = _Norm()
        cfg = framework.compose([f"+stage={stage}", f"precision={precision}", "scheduler=constant"])
        with framework.initialize(model, loss, cfg) as engine:
            state, m = engine.train_step(engine.state, Batch(((x, y),)))
            assert math.isfinite(m["loss"])
            assert model.bn.running_mean.dtype == model.bn.running_var.dtype == engine.components.policy.param_dtype
            assert model.bn.num_batches_tracked.item() == 1 and model.rot.inv_freq.dtype == torch.float32
            saved = engine.state_dict(state)
            framework.save_weights(engine, tmp_path / precision)
            full = engine.consolidated_state_dict()
        _Norm().load_state_dict(full)
        model32 = _Norm()
        with framework.initialize(model32, loss, framework.compose([f"+stage={stage}", "scheduler=constant"])) as e32:
            assert model32.bn.running_mean.dtype == torch.float32
            e32.load_state_dict(e32.state, [saved])
            assert torch.equal(model32.bn.running_var, full["bn.running_var"].float())
            model32.bn.running_var.zero_()
            framework.load_weights(e32, tmp_path / precision)
            assert torch.equal(model32.bn.running_var, full["bn.running_var"].float())


class Dropped(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(5, 16), nn.Linear(16, 1)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return self.b(self.drop(torch.tanh(self.a(x))))


def test_the_step_draws_from_the_states_generators_and_leaves_the_callers_as_they_were():
    over = ["optimizer=sgd", "optimizer.lr=0.1", "scheduler=constant", "train.steps=3", "train.grad_clip=0",
            "logger=none"]
    x, y = torch.randn(8, 5, generator=torch.Generator().manual_seed(1)), torch.zeros(8, 1)
    runs = []
    for caller_seed in (1, 2):
        torch.manual_seed(0)
        engine = framework.initialize(Dropped(), mse, framework.compose(over))
        failing = framework.initialize(Dropped(), lambda m, b: 1 / 0, framework.compose(over))
        torch.manual_seed(caller_seed)
        expected = torch.rand(3, 4)   # the caller's draws between steps, as if no step ran
        torch.manual_seed(caller_seed)
        state, losses = engine.state, []
        for k in range(3):
            state, m = engine.train_step(state, Batch(((x, y),)))
            losses.append(m["loss"])
            assert torch.equal(torch.rand(4), expected[k])
        runs.append(losses)
        with pytest.raises(ZeroDivisionError):   # a failed step puts the caller's generator back too
            failing.train_step(failing.state, Batch(((x, y),)))
        after = torch.get_rng_state()
        torch.manual_seed(caller_seed)
        torch.rand(3, 4)
        assert torch.equal(after, torch.get_rng_state())
    # The dropout masks come from the state's generators only: the caller's seed changes nothing.
    assert runs[0] == runs[1] and len(set(runs[0])) == 3


@pytest.mark.parametrize("stage", ["ddp", "zero3"])
def test_a_loss_fn_returning_anything_but_a_0_dim_floating_tensor_is_refused_in_one_line(stage):
    x, y = torch.randn(8, 5), torch.randn(8, 1)
    bad = {"per-row": lambda m, mb: (m(mb[0]) - mb[1]).square(), "shape [1]": lambda m, mb: mse(m, mb).reshape(1),
           "tuple": lambda m, mb: (mse(m, mb), 0), "dict": lambda m, mb: {"loss": mse(m, mb)},
           "number": lambda m, mb: 1.0, "integer tensor": lambda m, mb: torch.tensor(1)}
    choice = {"fn": mse}
    over = [] if stage == "ddp" else [f"+stage={stage}"]
    torch.manual_seed(0)
    model = TwoLayer()
    ref = copy.deepcopy(model)
    ref_loss = mse(ref, (x, y))
    ref_loss.backward()
    ref_norm = torch.cat([p.grad.reshape(-1) for p in ref.parameters()]).norm().item()
    with framework.initialize(model, lambda m, mb: choice["fn"](m, mb), framework.compose(over)) as engine:
        for what, fn in bad.items():
            choice["fn"] = fn
            with pytest.raises(framework.TrainingError, match=r"^loss_fn must return the loss as a 0-dim floating "
                                                              r"tensor \(e\.g\. reduce it with \.mean\(\)\), got "):
                engine.train_step(engine.state, Batch(((x, y),)))
            with pytest.raises(framework.TrainingError, match="^loss_fn must return the loss as a 0-dim"):
                engine.eval_step(engine.state, [(x, y)])
        # A loss with no grad (detached, or computed under no_grad): fine for eval_step, refused by train_step.
        choice["fn"] = lambda m, mb: mse(m, mb).detach()
        with pytest.raises(framework.TrainingError, match=r"^loss_fn returned a loss that does not require grad"):
            engine.train_step(engine.state, Batch(((x, y),)))
        assert engine.eval_step(engine.state, [(x, y)]) == pytest.approx(ref_loss.item(), rel=RTOL)
        choice["fn"] = mse
        for mode in (torch.no_grad, torch.inference_mode):   # the caller's, not loss_fn's: said so
            with pytest.raises(framework.TrainingError, match=r"^train_step: called under torch\.no_grad\(\) or "
                                                              r"torch\.inference_mode\(\)"), mode():
                engine.train_step(engine.state, Batch(((x, y),)))
        assert engine.state.step == 0
        state, m = engine.train_step(engine.state, Batch(((x, y),)))   # nothing of the refused steps is left
        assert state.step == 1 and m["loss"] == pytest.approx(ref_loss.item(), rel=RTOL)
        assert m["grad_norm"] == pytest.approx(ref_norm, rel=1e-5)


def test_a_float16_loss_under_loss_scaling_is_warned_about_once(capsys):
    """Its backward starts from loss scale / (micro batches x ranks) in float16: 65536 at world size 1
    overflows, 32768 at world size 2 does not, so which steps are skipped would silently depend on the world."""
    batch = Batch(((torch.randn(4, 5), 0.01 * torch.randn(4, 1)),))
    said = []
    for upcast in (False, True):
        torch.manual_seed(0)
        cfg = framework.compose(["precision=fp16", "scheduler=constant", "logger=none", "train.micro_batch=4"])

        def loss_fn(m, mb, upcast=upcast):
            out, y = m(mb[0].half()), mb[1].half()
            return nn.functional.mse_loss(out.float(), y.float()) if upcast else nn.functional.mse_loss(out, y)
        with framework.initialize(TwoLayer(), loss_fn, cfg) as engine:
            state, metrics = engine.train_step(engine.state, batch)
            assert metrics["skipped"] != upcast   # 65536 overflows the float16 loss's gradient
            engine.train_step(state, batch)
        said.append(capsys.readouterr().err.count("warning: train_step: loss_fn returned a float16 loss"))
    assert said == [1, 0]
