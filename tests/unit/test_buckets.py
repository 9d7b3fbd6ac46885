"""Bucket plans on partition boundaries: every bucket is one owner's or aligned (one reduce-scatter)."""
import pytest
import torch
from torch import nn

from framework.stages._flat import ALIGN, make_layout
from framework.stages._grads import Arrivals, expected_order, own_parts, plan_buckets, plan_stripes


def _layouts(world):
    shapes = [[(7, 50), (400,), (3,), (90, 20), (1000,)], [(11,), (300,)]]
    return [make_layout([(f"p{i}", nn.Parameter(torch.zeros(s))) for i, s in enumerate(g)], world) for g in shapes]


def _order(layouts):
    entries = [(g, s) for g, lay in enumerate(layouts) for s in lay.slots]
    entries = [entries[i] for i in (0, 5, 1, 2, 6, 3, 4)]  # the groups interleaved, as backward would
    return expected_order(entries)


def _covered(buckets, layouts, order):
    """Each group's elements [0, numel) covered exactly once; each bucket lists exactly the params it touches."""
    for g, lay in enumerate(layouts):
        seen = torch.zeros(lay.padded, dtype=torch.int32)
        for b in buckets:
            if b.group == g:
                for lo, hi in b.ranges:
                    seen[lo:hi] += 1
        assert (seen[:lay.numel] == 1).all() and (seen[lay.numel:] <= 1).all()
    for b in buckets:
        touched = {pid for pid, g, off, n in order if g == b.group
                   and any(off < hi and off + n > lo for lo, hi in b.ranges)}
        assert set(b.params) == touched


def _planned(planner, world: int, size: int):
    """(layouts, buckets) of ``planner`` over the test layouts, checked to cover every element once."""
    layouts = _layouts(world)
    order = _order(layouts)
    buckets = planner(order, size, {g: lay.shard for g, lay in enumerate(layouts)}, world)
    _covered(buckets, layouts, order)
    return layouts, buckets


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("size", [1, 100, 700, 1500, 4000, 10_000])
def test_gradient_order_buckets_stay_in_one_partition(world, size):
    layouts, buckets = _planned(plan_buckets, world, size)
    for b in buckets:
        shard = layouts[b.group].shard
        if b.count == 1:  # one owner: one reduce
            assert b.numel <= size and b.start // shard == (b.end - 1) // shard
        else:             # the whole padded buffer of a group that fits: aligned, one reduce-scatter
            assert b.contiguous and b.count == world and b.start == 0 and b.end == shard and b.numel <= size
    # Buckets close in gradient order: within a group they go down through the buffer.
    for g in range(len(layouts)):
        starts = [b.start for b in buckets if b.group == g]
        assert starts == sorted(starts, reverse=True)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("size", [3, 100, 700, 1500, 10_000])
def test_stripes_are_world_equal_chunks(world, size):
    layouts, buckets = _planned(plan_stripes, world, size)
    for b in buckets:
        shard = layouts[b.group].shard
        assert b.count == world and b.stride == shard and 0 <= b.start < b.end <= shard
        assert b.numel <= max(size, world)
        if b.end - b.start >= ALIGN and b.start > 0:
            assert (b.end - b.start) % ALIGN == 0


def test_own_parts_index_the_bucket_buffer():
    layouts = _layouts(4)
    shards = {g: lay.shard for g, lay in enumerate(layouts)}
    for b in plan_stripes(_order(layouts), 700, shards, 4):
        n = b.end - b.start
        for r in range(4):
            lo, hi = r * shards[b.group], (r + 1) * shards[b.group]
            assert own_parts(b, lo, hi) == [(lo + b.start, lo + b.end, r * n)]


def test_launcher_with_partition_plan_launches_each_bucket_once_in_order():
    layouts = _layouts(2)
    order = _order(layouts)
    buckets = plan_buckets(order, 500, {g: lay.shard for g, lay in enumerate(layouts)}, 2)
    launched = []
    launcher = Arrivals(buckets, launched.append, [str(pid) for pid, *_ in order], "zero1")
    launcher.arm()
    for pid, *_ in order:
        launcher.ready(pid)
    assert launched == list(range(len(buckets)))
