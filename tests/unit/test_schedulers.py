"""LR schedules: values at given steps (hand-computed), shape, validation and YAML defaults."""
from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

import framework
from framework.core.errors import ConfigError
from framework.core.registry import registry
from framework.schedulers import constant, warmup_cosine, warmup_lr

CONF = Path(__file__).resolve().parents[2] / "conf" / "scheduler"
LOG10_2, LOG10_4 = 0.30102999566398120, 0.60205999132796240


def at_iteration(lr_at):
    """DeepSpeed's schedules by its ``last_batch_iteration``: applied update ``it + 1`` uses the
    formula at ``it`` (update 0 uses what the constructor set: ``test_deepspeed_update_order``)."""
    return lambda it: lr_at(it + 1)


def test_constant():
    lr_at = constant.build(constant.ConstantConfig(), base_lr=3e-4, total_steps=10)
    assert [lr_at(s) for s in (0, 5, 10, 10_000)] == [3e-4] * 4


def test_warmup_lr_log():
    cfg = warmup_lr.WarmupLRConfig(warmup_min_lr=0.1, warmup_max_lr=1.1, warmup_num_steps=10)
    lr_at = at_iteration(warmup_lr.build(cfg, base_lr=5.0, total_steps=100))  # explicit max wins
    assert lr_at(0) == pytest.approx(0.1)  # log(1) = 0: the first update uses the min lr
    assert lr_at(1) == pytest.approx(0.1 + LOG10_2)
    assert lr_at(3) == pytest.approx(0.1 + LOG10_4)
    assert lr_at(9) == pytest.approx(1.1)  # log(10) / log(10)
    assert lr_at(10) == lr_at(500) == pytest.approx(1.1)


def test_warmup_lr_linear_and_default_max():
    cfg = warmup_lr.WarmupLRConfig(warmup_num_steps=4, warmup_type="linear")
    lr_at = at_iteration(warmup_lr.build(cfg, base_lr=2.0, total_steps=100))
    assert [lr_at(s) for s in range(7)] == pytest.approx([0.0, 0.5, 1.0, 1.5, 2.0, 2.0, 2.0])


def test_warmup_lr_one_step_is_raised_to_two_like_deepspeed():
    cfg = warmup_lr.WarmupLRConfig(warmup_num_steps=1, warmup_type="linear")
    lr_at = at_iteration(warmup_lr.build(cfg, base_lr=1.0, total_steps=10))
    assert [lr_at(s) for s in range(3)] == pytest.approx([0.0, 0.5, 1.0])
    log_at = at_iteration(warmup_lr.build(dataclasses.replace(cfg, warmup_type="log"), 1.0, 10))
    assert [log_at(s) for s in range(3)] == pytest.approx([0.0, 1.0, 1.0])  # log 2 / log 2


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_lr_is_non_decreasing_and_reaches_max(kind):
    cfg = warmup_lr.WarmupLRConfig(warmup_min_lr=1e-5, warmup_num_steps=100, warmup_type=kind)
    lrs = [warmup_lr.build(cfg, 1e-3, 1000)(s) for s in range(300)]   # in update order
    assert all(a <= b for a, b in zip(lrs, lrs[1:]))
    assert lrs[0] == pytest.approx(1e-5) and lrs[-1] == pytest.approx(1e-3)


def test_warmup_decay_lr_values():
    cfg = warmup_lr.WarmupDecayLRConfig(warmup_num_steps=10, warmup_type="linear",
                                              total_num_steps=30)
    lr_at = at_iteration(warmup_lr.build_decay(cfg, base_lr=1.0, total_steps=999))  # explicit total wins
    assert lr_at(5) == pytest.approx(0.5)  # warm-up: 5 / 10
    assert lr_at(10) == pytest.approx(1.0)  # (30 - 10) / (30 - 10)
    assert lr_at(20) == pytest.approx(0.5)
    assert lr_at(25) == pytest.approx(0.25)
    assert lr_at(30) == lr_at(45) == 0.0


def test_warmup_decay_lr_log_warmup_and_default_total():
    cfg = warmup_lr.WarmupDecayLRConfig(warmup_min_lr=0.1, warmup_max_lr=1.1,
                                              warmup_num_steps=10)
    lr_at = at_iteration(warmup_lr.build_decay(cfg, base_lr=5.0, total_steps=20))
    assert lr_at(3) == pytest.approx(0.1 + LOG10_4)
    assert lr_at(15) == pytest.approx(0.1 + 1.0 * 5 / 10)  # decays towards warmup_min_lr
    assert lr_at(20) == pytest.approx(0.1)
    lrs = [lr_at(s) for s in range(40)]
    assert all(a <= b for a, b in zip(lrs[:10], lrs[1:11]))
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))


def test_warmup_cosine_values():
    cfg = warmup_cosine.WarmupCosineConfig(warmup_steps=10, min_lr=1e-4, decay_steps=110)
    lr_at = warmup_cosine.build(cfg, base_lr=1e-3, total_steps=999)
    assert lr_at(0) == pytest.approx(1e-3 / 11)  # nanoGPT: lr * (it + 1) / (warmup + 1)
    assert lr_at(9) == pytest.approx(1e-3 * 10 / 11)
    assert lr_at(10) == pytest.approx(1e-3)  # cos(0)
    assert lr_at(60) == pytest.approx(5.5e-4)  # half way: min + (max - min) / 2
    assert lr_at(110) == pytest.approx(1e-4)
    assert lr_at(111) == lr_at(10_000) == 1e-4
    lrs = [lr_at(s) for s in range(200)]
    assert all(a < b for a, b in zip(lrs[:10], lrs[1:11]))
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))


def test_warmup_cosine_run_shorter_than_warmup():
    cfg = warmup_cosine.WarmupCosineConfig(warmup_steps=10, min_lr=1e-4)
    lr_at = warmup_cosine.build(cfg, base_lr=1e-3, total_steps=5)  # decay_steps = 5 < warmup
    assert lr_at(4) == pytest.approx(1e-3 * 5 / 11)
    assert lr_at(10) == 1e-4  # no cosine phase, and no division by zero


def test_warmup_cosine_default_decay_is_run_length():
    cfg = warmup_cosine.WarmupCosineConfig(warmup_steps=0, min_lr=0.0)
    lr_at = warmup_cosine.build(cfg, base_lr=1.0, total_steps=100)
    assert lr_at(0) == 1.0 and lr_at(50) == pytest.approx(0.5) and lr_at(100) == 0.0


@pytest.mark.parametrize("name,overrides,base_lr", [
    ("warmup_lr", {"warmup_type": "cosine"}, 1e-3),
    ("warmup_lr", {"warmup_num_steps": -1}, 1e-3),
    ("warmup_lr", {"warmup_min_lr": -1e-3}, 1e-3),
    ("warmup_lr", {"warmup_max_lr": float("nan")}, 1e-3),
    ("warmup_decay_lr", {"total_num_steps": 0}, 1e-3),
    ("warmup_decay_lr", {"warmup_type": "exp"}, 1e-3),
    ("warmup_cosine", {"warmup_steps": -1}, 1e-3),
    ("warmup_cosine", {"min_lr": 1e-2}, 1e-3),  # above the optimizer's lr
    ("warmup_cosine", {"warmup_steps": 50, "decay_steps": 50}, 1e-3),
])
def test_bad_config_raises_one_line_config_error(name, overrides, base_lr):
    component = registry("scheduler").get(name)
    cfg = dataclasses.replace(component.config(), **overrides)
    with pytest.raises(ConfigError) as info:
        component.build(cfg, base_lr, 1000)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("name", ["constant", "warmup_lr", "warmup_decay_lr", "warmup_cosine", "warmup_cosine_lr"])
def test_yaml_lists_every_field_with_its_default(name):
    component = registry("scheduler").get(name)
    node = yaml.safe_load((CONF / f"{name}.yaml").read_text())
    fields = {f.name: f.default for f in dataclasses.fields(component.config)}
    assert node == fields
    assert all(type(node[k]) is type(fields[k]) for k in fields), "YAML types must match the schema"
    component.build(component.config(**node), 1e-3, 1000)(0)  # the defaults build and run


def test_warmup_cosine_lr_values_deepspeed_formula():
    cfg = warmup_lr.WarmupCosineLRConfig(warmup_min_ratio=0.2, warmup_num_steps=4, cos_min_ratio=0.1,
                                                warmup_type="linear", total_num_steps=8)
    lr_at = at_iteration(warmup_lr.build_cosine(cfg, base_lr=2.0, total_steps=999))  # explicit total wins
    # warm-up: ratio = 0.2 + 0.8 * step / 4
    assert [lr_at(s) for s in range(4)] == pytest.approx([0.4, 0.8, 1.2, 1.6])
    # decay: progress (step - 4 + 1) / (8 - 4); ratio = 0.1 + 0.9 * (1 + cos(pi p)) / 2
    expect = [2.0 * (0.1 + 0.9 * (1 + math.cos(math.pi * p)) / 2) for p in (0.25, 0.5, 0.75, 1.0)]
    assert [lr_at(s) for s in range(4, 8)] == pytest.approx(expect)
    assert lr_at(8) == lr_at(100) == pytest.approx(0.2)  # stays at cos_min_ratio
    log = at_iteration(warmup_lr.build_cosine(warmup_lr.WarmupCosineLRConfig(warmup_num_steps=10), 1.0, 100))
    assert log(0) == 0.0 and log(1) == pytest.approx(LOG10_2) and log(9) == pytest.approx(1.0)
    with pytest.raises(ConfigError, match="cos_min_ratio"):
        warmup_lr.build_cosine(warmup_lr.WarmupCosineLRConfig(cos_min_ratio=2.0), 1.0, 10)


def test_deepspeed_update_order():
    """The lr each applied update uses, as DeepSpeed 0.19.8's engine sets it: the schedule's
    constructor sets the first (warmup_min_lr; 0 for WarmupCosineLR), then the engine steps it after
    every applied update, so the formula runs one update behind (sequences read from DeepSpeed's
    lr_schedules.py and engine._take_model_step)."""
    lin = warmup_lr.build(warmup_lr.WarmupLRConfig(warmup_num_steps=4, warmup_type="linear"), 1e-3, 100)
    assert [lin(k) for k in range(7)] == pytest.approx([0, 0, 2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3])
    log = warmup_lr.build(warmup_lr.WarmupLRConfig(warmup_min_lr=1e-4, warmup_num_steps=4), 1e-3, 100)
    assert [log(k) for k in range(3)] == pytest.approx([1e-4, 1e-4, 1e-4 + 9e-4 * math.log(2) / math.log(4)])
    decay = warmup_lr.build_decay(warmup_lr.WarmupDecayLRConfig(warmup_num_steps=3, warmup_type="linear",
                                                                total_num_steps=6), 1e-3, 100)
    assert [decay(k) for k in range(9)] == pytest.approx([0, 0, 1e-3 / 3, 2e-3 / 3, 1e-3, 2e-3 / 3, 1e-3 / 3, 0, 0])
    cos = warmup_lr.build_cosine(warmup_lr.WarmupCosineLRConfig(warmup_min_ratio=0.1, warmup_num_steps=3,
                                                                cos_min_ratio=0.01, warmup_type="linear",
                                                                total_num_steps=6), 1e-3, 100)
    assert cos(0) == 0.0 and cos(1) == pytest.approx(1e-4) and cos(2) == pytest.approx(4e-4)


def test_warmup_cosine_default_min_lr_is_a_tenth_of_the_lr():
    """The YAML default follows the lr: an lr below the old fixed floor (1e-4) builds, and the
    default lr of 1e-3 keeps the floor of 1e-4 exactly."""
    node = yaml.safe_load((CONF / "warmup_cosine.yaml").read_text())
    cfg = warmup_cosine.WarmupCosineConfig(**{**node, "warmup_steps": 0})
    assert warmup_cosine.build(cfg, base_lr=5e-5, total_steps=10)(10) == 5e-6
    assert warmup_cosine.build(cfg, base_lr=1e-3, total_steps=10)(10) == 1e-4


@pytest.mark.parametrize("overrides,says", [
    ([], None),
    (["optimizer.lr=5e-5"], None),
    (["optimizer.lr=5e-5", "scheduler.min_lr=5e-5"], None),
    (["scheduler.min_lr=1e-2"], "config: scheduler.min_lr=0.01 must be in [0, optimizer.lr=0.001]; set "
                                "scheduler.min_lr <= optimizer.lr or scheduler=constant (min_lr: null is lr / 10)"),
    # every value build checks, refused by compose (not after another sweep job has run)
    (["scheduler.warmup_steps=-5"], "config: scheduler.warmup_steps must be >= 0, got -5; give 0 for no warm-up"),
    (["scheduler.decay_steps=2"], "config: scheduler.decay_steps must be > warmup_steps=100, got 2; give a larger "
                                  "one, or null (the run's length)"),
    (["scheduler=warmup_cosine_lr", "scheduler.cos_min_ratio=5", "scheduler.warmup_num_steps=10"],
     "config: scheduler.cos_min_ratio must be in [0, 1] (a fraction of optimizer.lr), got 5.0"),
    (["scheduler=warmup_decay_lr", "scheduler.total_num_steps=0", "scheduler.warmup_num_steps=10"],
     "config: scheduler.total_num_steps must be >= 1, got 0; give 1 or more, or null (the run's length)"),
    (["scheduler=warmup_lr", "scheduler.warmup_max_lr=-1", "scheduler.warmup_num_steps=10"],
     "config: scheduler.warmup_max_lr must be >= 0, got -1.0"),
    # the peak lr (and the floor) meet the fp32 optimizer state as optimizer.lr does: inf there, NaN after it
    (["scheduler=warmup_lr", "scheduler.warmup_max_lr=1e39", "scheduler.warmup_num_steps=1"],
     "config: scheduler.warmup_max_lr must be finite in fp32 (the optimizer state's dtype), got 1e+39, which is inf "
     "there; give at most 3.4028234663852886e+38"),
    (["scheduler=warmup_decay_lr", "scheduler.warmup_min_lr=1e39", "scheduler.warmup_max_lr=1e39"],
     "config: scheduler.warmup_min_lr must be finite in fp32 (the optimizer state's dtype), got 1e+39, which is inf "
     "there; give at most 3.4028234663852886e+38"),
    (["scheduler=warmup_lr", "scheduler.warmup_type=lin"],
     "config: scheduler.warmup_type must be log or linear, got 'lin' (did you mean 'linear'?)"),
])
def test_scheduler_values_are_checked_with_the_config(overrides, says):
    from framework.config import compose

    if says is None:
        cfg = compose(overrides)
        warmup_cosine.build(cfg.scheduler, base_lr=cfg.optimizer.lr, total_steps=cfg.train.steps)
        return
    with pytest.raises(ConfigError) as info:
        compose(overrides)
    assert str(info.value) == says


@pytest.mark.parametrize("name", ["warmup_lr", "warmup_decay_lr", "warmup_cosine_lr"])
def test_warmup_num_steps_below_one_is_refused(name):
    # DeepSpeed (0.19.3 on) refuses 0 too; before, 0 ran two updates at lr 0.
    from framework.config import compose

    component = registry("scheduler").get(name)
    with pytest.raises(ConfigError, match="warmup_num_steps must be >= 1") as info:
        component.build(dataclasses.replace(component.config(), warmup_num_steps=0), 1e-3, 100)
    assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="^config: scheduler.warmup_num_steps must be >= 1") as info:
        compose([f"scheduler={name}", "scheduler.warmup_num_steps=0"])
    assert "\n" not in str(info.value)
    ds = {"scheduler": {"type": {"warmup_lr": "WarmupLR", "warmup_decay_lr": "WarmupDecayLR",
                                 "warmup_cosine_lr": "WarmupCosineLR"}[name],
                        "params": {"warmup_num_steps": 0, "total_num_steps": 300}}}
    if name == "warmup_lr":
        del ds["scheduler"]["params"]["total_num_steps"]
    with pytest.raises(ConfigError, match="warmup_num_steps must be >= 1") as info:
        compose([], ds_config=ds)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("overrides,says", [
    (["train.steps=20"], "warm-up (warmup_steps=100) is longer than the run (train.steps=20)"),
    (["scheduler=warmup_lr"], "warm-up (warmup_num_steps=1000) is longer than the run (train.steps=300)"),
    (["scheduler=warmup_cosine_lr", "train.steps=999"], "(warmup_num_steps=1000) is longer"),
    # A run as long as the warm-up ends below the peak too (its last update is still warming up, as
    # DeepSpeed's schedules lag an update); one update more reaches it, except a linear WarmupCosineLR's.
    (["train.steps=100"], "warm-up (warmup_steps=100) takes all of the run (train.steps=100)"),
    (["train.steps=101"], None),
    (["scheduler=warmup_decay_lr", "train.steps=1000"], "(warmup_num_steps=1000) takes all of the run"),
    (["scheduler=warmup_decay_lr", "train.steps=1001"], None),
    # A linear warm-up's gamma reaches 1 one update later than a log one's (update 11 of 12 here); a
    # WarmupCosineLR's then decays: its peak is its last warm-up update's.
    (["scheduler=warmup_lr", "scheduler.warmup_num_steps=10", "scheduler.warmup_type=linear", "train.steps=11"],
     "takes all of the run"),
    (["scheduler=warmup_lr", "scheduler.warmup_num_steps=10", "scheduler.warmup_type=linear", "train.steps=12"],
     None),
    (["scheduler=warmup_cosine_lr", "scheduler.warmup_num_steps=10", "scheduler.warmup_type=linear",
      "train.steps=10"], "takes all of the run"),
    (["scheduler=warmup_cosine_lr", "scheduler.warmup_num_steps=10", "scheduler.warmup_type=linear",
      "train.steps=11"], None),
    (["scheduler=warmup_cosine_lr", "scheduler.warmup_num_steps=10", "train.steps=10"], "takes all of the run"),
    (["scheduler=warmup_cosine_lr", "scheduler.warmup_num_steps=10", "train.steps=11"], None),
    (["scheduler=warmup_lr", "scheduler.warmup_num_steps=1", "scheduler.warmup_type=linear", "train.steps=3"],
     "takes all of the run"),   # (DeepSpeed warms up over 2)
    (["scheduler=warmup_cosine_lr", "scheduler.warmup_num_steps=10", "scheduler.warmup_type=linear",
      "train.steps=12"], None),   # (reaches its peak, then decays)
    (["scheduler=warmup_lr", "scheduler.warmup_max_lr=1e-4", "scheduler.warmup_min_lr=1e-4", "train.steps=3"],
     None),   # (no rise to miss)
    (["scheduler=constant", "train.steps=1"], None),
])
def test_a_warmup_longer_than_the_run_is_noted(overrides, says):
    from framework.config import compose

    notes = [n for n in compose(overrides).notices if "warm-up" in n]
    assert notes == ([] if says is None else [notes[0]]) and all(n.startswith("note: ") for n in notes), notes
    assert says is None or (says in notes[0] and "\n" not in notes[0]), notes


def test_a_decay_ending_before_the_run_holds_its_floor_with_a_note():
    """warmup_cosine_lr stops at total_num_steps and holds cos_min_ratio x lr, warmup_decay_lr warmup_min_lr
    (0 by default: those steps train nothing), as DeepSpeed (0.19.3 on for the cosine) does: kept, and said at
    start-up with the steps held, counted as the schedules themselves hold them; nothing where it ends with the run."""
    from framework.config import compose

    over = ["scheduler=warmup_cosine_lr", "scheduler.warmup_num_steps=2", "train.steps=12", "optimizer.lr=1e-3"]
    lr_at = compose([*over, "scheduler.total_num_steps=5"]).scheduler
    lr_at = warmup_lr.build_cosine(lr_at, 1e-3, 12)
    assert [lr_at(k) for k in range(5, 12)] == pytest.approx([1e-7] * 7)   # steps 6 to 12

    def held(*extra, name="warmup_cosine_lr"):
        return [n for n in compose([*over, f"scheduler={name}", *extra]).notices if "total_num_steps" in n]
    assert held("scheduler.total_num_steps=5") == [
        "note: scheduler.total_num_steps=5 is below train.steps=12: the lr holds at cos_min_ratio x optimizer.lr "
        "(1.00e-07) for the last 7 steps; set scheduler.total_num_steps=12 (or null: the run's length) to decay "
        "over the whole run"]
    assert "for the last 1 step;" in held("scheduler.total_num_steps=11")[0]
    assert held("scheduler.total_num_steps=12") == held() == []
    assert held("scheduler.total_num_steps=5", name="warmup_decay_lr") == [
        "note: scheduler.total_num_steps=5 is below train.steps=12: the lr holds at warmup_min_lr (0: those steps "
        "change no weight) for the last 6 steps; set scheduler.total_num_steps=12 (or null: the run's length) to "
        "decay over the whole run"]
    assert "warmup_min_lr (1.00e-05) for" in held("scheduler.total_num_steps=5", "scheduler.warmup_min_lr=1e-5",
                                                   name="warmup_decay_lr")[0]
    assert held("scheduler.total_num_steps=12", name="warmup_decay_lr") == []
    for name, build_at, cls, floor in (
            ("warmup_cosine_lr", warmup_lr.build_cosine, warmup_lr.WarmupCosineLRConfig, 1e-7),
            ("warmup_decay_lr", warmup_lr.build_decay, warmup_lr.WarmupDecayLRConfig, 0.0)):
        for warm, total in ((1, 1), (1, 2), (3, 2), (3, 3), (3, 4), (3, 10), (6, 14), (6, 15)):
            config = SimpleNamespace(train=SimpleNamespace(steps=16), optimizer=SimpleNamespace(lr=1e-3))
            node = cls(warmup_num_steps=warm, total_num_steps=total)
            lrs = [build_at(node, 1e-3, 16)(k) for k in range(16)]
            count = next(k for k in range(16) if abs(lrs[-1 - k] - floor) > 1e-15)   # the trailing updates at it
            note = [n for n in registry("scheduler").get(name).notes(node, config) if "total_num_steps" in n]
            says = f"for the last {count} step{'s' * (count > 1)};"
            assert (len(note) == 1 and says in note[0]) if count else note == [], (name, warm, total, lrs, note)


def test_a_resume_note_names_the_first_update_a_longer_run_moves_past_a_warm_up():
    """The warm-up's lrs are the same over either length: the note names the first update whose lr moves (it
    said nothing for a checkpoint inside the warm-up, the default's first 100 updates)."""
    from framework.persist.checkpoint._load import schedule_change

    given = ["scheduler=warmup_cosine", "scheduler.warmup_steps=2"]
    saved, cfg = (framework.compose([*given, f"train.steps={n}"]) for n in (4, 8))
    build = [warmup_cosine.build(cfg.scheduler, cfg.optimizer.lr, n) for n in (4, 8)]
    head = "the lr schedule (scheduler=warmup_cosine) follows train.steps: it now spans 8 steps, not 4, and "
    keep = "; set scheduler.decay_steps=4 to keep the saved run's"
    assert schedule_change(saved.to_dict(), cfg, 1) == (
        f"{head}the lr moves from update 4 on: {build[1](3):.2e} (over 4 steps: {build[0](3):.2e}){keep}")
    assert schedule_change(saved.to_dict(), cfg, 3) == (
        f"{head}the next update's lr is {build[1](3):.2e} (over 4 steps: {build[0](3):.2e}){keep}")
    # A warm-up of many thousand updates, and a move too small to print just past the peak: the update named is the
    # first whose printed lrs differ (the note printed 1.00e-03 twice, or nothing past a 10,000-update window).
    given = ["scheduler=warmup_cosine", "scheduler.warmup_steps=20000"]
    saved, cfg = (framework.compose([*given, f"train.steps={n}"]) for n in (50_000, 100_000))
    note = schedule_change(saved.to_dict(), cfg, 5000)
    update, lr, was = re.fullmatch(r".* the lr moves from update (\d+) on: (\S+) \(over 50000 steps: (\S+)\);.*",
                                   note).groups()
    build = [warmup_cosine.build(cfg.scheduler, cfg.optimizer.lr, n) for n in (50_000, 100_000)]
    i = int(update) - 1
    assert 20_000 < i and lr != was and (lr, was) == (f"{build[1](i):.2e}", f"{build[0](i):.2e}")
    assert all(f"{build[0](j):.2e}" == f"{build[1](j):.2e}" for j in range(5000, i))


def test_no_resume_note_where_optimizer_lr_changed_with_train_steps():
    """The note compares the saved run's lr with this run's: built with this run's optimizer.lr for both, its lrs,
    the update it names and its advice were wrong where optimizer.lr changed too (min_lr null follows it as well);
    "config differs in" names both keys."""
    from framework.persist.checkpoint._load import schedule_change

    given = ["scheduler=warmup_cosine", "scheduler.warmup_steps=2"]
    saved = framework.compose([*given, "train.steps=4"]).to_dict()
    assert schedule_change(saved, framework.compose([*given, "train.steps=8"]), 1) is not None
    assert schedule_change(saved, framework.compose([*given, "train.steps=8", "optimizer.lr=5e-4"]), 1) is None


@pytest.mark.parametrize("name", ["warmup_lr", "warmup_decay_lr"])
def test_a_warmup_max_lr_that_leaves_optimizer_lr_unused_is_noted(name):
    """A set warmup_max_lr is the peak: optimizer.lr is read by no update, said once at start-up (a DeepSpeed
    file's stated peak must equal the optimizer's lr; the command line's gets this note there too)."""
    import framework
    from framework.config import compose

    def peaks(*over, **kw):
        compose_ = framework.compose if kw else compose
        return [n for n in compose_([f"scheduler={name}", "train.steps=20", *over], **kw).notices if "peaks" in n]

    assert peaks("scheduler.warmup_max_lr=0.5", "optimizer.lr=0.001") == [
        "note: the lr peaks at scheduler.warmup_max_lr=0.5; optimizer.lr=0.001 is not used (set "
        "scheduler.warmup_max_lr=null to peak at optimizer.lr)"]
    assert peaks("scheduler.warmup_max_lr=1e-3", "optimizer.lr=0.001") == []   # the same peak
    assert peaks("optimizer.lr=0.001") == []                                    # null: the optimizer's lr
    kind, params = {"warmup_lr": ("WarmupLR", {}),
                    "warmup_decay_lr": ("WarmupDecayLR", {"total_num_steps": "auto"})}[name]
    ds = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 3e-4}},
          "scheduler": {"type": kind, "params": {"warmup_num_steps": 10, "warmup_max_lr": "auto", **params}}}
    assert len(peaks("scheduler.warmup_max_lr=0.01", ds_config=ds, world=1)) == 1
    assert peaks(ds_config=ds, world=1) == []
