"""Engine lifetime: engine.state follows train_step; close() (or a with block) stops our worker
thread and removes every hook the stage registered; offload runs on the checking accelerator
catch a missing event and a host buffer allocated in device memory."""
import contextlib
import copy
import dataclasses
import functools
import gc
import os
import threading
import time
import weakref
from dataclasses import replace

import pytest
import torch

import framework
from framework.comm.accelerator import DeviceMismatch, OrderError
from framework.core.errors import SwapIOError
from framework.engine.state import capture_rng
from framework.offload._store import Tier
from framework.models.gpt import gpt_loss
from framework.persist.checkpoint import Checkpointer, preflight
from tests._helpers import build_gpt, tiny_config


def _engine(*overrides):
    cfg = tiny_config("train.steps=2", "train.micro_batch=2", *overrides)
    module, data = build_gpt(cfg)
    return framework.initialize(module, gpt_loss, cfg), data


def _batch(data, state):
    return data.train_batch(state.data, micro_batch=2, grad_accum=1, rank=0, world=1)


def _saved(engine, data, cfg, run_dir, n):
    """``n`` steps from the engine's state, each saved in ``run_dir``'s checkpoint folder."""
    with contextlib.closing(Checkpointer(cfg, engine, run_dir=run_dir)) as ckpt:
        state = engine.state
        for _ in range(n):
            state, _ = engine.train_step(state, _batch(data, state))
            ckpt.save(state)
    return state


def _steps(engine, data, state, n):
    """``n`` steps from ``state``: the last state and the losses."""
    losses = []
    for _ in range(n):
        state, m = engine.train_step(state, _batch(data, state))
        losses.append(m["loss"])
    return state, losses


def _ours() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("host-step")]


def test_engine_state_is_the_latest_state(tmp_path):
    engine, data = _engine("+stage=zero1")
    first = engine.state
    assert first.step == 0
    state, _ = engine.train_step(first, _batch(data, first))
    assert engine.state is state and state.step == 1
    state, _ = engine.train_step(state, _batch(data, state))
    assert engine.state is state and state.step == 2
    # An older state's counters are stale (its tensors were updated in place): refused, nothing run.
    with pytest.raises(framework.FrameworkError, match=r"pass the state .*engine\.state"):
        engine.train_step(first, _batch(data, first))
    assert engine.state is state
    # Nor is it saved, evaluated or measured: its step 0 and optimizer counters with the trained tensors
    # would resume the schedule and the bias correction from the start on trained moments.
    micro = _batch(data, state).micro[0]
    ckpt = Checkpointer(tiny_config(), engine, run_dir=tmp_path)
    for what, call in [("state_dict", lambda: engine.state_dict(first)), ("checkpoint", lambda: ckpt.save(first)),
                       ("eval_step", lambda: engine.eval_step(first, [micro])),
                       ("memory", lambda: engine.memory(first))]:
        with pytest.raises(framework.FrameworkError, match=r"this state \(step 0\) is not the one .*engine\.state"):
            call()
    ckpt.close()
    assert not list(tmp_path.rglob("step-*"))
    state, _ = engine.train_step(replace(state, rng=capture_rng(torch.device("cpu"))), _batch(data, state))
    assert state.step == 3   # the same state with other scalars (the CLI's RNG) is the current one
    engine.state_dict(replace(state, rng=capture_rng(torch.device("cpu"))))
    engine.eval_step(state, [micro])
    engine.close()


@pytest.mark.parametrize("overrides", [[], ["+stage=zero1"], ["+stage=zero2", "offload=cpu"],
                                       ["+stage=zero2", "offload=cpu", "offload.overlap_step=true"],
                                       ["+stage=zero3", "offload=cpu", "offload.params=cpu"]])
def test_close_stops_the_worker_and_removes_hooks(overrides):
    before = _ours()
    with _engine(*overrides)[0] as engine:
        data = _engine(*overrides)[1]
        engine.train_step(engine.state, _batch(data, engine.state))
        if "offload=cpu" in overrides:
            assert len(_ours()) > len(before)   # the check can see the worker
        module = engine.components.module
    assert engine.closed and _ours() == before
    params = list(module.parameters())
    assert all(not p._post_accumulate_grad_hooks for p in params)
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in module.modules())
    if "+stage=zero3" not in overrides:  # (zero3's parameters stay empty placeholders)
        fired = []
        stage = engine.components.stage
        launcher = stage.flat_grads.launcher if hasattr(stage, "flat_grads") else stage.launcher
        launcher.ready = lambda i: fired.append(i)
        x = torch.randint(0, 24, (2, 16))
        gpt_loss(module, (x, x)).backward()
        assert fired == []
    with pytest.raises(framework.FrameworkError, match="engine is closed"):
        engine.train_step(engine.state, _batch(data, engine.state))
    if "+stage=zero3" in overrides:   # its empty shards cannot be trained again
        with pytest.raises(framework.FrameworkError, match="^initialize: this module was sharded by a zero3 engine"):
            framework.initialize(module, gpt_loss, tiny_config(*overrides))
        with pytest.raises(framework.FrameworkError, match="^state_dict.. of a ZeRO-3 module may hold empty sharded"):
            module.state_dict()
        x = torch.randint(0, 24, (2, 16))
        with framework.gathered(module.parameters()):   # the module's own use after close (docs/library.md)
            assert torch.isfinite(gpt_loss(module, (x, x)))
            with pytest.raises(framework.FrameworkError, match=r"refused inside framework.gathered too\): use "
                                                               r"engine.consolidated_state_dict\(\), or copy"):
                module.state_dict()   # (its values would be views of reused gather buffers)


@pytest.mark.parametrize("overrides", [["+stage=zero1"], ["+stage=zero2", "offload=cpu"]])
def test_close_inside_a_step_is_refused_in_one_line_and_the_engine_trains_on(overrides):
    # Every tier alike: under offload=cpu it used to end in the worker pool's raw "cannot schedule new futures
    # after shutdown"; without offload the step finished on a closed engine.
    before, closing, nested = _ours(), [], []

    def loss(m, mb):
        if nested:
            nested.pop()()   # an eval_step inside train_step's loss_fn: the step's mark is back after it
        elif closing:
            closing.pop()()   # on the 2nd micro batch of the step, or in eval_step
        return gpt_loss(m, mb)

    cfg = tiny_config("train.steps=2", "train.micro_batch=2", "train.grad_accum=2", *overrides)
    module, data = build_gpt(cfg)
    with framework.initialize(module, loss, cfg) as engine:
        batch = data.train_batch(engine.state.data, micro_batch=2, grad_accum=2, rank=0, world=1)
        closing.append(lambda: closing.append(engine.close))
        with pytest.raises(framework.FrameworkError, match=r"^close\(\) called inside train_step; close after it "
                                                            r"returns$"):
            engine.train_step(engine.state, batch)
        closing.append(engine.close)
        with pytest.raises(framework.FrameworkError, match=r"^close\(\) called inside eval_step; close after"):
            engine.eval_step(engine.state, batch.micro)
        nested.append(lambda: (engine.eval_step(engine.state, list(batch.micro[:1])), closing.append(engine.close)))
        with pytest.raises(framework.FrameworkError, match=r"^close\(\) called inside train_step; close after"):
            engine.train_step(engine.state, batch)
        assert not engine.closed
        state, _ = engine.train_step(engine.state, batch)
        assert state.step == 1
    assert engine.closed and _ours() == before


def test_zero_init_takes_a_module_with_an_initialiser_and_refuses_a_plain_one_in_one_line():
    # As framework's docstring says: not any module; a plain one built on meta names the fix.
    assert "refuses any other module" in " ".join(framework.__doc__.split())
    with framework.zero_init():
        plain = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(framework.ConfigError, match=r"^parameter '0.weight' is on the meta device but Sequential has "
                                                    r"no init_parameter\(name, tensor\) method .* build the model on "
                                                    r"a real device"):
        framework.initialize(plain, lambda m, b: m(b).sum(), framework.compose(["+stage=zero3"]))


class _Scaled(torch.nn.Module):   # a buffer made in __init__: on meta under zero_init
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("scale", torch.empty(4))

    def init_parameter(self, name, t):
        torch.nn.init.constant_(t, 0.5)

    def forward(self, x):
        return self.lin(x) * self.scale


def test_zero_init_fills_a_meta_buffer_by_the_modules_init_buffer_or_names_the_fix():
    with framework.zero_init():
        bare = _Scaled()
    with pytest.raises(framework.ConfigError, match=r"^buffer 'scale' of _Scaled is on the meta device; add an "
                                                    r"init_buffer\(name, tensor\) method"):
        framework.initialize(bare, lambda m, b: m(b).sum(), framework.compose(["+stage=zero3"]))
    _Scaled.init_buffer = lambda self, name, t: t.fill_(2.0)
    try:
        with framework.zero_init():
            module = _Scaled()
        with framework.initialize(module, lambda m, b: m(b).sum(), framework.compose(["+stage=zero3"])) as engine:
            loss = engine.eval_step(engine.state, [torch.ones(1, 4)])
        assert loss == 4 * 2.0 * (0.5 * 4 + 0.5)   # 4 outputs of (weights 0.5 . ones + bias 0.5), scaled by 2
    finally:
        del _Scaled.init_buffer


class _Returns(torch.nn.Module):   # writes its values into a new tensor and returns it instead of filling t
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("scale", torch.empty(4))

    def init_parameter(self, name, t):
        return torch.full(t.shape, 0.5)

    def init_buffer(self, name, t):
        return torch.nn.init.ones_(t)   # t itself, filled in place: accepted

    def forward(self, x):
        return self.lin(x) * self.scale


class _Fills(_Returns):
    def init_parameter(self, name, t):
        return t.fill_(0.5)   # t itself: in place, so accepted


class _FillsData(_Returns):
    def init_parameter(self, name, t):
        return t.data.fill_(0.5)   # another tensor over t's storage (HF's _init_weights idiom): t is filled


class _FillsView(_Returns):
    def init_parameter(self, name, t):
        return torch.nn.init.constant_(t.view(-1), 0.5)   # a view of t, filled: t is filled


class _FillsTransposed(_Returns):
    def init_parameter(self, name, t):
        return torch.nn.init.constant_(t.t(), 0.5)   # all of t, transposed (orthogonal_(t.T)'s idiom): t is filled


def test_a_returned_tensor_over_other_elements_than_t_is_no_fill_of_t():
    """Accepted: exactly t's elements, in any order of its dimensions; not a part, a repeat, a reinterpretation."""
    from framework.stages._flat import _same_elements
    t, nine = torch.empty(4, 3), torch.empty(9)
    assert all(_same_elements(v, t) for v in (t.data, t.view(-1), t.t(), t.unsqueeze(0).transpose(0, 2)))
    for other in (t.view(torch.int32), t[:1].expand(4, 3), t[::2], t[0], t.view(-1)[1:], t.clone()):
        assert not _same_elements(other, t), other.stride()
    assert not _same_elements(nine.as_strided((3, 3), (2, 2)), nine)   # 9 elements, its span, some twice
    assert not _same_elements(t.to_sparse(), t)   # a sparse tensor: no storage to compare (a traceback before)


class _FillsReturnsBuffer(_Fills):
    def init_buffer(self, name, t):
        return torch.ones(4)   # a new tensor: refused as init_parameter's is


@pytest.mark.parametrize("overrides", [[], ["+stage=zero2"], ["+stage=zero3"]])
def test_an_init_parameter_that_returns_its_values_instead_of_filling_the_tensor_is_refused_in_one_line(overrides):
    with framework.zero_init():
        module = _Returns()
    with pytest.raises(framework.ConfigError, match=r"^_Returns.init_parameter\('lin.weight', tensor\) returned a "
                                                    r"Tensor; it must fill `tensor` in place .* return None$"):
        framework.initialize(module, lambda m, b: m(b).sum(), framework.compose(overrides))
    for fills in (_Fills, _FillsData, _FillsView, _FillsTransposed):
        with framework.zero_init():
            module = fills()
        with framework.initialize(module, lambda m, b: m(b).sum(), framework.compose(overrides)) as engine:
            assert engine.eval_step(engine.state, [torch.ones(1, 4)]) == 4 * (0.5 * 4 + 0.5), fills
    with framework.zero_init():
        module = _FillsReturnsBuffer()
    with pytest.raises(framework.ConfigError, match=r"^_FillsReturnsBuffer.init_buffer\('scale', tensor\) returned a "
                                                    r"Tensor; it must fill `tensor` in place .* return None$"):
        framework.initialize(module, lambda m, b: m(b).sum(), framework.compose(overrides))


def test_a_failed_initialize_leaves_no_hooks_and_a_zero3_module_is_refused_in_one_line():
    def loss(m, mb):
        return m(mb).square().mean()

    x = torch.randn(2, 4)
    # A bad scheduler is refused before the module is touched: a retry on it works.
    module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    with pytest.raises(framework.ConfigError, match="warmup_steps"):
        framework.initialize(module, loss, framework.compose(["+stage=zero3", "scheduler.warmup_steps=-1"]))
    assert all(type(p) is torch.nn.Parameter and p.numel() for p in module.parameters())
    # A failure after the stage's setup (the optimizer's build: a value compose would refuse, set after it)
    # removes the stage's hooks; the parameters stay empty shards, and a retry (or a second engine on an open
    # one's module) is refused in one line.
    cfg = framework.compose(["+stage=zero3", "optimizer=sgd"])
    cfg = dataclasses.replace(cfg, optimizer=dataclasses.replace(cfg.optimizer, nesterov=True, momentum=0.0))
    with pytest.raises(framework.ConfigError, match="nesterov"):
        framework.initialize(module, loss, cfg)
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in module.modules())
    assert all(not p._post_accumulate_grad_hooks for p in module.parameters())
    for cfg in (["+stage=zero3"], []):
        with pytest.raises(framework.FrameworkError, match="^initialize: this module was sharded by a zero3 engine"):
            framework.initialize(module, loss, framework.compose(cfg))
    module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    with framework.initialize(module, loss, framework.compose(["+stage=zero3"])) as engine:
        engine.train_step(engine.state, framework.Batch((x,)))
        with pytest.raises(framework.FrameworkError, match="^initialize: this module was sharded by a zero3 engine"):
            framework.initialize(module, loss, framework.compose(["+stage=zero3"]))
        engine.train_step(engine.state, framework.Batch((x,)))   # the first engine goes on


def _interrupt_inside_the_update(engine):
    """Ctrl-C once the update has changed part of the state: in the publish (plain update) or after the
    first piece's copy back (the offload pipeline)."""
    upd, stage = engine.components.update, engine.components.stage
    owner, name = (upd, "_publish") if hasattr(upd, "_publish") else (stage, "publish")
    real = getattr(owner, name)

    def once(*args, **kwargs):
        real(*args, **kwargs)
        del owner.__dict__[name]   # the real one again
        raise KeyboardInterrupt

    setattr(owner, name, once)


@pytest.mark.parametrize("overrides", [["+stage=zero1"], ["+stage=zero3"], ["+stage=zero2", "offload=cpu"],
                                       ["+stage=zero2", "offload=nvme"]])
def test_an_interrupt_inside_the_optimizer_update_stops_the_engine_until_a_full_load(overrides, tmp_path):
    """A step interrupted (Ctrl-C, SIGTERM's SystemExit) while the update changes the masters and moments
    in place cannot be undone: stepping on would apply it twice, saving would keep a half-updated state.
    Every use of the state is refused in one line until a load replaces all of it; then training goes on
    exactly as a run that was never interrupted."""
    def build(name):
        cfg = tiny_config("train.micro_batch=2", "scheduler=constant", *overrides, f"checkpoint.dir={tmp_path}/ckpt",
                          *([f"offload.nvme_path={tmp_path}/{name}"] if "offload=nvme" in overrides else []))
        module, data = build_gpt(cfg)
        return framework.initialize(module, gpt_loss, cfg), data, cfg

    (clean, data, _), (broken, _, cfg) = build("clean"), build("broken")
    with clean, broken:
        _, ref = _steps(clean, data, clean.state, 3)
        state, m = broken.train_step(broken.state, _batch(data, broken.state))
        saved = broken.state_dict(state)
        _interrupt_inside_the_update(broken)
        with pytest.raises(KeyboardInterrupt):
            broken.train_step(state, _batch(data, state))
        assert broken.state is state
        refused = r"^step 2 was interrupted during the optimizer update, which is half-applied: load a checkpoint"
        for use in (lambda: broken.train_step(state, _batch(data, state)), lambda: broken.eval_step(state, [(0, 0)]),
                    lambda: broken.state_dict(state), broken.consolidated_state_dict,
                    lambda: framework.save_weights(broken, tmp_path / "w"),
                    lambda: Checkpointer(cfg, broken).save(state)):
            with pytest.raises(framework.FrameworkError, match=refused):
                use()
        assert not (tmp_path / "w").exists() and not (tmp_path / "ckpt" / "latest").exists()
        state = broken.load_state_dict(state, [saved])
        assert [m["loss"], *_steps(broken, data, state, 2)[1]] == ref
        assert all(torch.equal(a, b) for a, b in zip(clean.consolidated_state_dict().values(),
                                                      broken.consolidated_state_dict().values()))


def test_under_overlap_step_a_failure_before_the_update_publishes_is_rolled_back_and_training_goes_on():
    """offload.overlap_step steps pieces speculatively during the backward, after undo copies: a speculative
    step that fails, or Ctrl-C while the update waits for them, changes nothing for good (abort restores the
    copies), so the engine is not marked half-applied and goes on exactly as a run that never failed."""
    overrides = ("+stage=zero2", "offload=cpu", "offload.overlap_step=true", "stage.reduce_bucket_size=1500",
                 "train.grad_clip=0", "train.micro_batch=2", "scheduler=constant")
    (clean, data), (engine, _) = _engine(*overrides), _engine(*overrides)
    with clean, engine:
        _, ref = _steps(clean, data, clean.state, 3)
        state, m = engine.train_step(engine.state, _batch(data, engine.state))
        got = [m["loss"]]
        upd = engine.components.update
        for name, error in (("_speculate", MemoryError("a speculative step ran out of host memory")),
                            ("_settle", KeyboardInterrupt())):
            calls, real = [], getattr(upd, name)

            def once(*args, calls=calls, real=real, error=error, **kwargs):
                calls.append(1)   # (each piece's job is bound when submitted: maybe all before the first ran)
                if len(calls) == 1:
                    raise error
                return real(*args, **kwargs)

            setattr(upd, name, once)
            rolled_back = upd.rolled_back
            with pytest.raises(type(error)):
                engine.train_step(state, _batch(data, state))
            del upd.__dict__[name]
            assert calls and upd.rolled_back > rolled_back
        assert got + _steps(engine, data, state, 2)[1] == ref
        assert all(torch.equal(a, b) for a, b in zip(clean.consolidated_state_dict().values(),
                                                      engine.consolidated_state_dict().values()))


def test_a_peers_failure_after_this_ranks_update_still_orders_the_copies_back_before_compute(tmp_path):
    """offload=nvme: this rank's update finished and queued its copies back, then the agreement on IO
    errors raises for another rank's failure (simulated at world 1). Whatever the compute stream does next
    (the module run outside the engine) must follow those copies, as after a step that finished."""
    cfg = tiny_config("train.micro_batch=2", "+stage=zero2", "offload=nvme", f"offload.nvme_path={tmp_path}/swap")
    module, data = build_gpt(cfg)
    with framework.initialize(module, gpt_loss, cfg) as engine:
        state, _ = engine.train_step(engine.state, _batch(data, engine.state))
        target = engine.components.stage.offload
        real = target.agree_io_error

        def peer_failed(error, what):
            del target.__dict__["agree_io_error"]   # the real one again
            real(error or SwapIOError("rank 1: stepping the optimizer failed"), what)

        target.agree_io_error = peer_failed
        with pytest.raises(SwapIOError, match="rank 1"):
            engine.train_step(state, _batch(data, state))
        target.acc.use(reads=target.partitions)   # the compute stream reads the working parameters


@pytest.mark.parametrize("stage", ["ddp", "zero2"])
def test_a_second_engine_on_an_open_engines_module_is_refused_until_it_closes(stage):
    """ddp to zero2 bind the module's parameters to the engine's buffers: a second initialize would rebind
    them, and the first engine would step buffers the module no longer reads (training nothing)."""
    cfg = tiny_config("train.micro_batch=2", f"+stage={stage}")
    module, data = build_gpt(cfg)
    first = framework.initialize(module, gpt_loss, cfg)
    with pytest.raises(framework.FrameworkError, match=r"^initialize: \d+ parameters of this module \(.*\) are "
                                                       r"trained by another open engine; close that one first "
                                                       r"\(engine.close\(\)"):
        framework.initialize(module, gpt_loss, cfg)
    # a module sharing a submodule with it (a second head on the same body) would lose one engine's updates
    body = next(m for m in module.modules() if isinstance(m, torch.nn.Linear))
    with pytest.raises(framework.FrameworkError, match=r"^initialize: \d parameters? of this module \(0.weight"):
        framework.initialize(torch.nn.Sequential(body, torch.nn.Linear(body.out_features, 2)),
                             lambda m, mb: m(mb).sum(), cfg)
    before = [p.detach().clone() for p in module.parameters()]
    first.train_step(first.state, _batch(data, first.state))   # the first engine still trains the module
    assert any(not torch.equal(a, p) for a, p in zip(before, module.parameters()))
    framework.initialize(copy.deepcopy(module), gpt_loss, cfg).close()   # a copy is its own module
    first.close()
    with framework.initialize(module, gpt_loss, cfg) as second:
        second.train_step(second.state, _batch(data, second.state))


def test_a_dropped_engine_is_freed_at_once_and_its_module_can_be_initialized_again():
    """No reference cycle through the engine: ``del engine`` (unclosed) frees it and its optimizer state
    without waiting for the garbage collector, and the module is free for a new initialize."""
    cfg = tiny_config("train.micro_batch=2", "+stage=zero2")
    module, data = build_gpt(cfg)
    engine = framework.initialize(module, gpt_loss, cfg)
    engine.train_step(engine.state, _batch(data, engine.state))
    gone = weakref.ref(engine)
    was = gc.isenabled()
    gc.disable()
    try:
        del engine
        assert gone() is None
        with framework.initialize(module, gpt_loss, cfg) as second:
            second.train_step(second.state, _batch(data, second.state))
    finally:
        if was:
            gc.enable()


def _io_threads_and_swap_files(folder) -> tuple[list, list, list]:
    fds = []
    for fd in os.listdir("/proc/self/fd") if os.path.isdir("/proc/self/fd") else ():
        with contextlib.suppress(OSError):   # (the listing's own descriptor is gone)
            fds.append(os.readlink(f"/proc/self/fd/{fd}"))
    return ([t for t in threading.enumerate() if t.name.startswith("framework-aio-")],
            sorted(folder.rglob("*.swap")), [path for path in fds if path.startswith(str(folder))])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("close", [False, True])
@pytest.mark.parametrize("stage", ["zero1", "zero3"])
def test_a_collected_nvme_engine_stops_its_io_threads_and_removes_its_swap_files(stage, close, tmp_path):
    """An engine dropped unclosed lets go of what close() would once collected: its IO threads end, its swap
    files and their descriptors go (a notebook or a sweep that forgets close() does not pile them up)."""
    threads, _, _ = _io_threads_and_swap_files(tmp_path)
    cfg = tiny_config("train.micro_batch=2", f"+stage={stage}", "offload=nvme", f"offload.nvme_path={tmp_path}/swap")
    module, data = build_gpt(cfg)
    engine = framework.initialize(module, gpt_loss, cfg)
    engine.train_step(engine.state, _batch(data, engine.state))
    running, files, fds = _io_threads_and_swap_files(tmp_path)
    running = [t for t in running if t not in threads]
    assert running and files and fds
    if close:
        engine.close()
    gone = weakref.ref(engine)
    del engine, module
    gc.collect()
    assert gone() is None
    deadline = time.monotonic() + 10
    for t in running:   # (a collected engine's threads finish what was queued, then end)
        t.join(max(deadline - time.monotonic(), 0))
    # (only this engine's threads: the snapshot may hold an earlier test's, ending meanwhile)
    assert not [t for t in running if t.is_alive()] and _io_threads_and_swap_files(tmp_path)[1:] == ([], [])


@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_load_state_dict_across_a_frozen_trainable_switch_names_the_switch_and_the_way_on(stage):
    """Not "missing" or "unexpected", nor a cut-off list: which parameters changed and how to go on."""
    cfg = tiny_config("train.micro_batch=2", f"+stage={stage}")

    def engine_with(frozen: str):
        module, data = build_gpt(cfg)
        module.get_submodule(frozen).requires_grad_(False)
        return framework.initialize(module, gpt_loss, cfg), data

    engine, data = engine_with("blocks.0.mlp.fc")
    with engine:
        state, _ = engine.train_step(engine.state, _batch(data, engine.state))
        saved = engine.state_dict(state)
    way = (r"; set their requires_grad as when saved to load it \(then framework\.save_weights\(engine, DIR\) keeps "
           r"its weights alone, which framework\.load_weights\(engine, DIR\) loads into any choice of trainable "
           r"parameters\)$")
    with engine_with("blocks.1.mlp.fc")[0] as other:
        with pytest.raises(framework.FrameworkError, match=r"^load_state_dict: parameters 'blocks\.0\.mlp\.fc\.weight' "
                           r"were frozen \(requires_grad=False\) when saved but are trainable in this run; "
                           r"'blocks\.1\.mlp\.fc\.weight' were trainable when saved but are frozen in this run" + way):
            other.load_state_dict(other.state, [saved])


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_after_close_the_state_is_saved_from_host_memory_and_refused_in_one_line_from_swap_files(offload, tmp_path):
    cfg = tiny_config("train.micro_batch=2", "+stage=zero2", f"offload={offload}",
                      *([f"offload.nvme_path={tmp_path}/swap"] if offload == "nvme" else []))
    module, data = build_gpt(cfg)
    with framework.initialize(module, gpt_loss, cfg) as engine:
        state, _ = engine.train_step(engine.state, _batch(data, engine.state))
        saved = engine.state_dict(state)
    uses = (lambda: engine.state_dict(state), lambda: engine.load_state_dict(state, [saved]),
            lambda: framework.save_weights(engine, tmp_path / "w"))
    for use in uses:
        if offload == "cpu":   # the state is in host memory: still there
            use()
        else:
            with pytest.raises(framework.FrameworkError, match=r"^this engine is closed and its swap files "
                                                               r"\(offload=nvme\) are gone: call state_dict"):
                use()


def test_after_close_zero3_shards_on_nvme_are_refused_not_read_as_zeros(tmp_path):
    """The module's swapped parameter shards are gone with the swap file: a gathered forward after close is
    one line (each try), never a forward on the zero placeholders or on unfilled gather buffers."""
    cfg = tiny_config("train.micro_batch=2", "+stage=zero3", "stage.stage3_param_persistence_threshold=0",
                      "offload=nvme", "offload.params=nvme", f"offload.nvme_path={tmp_path}/swap")
    module, data = build_gpt(cfg)
    with framework.initialize(module, gpt_loss, cfg) as engine:
        engine.train_step(engine.state, _batch(data, engine.state))
    # (every time: a refused gather leaves nothing half done for the next one to finish on unfilled buffers)
    for use in (engine.consolidated_state_dict, lambda: framework.gathered(module.parameters()).__enter__()) * 2:
        with pytest.raises(framework.FrameworkError, match=r"^this engine is closed and its zero3 parameter swap "
                                                           r"file"):
            use()


@pytest.mark.parametrize("fault,code,says", [
    ("write_at", "ENOSPC", r"No space left on device; free space or point offload\.nvme_path at a larger disk"),
    ("write_at", "EFBIG", r"File too large; a file size limit stops it: raise it \(ulimit -f\)"),   # not room
    ("mkstemp", "EACCES", r"Permission denied; fix its permissions or set offload\.nvme_path to a writable folder"),
    ("read_into", "EIO", r"construction spill in .*: Input/output error; check the disk"),
])
def test_a_failed_zero3_parameter_spill_to_nvme_is_one_line_naming_the_folder(tmp_path, monkeypatch, fault, code,
                                                                               says):
    """The shards spilled while the model is built (after the pre-flight: the disk may fill or lose its permissions
    since), and read back into their swap file: an OSError there was a bare traceback."""
    import errno
    import os
    import tempfile

    import framework.offload._diskshards as diskshards
    code = getattr(errno, code)
    real_mkstemp = tempfile.mkstemp

    def fail(*args, **kwargs):
        if fault == "mkstemp" and kwargs.get("prefix") != ".construction-":   # (the pre-flight's probe passes)
            return real_mkstemp(*args, **kwargs)
        raise OSError(code, os.strerror(code))
    monkeypatch.setattr(*(diskshards, fault) if fault != "mkstemp" else (tempfile, "mkstemp"), fail)
    cfg = tiny_config("+stage=zero3", "stage.stage3_param_persistence_threshold=0", "offload=nvme",
                      "offload.params=nvme", f"offload.nvme_path={tmp_path}/swap")
    module, _ = build_gpt(cfg)
    with pytest.raises(SwapIOError, match=r"^nvme: cannot (spill|read) the zero3 parameter shards .*" + says) as e:
        framework.initialize(module, gpt_loss, cfg)
    assert f"{tmp_path}/swap" in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "swap").exists()   # the swap folder initialize made is removed


OFFLOAD = ["+stage=zero2", "offload=cpu", "stage.reduce_bucket_size=1500", "offload.overlap_step=true",
           "train.grad_clip=0"]


@pytest.mark.parametrize("overrides,needle", [
    (OFFLOAD, "stream 'offload d2h' reads .* stream 'compute' wrote"),   # gradient copy before its reduction
    (["+stage=zero3", "offload=cpu", "offload.params=cpu", "stage.stage3_param_persistence_threshold=0"],
     # a gradient copy before its reduction, or a shard load into a gather buffer before its last use (or
     # before the H2D stream waited for compute, whose allocator refilled the buffer)
     "copy on stream 'offload (d2h|h2d)' .* (which stream '(compute|collectives)' wrote|before stream 'offload "
     "h2d' waited for compute)"),
])
def test_a_missing_event_fails_on_cpu(monkeypatch, overrides, needle):
    """If a stream did not wait for the event behind the producer of what it reads, the checking
    accelerator (the suite's default) raises instead of letting CPU tests pass."""
    from framework.comm.accelerator import CheckingEvent
    monkeypatch.setattr(CheckingEvent, "wait", lambda self, stream=None: None)
    engine, data = _engine(*overrides)
    with engine, pytest.raises(OrderError, match=needle):
        engine.train_step(engine.state, _batch(data, engine.state))


def test_a_host_buffer_in_device_memory_fails_on_cpu(monkeypatch):
    from framework.offload._store import HostStore
    monkeypatch.setattr(HostStore, "allocate", lambda self, n, dtype: torch.empty(n, dtype=dtype))
    with pytest.raises(DeviceMismatch, match="expected a host buffer"):
        engine, data = _engine(*OFFLOAD)
        with engine:
            engine.train_step(engine.state, _batch(data, engine.state))


@pytest.mark.parametrize("overrides", [[], ["+stage=zero1"], ["+stage=zero2"], ["+stage=zero3"],
                                       ["+stage=zero2", "offload=cpu", "stage.reduce_bucket_size=1500"]])
def test_the_overflow_error_names_exactly_the_parameters_with_non_finite_gradients(overrides):
    # the last element of every piece and the first of the piece holding most parameters get a NaN/inf:
    # those parameters are named, not the finite ones between them (offload=cpu: pieces start inside
    # the partition, so each piece's offset counts)
    engine, _ = _engine(*overrides)
    stage = engine.components.stage
    specs = stage.piece_specs()
    grads = [torch.zeros(s.numel) for s in specs]
    named = set()
    for g, spec in zip(grads, specs):
        if not spec.spans:   # a piece of padding only
            continue
        g[spec.spans[-1].piece[1] - 1] = float("inf")
        named.add(spec.spans[-1].name)
    i = max(range(len(specs)), key=lambda k: len(specs[k].spans))
    assert len(specs[i].spans) >= 3
    grads[i][specs[i].spans[0].piece[0]] = float("nan")
    named.add(specs[i].spans[0].name)
    if "offload=cpu" in overrides:
        assert len(specs) > 2 and any(start for _, start in stage.piece_index)
    assert sorted(stage.nonfinite_names(grads)) == sorted(named)
    engine.close()


def test_a_module_with_nothing_to_train_is_refused_by_initialize():
    module = torch.nn.Linear(3, 1).requires_grad_(False)
    with pytest.raises(framework.FrameworkError, match=r"^initialize: the module has no parameters with "
                                                       r"requires_grad=True: nothing to train"):
        framework.initialize(module, lambda m, mb: m(mb[0]).sum(), tiny_config())


@pytest.mark.parametrize("args,needle", [
    ((lambda x: x, lambda m, mb: m(mb[0]).sum(), None), r"module must be a torch\.nn\.Module, got function$"),
    ((torch.nn.Linear(3, 1), None, None), r"loss_fn must be callable .*got NoneType$"),
    ((torch.nn.Linear(3, 1), lambda mb: mb, None), r"loss_fn is called as loss_fn\(module, micro_batch\), which "
     r"<lambda>\(mb\) cannot take \(too many positional arguments\); give it those two positional parameters$"),
    ((torch.nn.Linear(3, 1), lambda m, *, mb: mb, None), r"loss_fn is called as loss_fn\(module, micro_batch\)"),
    ((torch.nn.Linear(3, 1), lambda m, mb: m(mb[0]).sum(), ["+stage=zero2"]),
     r"cfg must be a framework Config, got list; build one with framework\.compose"),
    ((torch.nn.Linear(3, 1), lambda m, mb: m(mb[0]).sum(), {"optimizer": {"lr": 1}}), r"cfg must be a framework Config, got dict; build one"),
])
def test_initialize_refuses_arguments_of_the_wrong_type_in_one_line(args, needle):
    module, loss_fn, cfg = args
    with pytest.raises(framework.ConfigError, match="^initialize: " + needle) as e:
        framework.initialize(module, loss_fn, cfg if cfg is not None else tiny_config())
    assert "\n" not in str(e.value)
    def supplies_scale(fn):   # a decorator's wrapper, which is what is called, takes (module, micro_batch)
        @functools.wraps(fn)
        def wrapper(m, mb):
            return fn(m, mb, 2.0)
        return wrapper

    @supplies_scale
    def scaled(m, mb, scale):
        return scale * m(mb[0]).sum()

    for loss_fn in (lambda m, mb, scale=1.0: m(mb[0]).sum(), lambda *args: None, max, scaled):   # (max: no signature)
        framework.initialize(torch.nn.Linear(3, 1), loss_fn, tiny_config()).close()
    # overrides as one string (not a list of them): compose's own line, not a parse error of its first character
    with pytest.raises(framework.ConfigError, match=r"overrides must be a list of strings, not the string "
                                                    r"'optimizer\.lr=0\.1'; pass \['optimizer\.lr=0\.1'\]$"):
        framework.initialize(torch.nn.Linear(3, 1), lambda m, mb: m(mb[0]).sum(), overrides="optimizer.lr=0.1")


def test_eval_step_takes_any_iterable_of_micro_batches():
    module = torch.nn.Linear(3, 1)
    micro = [(torch.randn(2, 3), torch.randn(2, 1)) for _ in range(2)]
    loss = lambda m, mb: torch.nn.functional.mse_loss(m(mb[0]), mb[1])   # noqa: E731
    with framework.initialize(module, loss, tiny_config()) as engine:
        want = engine.eval_step(engine.state, micro)
        assert engine.eval_step(engine.state, iter(micro)) == want
        assert engine.eval_step(engine.state, (b for b in micro)) == want
        with pytest.raises(framework.DataError, match="^eval_step: no batches"):
            engine.eval_step(engine.state, iter([]))
        with pytest.raises(framework.FrameworkError, match="^eval_step: state must be a TrainState, got NoneType"):
            engine.eval_step(None, micro)


@pytest.mark.parametrize("stage", ["+stage=ddp", "+stage=zero3"])
def test_eval_step_puts_back_each_modules_own_mode_a_frozen_batch_norm_stays_frozen(stage):
    # module.train(was) on the root would turn the BatchNorm the user froze with .eval() back to training: the next
    # steps would update its running statistics. Each flag is put back, after a loss_fn that raises too, and
    # through each module's own train(): an override that drops an eval-only cache runs (as transformers'
    # LevitAttention clears its attention-bias cache), else the next eval reads the cache of old weights.
    class Cached(torch.nn.Linear):
        cache = None

        def train(self, mode=True):
            super().train(mode)
            self.cache = None if mode else self.cache
            return self

        def forward(self, x):
            self.cache = self.cache if self.training else "filled from this eval's weights"
            return super().forward(x)
    module = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Dropout(0.5),
                                 Cached(4, 1))
    module[1].eval(), module[2].eval()
    micro = [(torch.randn(2, 3), torch.randn(2, 1))]

    def loss(m, mb):
        out = m(mb[0])   # (a target of None: raises after the forward, in eval mode)
        return torch.nn.functional.mse_loss(out, mb[1]) if mb[1] is not None else 1 / 0
    modes = [m.training for m in module.modules()]
    with framework.initialize(module, loss, tiny_config(stage, "train.grad_accum=1")) as engine:
        engine.eval_step(engine.state, micro)
        assert [m.training for m in module.modules()] == modes == [True, True, False, False, True]
        assert module[3].cache is None   # its train() ran
        with pytest.raises(ZeroDivisionError):
            engine.eval_step(engine.state, [(micro[0][0], None)])
        assert [m.training for m in module.modules()] == modes
        engine.train_step(engine.state, framework.Batch(tuple(micro)))
        assert module[1].num_batches_tracked.item() == 0 and not module[1].training


def test_the_state_api_refuses_a_misplaced_argument_in_one_line(tmp_path):
    """Another engine's state, one rank's state dict where a list goes, a dict where load_weights takes a
    path, a save through a closed Checkpointer: each one line that says what to pass instead, nothing written."""
    module = torch.nn.Linear(3, 1)
    micro = (torch.randn(2, 3), torch.randn(2, 1))
    loss = lambda m, mb: torch.nn.functional.mse_loss(m(mb[0]), mb[1])   # noqa: E731
    with framework.initialize(module, loss, tiny_config()) as engine, \
            framework.initialize(torch.nn.Linear(3, 1), loss, tiny_config()) as other:
        state, _ = engine.train_step(engine.state, framework.Batch((micro,)))
        with pytest.raises(framework.FrameworkError, match=r"^train_step: this state belongs to another engine.*"
                                                           r"pass this engine's state \(engine\.state"):
            other.train_step(state, framework.Batch((micro,)))
        saved, snap = engine.state_dict(state), copy.deepcopy(state)   # a snapshot to return to, the JAX way
        state, _ = engine.train_step(state, framework.Batch((micro,)))
        for use in (lambda: engine.train_step(snap, framework.Batch((micro,))), lambda: engine.state_dict(snap)):
            with pytest.raises(framework.FrameworkError, match=r"this state belongs to another engine, or is a copy "
                               r"of one \(copy.deepcopy.*to keep a state to return to, take sd = engine.state_dict"
                               r"\(state\) and later state = engine.load_state_dict\(engine.state, \[sd\]\)"):
                use()
        state = engine.load_state_dict(engine.state, [saved])   # the way the message names: back to that step
        assert state.step == 1 and torch.equal(state.params[0], snap.params[0])
        with pytest.raises(framework.FrameworkError, match=r"^load_state_dict or resume: this state belongs to "
                                                           r"another engine"):   # (it took the other's tensors)
            other.load_state_dict(state, [saved])
        with contextlib.closing(Checkpointer(tiny_config(), engine, run_dir=tmp_path / "own")) as own:
            own.save(state)
        with pytest.raises(framework.FrameworkError, match=r"^load_state_dict or resume: this state belongs"):
            Checkpointer(tiny_config(), other, run_dir=tmp_path / "own").resume(state)
        with pytest.raises(framework.FrameworkError, match=r"^load_state_dict: pass every rank's state dicts as "
                                                           r"a list: \[sd\]"):
            engine.load_state_dict(state, saved)
        with pytest.raises(framework.ConfigError, match=r"^load_weights: source must be a path \(a weights file or "
                                                        r"folder\), got dict; .*module\.load_state_dict"):
            framework.load_weights(engine, engine.consolidated_state_dict())
        ckpt = Checkpointer(tiny_config(), engine, run_dir=tmp_path)
        ckpt.close()
        for use in (lambda: ckpt.save(state), lambda: ckpt.resume(state)):
            with pytest.raises(framework.FrameworkError, match=r"^checkpoint (save|resume): this Checkpointer is "
                                                               r"closed \(ckpt\.close\(\)\)"):
                use()
        assert [p.parent.name for p in tmp_path.rglob("step-*")] == ["checkpoints"]   # the one saved above
        assert engine.state is state and other.state.step == 0 and other.state.params[0] is not state.params[0]


def test_a_checkpointer_that_saves_nothing_says_so_once(tmp_path, capsys):
    # compose's checkpoint.every=0: the library loop's maybe_save would save nothing, silently
    loss = lambda m, mb: torch.nn.functional.mse_loss(m(mb[0]), mb[1])   # noqa: E731
    with framework.initialize(torch.nn.Linear(3, 1), loss, tiny_config()) as engine:
        with contextlib.closing(Checkpointer(tiny_config(), engine, run_dir=tmp_path)) as ckpt:
            ckpt.maybe_save(engine.state)
            ckpt.maybe_save(engine.state, last=True)
        assert capsys.readouterr().out.splitlines() == [
            "checkpoint: none saved (checkpoint.every=0): maybe_save saves nothing; set checkpoint.every=N to save "
            "every N steps and at last=True, or call ckpt.save(state)"]
        with contextlib.closing(Checkpointer(tiny_config("checkpoint.every=5"), engine, run_dir=tmp_path)) as ckpt:
            ckpt.maybe_save(engine.state, last=True)
    assert [p.name for p in tmp_path.rglob("step-*")] == ["step-0"] and "none saved" not in capsys.readouterr().out


def _rewrite_step(step, train_state=None, **manifest):
    """``step``'s train_state.json edited by ``train_state(body)`` and its manifest's fields set to ``manifest``,
    the checksums made to match: files as another version writes them, no damage."""
    import hashlib
    import json
    from framework.persist import stepfolders
    body = json.loads((step / "train_state.json").read_text())
    if train_state is not None:
        train_state(body)
    raw = json.dumps(body).encode()
    (step / "train_state.json").write_bytes(raw)
    m = {**json.loads((step / "manifest.json").read_text()), **manifest}
    m["files"]["train_state.json"] = {"bytes": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}
    m[stepfolders.SELF_SHA] = stepfolders._body_sha(m)
    (step / "manifest.json").write_text(json.dumps(m))


def _newer_layout(body):
    body["state_format"] = 2   # and what a newer layout may rename: no key or shape check may come first
    body["layout"] = body.pop("fragments")
    body["config"]["model"]["layers"] = body["config"]["model"].pop("n_layer")


@pytest.mark.parametrize("newer", ["manifest format", "train_state.json format", "state format"])
def test_a_newer_versions_checkpoint_is_refused_not_fallen_back_past_nor_replaced(tmp_path, newer):
    """A step a newer version of the framework saved (a version field above this one's, files intact) is no
    damage: resume=auto stops on one line with the way out (no fall back to the step before it, whose run would
    save over it and rotate), the version read before any other key; export refuses it; a run resumed from the
    step before it does not replace it with its own save of that step."""
    from framework.persist.export import get_fp32_state_dict_from_checkpoint
    from framework.persist.stepfolders import NewerVersion
    cfg = tiny_config("train.steps=2", "train.micro_batch=2", "checkpoint.every=1", "checkpoint.keep_last=0")
    module, data = build_gpt(cfg)
    with framework.initialize(module, gpt_loss, cfg) as engine:
        _saved(engine, data, cfg, tmp_path, 2)
        step = tmp_path / "checkpoints" / "step-2"
        _rewrite_step(step, **{"manifest format": {"format": 2},
                               "train_state.json format": {"train_state": lambda b: b.update(format=2)},
                               "state format": {"train_state": _newer_layout}}[newer])
        before = {p.name: p.read_bytes() for p in step.iterdir()}
        with contextlib.closing(Checkpointer(cfg, engine, run_dir=tmp_path)) as ckpt:
            with pytest.raises(NewerVersion, match=rf"^checkpoint {step} was saved by a newer version of the framework "
                                                   rf"\({newer} 2, this one reads 1\): resume it with that version, or "
                                                   r"use another checkpoint.dir to start this run afresh$"):
                ckpt.resume(engine.state)
        with pytest.raises(NewerVersion, match=rf"^export: checkpoint {step} was saved by a newer .*: export it with "
                                               "that version$"):
            get_fp32_state_dict_from_checkpoint(step.parent)
        resume = tiny_config("train.steps=2", "train.micro_batch=2", "checkpoint.every=1", "checkpoint.keep_last=0",
                             f"checkpoint.resume={step.parent / 'step-1'}")
        with contextlib.closing(Checkpointer(resume, engine, run_dir=tmp_path)) as ckpt:   # at the start, not
            with pytest.raises(NewerVersion, match=rf"^checkpoint {step} was saved by a newer .*: this run resumes "
                               r"from step-1 below it and trains to step 2, so it would save that step in its place; "
                               r"set checkpoint.dir to another folder or train.steps below 2 \(or"):
                ckpt.resume(engine.state)                                # at the save after the training since
            with pytest.raises(NewerVersion, match=r"this run resumes from step-1 below it"):
                preflight(resume, tmp_path)   # (the CLI's, before any rank starts)
            short = tiny_config("train.steps=1", "train.micro_batch=2", "checkpoint.every=1", "checkpoint.keep_last=0",
                                f"checkpoint.resume={step.parent / 'step-1'}")   # (never saves step-2: left alone)
            preflight(short, tmp_path)
            with contextlib.closing(Checkpointer(short, engine, run_dir=tmp_path)) as above:
                assert above.resume(engine.state).step == 1
            reading = tiny_config("train.steps=2", "train.micro_batch=2", f"checkpoint.resume={step.parent / 'step-1'}")
            with contextlib.closing(Checkpointer(reading, engine, run_dir=tmp_path)) as reader:   # (saves nothing)
                state = reader.resume(engine.state)
            state, _ = engine.train_step(state, _batch(data, state))
            with pytest.raises(framework.FrameworkError, match=r"newer version .*: not replaced by this run's save"):
                ckpt.save(state)   # (a loop that saves on all the same)
        assert {p.name: p.read_bytes() for p in step.iterdir()} == before


def test_a_checkpoint_from_before_the_loss_scaler_record_resumes(tmp_path):
    """The first checkpoints recorded the precision policy's name alone (``"precision": "fp32"``, no loss scaler,
    no recent losses): no dynamic scaling, so no step was skipped and no scale carries over; it resumes (it was
    refused as damage: "the loss scale None"); with dynamic scaling it is named as an earlier version's. A save
    records the framework's version."""
    import json
    cfg = tiny_config("train.steps=2", "train.micro_batch=2", "checkpoint.every=1")
    module, data = build_gpt(cfg)
    with framework.initialize(module, gpt_loss, cfg) as engine:
        _saved(engine, data, cfg, tmp_path, 1)
        step = tmp_path / "checkpoints" / "step-1"
        assert json.loads((step / "train_state.json").read_text())["framework_version"] == "0.1.0"

        def older(body):
            body.update(precision="fp32")
            for key in ("recent_losses", "precision_policy", "framework_version"):
                body.pop(key)
        _rewrite_step(step, older)
        with contextlib.closing(Checkpointer(cfg, engine, run_dir=tmp_path)) as ckpt:
            state = ckpt.resume(engine.state)
        assert (state.step, state.precision.skipped_steps, state.precision.cur_scale) == (1, 0, 1.0)
        # with dynamic scaling its scale is not there: named as an earlier version's, with the way out, no damage
        _rewrite_step(step, lambda body: body.update(dynamic_loss_scale=True))
        with contextlib.closing(Checkpointer(cfg, engine, run_dir=tmp_path)) as ckpt:
            with pytest.raises(framework.FrameworkError, match=r"saved by an earlier version of the framework "
                               r"\(train_state.json precision 'fp32', before the loss-scaler record\).*export its "
                               r"weights \(python -m framework.export") as e:
                ckpt.resume(engine.state)
        assert type(e.value) is framework.FrameworkError   # (not a CheckpointError: damage)


def test_a_step_a_live_run_rotates_away_while_a_resume_reads_it_is_no_damage(tmp_path, monkeypatch):
    """A run reading the folder another run saves into (resume=auto, saving nothing): that run's rotation may
    remove the step being read. No damage: the folder is listed again once, its newest step then read; else one
    line naming that run (the folder's lock, where a run holds it) and the way out (was "every checkpoint ... is
    damaged")."""
    import fcntl
    import shutil

    import framework.persist.checkpoint as package

    cfg = tiny_config("train.steps=2", "train.micro_batch=2", "checkpoint.every=1", "checkpoint.keep_last=0")
    module, data = build_gpt(cfg)
    with framework.initialize(module, gpt_loss, cfg) as engine:
        _saved(engine, data, cfg, tmp_path, 3)
        root = tmp_path / "checkpoints"
        (root / ".lock").write_text("pid 7 on host h\n")
        holding = open(root / ".lock", "rb")   # that run's lock, held as cli/launch holds it
        fcntl.flock(holding.fileno(), fcntl.LOCK_EX)
        doomed, load = {"step-3"}, package.load

        def rotated(engine, state, folder, **kwargs):   # that run's rotation, as the check reads the step
            if folder.name in doomed:
                shutil.rmtree(folder)
            return load(engine, state, folder, **kwargs)

        monkeypatch.setattr(package, "load", rotated)
        reader = tiny_config("train.steps=2", "train.micro_batch=2", f"checkpoint.dir={root}")
        with contextlib.closing(Checkpointer(reader, engine, run_dir=tmp_path)) as ckpt:
            assert ckpt.resume(engine.state).step == 2 and ckpt.resumed_from == root / "step-2"

        def refused():   # (a resume of the folder)
            with contextlib.closing(Checkpointer(reader, engine, run_dir=tmp_path)) as ckpt:
                with pytest.raises(framework.FrameworkError) as e:
                    ckpt.resume(engine.state)
            return e.value

        shutil.copytree(root / "step-1", tmp_path / "spare")
        doomed.update({"step-2", "step-1"})
        error = refused()
        assert str(error) == (f"checkpoint.resume=auto: {root / 'step-1'} was removed while it was read: the run "
                              f"holding {root / '.lock'} (pid 7 on host h) rotates its checkpoints; run again, or "
                              "resume from a step that run keeps (checkpoint.keep_last)")
        assert not isinstance(error, package.CheckpointError)   # (no damage)
        # This process holds the lock (a CLI run resuming from its own folder): it rotated nothing, so not named
        import os
        import socket

        from framework.persist.stepfolders import removed_while_read
        (root / ".lock").write_text(f"pid {os.getpid()} on host {socket.gethostname()}\n")
        assert removed_while_read(root / "step-1", "run again") == (
            f"{root / 'step-1'} was removed while it was read: another process removed it (this run holds "
            f"{root / '.lock'}); run again")
        # No run holds the lock (the run it names ended; a user's rm, a library loop): that run is not named
        holding.close()
        shutil.copytree(tmp_path / "spare", root / "step-1")
        assert str(refused()) == (f"checkpoint.resume=auto: {root / 'step-1'} was removed while it was read: "
                                  f"another process removed it (no run holds {root / '.lock'}); run again, or "
                                  "resume from a step that run keeps (checkpoint.keep_last)")


def test_an_async_save_keeps_the_warnings_filters_the_user_adds_meanwhile(tmp_path, recwarn):
    """An async save runs on the Checkpointer's thread, where ``warnings.catch_warnings`` would put back the whole
    process-wide filter list on leaving, dropping a filter the user's loop added meanwhile; DCP's one-process
    warning stays hidden all the same."""
    import warnings

    from framework.persist.checkpoint import glue

    writing, go_on = threading.Event(), threading.Event()

    class Held(glue().dcp.FileSystemWriter):   # holds the save inside DCP's write until the filter is added
        def write_data(self, *args, **kwargs):
            writing.set()
            go_on.wait(30)
            return super().write_data(*args, **kwargs)
    loss = lambda m, mb: torch.nn.functional.mse_loss(m(mb[0]), mb[1])   # noqa: E731
    with warnings.catch_warnings():
        with framework.initialize(torch.nn.Linear(3, 1), loss, tiny_config()) as engine:
            with contextlib.closing(Checkpointer(tiny_config("checkpoint.async=true", "checkpoint.every=1"),
                                                 engine, run_dir=tmp_path)) as ckpt:
                ckpt.writer = Held
                ckpt.save(engine.state)
                assert writing.wait(30)
                warnings.filterwarnings("error", message="the user's own")
                go_on.set()
            assert any(f[0] == "error" and f[1].pattern == "the user's own" for f in warnings.filters)
    assert [p.name for p in tmp_path.rglob("step-*")] == ["step-0"]
    assert not [w for w in recwarn if "torch.distributed is disabled" in str(w.message)]


def test_a_resume_after_an_async_save_reads_that_save(tmp_path, capsys):
    """``resume`` waits for a save in flight (as ``save`` does): it reads the step just saved, not an older one or
    none; and with none to read it keeps the state given, saying so (not "starting from step 0")."""
    from framework.persist.checkpoint import glue

    writing, go_on = threading.Event(), threading.Event()

    class Slow(glue().dcp.FileSystemWriter):   # a save still writing when resume looks
        def write_data(self, *args, **kwargs):
            writing.set()
            go_on.wait(30)
            return super().write_data(*args, **kwargs)
    loss = lambda m, mb: torch.nn.functional.mse_loss(m(mb[0]), mb[1])   # noqa: E731
    cfg = tiny_config("checkpoint.async=true", "checkpoint.every=1")
    with framework.initialize(torch.nn.Linear(3, 1), loss, tiny_config()) as engine:
        x = torch.randn(4, 3)
        state, _ = engine.train_step(engine.state, framework.Batch(((x, x.sum(1, keepdim=True)),)))
        with contextlib.closing(Checkpointer(cfg, engine, run_dir=tmp_path)) as ckpt:
            assert ckpt.resume(state).step == 1 and ckpt.resumed_from is None
            assert f"no checkpoint in {tmp_path / 'checkpoints'}; keeping the given state (step 1)" in \
                capsys.readouterr().out
            ckpt.writer = Slow
            ckpt.save(state)
            assert writing.wait(30)
            real_wait = ckpt.wait

            def waiting():   # the writer goes on only once resume waits: without the wait it is still blocked
                go_on.set()
                real_wait()
            ckpt.wait = waiting
            try:
                ckpt.resume(state)
            finally:
                go_on.set()
            assert ckpt.resumed_from == tmp_path / "checkpoints" / "step-1"


class _Checked(torch.nn.Linear):
    def forward(self, h):
        if not self.weight.numel():
            raise ValueError   # an error with no message (as a bare assert raises)
        return super().forward(h)


class _Inner(torch.nn.Module):   # a part of the unit with no parameters of its own (its child has)
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, h):
        return torch.relu(self.lin(h))


class _Blk(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.inner, self.b = torch.nn.Linear(16, 16), _Inner(), _Checked(16, 16)

    def forward(self, h):
        return self.b(self.inner(torch.relu(self.a(h))))


def test_the_resume_off_and_latest_notes_say_what_the_run_starts_from(tmp_path, capsys):
    """With nothing read (resume=off beside checkpoints, resume=latest finding none), the note says the run starts
    from step 0, or keeps a trained state given (a loop of one's own): not "starting from step 0" then."""
    loss = lambda m, mb: torch.nn.functional.mse_loss(m(mb[0]), mb[1])   # noqa: E731
    with framework.initialize(torch.nn.Linear(3, 1), loss, tiny_config()) as engine:
        x = torch.randn(4, 3)
        state, _ = engine.train_step(engine.state, framework.Batch(((x, x.sum(1, keepdim=True)),)))
        with contextlib.closing(Checkpointer(tiny_config("checkpoint.every=1"), engine, run_dir=tmp_path)) as ckpt:
            ckpt.save(state)
        ckpts, none = tmp_path / "checkpoints", tmp_path / "none"
        for over, said in ((["checkpoint.resume=off"], "resume=off: {0} although {1} holds 1 checkpoint, newest "
                            "step-1; set checkpoint.resume=auto to continue from it"),
                           (["checkpoint.resume=latest", f"checkpoint.dir={none}"], "resume=latest: no checkpoint in "
                            "{1} or in the run folders under outputs/, multirun/; {0}")):
            for given, start in ((replace(state, step=0), "starting from step 0"),
                                 (state, "keeping the given state (step 1)")):
                capsys.readouterr()
                cfg = tiny_config(*over, "checkpoint.every=0")
                with contextlib.closing(Checkpointer(cfg, engine, run_dir=tmp_path)) as ckpt:
                    assert ckpt.resume(given) is given
                out = capsys.readouterr().out
                assert f"checkpoint: {said.format(start, ckpts if 'off' in over[0] else none)}\n" in out, out


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.blk, self.out = torch.nn.Linear(8, 16), _Blk(), torch.nn.Linear(16, 2)

    def forward(self, x):
        return self.out(self.blk(self.inp(x)))


@pytest.mark.parametrize("split_root,call,needle", [
    ("true", lambda m, x: m.out(m.blk(m.inp(x))), None),   # units and split-root children: gathered
    ("true", lambda m, x: m.out(m.blk.b(torch.relu(m.blk.a(m.inp(x))))),
     r"Linear\) whose parameters were not gathered \(RuntimeError: .*\): it is part of gather unit 'blk', .*"
     r"call module\.blk\(\.\.\.\) \(or the whole module\) in loss_fn, not its parts$"),
    ("true", lambda m, x: m.out(m.blk.b(m.inp(x))),
     r"_Checked\) whose parameters were not gathered \(ValueError\): it is part of gather unit 'blk', "),
    # The part's own forward (_Inner's, running inner.lin) is no caller to blame: it holds the module already.
    ("true", lambda m, x: m.out(m.blk.inner(m.inp(x))),
     r"Linear\) whose parameters were not gathered \(RuntimeError: .*\): it is part of gather unit 'blk', .*"
     r"call module\.blk\(\.\.\.\) \(or the whole module\) in loss_fn, not its parts$"),
    ("false", lambda m, x: m.out(m.blk(m.inp(x))),
     r"Linear\) whose .* part of the root module's unit, .*or set stage\.split_root=true"),
])
def test_under_zero3_a_part_of_a_unit_called_directly_fails_in_one_line_naming_the_unit(split_root, call, needle):
    """Only a unit's own forward gathers it (no hook on every submodule): the torch error of a part's empty
    shards becomes one line saying which unit to call."""
    cfg = tiny_config("+stage=zero3", "stage.gather_unit=[_Blk]", "stage.stage3_param_persistence_threshold=0",
                      f"stage.split_root={split_root}")
    loss = lambda m, mb: torch.nn.functional.mse_loss(call(m, mb[0]), mb[1])   # noqa: E731
    batch = framework.Batch(((torch.randn(4, 8), torch.randn(4, 2)),))
    with framework.initialize(_Net(), loss, cfg) as engine:
        if needle is None:
            engine.train_step(engine.state, batch)
            # An error before a unit's forward (here a hook ahead of its gather) is not taken for such a call.
            def boom(*_):
                raise RuntimeError("simulated out of memory")
            engine.components.module.blk.register_forward_pre_hook(boom, prepend=True)
            with pytest.raises(RuntimeError, match="^simulated out of memory$"):
                engine.train_step(engine.state, batch)
            return
        for run in (lambda: engine.train_step(engine.state, batch), lambda: engine.eval_step(engine.state, batch.micro)):
            with pytest.raises(framework.FrameworkError, match=r"^zero3: loss_fn called a module \(" + needle) as e:
                run()
            assert "\n" not in str(e.value)


class _Reach(_Net):   # its forward calls a part of the unit blk, held or not as a submodule of its own
    def __init__(self, hold):
        super().__init__()
        self.part = self.blk.b if hold else None

    def forward(self, x):
        return self.out(self.blk.b(self.inp(x)))


class _Bypass(_Net):   # calls the unit's forward directly: no hook of blk runs to gather it
    def forward(self, x):
        return self.out(self.blk.forward(self.inp(x)))


class _DecoratedReach(_Reach):
    @torch.enable_grad()   # (a decorator keeping the function in __wrapped__): still named, not taken for loss_fn
    def forward(self, x):
        return self.out(self.blk.b(self.inp(x)))


def test_under_zero3_a_model_module_calling_a_part_of_a_unit_is_told_to_hold_it_not_to_change_loss_fn():
    """The one line blamed loss_fn, which called the whole module; a part the caller holds as its own submodule
    too stays gathered (shared across the unit's boundary), as the line now advises."""
    cfg = tiny_config("+stage=zero3", "stage.gather_unit=[_Blk]", "stage.stage3_param_persistence_threshold=0")
    loss = lambda m, mb: torch.nn.functional.mse_loss(m(mb[0]), mb[1])   # noqa: E731
    batch = framework.Batch(((torch.randn(4, 8), torch.randn(4, 2)),))
    for reach in (_Reach, _DecoratedReach):
        name = reach.__name__
        with framework.initialize(reach(hold=False), loss, cfg) as engine:
            line = (rf"^zero3: {name}\.forward called a module \(_Checked\) .*gather unit 'blk', "
                    rf".*register it as a submodule of {name} too .*call the unit itself$")
            with pytest.raises(framework.FrameworkError, match=line):
                engine.train_step(engine.state, batch)
    with framework.initialize(_Reach(hold=True), loss, cfg) as engine:
        engine.train_step(engine.state, batch)
    with framework.initialize(_Bypass(), loss, cfg) as engine:   # (blk already is its submodule)
        with pytest.raises(framework.FrameworkError, match=r"^zero3: _Bypass\.forward called a module \(_Blk\) .*"
                           r"its forward was called directly, .*call self\.blk\(\.\.\.\), not self\.blk\.forward"):
            engine.train_step(engine.state, batch)
    # From loss_fn: the unit's path from the root (it said "call the module(...)"), a ModuleList's child by index
    bypass = lambda m, mb: torch.nn.functional.mse_loss(m.out(m.blk.forward(m.inp(mb[0]))), mb[1])   # noqa: E731
    listed = lambda m, mb: torch.nn.functional.mse_loss(m.out(m.blk[1].forward(m.inp(mb[0]))), mb[1])   # noqa: E731
    stacked = _Net()
    stacked.blk = torch.nn.ModuleList([_Blk(), _Blk()])
    for module, fn, path in ((_Net(), bypass, r"module\.blk"), (stacked, listed, r"module\.blk\[1\]")):
        with framework.initialize(module, fn, cfg) as engine:
            with pytest.raises(framework.FrameworkError, match=rf"^zero3: loss_fn called a module \(_Blk\) .*"
                               rf"call {path}\(\.\.\.\), not {path}\.forward\(\.\.\.\)$"):
                engine.train_step(engine.state, batch)


def test_a_zero3_collective_that_timed_out_names_data_dependent_control_flow_as_the_likely_cause(monkeypatch):
    # Each rank gathers, prefetches and keeps units along the order it recorded itself: ranks that take different
    # modules after their first pass issue different collectives and wait until dist.timeout_s, before the order
    # check is read. The line says so (forward gathers and backward reductions alike); a lost peer's stays as it is.
    module = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))
    loss = lambda m, mb: m(mb[0]).square().mean()   # noqa: E731
    micro = (torch.randn(2, 3),)
    with framework.initialize(module, loss, tiny_config("+stage=zero3", "stage.stage3_param_persistence_threshold=0",
                                                        "train.grad_accum=1")) as engine:
        comm, wait = engine.components.dist.comm, engine.components.dist.comm.wait

        def stuck(works, what, waited=True):
            when[1] -= what == when[0]
            if what == when[0] and not when[1]:
                raise framework.DistributedError(f"rank 0/2: {what} failed after waiting up to 5s (a peer rank died or "
                                                 f"stalled; dist.timeout_s sets the limit): Timed out", waited=waited)
            wait(works, what)
        monkeypatch.setattr(comm, "wait", stuck)
        step = lambda: engine.train_step(engine.state, framework.Batch((micro,)))   # noqa: E731
        # (the last unit's gather: in the forward of eval_step and train_step, then again in the backward)
        for when, run in (["zero3 gather of '1'", 1], lambda: engine.eval_step(engine.state, [micro])), \
                         (["zero3 gather of '1'", 1], step), (["zero3 gather of '1'", 2], step):
            with pytest.raises(framework.DistributedError, match=rf"^rank 0/2: {when[0]}.* Timed out; under zero3 the "
                                                                 r"likely causes, where no rank died, are an exception "
                                                                 r"on another rank .* or data-dependent control flow: "
                                                                 r".*TORCH_DISTRIBUTED_DEBUG=DETAIL"):
                run()
        stuck.__defaults__, when = (False,), ["zero3 gather of '1'", 1]   # a lost peer (or one seen stopped): its line
        with pytest.raises(framework.DistributedError, match=r"Timed out$"):
            engine.eval_step(engine.state, [micro])
        monkeypatch.undo()


def test_a_complex_trainable_parameter_is_refused_by_initialize():
    """Every stage keeps real masters: its imaginary part would be dropped with only a warning."""
    module = torch.nn.Linear(3, 1)
    module.c = torch.nn.Parameter(torch.randn(4, dtype=torch.cfloat))
    with pytest.raises(framework.ConfigError, match=r"^initialize: complex trainable parameters are not "
                                                    r"supported \(c\); .*torch\.view_as_complex"):
        framework.initialize(module, lambda m, mb: m(mb[0]).sum(), tiny_config("+stage=zero3"))


def test_an_uninitialised_lazy_module_is_refused_by_initialize_until_a_forward_gives_it_its_shapes():
    """torch's own error came from inside the stage's layout and blamed load_state_dict."""
    module = torch.nn.Sequential(torch.nn.LazyLinear(2), torch.nn.LazyBatchNorm1d())
    for stage in ("ddp", "zero3"):
        with pytest.raises(framework.ConfigError, match=r"^initialize: 0\.weight, 0\.bias, 1\.weight and 3 more are "
                                                        r"not initialised yet \(a lazy module, such as nn\.LazyLinear\): "
                                                        r"run one forward on a dummy batch before framework\.initialize"):
            framework.initialize(module, lambda m, mb: m(mb[0]).sum(), tiny_config(f"+stage={stage}"))
    module(torch.randn(2, 3))
    with framework.initialize(module, lambda m, mb: m(mb[0]).sum(), tiny_config("+stage=zero3")) as engine:
        engine.train_step(engine.state, framework.Batch(((torch.randn(4, 3),),)))


def test_a_step_reads_the_device_once():
    """The gradient norm and the loss come to the host together: the step itself waits for the device
    once (on CUDA each read is a wait for the queue)."""
    import sys

    from torch.overrides import TorchFunctionMode

    reads = []

    class Reads(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if getattr(func, "__name__", "") in ("item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__"):
                f = sys._getframe(1)
                while f is not None and "/site-packages/torch/" in f.f_code.co_filename:
                    f = f.f_back   # (torch's own Python wrappers)
                if f is not None and f.f_code.co_filename.endswith("framework/engine/step.py"):
                    reads.append(f.f_lineno)
            return func(*args, **(kwargs or {}))

    engine, data = _engine("train.grad_clip=0.5")
    batch = _batch(data, engine.state)
    with Reads():
        _, metrics = engine.train_step(engine.state, batch)
    assert len(reads) == 1 and metrics["grad_norm"] > 0.5, reads
    engine.close()


class _Interrupt(torch.autograd.Function):
    """Identity whose backward raises KeyboardInterrupt while ``armed``: Ctrl-C in the middle of a backward
    pass, after the buckets of the layers above it went out."""
    armed = False

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        if _Interrupt.armed:
            raise KeyboardInterrupt
        return g


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("where", ["autograd", "third reduction", "next-to-last reduction"])
def test_zero2_trains_on_after_ctrl_c_in_a_backward_pass(overlap, where, monkeypatch):
    """Ctrl-C anywhere in zero2's backward pass (in autograd with buckets in flight, or inside a bucket's
    reduction, its buffer between the pool and the queue) leaves the stage as between passes: buffers of
    collectives left running stay with them and the pass gets new ones (every later step raised IndexError on
    an empty queue), and reductions it left undone are never added to a later step (they were, silently).
    The engine then trains exactly as one that never saw the interrupted step."""
    from framework.stages import sharded

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(6))

        def forward(self, x):
            x = _Interrupt.apply(self.layers[0](x))
            for layer in self.layers[1:]:
                x = torch.tanh(layer(x))
            return x.sum()

    real, calls, stop = sharded.own_overlap, [], [0]

    def counted(*args):   # a bucket's reduction result, as it is added into the partition
        calls.append(1)
        if len(calls) == stop[0]:
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(sharded, "own_overlap", counted)
    cfg = framework.compose(["+stage=zero2", "stage.reduce_bucket_size=40", f"stage.overlap_comm={overlap}",
                             "optimizer=adamw", "scheduler=constant", "logger=none"])
    batch = framework.Batch((torch.randn(8, 16, generator=torch.Generator().manual_seed(1)),))

    def run(interrupt_at: int | None) -> tuple[list[float], int]:
        """Five steps' losses, with a step before the third interrupted at reduction ``interrupt_at`` (0: in
        autograd); and how many reductions a step makes."""
        torch.manual_seed(0)
        losses = []
        with framework.initialize(Net(), lambda m, mb: m(mb[0]), cfg) as engine:
            state = engine.state
            for k in range(5):
                if k == 2 and interrupt_at is not None:
                    calls.clear()
                    stop[0] = interrupt_at
                    with monkeypatch.context() as patch, pytest.raises(KeyboardInterrupt):
                        patch.setattr(_Interrupt, "armed", interrupt_at == 0)
                        engine.train_step(state, batch)
                    stop[0] = 0
                calls.clear()
                state, m = engine.train_step(state, batch)
                losses.append(m["loss"])
        return losses, len(calls)

    clean, per_step = run(None)
    assert run({"autograd": 0, "third reduction": 3, "next-to-last reduction": per_step - 1}[where])[0] == clean


def test_a_module_with_an_empty_submodule_slot_trains():
    """A submodule slot may hold None (``register_module(name, None)``): the per-step check of the module's
    parameters passes over it."""
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(4, 4)
            self.register_module("unused", None)

        def forward(self, x):
            return self.a(x)

    cfg = framework.compose(["scheduler=constant", "logger=none"])
    with framework.initialize(Net(), lambda m, mb: m(mb[0]).pow(2).mean(), cfg) as engine:
        _, metrics = engine.train_step(engine.state, framework.Batch(((torch.ones(2, 4),),)))
    assert torch.isfinite(torch.tensor(metrics["loss"]))


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_a_torch_jit_scripted_submodule_trains_as_its_plain_twin_and_a_scripted_root_is_refused_where_hooked(stage):
    """A ScriptModule's ``_parameters`` is no dict (the per-step edit check failed on it) and it takes no Python
    hooks: zero3 gathers it, children and all, with its parent's unit. The root has to take zero3's hooks."""
    def net(script):
        torch.manual_seed(0)
        inner = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4))
        return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.jit.script(inner) if script else inner)

    cfg = tiny_config(f"+stage={stage}", "scheduler=constant")
    _assert_scripted_trains_as_plain(net, cfg, 4)
    # A user's error inside a scripted module surfaces as itself (zero3's error path, looking for a module run
    # on empty shards, read each frame's class forward: a ScriptModule's raises AttributeError there).
    wrong = net(True)
    wrong[0] = torch.nn.Linear(4, 6)   # 6 features into the scripted 4-wide layer
    with framework.initialize(wrong, _square_loss, cfg) as engine:
        with pytest.raises(RuntimeError, match=r"mat1 and mat2 shapes cannot be multiplied \(2x6 and 4x4\)"):
            engine.train_step(engine.state, framework.Batch(((torch.ones(2, 4),),)))
    if stage == "zero3":
        with pytest.raises(framework.ConfigError, match=r"^initialize: the module is torch\.jit\.script'ed, .*"
                                                        r"stage=zero3 needs on the root: pass a plain nn\.Module"):
            framework.initialize(torch.jit.script(net(False)), _square_loss, cfg)


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("threshold", [None, 0])
def test_a_scripted_submodule_that_two_modules_call_trains_as_its_plain_twin_under_zero3(threshold):
    """Each caller's own unit must gather a scripted module it calls (it takes no hooks to gather itself):
    only the first caller's did, so the second one ran it on empty shards. Its weight is above the default
    persistence threshold (100000 elements), so it is gathered per unit at default settings too."""
    d = 320

    class Calls(torch.nn.Module):   # a unit of its own (its Linear) that calls the module both layers share
        def __init__(self, shared):
            super().__init__()
            self.lin, self.shared = torch.nn.Linear(d, d), shared

        def forward(self, x):
            return self.shared(torch.tanh(self.lin(x)))

    def net(script):
        torch.manual_seed(0)
        shared = torch.nn.Sequential(torch.nn.Linear(d, d), torch.nn.Tanh())
        shared = torch.jit.script(shared) if script else shared
        return torch.nn.Sequential(Calls(shared), Calls(shared))

    over = () if threshold is None else (f"stage.stage3_param_persistence_threshold={threshold}",)
    # TorchScript's optimizing executor rewrites the backward of a layer this wide, 1 ulp off eager torch's
    # with no framework involved: the twins are compared with it off, so what differs is the framework's.
    with torch.jit.optimized_execution(False):
        _assert_scripted_trains_as_plain(net, tiny_config("+stage=zero3", "scheduler=constant", *over), d)


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
def test_a_module_shared_by_a_gather_unit_and_a_module_outside_it_trains_as_with_no_units_under_zero3():
    """A module inside a gather unit takes no hooks of its own (the unit's gather it): one that a module outside
    the unit also calls ran there on empty shards, and the error blamed loss_fn. It must stay gathered, as a
    scripted one and tied weights do, and train as with no gather units at all."""
    d = 320   # the shared weight is above the default persistence threshold: gathered per unit by default

    class Calls(torch.nn.Module):
        def __init__(self, shared):
            super().__init__()
            self.lin, self.shared = torch.nn.Linear(d, d), shared

        def forward(self, x):
            return self.shared(torch.tanh(self.lin(x)))

    class Block(Calls):   # a gather unit by default
        pass

    def net(script):
        torch.manual_seed(0)
        shared = torch.nn.Sequential(torch.nn.Linear(d, d), torch.nn.Tanh())
        shared = torch.jit.script(shared) if script else shared
        return torch.nn.Sequential(Block(shared), Calls(shared))

    over = ("+stage=zero3", "scheduler=constant")
    with torch.jit.optimized_execution(False):   # (see the test above)
        (want, want_sd), *runs = (_train(net(script), tiny_config(*over, *units), d)
                                  for script, units in ((False, ["stage.gather_unit=[]"]), (False, []), (True, [])))
    for losses, sd in runs:
        assert losses == want and all(torch.equal(sd[k], want_sd[k]) for k in want_sd)


def _square_loss(m, mb):
    return m(mb[0]).pow(2).mean()


def _train(module, cfg, width):
    """Two steps' losses and the trained weights."""
    with framework.initialize(module, _square_loss, cfg) as engine:
        losses = [engine.train_step(engine.state, framework.Batch(((torch.ones(2, width),),)))[1]["loss"]
                  for _ in range(2)]
        return losses, engine.consolidated_state_dict()


def _assert_scripted_trains_as_plain(net, cfg, width):
    """``net(script)`` trains to bit-identical losses and weights with its scripted submodules as without."""
    (plain, plain_sd), (scripted, scripted_sd) = (_train(net(script), cfg, width) for script in (False, True))
    assert plain == scripted and all(torch.equal(plain_sd[k], scripted_sd[k]) for k in plain_sd)


def test_a_tied_weight_frozen_by_its_second_name_is_reported_with_both_names():
    """named_parameters() lists a tied weight under its first name only: the one the user touched is named too."""
    module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    module[1].weight = module[0].weight
    loss = lambda m, mb: m(mb).square().mean()   # noqa: E731
    with framework.initialize(module, loss, tiny_config("+stage=zero2")) as engine:
        module[1].weight.requires_grad_(False)
        with pytest.raises(framework.TrainingError, match=r"^train_step: requires_grad of 1 parameter changed after "
                                                          r"initialize: 1 frozen \(0\.weight \(tied: 1\.weight\)\); "):
            engine.train_step(engine.state, framework.Batch((torch.randn(2, 4),)))


@pytest.mark.parametrize("stage", ["ddp", "zero1", "zero2", "zero3"])
def test_a_requires_grad_changed_after_initialize_is_refused_before_the_step_changes_anything(stage, tmp_path):
    """The stage lays out the trainable set once: a layer frozen later was still stepped (its zero gradient,
    AdamW's moments and weight decay), one unfrozen later never trained and kept its .grad growing. A resume
    read the trainable set from the flags (one unfrozen later was left at its initial values and called
    resumed, one frozen later made the good checkpoint "damaged"); save_weights, which picks the tensors by the
    stage's layout, writes the trained weights (a module frozen after training, as before sampling)."""
    from safetensors.torch import load_file
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))
    module[2].requires_grad_(False)   # frozen at initialize
    loss = lambda m, mb: torch.nn.functional.mse_loss(m(mb[0]), mb[1])   # noqa: E731
    x = torch.randn(8, 5)
    batch = framework.Batch(((x, x[:, :3]),))
    cfg = tiny_config(f"+stage={stage}", "scheduler=constant")
    with framework.initialize(module, loss, cfg) as engine:
        state, _ = engine.train_step(engine.state, batch)
        ckpt = Checkpointer(cfg, engine, run_dir=tmp_path)
        ckpt.save(state)
        ckpt.close()
        for layer, flag, needle in [(module[0].weight, False, r"1 parameter changed after initialize: 1 frozen \(0\.weight\)"),
                                    (module[2], True, r"2 parameters changed after initialize: 2 unfrozen \(2\.weight, 2\.bias\)")]:
            layer.requires_grad_(flag)
            before = [p.detach().clone() for p in engine.state.params]
            with pytest.raises(framework.TrainingError, match=r"^train_step: requires_grad of " + needle +
                               r"; .*set requires_grad before framework\.initialize"):
                engine.train_step(state, batch)
            with pytest.raises(framework.TrainingError, match=r"^state_dict or checkpoint save: requires_grad of "):
                engine.state_dict(state)
            with pytest.raises(framework.TrainingError, match=r"^checkpoint resume: requires_grad of " + needle):
                Checkpointer(cfg, engine, run_dir=tmp_path).resume(state)
            saved = load_file(framework.save_weights(engine, tmp_path / f"w{flag}")[0])
            assert saved.keys() == (whole := engine.consolidated_state_dict()).keys()
            assert all(torch.equal(saved[k], whole[k]) for k in whole)
            assert engine.state is state and all(torch.equal(a, b) for a, b in zip(before, state.params))
            assert all(p.grad is None for p in module.parameters())   # no forward, no backward ran
            layer.requires_grad_(not flag)   # set back: training goes on
        # A parameter added after initialize (a LoRA layer injected) was never trained nor saved, and its .grad
        # grew; one removed was still stepped and saved.
        first = module[0]
        for change, undo, needle in [(lambda: module[2].register_parameter("lora", torch.nn.Parameter(torch.ones(3))),
                                      lambda: delattr(module[2], "lora"), r"1 added \(2\.lora\)"),
                                     (lambda: module.__setitem__(0, torch.nn.Identity()),
                                      lambda: module.__setitem__(0, first), r"2 removed \(0\.weight, 0\.bias\)")]:
            change()
            with pytest.raises(framework.TrainingError, match=r"^train_step: the module's parameters changed after "
                               r"initialize: " + needle + r"; .*add \(or remove\) them before framework\.initialize"):
                engine.train_step(state, batch)
            with pytest.raises(framework.TrainingError, match=r"^state_dict or checkpoint save: the module's parameters"):
                engine.state_dict(state)
            assert all(p.grad is None for p in module.parameters())
            undo()
        state = Checkpointer(cfg, engine, run_dir=tmp_path).resume(state)   # flags as at initialize: resumed
        assert state.step == 1
        state, _ = engine.train_step(state, batch)
        assert state.step == 2


@pytest.mark.parametrize("stage", ["ddp", "zero2", "zero3"])
def test_a_backward_pass_of_the_users_own_between_steps_is_told_apart_from_loss_fns(stage):
    """An input saliency between steps was blamed on loss_fn. Under ddp, zero1 and zero2 its gradients are
    refused at the next step, which zero_grad(set_to_none=True) lets go on, and torch.autograd.grad leaves none;
    zero3 refuses the backward pass itself."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    batch = framework.Batch(((x, y),))
    loss = lambda m, mb: torch.nn.functional.mse_loss(m(mb[0]), mb[1])   # noqa: E731
    with framework.initialize(module, loss, tiny_config(f"+stage={stage}", "scheduler=constant")) as engine:
        state, _ = engine.train_step(engine.state, batch)
        inputs = x.clone().requires_grad_(True)
        if stage == "zero3":
            with pytest.raises(framework.TrainingError, match=r"^zero3: a backward pass ran outside train_step's \(in "
                               r"loss_fn, or on the module's output between steps: .*which zero3 does not support"):
                module(inputs).sum().backward()
        else:
            torch.autograd.grad(module(inputs).sum(), inputs)
            state, _ = engine.train_step(state, batch)
            module(inputs).sum().backward()
            with pytest.raises(framework.TrainingError, match=rf"^{stage}: .* already had a gradient .*: a backward "
                               r"pass ran outside train_step's \(in loss_fn, or on the module's output between steps: "
                               r".*module\.zero_grad\(set_to_none=True\) after your own backward pass, or take "
                               r"gradients with torch\.autograd\.grad\(out, inputs\)"):
                engine.train_step(state, batch)
            module(inputs).sum().backward()
            module.zero_grad(set_to_none=True)
        state, _ = engine.train_step(state, batch)
        assert state.step == (2 if stage == "zero3" else 3)


def test_initialize_notes_parameters_cast_to_another_dtype_on_rank_0(capsys):
    """A float64 (or, in an fp32 run, 16-bit) parameter, frozen or trainable, is cast to the working dtype: said
    once, not left to a Float/Double mismatch deep in forward; an fp32 model under bf16 is the ordinary case (no note)."""
    def make():
        module = torch.nn.Linear(3, 2)
        module.hi = torch.nn.Parameter(torch.randn(2, dtype=torch.float64))
        module.lo = torch.nn.Parameter(torch.randn(2, dtype=torch.bfloat16))
        module.kept = torch.nn.Parameter(torch.randn(2, dtype=torch.float64), requires_grad=False)
        return module
    loss = lambda m, mb: m(mb[0]).sum()   # noqa: E731
    for precision, note in [("fp32", "(hi float64, lo bfloat16, kept float64 (frozen)) are cast to precision=fp32's "
                                     "working dtype float32 (forward sees them in it; trainable ones train in it)"),
                            ("bf16", "(hi float64, kept float64 (frozen)) are cast to precision=bf16's working dtype "
                                     "bfloat16")]:
        with framework.initialize(make(), loss, tiny_config(f"precision={precision}")) as engine:
            assert engine.components.module.hi.dtype == engine.components.policy.param_dtype
        err = capsys.readouterr().err
        assert f"note: initialize: parameters of another dtype {note}" in err and err.count("note: initialize:") == 1
    with framework.initialize(torch.nn.Linear(3, 2), loss, tiny_config("precision=bf16")):
        pass
    assert "note: initialize" not in capsys.readouterr().err


def test_initialize_prints_the_notices_of_a_config_composed_before_it(capsys):
    """``framework.compose`` then ``initialize(module, loss_fn, cfg)`` (the documented flow) says the config's
    warnings and notes once, as ``initialize(ds_config=...)`` does; so does a dist.nproc it cannot act on."""
    ds = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2}, "my_unknown_top_key": 3}
    loss = lambda m, mb: m(mb[0]).sum()   # noqa: E731
    cfg = framework.compose(["train.steps=3", "dist.nproc=2"], ds_config=ds)
    capsys.readouterr()
    with framework.initialize(torch.nn.Linear(3, 2), loss, cfg):
        pass
    err = capsys.readouterr().err
    assert err.count("keys DeepSpeed does not know, ignored") == 1 and "my_unknown_top_key" in err, err
    assert err.count("warm-up (warmup_steps=100) is longer than the run") == 1, err
    assert err.count("note: initialize: dist.nproc=2 is read by the command line only; this engine joined a world "
                     "of 1 rank:") == 1, err
    with framework.initialize(torch.nn.Linear(3, 2), loss, ds_config=ds, overrides=["train.steps=3"]):
        pass
    err = capsys.readouterr().err
    assert err.count("my_unknown_top_key") == 1 and "dist.nproc" not in err, err


class _Renorm(torch.nn.Module):   # its forward rescales embedding rows in place (max_norm)
    def __init__(self):
        super().__init__()
        self.emb, self.out = torch.nn.Embedding(20, 8, max_norm=1.0), torch.nn.Linear(8, 20)

    def forward(self, x):
        return self.out(self.emb(x))


def _renorm_loss(m, mb):
    return torch.nn.functional.cross_entropy(m(mb[0]).float().reshape(-1, 20), mb[1].reshape(-1))


@pytest.mark.parametrize("stage", ["ddp", "zero3"])
def test_weight_edits_are_told_from_a_forwards_own_and_survive_no_gathered_block(stage):
    """A forward's own in-place edit (Embedding max_norm) trains; a load with assign=True (new Parameter objects)
    is refused; under zero3 an edit made before a framework.gathered block stays refused after it."""
    x = torch.randint(0, 20, (4, 6), generator=torch.Generator().manual_seed(0))
    cfg = tiny_config(f"+stage={stage}", "scheduler=constant")
    with framework.initialize(_Renorm(), _renorm_loss, cfg) as engine:
        state = engine.state
        for _ in range(3):
            state, _ = engine.train_step(state, framework.Batch(((x, x),)))
        engine.eval_step(state, [(x, x)])
        engine.eval_step(state, [(x, x)])
    module = _Renorm()
    with framework.initialize(module, _renorm_loss, cfg) as engine:
        if stage == "zero3":
            with torch.no_grad():
                module.out.bias.fill_(0.5)
            with framework.gathered([module.out.bias]):
                pass
            with pytest.raises(framework.TrainingError, match=r"^eval_step: the weights of 1 trainable parameter "
                                                              r"\(out\.bias\) were changed in place"):
                engine.eval_step(engine.state, [(x, x)])
            return
        module.load_state_dict({k: v.clone() for k, v in module.state_dict().items()}, assign=True)
        with pytest.raises(framework.TrainingError, match=r"^train_step: the weights of 3 trainable parameters .*"
                                                          r"changed in place \(or replaced\)"):
            engine.train_step(engine.state, framework.Batch(((x, x),)))


def test_a_ctrl_c_inside_a_zero3_gather_leaves_training_as_if_it_never_ran():
    """Ctrl-C at any shard load of a step (host shards, 4 units): the unit cut mid-gather is sharded again, its
    buffers left to the collectives, and the steps after it equal the steps of a run never interrupted."""
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(4))

        def forward(self, x):
            for layer in self.layers:
                x = torch.tanh(layer(x))
            return x.sum()

    cfg = tiny_config("+stage=zero3", "offload=cpu", "offload.params=cpu", "scheduler=constant",
                      "stage.stage3_param_persistence_threshold=0")
    batch = framework.Batch((torch.randn(8, 16, generator=torch.Generator().manual_seed(1)),))
    runs = []
    for cut in (0, 2, 3, 5):
        torch.manual_seed(0)
        with framework.initialize(Net(), lambda m, mb: m(mb[0]), cfg) as engine:
            shards, calls = engine.components.stage.offload.shards, []
            real = shards.load

            def load(*a, cut=cut, calls=calls, real=real):
                calls.append(1)
                if len(calls) == cut:
                    raise KeyboardInterrupt
                return real(*a)
            state, losses = engine.state, []
            state, _ = engine.train_step(state, batch)
            if cut:
                shards.load = load
                with pytest.raises(KeyboardInterrupt):
                    engine.train_step(state, batch)
                shards.load = real
            for _ in range(2):
                state, metrics = engine.train_step(state, batch)
                losses.append(metrics["loss"])
            runs.append(losses)
    assert runs[1:] == [runs[0]] * 3, runs
    # A Ctrl-C while a load regathers the persistent unit (biases under the threshold): the next load and the
    # next step gather it again (the unit was left sharded: its release once raised "sharded -> sharded").
    cfg = tiny_config("+stage=zero3", "offload=cpu", "offload.params=cpu", "scheduler=constant",
                      "stage.stage3_param_persistence_threshold=20")
    for reload in (True, False):
        torch.manual_seed(0)
        with framework.initialize(Net(), lambda m, mb: m(mb[0]), cfg) as engine:
            state, _ = engine.train_step(engine.state, batch)
            saved, gatherer = engine.state_dict(state), engine.components.stage.gatherer
            real_refresh = gatherer.refresh

            def cut(real_refresh=real_refresh, shards=engine.components.stage.offload.shards):
                real, shards.load = shards.load, lambda *a: (_ for _ in ()).throw(KeyboardInterrupt)
                try:
                    real_refresh()
                finally:
                    shards.load = real
            gatherer.refresh = cut
            with pytest.raises(KeyboardInterrupt):
                engine.load_state_dict(state, [saved])
            del gatherer.refresh
            if reload:
                engine.load_state_dict(engine.state, [saved])
            state, metrics = engine.train_step(engine.state, batch)
            assert metrics["loss"] == runs[0][0], (reload, metrics["loss"], runs[0])


def test_module_to_after_initialize_is_refused_and_discard_edits_reattaches_the_weights():
    """module.half(); .float() (nn.Module._apply: new storage under the same Parameter and version counter) left
    ddp/zero1/zero2's module off their flat buffers: the steps trained nothing, silently. Refused in one line;
    discard_edits puts the stage's views back, and the steps reach the module again."""
    micro = (torch.randn(4, 8), torch.randn(4, 1))
    loss = lambda m, mb: torch.nn.functional.mse_loss(m(mb[0]), mb[1])   # noqa: E731
    for stage, cast in (("ddp", "half"), ("zero2", "double")):
        torch.manual_seed(0)
        module = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
        with framework.initialize(module, loss, tiny_config(f"+stage={stage}", "scheduler=constant")) as engine:
            engine.train_step(engine.state, framework.Batch((micro,)))
            getattr(module, cast)()
            module.float()
            said = r"^train_step: module\.to\(\), \.half\(\).*4 trainable parameters.*call engine\.discard_edits"
            with pytest.raises(framework.TrainingError, match=said + r"\(engine\.state\)$"):
                engine.train_step(engine.state, framework.Batch((micro,)))
            engine.discard_edits(engine.state)
            before = module[0].weight.detach().clone()
            engine.train_step(engine.state, framework.Batch((micro,)))
            assert not torch.equal(before, module[0].weight.detach()), stage
            assert torch.equal(engine.consolidated_state_dict()["0.weight"], module[0].weight.detach()), stage


def test_a_gathered_unit_finds_its_moved_parameter_of_no_elements():
    """``UnitGroup.astray`` of a gathered unit: a parameter of no elements has no address to compare, so one that
    module.to() moved to another device is found by its device (the working dtype alike)."""
    from types import SimpleNamespace

    from framework.stages._shards import UnitGroup

    full = torch.zeros(8)
    slots = [SimpleNamespace(numel=8, offset=0), SimpleNamespace(numel=0, offset=8)]
    kept, moved = full[:8], torch.empty(0, device="meta")
    g = UnitGroup("decay", 0, SimpleNamespace(slots=slots), [kept, moved], full[:0], full[:0], full=full)
    assert [id(p) for p in g.astray(full[:0], gathered=True)] == [id(moved)]
    g.params[1] = cast = torch.empty(0, dtype=torch.float16)
    assert [id(p) for p in g.astray(full[:0], gathered=True)] == [id(cast)]


def test_module_half_after_initialize_is_refused_under_every_stage_and_discard_edits_puts_all_back():
    """module.half() after initialize: refused in one line under zero3 too (it re-pointed its trainable parameters
    at each gather, silently, while the frozen ones and the buffers stayed half: a mixed-dtype model); discard_edits
    puts back the parameters (sharded ones: empty or views of the gathered buffer), the frozen ones and the buffers
    it cast, and the next step equals the one of a run without the cast."""
    micro = [(torch.randn(4, 8), torch.randn(4, 1)) for _ in range(2)]
    loss = lambda m, mb: torch.nn.functional.mse_loss(m(mb[0]), mb[1])   # noqa: E731
    for stage in ("ddp", "zero3"):
        runs = []
        for cast in (False, True):
            torch.manual_seed(0)
            module = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 8),
                                         torch.nn.Linear(8, 1))
            module[0].requires_grad_(False)
            # (zero3: the 8x8 weight gathered per pass, the smaller parameters always gathered)
            cfg = tiny_config(f"+stage={stage}", "scheduler=constant",
                              *["stage.stage3_param_persistence_threshold=50"] * (stage == "zero3"))
            with framework.initialize(module, loss, cfg) as engine:
                engine.train_step(engine.state, framework.Batch((micro[0],)))
                if cast:
                    module.half()
                    said = r"module\.to\(\), \.half\(\).* gave 6 trainable parameters .*discard_edits\(engine\.state\)$"
                    calls = (("train_step", lambda: engine.train_step(engine.state, framework.Batch(micro[1:]))),
                             ("eval_step", lambda: engine.eval_step(engine.state, micro[1:])))
                    for what, call in calls:
                        with pytest.raises(framework.TrainingError, match=f"^{what}: {said}"):
                            call()
                    engine.discard_edits(engine.state)
                    floats = [t for t in (*module.parameters(), *module.buffers()) if t.is_floating_point()]
                    assert {t.dtype for t in floats} == {torch.float32}, stage
                _, m = engine.train_step(engine.state, framework.Batch((micro[1],)))
                runs.append((m["loss"], engine.consolidated_state_dict()))
        assert runs[0][0] == runs[1][0], (stage, runs[0][0], runs[1][0])
        assert all(torch.equal(v, runs[1][1][k]) for k, v in runs[0][1].items()), stage


def test_a_cast_or_move_of_frozen_parameters_is_refused_and_discard_edits_puts_them_back():
    """A frozen submodule's .half() (the trainable ones untouched) was not refused: the forward mixed dtypes;
    module.to("meta") replaced the frozen Parameter objects, which discard_edits left on meta. Both refused in one
    line under every stage, and after discard_edits the step equals the one of a run without the cast."""
    micro = [(torch.randn(4, 8), torch.randn(4, 1)) for _ in range(2)]
    loss = lambda m, mb: torch.nn.functional.mse_loss(m(mb[0]), mb[1])   # noqa: E731
    for stage in ("ddp", "zero2", "zero3"):
        runs = []
        for cast in (None, lambda m: m[0].half(), lambda m: m.to("meta")):
            torch.manual_seed(0)
            module = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
            module[0].requires_grad_(False)
            with framework.initialize(module, loss, tiny_config(f"+stage={stage}", "scheduler=constant")) as engine:
                engine.train_step(engine.state, framework.Batch((micro[0],)))
                if cast is not None:
                    cast(module)
                    said = r"^train_step: module\.to\(\), \.half\(\).* 2 frozen parameters \(0\.weight, 0\.bias\)"
                    with pytest.raises(framework.TrainingError, match=said + r".*discard_edits\(engine\.state\)$"):
                        engine.train_step(engine.state, framework.Batch((micro[1],)))
                    engine.discard_edits(engine.state)
                    assert {(p.dtype, p.device.type) for p in module.parameters()} == {(torch.float32, "cpu")}
                runs.append(engine.train_step(engine.state, framework.Batch((micro[1],)))[1]["loss"])
        assert runs[0] == runs[1] == runs[2], (stage, runs)


def test_a_load_after_parameters_were_replaced_gives_the_module_the_engines_back(tmp_path):
    """load_state_dict(..., assign=True) put new Parameter objects on the module (refused); a load into the
    engine puts the engine's back, so the steps after it train the module again."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    torch.save({k: v.clone() for k, v in module.state_dict().items()}, tmp_path / "w.pt")
    micro = (torch.randn(4, 8), torch.randn(4, 1))
    loss = lambda m, mb: torch.nn.functional.mse_loss(m(mb[0]), mb[1])   # noqa: E731
    for stage in ("ddp", "zero3"):
        with framework.initialize(module, loss, tiny_config(f"+stage={stage}", "scheduler=constant")) as engine:
            mine = list(module.parameters())
            module.load_state_dict(torch.load(tmp_path / "w.pt"), assign=True)
            with pytest.raises(framework.TrainingError, match=r"changed in place \(or replaced\).*call "
                                                              r"engine\.discard_edits\(engine\.state\)$"):
                engine.train_step(engine.state, framework.Batch((micro,)))
            # The way out without a save: the engine's parameters back on the module, stepping and saving again.
            engine.discard_edits(engine.state)
            assert all(p is q for p, q in zip(module.parameters(), mine)), stage
            engine.state_dict(engine.state)
            module.load_state_dict(torch.load(tmp_path / "w.pt"), assign=True)
            framework.load_weights(engine, tmp_path / "w.pt")
            with framework.gathered(list(module.parameters())):
                before = module[0].weight.detach().clone()
            engine.train_step(engine.state, framework.Batch((micro,)))
            with framework.gathered(list(module.parameters())):
                assert not torch.equal(before, module[0].weight.detach()), stage
            # fp32 without offload: an edit in place is in the masters, which discard_edits refuses (zero3 at
            # one rank too: its small always-gathered parameters are views of the shard, the masters)
            if stage in ("ddp", "zero3"):
                with torch.no_grad():
                    module[0].weight.mul_(3)
                with pytest.raises(framework.TrainingError) as e:
                    engine.train_step(engine.state, framework.Batch((micro,)))
                assert "(fp32 without offload) they are the engine's master copies" in str(e.value), e.value
                assert "discard_edits" not in str(e.value) and "\n" not in str(e.value), e.value
                with pytest.raises(framework.TrainingError, match="^discard_edits: the edit of 1 parameter"):
                    engine.discard_edits(engine.state)
                framework.load_weights(engine, tmp_path / "w.pt")   # the way on the refusal names
                engine.train_step(engine.state, framework.Batch((micro,)))
        module = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    # Tied weights: assign=True unties them; load_weights (strict) loads by the engine's names and ties them again.
    tied = torch.nn.Sequential(torch.nn.Embedding(10, 8), torch.nn.Linear(8, 10, bias=False))
    tied[1].weight = tied[0].weight
    tokens = torch.randint(0, 10, (4, 5), generator=torch.Generator().manual_seed(0))
    tied_loss = lambda m, mb: torch.nn.functional.cross_entropy(m(mb[0]).reshape(-1, 10), mb[0].reshape(-1))  # noqa: E731
    with framework.initialize(tied, tied_loss, tiny_config("scheduler=constant")) as engine:
        framework.save_weights(engine, tmp_path / "tied")
        tied.load_state_dict({k: v.clone() for k, v in tied.state_dict().items()}, assign=True)
        framework.load_weights(engine, tmp_path / "tied")
        assert tied[1].weight is tied[0].weight
        engine.train_step(engine.state, framework.Batch(((tokens,),)))


def test_parameters_beyond_the_hosts_memory_are_refused_before_they_are_allocated():
    """A config with a typo in a width builds on meta at once; laying its weights out on the host would fail in the
    allocator (a traceback) or swap. Refused in one line with the sizes instead."""
    from framework.comm.distributed import connect

    with framework.zero_init():
        huge = torch.nn.Linear(1 << 20, 1 << 20)   # 1.1e12 parameters: 4 TiB as fp32
    said = (r"^the model declares 1,099,512,676,352 parameters to lay out on the host: 4096\.00 GiB "
            r"\(4398050705408 bytes\) as float32 for the weights alone, more than this host's")
    with pytest.raises(framework.ConfigError, match=said):
        framework.initialize(huge, lambda m, b: m(b).sum(), framework.compose([]), connect("gloo"))


def test_frozen_weights_already_on_the_host_are_not_counted_as_new_memory(monkeypatch):
    """bind_frozen keeps a frozen parameter already on the host in the working dtype where it is: a frozen-backbone
    fine-tune of a model materialised on the host needs room for the trainable flat only. A frozen one still to be
    materialised (meta) or cast is allocated, and counted."""
    import framework.stages._flat as flat
    from framework.comm.distributed import connect

    def model(backbone_dtype=torch.float32):
        m = torch.nn.Sequential(torch.nn.Linear(256, 256, bias=False, dtype=backbone_dtype),
                                torch.nn.Linear(256, 2, bias=False))   # 256 KiB frozen (fp32), 2 KiB trainable
        return m, m[0].requires_grad_(False)

    monkeypatch.setattr(flat, "available_ram", lambda: 64 << 10)
    loss = lambda m, mb: m(mb[0]).sum()   # noqa: E731
    m, frozen = model()
    held = frozen.weight.data_ptr()
    with framework.initialize(m, loss, framework.compose([]), connect("gloo")) as engine:
        assert frozen.weight.data_ptr() == held   # (in place: no copy made)
        engine.train_step(engine.state, framework.Batch(((torch.randn(2, 256),),)))
    with framework.zero_init():
        on_meta, _ = model()
    for m in (model(torch.float64)[0], on_meta):
        with pytest.raises(framework.ConfigError, match=r"^the model declares 66,048 parameters to lay out"):
            framework.initialize(m, loss, framework.compose([]), connect("gloo"))


def test_parameters_beyond_the_devices_free_memory_are_one_line_before_allocating(monkeypatch):
    """On CUDA the flats go to device memory: more than the accelerator's free memory is the host check's one line
    for the device (the accelerator's count stood in for here: the CPU one has none, so the host's RAM counts)."""
    from framework.comm.accelerator import CpuAccelerator
    from framework.comm.distributed import connect

    loss = lambda m, mb: m(mb[0]).sum()   # noqa: E731
    monkeypatch.setattr(CpuAccelerator, "free_memory", lambda self: 64 << 10)
    for stage in ([], ["+stage=zero2"]):
        with pytest.raises(framework.ConfigError) as e:   # 256 KiB of fp32 weights
            framework.initialize(torch.nn.Linear(256, 256, bias=False), loss, framework.compose(stage), connect("gloo"))
        assert str(e.value).startswith("the model declares 65,536 parameters to lay out on cpu: 0.25 MiB") \
            and "more than the 0.06 MiB (65536 bytes) free on cpu; build a smaller model" in str(e.value), e.value
    monkeypatch.setattr(CpuAccelerator, "free_memory", lambda self: 1 << 20)
    with framework.initialize(torch.nn.Linear(256, 256, bias=False), loss, framework.compose([]), connect("gloo")):
        pass


def test_zero3_says_once_when_every_parameter_stays_gathered(capsys):
    """Every trainable parameter below stage3_param_persistence_threshold: no unit gathers anything and the gather
    keys change nothing, said once at start-up; with one parameter at the threshold there is a unit (no note)."""
    loss = lambda m, mb: m(mb[0]).sum()   # noqa: E731
    for threshold, noted in ((100_000, True), (6, False)):
        cfg = framework.compose(["+stage=zero3", f"stage.stage3_param_persistence_threshold={threshold}"])
        with framework.initialize(torch.nn.Linear(3, 2), loss, cfg):
            pass
        err = capsys.readouterr().err
        assert err.count("note: zero3: every trainable parameter stays gathered (the largest has 6 elements, "
                         "stage.stage3_param_persistence_threshold=100,000): each rank holds the whole model") \
            == noted, err


def _ctrl_c_once(monkeypatch, owner, name: str, when=lambda *args: True) -> list:
    """``owner.name`` (one framework method or function) raises KeyboardInterrupt at its first call that ``when``
    accepts (a Ctrl-C landing between a pool's take and its bookkeeping), the real one otherwise; the calls cut."""
    real, cut = getattr(owner, name), []

    def once(*args, **kwargs):
        if not cut and when(*args):
            cut.append(1)
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, once)
    return cut


def _landing(placement):   # copy_on's source is one of zero3's gradient read-back landings
    ptrs = {t.untyped_storage().data_ptr() for t, _ in placement.landings}
    return lambda acc, stream, dst, src, *rest: src.untyped_storage().data_ptr() in ptrs


@pytest.mark.timeout(120)   # (a lock left held hung the step)
@pytest.mark.parametrize("where", ["a swap write's submit", "a swap lock's with-exit", "a gradient read-back's copy",
                                   "zero1's unbind"])
def test_ctrl_c_between_a_pools_take_and_its_bookkeeping_is_recovered_as_documented(where, tmp_path, monkeypatch):
    """offload=nvme: a Ctrl-C after a pool slot or landing was taken and before it was recorded lost it (the
    load a half-applied update asks for was refused for good, "pieces [..] are in use"; every later step raised
    IndexError on an empty deque, or hung). Cut inside the backward's own bookkeeping, ``.grad`` stayed bound
    and the retry blamed a user's backward pass. Now the documented recovery works: retry with the previous
    state, or load_state_dict where the step is refused as half-applied; then training is exact. (A Ctrl-C on a
    ``with lock:`` block's exit line skips the exit: the lock stays held and the worker needing it hung.)"""
    from framework.offload import _disk
    over = {"a swap write's submit": ["+stage=zero2", "offload=nvme"],
            "a swap lock's with-exit": ["+stage=zero2", "offload=nvme"],
            "a gradient read-back's copy": ["+stage=zero3", "stage.stage3_param_persistence_threshold=0",
                                            "offload=nvme"],
            "zero1's unbind": ["+stage=zero1"]}[where]

    def build(name):
        cfg = tiny_config("train.micro_batch=2", "train.grad_accum=2", "scheduler=constant", *over,
                          *([f"offload.nvme_path={tmp_path}/{name}"] if "offload=nvme" in over else []))
        module, data = build_gpt(cfg)
        return framework.initialize(module, gpt_loss, cfg), data

    def batch(state):
        return data.train_batch(state.data, micro_batch=2, grad_accum=2, rank=0, world=1)

    (clean, data), (engine, _) = build("clean"), build("cut")
    with clean, engine:
        state, ref = clean.state, []
        for _ in range(4):
            state, m = clean.train_step(state, batch(state))
            ref.append(m["loss"])
        state, m = engine.train_step(engine.state, batch(engine.state))
        got, saved = [m["loss"]], engine.state_dict(state)
        target = engine.components.update.target if "+stage=zero1" not in over else None
        store = target.stores.get(Tier.DISK) if target is not None else None
        cuts = {"a swap write's submit": [lambda: _ctrl_c_once(monkeypatch, store.io, "pwrite")],
                "a swap lock's with-exit": [lambda: _ctrl_c_once(monkeypatch, store, "release",
                                                                 lambda *a: store.cond.acquire())],   # (held)
                "a gradient read-back's copy": [lambda: _ctrl_c_once(monkeypatch, _disk, "copy_on", _landing(target))],
                "zero1's unbind": [lambda: _ctrl_c_once(monkeypatch, engine.components.stage.flat_grads.launcher,
                                                        "disarm")],
                }[where]
        for k in range(3):   # (a landing lost once went unnoticed: the second loss emptied the pool)
            for make in cuts if k < (2 if where.startswith("a grad") else 1) else ():
                cut = make()
                with pytest.raises(KeyboardInterrupt):
                    engine.train_step(state, batch(state))
                assert cut
            try:
                state, m = engine.train_step(state, batch(state))
            except framework.FrameworkError as e:
                assert k == 0 and where.startswith("a swap") and "half-applied" in str(e)
                state = engine.load_state_dict(engine.state, [saved])
                state, m = engine.train_step(state, batch(state))
            got.append(m["loss"])
        assert got == ref
        assert all(torch.equal(a, b) for a, b in zip(clean.consolidated_state_dict().values(),
                                                      engine.consolidated_state_dict().values()))


def test_a_step_marker_an_interrupt_left_at_its_restore_does_not_stop_close():
    """A Ctrl-C landing on train_step's own marking lines left it marked for good: close() and the with
    block's exit raised "close() called inside train_step" forever. A marker with no step running is stale."""
    engine, data = _engine("+stage=zero1")
    state, _ = engine.train_step(engine.state, _batch(data, engine.state))
    engine._stepping = "train_step"   # as the interrupted restore leaves it
    engine.train_step(state, _batch(data, state))
    engine.close()
    assert engine.closed


def test_close_from_another_thread_while_a_step_runs_is_refused():
    """A watchdog's (or a server's shutdown handler's) close() while loss_fn runs on the training thread: refused,
    and the step finishes on an open engine (the marker is stale only when no thread runs a step of it)."""
    entered, tried, got = threading.Event(), threading.Event(), {}
    cfg = tiny_config("train.steps=2", "train.micro_batch=2", "+stage=zero2", "offload=cpu")
    module, data = build_gpt(cfg)

    def loss(m, mb):
        entered.set()
        tried.wait(60)
        return gpt_loss(m, mb)

    def closer():
        entered.wait(60)
        try:
            engine.close()
        except framework.FrameworkError as e:
            got["error"] = str(e)
        finally:
            tried.set()

    with framework.initialize(module, loss, cfg) as engine:
        th = threading.Thread(target=closer)
        th.start()
        state, _ = engine.train_step(engine.state, _batch(data, engine.state))
        th.join(60)
        assert got == {"error": "close() called inside train_step; close after it returns"}
        assert not engine.closed and state.step == 1
    assert engine.closed
