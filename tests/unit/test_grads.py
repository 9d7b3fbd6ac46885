"""Per-parameter arrival flags for the bucket hooks (stages/_grads.py), and what they guard against:
a weight used in two segments of reentrant activation checkpointing is accumulated twice in one
backward pass, so its hook fires twice, which is refused."""
import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import framework
from framework import Batch, TrainingError
from framework.stages._flat import make_layout
from framework.stages._grads import Arrivals, expected_order, plan_buckets


def _arrivals(launched):
    named = [(f"p{i}", nn.Parameter(torch.zeros(4))) for i in range(3)]
    layout = make_layout(named, 1)
    buckets = plan_buckets(expected_order([(0, s) for s in layout.slots]), 8)  # [4, 12): p2, p1; [0, 4): p0
    return Arrivals(buckets, launched.append, [n for n, _ in named], "zero2")


def test_a_second_arrival_is_refused_before_or_after_its_bucket():
    for launch in (True, False):
        launched = []
        arrivals = _arrivals(launched)
        arrivals.ready(2)                    # not armed: ignored
        arrivals.arm(launch=launch)
        arrivals.ready(2)
        with pytest.raises(TrainingError, match=r"'p2' received a second gradient .* use_reentrant=False"):
            arrivals.ready(2)                # before its bucket went out too: the same at every bucket layout
        arrivals.ready(1)
        assert launched == ([0] if launch else [])
        with pytest.raises(TrainingError, match=r"'p1' received a second gradient .* use_reentrant=False"):
            arrivals.ready(1)
        arrivals.disarm()
        arrivals.ready(0)                    # after backward: ignored
        arrivals.flush()
        assert launched == [0, 1]


class SharedTwice(nn.Module):
    """One Linear used in two checkpoint segments (reentrant unless ``reentrant`` is False)."""
    reentrant = True

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.shared = nn.Linear(8, 8)
        self.out = nn.Linear(8, 1)

    def segment(self, h):
        return torch.tanh(self.shared(h))

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        h = checkpoint(self.segment, h, use_reentrant=self.reentrant)
        h = checkpoint(self.segment, h, use_reentrant=self.reentrant)
        return self.out(h)


def _mse(module, micro):
    x, y = micro
    return nn.functional.mse_loss(module(x), y)


def _sgd_against_plain(cfg, model, error: bool) -> None:
    """Three SGD steps of ``model`` under ``cfg`` against torch.optim.SGD on a copy (1e-6), or,
    with ``error``, the first step must raise the second-gradient error."""
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    engine = framework.initialize(model, _mse, cfg)
    state = engine.state
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(4, 6, generator=gen)
        micro = (x, x.sum(1, keepdim=True).sin())
        if error:
            with pytest.raises(TrainingError, match="received a second gradient"):
                engine.train_step(state, Batch((micro,)))
            return
        state, _ = engine.train_step(state, Batch((micro,)))
        _mse(ref, micro).backward()
        opt.step()
        opt.zero_grad()
    with framework.gathered(list(model.parameters())):  # whole already, except under zero3
        for (name, a), b in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.parametrize("stage,bucket", [(s, b) for s in ("ddp", "zero1", "zero2") for b in (10_000, 8)]
                         + [("zero3", None)])
def test_shared_weight_under_reentrant_checkpointing(stage, bucket):
    """A weight used in two reentrant checkpoint segments gets two gradients in one backward pass. With
    bucketed reduction in the hooks (zero2; ddp and zero1 at more than one rank with overlap_comm) the second
    one can arrive after its bucket went out; refused at every stage, bucket size and world size alike, so
    this one-process test finds what a multi-rank job would hit (zero3's persistent unit included)."""
    size = [] if stage == "zero3" else [f"stage.reduce_bucket_size={bucket}"]
    cfg = framework.compose([f"+stage={stage}", *size, "optimizer=sgd",
                             "optimizer.lr=0.1", "scheduler=constant", "train.steps=3", "train.grad_clip=0"])
    torch.manual_seed(0)
    _sgd_against_plain(cfg, SharedTwice(), error=True)


@pytest.mark.parametrize("stage,bucket", [(s, b) for s in ("ddp", "zero1", "zero2") for b in (10_000, 8)])
def test_shared_weight_under_non_reentrant_checkpointing_equals_plain(stage, bucket):
    """The other side of the refusal: non-reentrant checkpointing accumulates the shared weight once per
    backward, so the hooks (on every parameter, at every world size) let it through and three steps equal
    torch.optim.SGD; a hook that fired twice or counted a recomputation as a second gradient shows here."""
    cfg = framework.compose([f"+stage={stage}", f"stage.reduce_bucket_size={bucket}", "optimizer=sgd",
                             "optimizer.lr=0.1", "scheduler=constant", "train.steps=3", "train.grad_clip=0"])
    torch.manual_seed(0)
    model = SharedTwice()
    model.reentrant = False
    _sgd_against_plain(cfg, model, error=False)


class SharedInFirstMicroBatch(SharedTwice):
    """Reuses the shared Linear in its first forward only (data-dependent reuse); later ones use another."""

    def __init__(self):
        super().__init__()
        self.other = nn.Linear(8, 8)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        h = torch.tanh(self.inp(x))
        h = checkpoint(self.segment, h, use_reentrant=True)
        second = self.segment if self.calls == 1 else (lambda t: torch.tanh(self.other(t)))
        return self.out(checkpoint(second, h, use_reentrant=True))


@pytest.mark.parametrize("stage", ["ddp", "zero1", "zero2"])
def test_a_second_gradient_in_a_micro_batch_before_the_sync_one_is_refused(stage):
    """With train.grad_accum=2 only the first micro batch (not the step's sync one, which launches nothing
    under ddp/zero1) gives the shared weight two gradients: refused there too, not only when it launches."""
    cfg = framework.compose([f"+stage={stage}", "stage.reduce_bucket_size=10000", "optimizer=sgd",
                             "optimizer.lr=0.1", "scheduler=constant", "train.steps=1", "train.grad_clip=0",
                             "train.grad_accum=2"])
    torch.manual_seed(0)
    model = SharedInFirstMicroBatch()
    engine = framework.initialize(model, _mse, cfg)
    gen = torch.Generator().manual_seed(1)
    micros = []
    for _ in range(2):
        x = torch.randn(4, 6, generator=gen)
        micros.append((x, x.sum(1, keepdim=True).sin()))
    with pytest.raises(TrainingError, match=r"'shared\.(weight|bias)' received a second gradient"):
        engine.train_step(engine.state, Batch(tuple(micros)))
    assert model.calls == 1   # refused in the first micro batch's backward, before the sync one ran


class SharedTwiceZero3(SharedTwice):
    share = True

    def __init__(self):
        super().__init__()
        self.other = nn.Linear(8, 8)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        h = checkpoint(self.segment, h, use_reentrant=self.reentrant)
        second = self.segment if self.share else (lambda t: torch.tanh(self.other(t)))
        h = checkpoint(second, h, use_reentrant=self.reentrant)
        return self.out(h)


@pytest.mark.parametrize("reentrant,share", [(True, True), (False, True), (True, False)])
def test_zero3_shared_weight_under_checkpointing(reentrant, share):
    """zero3 (each Linear a unit): the shared Linear's unit is reduced and released once its
    weight and bias have arrived. Under reentrant checkpointing the second segment's nested
    backward brings a second gradient after that, which raises (a hook counter lost it silently);
    non-reentrant checkpointing accumulates once and equals plain PyTorch, and so does reentrant
    checkpointing of segments that share nothing (their first forward runs without grad, so the
    recomputation inside backward is what announces each unit's gradients)."""
    cfg = framework.compose(["+stage=zero3", "stage.gather_unit=[Linear]", "stage.stage3_param_persistence_threshold=0",
                             "optimizer=sgd", "optimizer.lr=0.1", "scheduler=constant", "train.steps=3",
                             "train.grad_clip=0"])
    torch.manual_seed(0)
    model = SharedTwiceZero3()
    model.reentrant, model.share = reentrant, share
    _sgd_against_plain(cfg, model, error=reentrant and share)
