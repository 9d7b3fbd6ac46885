"""The name-keyed layout: piece specs, coverage of saved ranges, and the state dict re-slicing them.

The distributed round trips (every stage, world 1/2/4, offload) are in tests/dist/test_layout.py;
here the arithmetic is checked element by element on plain tensors.
"""
import copy
import functools
import random
from dataclasses import replace

import pytest
import torch
from torch import nn

from framework import compose
from framework.engine.build import component
from framework.core.errors import FrameworkError
from framework.precision import Policy, PrecisionState, ScalerConfig
from framework.stages._flat import PieceSpec, cover, make_layout, piece_spec
from framework.engine.state import TrainState, optimizer_leaves, with_scalars
from framework.persist.layout import load_state_dict, state_dict

FP32 = Policy("fp32", torch.float32, torch.float32, torch.float32, None)
FP16 = Policy("fp16", torch.float16, torch.float16, torch.float32, ScalerConfig())
SHAPES = {"a": (5, 7), "b": (13,), "c": (1,), "d": (3, 3, 3), "e": (300,)}


def named():
    return [(n, nn.Parameter(torch.zeros(s))) for n, s in SHAPES.items()]


def values(name: str) -> torch.Tensor:
    """Distinct, recognisable values for every element of every parameter."""
    k = list(SHAPES).index(name)
    n = torch.Size(SHAPES[name]).numel()
    return 1000.0 * (k + 1) + torch.arange(n, dtype=torch.float32)


def pieces_of(world: int, chunk: int | None):
    """(layout, [(start, end)]) as a sharded stage cuts it: each rank's partition in chunks."""
    layout = make_layout(named(), world)
    ranges = []
    for r in range(world):
        lo, hi = layout.partition(r)
        step = chunk or hi - lo
        ranges += [(a, min(a + step, hi)) for a in range(lo, hi, step)]
    return layout, ranges


@pytest.mark.parametrize("world,chunk", [(1, None), (2, None), (3, 50), (4, 7), (7, 1000)])
def test_piece_specs_name_every_element_once(world, chunk):
    layout, ranges = pieces_of(world, chunk)
    flat = torch.zeros(layout.padded)
    for s in layout.slots:
        flat[s.offset:s.offset + s.numel] = values(s.name)
    seen = {n: torch.zeros(torch.Size(s).numel(), dtype=torch.int64) for n, s in SHAPES.items()}
    for a, b in ranges:
        spec = piece_spec(layout, a, b)
        assert spec.numel == b - a
        piece = flat[a:b]
        for span in spec.spans:
            assert span.shape == SHAPES[span.name]
            (p0, p1), (q0, q1) = span.param, span.piece
            assert p1 - p0 == q1 - q0 > 0 and 0 <= q0 and q1 <= spec.numel
            assert torch.equal(piece[q0:q1], values(span.name)[p0:p1])
            seen[span.name][p0:p1] += 1
        # spans are disjoint within a piece and come in piece order
        starts = [s.piece for s in spec.spans]
        assert all(x[1] <= y[0] for x, y in zip(starts, starts[1:]))
    for name, count in seen.items():
        assert torch.all(count == 1), f"{name}: elements covered {count.tolist()}"


def test_padding_piece_has_no_spans_and_bad_ranges_raise():
    layout = make_layout(named(), 4)
    assert layout.padded > layout.numel
    assert piece_spec(layout, layout.numel, layout.padded).spans == ()
    with pytest.raises(ValueError, match="outside"):
        piece_spec(layout, 0, layout.padded + 1)


def test_cover_tiles_in_order_and_prefers_the_furthest_reach():
    assert cover(0, 10, [(5, 10), (0, 5)]) == [(1, 0, 5), (0, 5, 10)]
    # replicated saves (every rank everything) plus a short one: one copy, from the longest
    assert cover(2, 8, [(0, 4), (0, 10), (0, 10)]) == [(1, 2, 8)]
    assert cover(3, 3, []) == []
    with pytest.raises(LookupError, match=r"elements \[4, 6\) are in no saved fragment"):
        cover(0, 10, [(0, 4), (6, 10)])
    with pytest.raises(LookupError, match=r"elements \[8, 10\)"):
        cover(0, 10, [(0, 8)])
    with pytest.raises(LookupError, match=r"elements \[0, 2\)"):
        cover(0, 10, [(2, 10)])


def test_cover_matches_brute_force_on_random_ranges():
    rng = random.Random(0)
    for _ in range(500):
        ranges = [tuple(sorted(rng.sample(range(40), 2))) for _ in range(rng.randint(0, 6))]
        lo = rng.randint(0, 30)
        hi = rng.randint(lo, 40)
        held = {i for a, b in ranges for i in range(a, b)}
        missing = [i for i in range(lo, hi) if i not in held]
        if missing:
            with pytest.raises(LookupError, match=rf"elements \[{missing[0]},"):
                cover(lo, hi, ranges)
            continue
        parts = cover(lo, hi, ranges)
        assert [p[1] for p in parts] == [lo, *[p[2] for p in parts[:-1]]] if parts else lo == hi
        assert all(ranges[i][0] <= a < b <= ranges[i][1] for i, a, b in parts)
        assert (parts[-1][2] if parts else lo) == hi


# --- optimizer state leaves --------------------------------------------------------------------

OPTIMIZERS = {
    "adamw": (["0.mu", "0.nu"], {"0.count": 0}),
    "adam": (["1.mu", "1.nu"], {"1.count": 0}),
    "lion": (["0.mu"], {}),
    "sgd": (["1.trace"], {"1.count": 0}),
    "adagrad": (["1.sum_of_squares"], {"1.count": 0}),
}


@functools.cache
def optimizer(name: str, n: int):
    extra = ["optimizer.momentum=0.9"] if name == "sgd" else []
    cfg = compose([f"optimizer={name}", *extra])
    return component(cfg, "optimizer").build(cfg.optimizer, [True] * n)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_optimizer_leaves_find_per_element_state_without_special_cases(name):
    params = [torch.zeros(7), torch.zeros(3)]
    opt_state = optimizer(name, 2).init(params)
    per, scalars = optimizer_leaves(opt_state, params)
    assert sorted(per) == OPTIMIZERS[name][0] and scalars == OPTIMIZERS[name][1]
    for ts in per.values():
        assert [t.numel() for t in ts] == [7, 3]
    new = with_scalars(opt_state, params, {k: 5 for k in scalars})
    assert type(new) is type(opt_state) and [type(x) for x in new] == [type(x) for x in opt_state]
    assert optimizer_leaves(new, params)[1] == {k: 5 for k in scalars}
    assert all(a is b for k in per for a, b in zip(optimizer_leaves(new, params)[0][k], per[k]))


# --- state_dict / load_state_dict on plain tensors ----------------------------------------------

def make_state(world: int, chunk: int | None, opt: str = "adamw", seed: int | None = None):
    """Per-rank (TrainState, specs) of one configuration; with ``seed`` the pieces hold the
    reference values (master = values(name), moments = values * 2 and * 3), else random junk."""
    layout, ranges = pieces_of(world, chunk)
    per_rank = []
    for r in range(world):
        lo, hi = layout.partition(r)
        mine = [(a, b) for a, b in ranges if lo <= a < hi]
        specs = [piece_spec(layout, a, b) for a, b in mine]
        params = tuple(torch.randn(b - a) for a, b in mine)
        opt_state = optimizer(opt, len(params)).init(params)
        per, _ = optimizer_leaves(opt_state, params)
        for t in [*params, *(t for ts in per.values() for t in ts)]:
            t.normal_()
        if seed is not None:
            for k, spec in enumerate(specs):
                for span in spec.spans:
                    (p0, p1), (q0, q1) = span.param, span.piece
                    params[k][q0:q1] = values(span.name)[p0:p1]
                    for m, ts in enumerate(per.values()):
                        ts[k][q0:q1] = values(span.name)[p0:p1] * (m + 2)
            opt_state = with_scalars(opt_state, params, {p: 7 for p in optimizer_leaves(opt_state, params)[1]})
        state = TrainState(step=11 if seed is not None else 0, params=params, opt_state=opt_state,
                           precision=PrecisionState(cur_iter=11, skipped_steps=2) if seed is not None else PrecisionState(),
                           rng=(torch.get_rng_state(),), data=9 if seed is not None else 0)
        per_rank.append((state, specs))
    return per_rank


def saved_by(per_rank, policy=FP32):
    return [state_dict(s, specs, policy=policy, rank=r, world=len(per_rank)) for r, (s, specs) in enumerate(per_rank)]


def check_reference(state: TrainState, specs: list[PieceSpec]):
    per, scalars = optimizer_leaves(state.opt_state, state.params)
    for k, spec in enumerate(specs):
        for span in spec.spans:
            (p0, p1), (q0, q1) = span.param, span.piece
            assert torch.equal(state.params[k][q0:q1], values(span.name)[p0:p1])
            for m, ts in enumerate(per.values()):
                assert torch.equal(ts[k][q0:q1], values(span.name)[p0:p1] * (m + 2))
    assert set(scalars.values()) <= {7}
    assert (state.step, state.data, state.precision) == (11, 9, PrecisionState(cur_iter=11, skipped_steps=2))


@pytest.mark.parametrize("opt", ["adamw", "lion"])
@pytest.mark.parametrize("src,dst", [((4, 7), (1, None)), ((1, None), (3, 50)), ((2, 100), (7, 1000)),
                                     ((3, 1), (2, 33))])
def test_round_trip_between_layouts(opt, src, dst):
    saved = saved_by(make_state(*src, opt=opt, seed=0))
    for r, (state, specs) in enumerate(make_state(*dst, opt=opt)):
        before = [t.clone() for t in state.params]
        loaded = load_state_dict(state, specs, saved, policy=FP32, names=SHAPES, rank=r, world=dst[0])
        assert all(a is b for a, b in zip(loaded.params, state.params))  # in place
        check_reference(loaded, specs)
        # padding past the last parameter keeps what it held
        for k, spec in enumerate(specs):
            end = spec.spans[-1].piece[1] if spec.spans else 0
            assert torch.equal(loaded.params[k][end:], before[k][end:])


def test_replicated_saves_load_and_rng_follows_the_rank():
    saved = saved_by(make_state(1, None, seed=0)) * 2   # two ddp ranks: both hold everything
    saved = [{**saved[0], "world": 2}, {**saved[1], "rank": 1, "world": 2, "rng": [torch.zeros(3, dtype=torch.uint8)]}]
    (s0, sp0), (s1, sp1) = make_state(2, 64)
    loaded = load_state_dict(s1, sp1, saved, policy=FP32, names=SHAPES, rank=1, world=2)
    check_reference(loaded, sp1)
    assert torch.equal(loaded.rng[0], torch.zeros(3, dtype=torch.uint8))
    # another world size: no rank to match, each derives its own from (seed, step, rank), as a resume does
    from framework.persist.rng import derive
    (s,  sp), = make_state(1, None)
    got = load_state_dict(s, sp, saved, policy=FP32, names=SHAPES, seed=5).rng[0]
    assert torch.equal(got, derive(5, saved[0]["step"], 0, torch.device("cpu"))[0][0])
    assert not torch.equal(got, saved[0]["rng"][0])


def test_a_new_runs_rank_streams_are_keyed_by_seed_and_rank():
    """The torch seed each rank of a new run starts from (framework.cli.loop): no two (seed, rank) pairs share
    one, where ``seed + rank`` gave rank 1 of seed 1 rank 0's dropout masks of seed 2 (a seed sweep's runs)."""
    from framework.persist.rng import fresh_seed
    seeds = {(seed, rank): fresh_seed(seed, rank) for seed in range(64) for rank in range(8)}
    assert len(set(seeds.values())) == len(seeds)
    assert all(0 <= s < 2 ** 63 for s in seeds.values())
    assert fresh_seed(1337, 0) == fresh_seed(1337, 0)   # fixed per run


def _unchanged_after(fn, state):
    before = [t.clone() for t in state.params]
    fn()
    assert all(torch.equal(a, b) for a, b in zip(before, state.params)), "a failed load wrote into the state"


def test_errors_are_one_line_and_leave_the_state_alone():
    saved = saved_by(make_state(2, None, seed=0))
    (state, specs), = make_state(1, None)
    load = lambda s, names=SHAPES: load_state_dict(state, specs, s, policy=FP32, names=names)  # noqa: E731

    # not every rank of one run, each once (each rank passing [its own], or one rank's twice): the generators and
    # buffers would be some rank's, silently
    how = (r"pass every rank's state dict \(engine.state_dict on each rank\), the same list on every rank \(the dicts "
           r"of all 2 ranks\)$")
    with pytest.raises(FrameworkError, match=r"^load_state_dict: got the state dicts of ranks \[1\] of a 2-rank run "
                                             r"\(1 rank missing \(0\)\): " + how):
        _unchanged_after(lambda: load(saved[1:]), state)
    with pytest.raises(FrameworkError, match=r"ranks \[0, 0\] of a 2-rank run \(1 rank missing \(1\); rank 0 "
                                             r"given more than once\): " + how):
        _unchanged_after(lambda: load([saved[0], saved[0]]), state)
    with pytest.raises(FrameworkError, match=r"ranks \[0, 2\] of a 2-rank run \(rank 2 is not a rank of a 2-rank "
                                             r"run; 1 rank missing \(1\)\): " + how):
        _unchanged_after(lambda: load([saved[0], {**saved[1], "rank": 2}]), state)   # an edited or mixed dict
    one = saved_by(make_state(1, None, seed=0))
    with pytest.raises(FrameworkError, match=r"^load_state_dict: got the state dicts of ranks \[1\] of a 1-rank run "
                                             r"\(rank 1 is not a rank of a 1-rank run; 1 rank missing \(0\)\): pass "
                                             r"every rank's state dict \(engine.state_dict on each rank\), the same "
                                             r"list on every rank$"):
        _unchanged_after(lambda: load([{**one[0], "rank": 1}]), state)
    with pytest.raises(FrameworkError, match=r"^load_state_dict: a state dict with world None is not a state dict of "
                                             r"engine.state_dict: pass"):
        _unchanged_after(lambda: load([{k: v for k, v in sd.items() if k != "world"} for sd in saved]), state)
    with pytest.raises(FrameworkError, match=r"^load_state_dict: the state dicts are of runs of 1, 2 ranks: pass"):
        _unchanged_after(lambda: load([*saved, *saved_by(make_state(1, None, seed=0))]), state)
    gap = [{**sd, "params": {n: {**e, "fragments": e["fragments"][:-1] if n == "e" else e["fragments"]}
                             for n, e in sd["params"].items()}} if sd["rank"] == 1 else sd for sd in saved]
    with pytest.raises(FrameworkError, match=r"parameter 'e' \(300,\): elements \[\d+, 300\) are in no saved "
                                             r"fragment of the 2 saved ranks"):
        _unchanged_after(lambda: load(gap), state)   # rank 1's half is missing
    missing = [{**sd, "params": {n: e for n, e in sd["params"].items() if n != "c"}} for sd in saved]
    with pytest.raises(FrameworkError, match=r"parameter 'c' is not in the saved state"):
        _unchanged_after(lambda: load(missing), state)
    with pytest.raises(FrameworkError, match=r"the saved state has parameters this model does not train: 'c'$"):
        _unchanged_after(lambda: load(saved, names=[n for n in SHAPES if n != "c"]), state)
    reshaped = [{**sd, "params": {**sd["params"], "b": {**sd["params"]["b"], "shape": (13, 1)}}}
                if "b" in sd["params"] else sd for sd in saved]
    with pytest.raises(FrameworkError, match=r"parameter 'b' has shape \(13, 1\) in the saved state but \(13,\)"):
        _unchanged_after(lambda: load(reshaped), state)
    lion = saved_by(make_state(2, None, opt="lion", seed=0))
    with pytest.raises(FrameworkError, match=r"saved optimizer state has \['0.mu'\] but this optimizer's has "
                                             r"\['0.count', '0.mu', '0.nu'\]"):
        _unchanged_after(lambda: load(lion), state)
    def spoiled(name: str, key: str | None, value: float) -> list[dict]:   # a diverged value, as a resume refuses it
        out = copy.deepcopy(saved)
        f = next(sd["params"][name]["fragments"][0] for sd in out if name in sd["params"])
        (f["master"] if key is None else f["optim"][key])[0] = value
        return out
    with pytest.raises(FrameworkError, match=r"non-finite values \(NaN or inf\) in 'b \(master\)' of the saved state"):
        _unchanged_after(lambda: load(spoiled("b", None, float("nan"))), state)
    with pytest.raises(FrameworkError, match=r"non-finite values \(NaN or inf\) in 'e \(0.nu\)' of the saved state"):
        _unchanged_after(lambda: load(spoiled("e", "0.nu", float("inf"))), state)
    # buffers and frozen parameters: an infinity may be by design (an additive mask), a NaN is refused
    mask = torch.full((3, 3), float("-inf")).triu(1)
    whole = {"frozen.mask": torch.zeros(3, 3), "buffer.mask": torch.zeros(3, 3)}
    load_state_dict(state, specs, [{**sd, "whole": {k: mask for k in whole}} for sd in saved], policy=FP32,
                    names=SHAPES, whole=whole)
    assert all(torch.equal(t, mask) for t in whole.values())
    for key in whole:
        nan = [{**sd, "whole": {**{k: mask for k in whole}, key: torch.full((3, 3), float("nan"))}} for sd in saved]
        with pytest.raises(FrameworkError, match=fr"non-finite values \(NaN or inf\) in '{key}' of the saved state"):
            load_state_dict(state, specs, nan, policy=FP32, names=SHAPES, whole=whole)
    with pytest.raises(FrameworkError, match="different steps"):
        load([saved[0], {**saved[1], "step": 3}])
    with pytest.raises(FrameworkError, match="no saved state"):
        load([])
    with pytest.raises(FrameworkError) as e:
        load(saved[1:])
    assert "\n" not in str(e.value)


def test_loss_scale_carries_over_only_between_dynamic_scalers():
    fp16_state = PrecisionState(cur_scale=512.0, cur_iter=11, last_overflow_iter=8, cur_hysteresis=1,
                                skipped_steps=3)
    per_rank = [(replace(s, precision=fp16_state), sp) for s, sp in make_state(1, None, seed=0)]
    saved = saved_by(per_rank, FP16)
    static = Policy("fp16", torch.float16, torch.float16, torch.float32, ScalerConfig(loss_scale=128.0))
    for policy, expected in ((FP16, fp16_state),
                             (FP32, PrecisionState(cur_iter=11, skipped_steps=3)),
                             (static, PrecisionState(cur_scale=128.0, cur_iter=11, cur_hysteresis=2,
                                                     skipped_steps=3))):
        (s, sp), = make_state(2, 64)[:1]
        assert load_state_dict(s, sp, saved, policy=policy, names=SHAPES, world=2).precision == expected, policy.name
    # a minimum raised since the save holds from the first step on (the scale stayed below it, and the next
    # overflows stopped the run "at min_loss_scale" the scale never came down to)
    raised = replace(FP16, scaler=replace(FP16.scaler, min_loss_scale=1024.0))
    (s, sp), = make_state(2, 64)[:1]
    assert load_state_dict(s, sp, saved, policy=raised, names=SHAPES, world=2).precision == replace(
        fp16_state, cur_scale=1024.0)
    # so does a hysteresis lowered since (the saved count of overflows still forgiven is at most the new one);
    # a higher one leaves the saved count, refilled by the next window as in a run started with it
    three = [(replace(s, precision=replace(fp16_state, cur_hysteresis=3)), sp) for s, sp in make_state(1, None, seed=0)]
    for hysteresis, expected in ((2, 2), (1, 1), (3, 3), (5, 3)):
        policy = replace(FP16, scaler=replace(FP16.scaler, hysteresis=hysteresis))
        (s, sp), = make_state(2, 64)[:1]
        got = load_state_dict(s, sp, saved_by(three, FP16), policy=policy, names=SHAPES, world=2).precision
        assert got == replace(fp16_state, cur_hysteresis=expected), hysteresis
    # and from fp32 into fp16: the scaler starts where a new fp16 run would (its first growth a full window on)
    (s, sp), = make_state(1, None)
    got = load_state_dict(s, sp, saved_by(make_state(1, None, seed=0)), policy=FP16, names=SHAPES).precision
    assert got == replace(FP16.init_state(), cur_iter=11, last_overflow_iter=10, skipped_steps=2)


def test_specs_must_describe_the_pieces_one_for_one():
    (state, specs), = make_state(2, 64)[:1]
    with pytest.raises(ValueError, match="piece specs of"):
        state_dict(state, specs[:-1], policy=FP32)
    with pytest.raises(ValueError, match="piece specs of"):
        load_state_dict(state, [PieceSpec(specs[0].numel + 1, specs[0].spans), *specs[1:]], [], policy=FP32,
                        names=SHAPES)
