"""Partition math and bucket plans: the arithmetic every sharded stage relies on."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from framework.stages._flat import ALIGN, make_layout, param_groups
from framework.stages._grads import Arrivals, expected_order, own_overlap, plan_buckets


def named(*shapes):
    return [(f"p{i}", nn.Parameter(torch.zeros(s))) for i, s in enumerate(shapes)]


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
def test_layout_partitions_cover_padded_buffer(world):
    layout = make_layout(named((5, 7), (13,), (1,), (3, 3, 3)), world)
    assert layout.numel == 35 + 13 + 1 + 27
    assert layout.padded % (world * ALIGN) == 0 and layout.padded >= layout.numel
    parts = [layout.partition(r) for r in range(world)]
    assert parts[0][0] == 0 and parts[-1][1] == layout.padded
    assert all(a[1] == b[0] for a, b in zip(parts, parts[1:]))
    offsets = [s.offset for s in layout.slots]
    assert offsets == [0, 35, 48, 49]

    def at(*i, start=0, end=layout.padded):
        g = torch.zeros(end - start)
        g[[k - start for k in i]] = float("nan")
        return layout.nonfinite_names(g, start)
    assert at(34, 35) == ["p0", "p1"] and at(76, 77, 78, 79) == []   # 76..: padding
    # exactly the parameters holding the bad elements, not every one between the first and the last
    assert at(49, 0, 0) == ["p0", "p3"] and at() == []
    # a piece from ``start``: its positions count from there, and parameters outside it are not read
    assert at(40, 50, start=36, end=60) == ["p1", "p3"] and at(start=36, end=60) == []


def test_nonfinite_names_never_names_an_empty_parameter_sharing_an_offset():
    layout = make_layout(named((2,), (0,), (3,)), 1)
    g = torch.zeros(layout.padded)
    g[[2, 4]] = float("inf")
    assert layout.nonfinite_names(g) == ["p2"]


_NAN_PEAK = """
import torch
from types import SimpleNamespace
from framework.stages._flat import make_layout
from framework.stages.ddp import DDPStage
def names(layout, g):   # the stage's method on just what it reads
    return DDPStage.nonfinite_names(SimpleNamespace(layouts=[layout]), [g])
def hwm():   # peak RSS since the reset, kB; ru_maxrss would keep the peak of the process that started
    with open("/proc/self/status") as f:   # this one (a big pytest worker), carried through fork and exec
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
torch.set_num_threads(1)   # no worker threads' heaps appearing mid-measurement
n, k = 1 << 20, 20
one = make_layout([("w", torch.empty(n))], 1)
names(one, torch.full((one.padded,), float("nan")))   # first call: kernels' code pages, not counted
layout = make_layout([(f"p{i}", torch.empty(n)) for i in range(k)], 1)
g = torch.full((layout.padded,), float("nan"))
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")   # the peak RSS (VmHWM) starts again from the current RSS
base = hwm()
names = names(layout, g)
assert names == [f"p{i}" for i in range(k)], names
print((hwm() - base) // 1024)
"""


def test_nonfinite_names_of_all_nan_gradients_needs_no_more_than_a_few_parameters_memory():
    # the error path after an overflow: per-element index tensors of 80 MiB of NaN would take ~1 GiB
    out = subprocess.run([sys.executable, "-c", _NAN_PEAK], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.split()[-1]) < 16, out.stdout   # MiB of peak RSS growth; one parameter is 4 MiB


def test_param_groups_split_by_dimension_and_dedupe_tied():
    m = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Linear(4, 3, bias=False))
    m.append(m[0])  # the same module twice: its parameters appear once
    kinds = [(k, [n for n, _ in g]) for k, g in param_groups(m)]
    assert kinds == [("decay", ["0.weight", "2.weight"]), ("no_decay", ["0.bias", "1.weight", "1.bias"])]


@pytest.mark.parametrize("size", [1, 5, 16, 100, 10_000])
def test_buckets_bounded_contiguous_and_complete(size):
    groups = [make_layout(named((7, 5), (40,), (3,), (9, 2)), 2), make_layout(named((11,), (2,)), 2)]
    entries = [(g, s) for g, lay in enumerate(groups) for s in lay.slots]
    # Interleave the two groups as backward would.
    entries = [entries[i] for i in (0, 4, 1, 2, 5, 3)]
    buckets = plan_buckets(expected_order(entries), size)
    for g, lay in enumerate(groups):
        mine = sorted((b.start, b.end) for b in buckets if b.group == g)
        assert mine[0][0] == 0 and mine[-1][1] == lay.numel
        assert all(a[1] == b[0] for a, b in zip(mine, mine[1:]))  # contiguous, disjoint
    assert all(b.numel <= size for b in buckets)


def test_launcher_orders_and_flushes():
    layout = make_layout(named((4,), (4,), (4,)), 1)
    buckets = plan_buckets(expected_order([(0, s) for s in layout.slots]), 4)
    launched = []
    launcher = Arrivals(buckets, launched.append, ["a", "b", "c"], "ddp")
    launcher.ready(0)                      # not armed: ignored
    launcher.arm()
    launcher.ready(0)                      # param 0's bucket is last in order: waits
    assert launched == []
    launcher.ready(2)
    assert launched == [0]
    launcher.flush()                       # param 1 never got a gradient
    assert launched == [0, 1, 2]


def test_own_overlap():
    assert own_overlap(0, 10, 5, 20) == (5, 10)
    assert own_overlap(0, 5, 5, 20) is None


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
def test_a_gather_unit_that_matches_no_module_is_an_error():
    """stage.gather_unit names module classes; one the model does not have is refused, naming the closest
    class it has. The default ([Block], our GPT's layer) does nothing on a model without one."""
    from framework.core.errors import ConfigError
    from framework.models.gpt import GPT, preset
    from framework.stages import plan_units

    with torch.device("meta"):
        gpt = GPT(preset("gpt-nano"))
    with pytest.raises(ConfigError, match=r"^stage.gather_unit: 'Blok' matches no module of the model "
                                          r"\(did you mean 'Block'\?\)"):
        plan_units(gpt, ["Block", "Blok"], True, 0)
    assert len(plan_units(gpt, ["Block"], True, 0)[0]) > preset("gpt-nano").n_layer
    seq = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    assert [u.name for u in plan_units(seq, ["Block"], True, 0)[0]] == ["<root>", "0", "1"]   # the default
    assert [u.name for u in plan_units(seq, ["Linear"], True, 0)[0]] == ["<root>", "0", "1"]
    with pytest.raises(ConfigError, match="'Block' matches no module"):
        plan_units(seq, ["Linear", "Block"], True, 0)
    # A name that matches only modules that would gather nothing is refused too, saying why.
    for name, why in (("GPT", "GPT is the root module, always a unit: .* stage.split_root=false"),
                      ("ModuleList", "ModuleList has no forward of its own"),
                      ("Dropout", "Dropout holds no trainable parameters")):
        with pytest.raises(ConfigError, match=f"^stage.gather_unit: {why}"):
            plan_units(gpt, [name], True, 0)
    att = nn.Sequential(nn.MultiheadAttention(4, 2))
    with pytest.raises(ConfigError, match="NonDynamicallyQuantizableLinear is read by its parent's own forward, "
                                          "so it is gathered with MultiheadAttention: name that class"):
        plan_units(att, ["NonDynamicallyQuantizableLinear"], True, 0)
    # A torch.jit.script'ed module is there but takes no hooks: named by the class it was scripted from (or as
    # ScriptModule's class) it is refused saying so, not as a typo (nor in an AttributeError).
    class Enc(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x)

    class Calls(nn.Module):
        def __init__(self):
            super().__init__()
            self.enc = torch.jit.script(Enc())

        def forward(self, x):
            return self.enc(x)

    for root, gathered in ((nn.Sequential(nn.Linear(4, 4), torch.jit.script(Enc())), "the root module's unit"),
                           (nn.Sequential(Calls()), r"the unit of the module that calls it \(Calls: name that class")):
        for name in ("Enc", "RecursiveScriptModule"):
            with pytest.raises(ConfigError, match=f"^stage.gather_unit: Enc is torch.jit.script'ed: a ScriptModule "
                                                  f"takes no Python hooks, so it cannot be a unit and zero3 gathers it "
                                                  f"with {gathered}"):
                plan_units(root, [name], True, 0)
    # Scripted as part of its scripted parent, it can only be passed unscripted with that parent; a near miss of
    # a scripted class's name is hinted at (it leads to the refusal above), not at an unrelated plain class.
    with pytest.raises(ConfigError, match=r"^stage.gather_unit: Enc is inside Calls, which is torch.jit.script'ed: "
                                          r".*; or pass Calls unscripted$"):
        plan_units(nn.Sequential(torch.jit.script(Calls()), nn.Linear(4, 4)), ["Enc"], True, 0)
    with pytest.raises(ConfigError, match=r"matches no module of the model \(did you mean 'Enc'\?\)$"):
        plan_units(nn.Sequential(nn.Linear(4, 4), torch.jit.script(Enc())), ["En"], True, 0)


def test_parameters_read_by_a_parent_module_are_in_its_unit():
    """A ParameterList/ParameterDict is never called (whoever holds it reads it), and MultiheadAttention
    reads out_proj.weight itself: their parameters are gathered with the module whose forward reads them."""
    from framework.stages import plan_units

    class Scale(nn.Module):   # no parameters of its own, but its forward reads its ParameterDict
        def forward(self, x):
            return x * self.pd["g"]

    m = nn.Module()
    m.att = nn.MultiheadAttention(4, 2)
    m.ps = nn.ParameterList([nn.Parameter(torch.ones(2))])
    m.h = Scale()
    m.h.pd = nn.ParameterDict({"g": nn.Parameter(torch.ones(2))})
    m.layers = nn.ModuleList([nn.Linear(2, 2)])   # a container's children are still units of their own
    units, _ = plan_units(m, ["Block"], True, 0)
    assert {u.name: [n for n, _ in u.named] for u in units} == {
        "<root>": ["ps.0"], "h": ["h.pd.g"], "layers.0": ["layers.0.weight", "layers.0.bias"],
        "att": ["att.in_proj_weight", "att.in_proj_bias", "att.out_proj.weight", "att.out_proj.bias"]}
