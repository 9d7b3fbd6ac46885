"""The offload target and its piece pipeline, driven without any stage: only the documented
contract (place, grads_final, grads, make_update(tx, gather)) on the checking accelerator. The
pipeline's step equals the plain optimizer step over the same partition, bit for bit."""
import pytest
import torch

from framework import compose
from framework.comm.accelerator import CheckingCpuAccelerator
from framework.engine.build import component
from framework.offload._store import Tier
from framework.offload.base import PIECE_ALIGN
from framework.offload.cpu import HostPlacement
from framework.optimizers import step


def _tx(groups: int):
    cfg = compose(["optimizer=adamw", "optimizer.lr=0.01"])
    return component(cfg, "optimizer").build(cfg.optimizer, [True] * groups)


@pytest.mark.parametrize("speculative", [False, True])
@pytest.mark.parametrize("ratio", [1.0, 0.5])
def test_pipeline_driven_by_events_equals_the_plain_step(speculative, ratio):
    torch.manual_seed(0)
    acc = CheckingCpuAccelerator()
    target = HostPlacement(host_fraction=ratio, pin=True, overlap_step=speculative, accelerator=acc)
    working = [torch.randn(40), torch.randn(24)]        # two owned partitions (device memory)
    reals = [37, 24]                                    # the first ends in 3 elements of padding
    pieces = [target.place(w, torch.float32, chunk=8, real=r) for w, r in zip(working, reals)]
    infos = target.pieces()
    assert [(i.group, i.start, i.end) for i in infos] == \
        [(g, p.start, p.end) for g, ps in enumerate(pieces) for p in ps]   # master order
    assert all(i.tier is (Tier.HOST if i.end <= round(ratio * len(working[i.group])) else Tier.DEVICE)
               for i in infos)
    master = [p.master for ps in pieces for p in ps]
    reference = [m.clone() for m in master]
    tx = _tx(len(master))
    opt_state, ref_state = tx.init(master), tx.init(reference)
    gathered = []
    update = target.make_update(tx, gather=lambda: gathered.append(True))
    for it in range(3):
        grads = [torch.randn(w.numel()) for w in working]
        for g, r in zip(grads, reals):
            g[r:] = 0.0
        update.arm(opt_state, master, lr=0.01, scale=1.0)
        # Backward reports ranges final, out of order and in odd sizes (only the real elements).
        for g, (lo, hi) in [(1, (8, 24)), (0, (20, 37)), (1, (0, 8)), (0, (0, 20))]:
            acc.use(writes=[grads[g][lo:hi]])   # the stage produced them on the compute stream
            target.grads_final(g, lo, hi, grads[g])
        update.drain()
        got = target.grads(grads)
        opt_state = update.apply(got, 1.0, opt_state, master, lr=0.01)
        ref_grads = [grads[i.group][i.start:i.end].clone() for i in infos]
        ref_state = step(tx, ref_grads, ref_state, reference, 0.01)
        for m, r in zip(master, reference):
            assert torch.equal(m, r), f"iteration {it}"
        for info in infos:   # published into the working partition
            assert torch.equal(info.working, info.master)
    assert gathered == [True] * 3
    if ratio == 1.0:
        assert update.early_copies == 3 * len(infos)   # every host piece was copied during "backward"
    if speculative:
        assert update.kept > 0
        # the undo copies are touched by the host only: pageable, not pinned
        assert update.undo and all(not acc._host_entry(t)[1] for ts in update.undo.values() for t in ts)
    update.close()


@pytest.mark.parametrize("n,chunk,tile", [(16_777_216, None, 10_000_000), (13_333_335, 10_000_000, None),
                                           (1000, 300, None), (5000, 4096, 1000), (129, None, 128)])
def test_a_partition_is_cut_into_nearly_equal_pieces(n, chunk, tile):
    # A pool slot holds the longest piece: a 12.6 M-element host part cut 10 M + 2.6 M would leave the
    # slots that only ever receive the short pieces mostly empty. As few pieces as chunk and tile allow,
    # none longer, all of one length within PIECE_ALIGN, then the device's part.
    target = HostPlacement(host_fraction=0.75, pin=False, accelerator=CheckingCpuAccelerator())
    target.tile = tile
    cut = target.ranges(n, chunk)
    k = round(0.75 * n)
    step = min(chunk or k, tile or k)
    assert cut[-1] == (k, n, Tier.DEVICE) and cut[0][0] == 0
    assert all(b == a for (_, b, _), (a, _, _) in zip(cut, cut[1:]))
    lengths = [b - a for a, b, tier in cut[:-1] if tier is Tier.HOST]
    assert len(lengths) == len(cut) - 1 == -(-k // step)
    assert max(lengths) <= step and max(lengths) - min(lengths) <= PIECE_ALIGN, lengths


def test_host_buffers_are_slices_of_one_pinned_arena_per_partition():
    """Pinned host memory is allocated as it is used: one arena per partition (no power-of-two
    rounding of each buffer), measured by the store, and returned when its last buffer goes."""
    import gc
    acc = CheckingCpuAccelerator()
    target = HostPlacement(host_fraction=1.0, pin=True, accelerator=acc)
    for w in (torch.randn(40).bfloat16(), torch.randn(24).bfloat16()):
        target.place(w, torch.float32, chunk=8)
    buffers = [t for i in target.pieces() for t in (i.master, i.grad, i.staging)]
    assert len({t.untyped_storage().data_ptr() for t in buffers}) == 2
    assert all(acc._host_entry(t)[1] for t in buffers)   # pinned, as non_blocking copies need
    need = sum(t.numel() * t.element_size() for t in buffers)
    host = target.stores[Tier.HOST]
    assert need <= host.pinned_bytes() <= need + 64 * len(buffers)   # (each slice 64-byte aligned)
    before = host.pinned_bytes()
    shard = host.allocate(1000, torch.bfloat16)   # a lone buffer: an arena of its own
    assert host.pinned_bytes() == before + 2000
    del shard
    gc.collect()
    assert host.pinned_bytes() == before
