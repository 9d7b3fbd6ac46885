"""DiskStore on its own: pieces of odd sizes survive many acquire / modify / release cycles bitwise,
with 1 to 3 slots, read-ahead and write-behind on and off, a piece taken back while its writes
drain, clean (read-only) releases that are never written, and parked tensors that hold no memory."""
import threading

import pytest
import torch

from framework.comm.accelerator import for_device
from framework.offload._aio import AsyncIO
from framework.offload._diskstore import DiskStore

SIZES = [1, 1023, 4097, 3000, 17]


def _store(tmp_path, slots, read_ahead, write_behind, learn=False):
    acc = for_device(torch.device("cpu"))
    store = DiskStore(acc, pin=False, buffer_count=slots, read_ahead=read_ahead, write_behind=write_behind,
                      name="test", learn_order=learn)
    tensors = {}
    for k, n in enumerate(SIZES):
        a, b = torch.empty(n), torch.empty(n, dtype=torch.bfloat16)
        a.copy_(torch.arange(n) * (k + 1)), b.copy_(torch.arange(n) % 7)
        tensors[k] = (a, b, torch.empty(n, dtype=torch.bfloat16))
        store.add(k, tensors[k][:2], tensors[k][2:], park=False)
    reference = {k: [t.clone() for t in ts[:2]] for k, ts in tensors.items()}
    store.open(tmp_path / "s.swap", AsyncIO(4096, 2, 1))
    for k in tensors:
        store.create(k)
    store.flush()
    return store, tensors, reference


@pytest.mark.parametrize("slots", [1, 2, 3])
@pytest.mark.parametrize("read_ahead,write_behind", [(False, False), (True, False), (False, True), (True, True)])
def test_round_trips_bitwise(tmp_path, slots, read_ahead, write_behind):
    store, tensors, ref = _store(tmp_path, slots, read_ahead, write_behind)
    for t in tensors[0][:2]:   # parked: zero strides over one element, no buffer held
        assert t.stride() == (0,) and t.untyped_storage().nbytes() == t.element_size()
    worker = threading.Thread   # acquire/wait on a worker, release on this thread, as the pipeline does
    for step in range(3):
        for k in list(tensors) + [0]:   # piece 0 again at once: taken back while its writes may drain
            got = {}

            def work(k=k):
                h = store.acquire(k)
                store.wait(h)
                got["h"] = h
            th = worker(target=work)
            th.start()
            th.join(timeout=30)
            a, b, staging = tensors[k]
            assert torch.equal(a, ref[k][0]) and torch.equal(b, ref[k][1]), (step, k)
            a.add_(1.5), b.add_(1), staging.fill_(3)
            ref[k][0].add_(1.5), ref[k][1].add_(1)
            store.release(got["h"], None)
    for k in tensors:   # read-only use: values come back; a clean release writes nothing
        h = store.acquire(k)
        store.wait(h)
        before = store.bytes_written
        assert torch.equal(tensors[k][0], ref[k][0]) and torch.equal(tensors[k][1], ref[k][1])
        store.release(h, None, dirty=False)
        assert store.bytes_written == before
    store.close()
    assert not (tmp_path / "s.swap").exists()


def test_learned_order_reads_ahead(tmp_path):
    store, tensors, ref = _store(tmp_path, 2, True, True, learn=True)
    order = [3, 1, 4, 0, 2]
    for _ in range(2):
        for k in order:
            h = store.acquire(k)
            store.wait(h)
            assert torch.equal(tensors[k][0], ref[k][0])
            store.release(h, None, dirty=False)
    assert [store.follow[a] for a in order[:-1]] == order[1:]
    store.close()


def test_handle_for_a_released_piece_is_ignored(tmp_path):
    store, _, _ = _store(tmp_path, 1, False, False)
    store.release(2, None)   # never acquired: nothing happens
    store.close()


@pytest.mark.parametrize("checksum", ["sum64", "none"])
def test_mapped_views_read_and_write_the_swap_file(tmp_path, checksum):
    """``mapped``: the swapped values as views of the mapped file, with no slot involved (a checkpoint's
    path). A read-only map sees the values the engine wrote; values written through a writable map
    are what the next acquire reads, its checksums refreshed (a stale clean slot is not reused)."""
    store, tensors, ref = _store(tmp_path, 2, True, True)
    store.io = AsyncIO(4096, 2, 1, checksum=checksum)
    for k in tensors:   # rewrite everything under this checksum kind
        h = store.acquire(k)
        store.wait(h)
        store.release(h, None)
    h = store.acquire(1)   # leaves piece 1 clean in a slot and piece 2 read ahead
    store.wait(h)
    store.release(h, None, dirty=False)
    fmap, views = store.mapped(write=False)
    assert all(s.key is None for s in store.slots)   # settled: the file is the only copy
    for k, (a, b) in views.items():
        assert torch.equal(a, ref[k][0]) and torch.equal(b, ref[k][1]) and a.shape == ref[k][0].shape
        own = fmap.own(a[1:])
        assert own is None or own.untyped_storage().nbytes() == own.numel() * own.element_size()
    del fmap, views
    fmap, views = store.mapped(write=True)
    for k, (a, b) in views.items():
        a.mul_(-2), b.add_(3)
        ref[k][0].mul_(-2), ref[k][1].add_(3)
    store.unmapped(fmap)
    del fmap, views
    for k in tensors:   # the engine reads (and checks) what was written through the map
        h = store.acquire(k)
        store.wait(h)
        assert torch.equal(tensors[k][0], ref[k][0]) and torch.equal(tensors[k][1], ref[k][1]), k
        store.release(h, None, dirty=False)
    store.close()


def test_a_damaged_swap_file_is_never_mapped_for_a_save(tmp_path):
    """A read-only map checks every extent against the engine's checksums: a flipped byte is a
    SwapIOError naming the file and the piece, not a checkpoint of bad values."""
    from framework.core.errors import SwapIOError

    store, tensors, _ = _store(tmp_path, 2, False, False)
    offset = store.file.extent("3.0")[0] + 5
    with open(store.file.path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x10]))
    with pytest.raises(SwapIOError, match=r"s\.swap.*checksum mismatch.*piece 3 tensor 0"):
        store.mapped(write=False)
    store.close()


class _Copy:
    """The event of a copy to the device, still running (``query`` False) until the host waits for it."""

    def __init__(self):
        self.done, self.waited = False, 0

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:   # counts only waits that block (a finished copy's is instant)
        self.waited += not self.done
        self.done = True


def test_slots_still_copied_from_are_polled_not_waited_for(tmp_path):
    """zero3 loads from the parameter pool: a slot whose copy to the device still runs is taken only
    when no other slot is (then the host waits for the oldest), read-ahead never waits for one, and
    loading a resident shard again does not wait for its earlier copy."""
    store, tensors, ref = _store(tmp_path, 3, read_ahead=True, write_behind=True)
    copies = {}
    for k in (0, 1):   # piece 1 is read ahead while 0 is in use; 2 while 1 is
        h = store.acquire(k)
        store.wait(h, host_writes=False)
        copies[k] = _Copy()
        store.release(h, copies[k], dirty=False)
    h = store.acquire(3)   # every candidate slot is still copied from: the oldest one is waited for
    assert copies[0].waited == 1 and copies[1].waited == 0
    assert 4 not in store.where   # the read-ahead skipped the slot whose copy runs instead of waiting
    store.wait(h, host_writes=False)
    again = _Copy()
    store.release(h, again, dirty=False)
    h = store.acquire(3)   # resident (clean): loaded again without waiting for the running copy
    store.wait(h, host_writes=False)
    assert again.waited == 0
    store.release(h, None, dirty=False)
    copies[1].done = True
    h = store.acquire(4)   # the slot whose copy finished is taken: nothing waited for
    store.wait(h)
    assert copies[1].waited == 0 and again.waited == 0
    assert all(torch.equal(t, r) for t, r in zip(tensors[4][:2], ref[4]))
    store.release(h, None, dirty=False)
    store.close()


def test_an_open_that_cannot_make_its_pool_leaves_no_swap_file(tmp_path):
    """The pool is made after the swap file: when host memory for it is refused, the file and its
    manifest go, so a failed start leaves nothing in the user's folder."""
    class NoMemory:
        device = torch.device("cpu")

        def empty_host(self, *args, **kwargs):
            raise MemoryError("host pool refused")

    store = DiskStore(NoMemory(), pin=False, buffer_count=1, read_ahead=False, write_behind=False, name="test")
    store.add(0, [torch.ones(1000)], [], park=False)
    with pytest.raises(MemoryError, match="host pool refused"):
        store.open(tmp_path / "s.swap", AsyncIO(4096, 1, 1))
    assert list(tmp_path.iterdir()) == [] and store.file is None


class _TwoRanks:
    """Two ranks of one host with the same request (this process plays both)."""
    rank, world, device = 0, 2, torch.device("cpu")

    def all_gather_object(self, obj, what):
        return [obj, obj]


def test_the_early_swap_bound_sums_the_ranks_sharing_a_disk(tmp_path):
    """zero3's bound before any swap file is written: each rank's files alone fit (60% of the free
    space), both ranks' do not; the line gives sizes as the later checks do (not "0.00 GiB")."""
    import os

    from framework.core.errors import ConfigError
    from framework.offload.nvme import NVMeOffloadConfig, build, resolve

    spec = resolve(NVMeOffloadConfig(nvme_path=str(tmp_path), sub_group_size=10**6), "zero3", {})
    placement = build(spec, for_device(torch.device("cpu")))
    placement.connect(_TwoRanks())
    st = os.statvfs(tmp_path)
    per_param = 4 + 4 + 2 * 2   # fp32 master + optimizer on nvme, the owned gradient, bf16 shards in and out
    placement.swap_grads(torch.float32, 2)
    groups = int(st.f_bavail * st.f_frsize * 0.6) // per_param // 10**6   # unit groups of 10^6 elements
    with pytest.raises(ConfigError) as e:
        placement.expect([10**6] * groups, torch.bfloat16, torch.float32)
    assert str(e.value).startswith(f"offload.nvme_path={tmp_path}: the swap files of ranks 0, 0, sharing this "
                                   "file system, need at least "), str(e.value)
    assert "GiB (" in str(e.value) and "\n" not in str(e.value)
    placement.expect([10**6] * (groups // 4), torch.bfloat16, torch.float32)   # both fit


class _PeerMade:
    """Rank 1 of two on one host, whose peer (rank 0) found a folder missing and made it: the swap folder they
    share, or ``its_own`` (a sibling of this rank's)."""
    rank, world, device = 1, 2, torch.device("cpu")

    def __init__(self, its_own=None):
        self.its_own = its_own

    def all_gather_object(self, obj, what):
        import dataclasses

        claim, error = obj
        missing = claim.folder if self.its_own is None else str(self.its_own)
        return [(dataclasses.replace(claim, rank=0, missing=missing), None), obj]


def test_every_rank_removes_the_swap_folder_a_peer_made_once_empty(tmp_path):
    """Only the rank that found the folder missing knew this run made it: the ranks agree, so whichever
    closes last (its files gone, the folder empty) removes it; a folder no rank made is kept, the user's
    empty folder for this rank included where the peer made one of its own beside it."""
    from framework.offload.nvme import NVMeOffloadConfig, build, resolve

    folder = tmp_path / "nvme"
    for peer, removed in ((_PeerMade(), True), (_TwoRanks(), False), (_PeerMade(tmp_path / "nvme0"), False)):
        folder.mkdir(exist_ok=True)
        placement = build(resolve(NVMeOffloadConfig(nvme_path=str(folder)), "zero3", {}), for_device(torch.device("cpu")))
        placement.connect(peer)
        placement.expect([1024], torch.bfloat16, torch.float32)
        placement.close()
        assert folder.exists() is not removed, peer
    folder.rmdir()


def test_a_refused_preflight_removes_the_folders_it_made(tmp_path):
    """Pre-flight makes offload.nvme_path, parents too, before it can refuse (here: no room): the refusal
    leaves the tree as it found it; a run that goes on removes them at close, a folder it found kept."""
    from framework.core.errors import ConfigError
    from framework.offload._swapfolder import preflight
    from framework.offload.nvme import NVMeOffloadConfig, build, resolve

    folder = tmp_path / "not" / "yet" / "nvme"

    def write_swap(need):
        placement = build(resolve(NVMeOffloadConfig(nvme_path=str(folder)), "zero2", {}),
                          for_device(torch.device("cpu")))
        placement.connect(_PeerFailed(0))   # (two ranks that found the same folders missing)
        placement.expect([1024], torch.bfloat16, torch.float32)
        store = DiskStore(for_device(torch.device("cpu")), pin=False, buffer_count=1, read_ahead=False,
                          write_behind=False, name="test")
        store.add(0, [torch.ones(1000)], [], park=False)
        try:
            placement.write_swap(store, "optim", lambda: preflight(folder, need, create=True), [(0, None)], "testing")
            assert (folder / "rank00000.optim.swap").exists()
        finally:
            store.close()
            placement.close()

    with pytest.raises(ConfigError, match="free space"):
        write_swap(1 << 60)
    assert list(tmp_path.iterdir()) == []
    write_swap(1)
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "not").mkdir()
    with pytest.raises(ConfigError, match="free space"):
        write_swap(1 << 60)
    assert [p.name for p in tmp_path.iterdir()] == ["not"] and not any((tmp_path / "not").iterdir())


class _PeerFailed(_TwoRanks):
    """Rank 0 of two, whose peer's swap file failed with the flag ``peer`` (the MAX all-reduce of the flags)."""

    def __init__(self, peer):
        self.peer, self.sent = peer, None

    def all_reduce(self, flag, op, what):
        self.sent = flag.item()
        flag.clamp_(min=self.peer)


def test_a_peer_names_the_kind_of_swap_failure(tmp_path):
    """A rank whose swap file is in use (a ConfigError) is not reported by its peers as an IO error."""
    from framework.core.errors import ConfigError, SwapIOError
    from framework.offload.nvme import NVMeOffloadConfig, build, resolve

    placement = build(resolve(NVMeOffloadConfig(nvme_path=str(tmp_path)), "zero2", {}), for_device(torch.device("cpu")))
    what = "writing the parameter shards to their swap file"
    for error, sent in ((ConfigError("swap file x is in use by another run or engine"), 1), (OSError("EIO"), 2)):
        placement.connect(dist := _PeerFailed(0))
        with pytest.raises(type(error)):
            placement.agree_io_error(error, what)
        assert dist.sent == sent
    placement.connect(_PeerFailed(1))
    with pytest.raises(ConfigError) as e:
        placement.agree_io_error(None, what)
    assert str(e.value) == "another rank failed to set up its swap file (its error says why); this rank stops too"
    placement.connect(_PeerFailed(2))
    with pytest.raises(SwapIOError, match=f"another rank failed while {what} \\(its error names the file"):
        placement.agree_io_error(None, what)
    placement.close()


def test_a_run_without_nvme_path_removes_the_private_folders_of_dead_runs(tmp_path, monkeypatch, capsys):
    """Library use without offload.nvme_path: a killed run (SIGTERM, SIGKILL) left its private folder under a
    name no later run uses, so a run's start-up removes such folders that no live process holds, and the swap
    files in them no live process holds, in one line; a live run's folder (its lock) or file (its flock) stays."""
    import fcntl
    import os

    import framework.offload._disk as disk
    from framework.offload.nvme import NVMeOffloadConfig, build, resolve

    monkeypatch.setattr(disk, "temp_root", lambda: str(tmp_path))   # (not wherever the machine's /tmp is)
    for name in ("framework-nvme-dead", "framework-nvme-empty", "framework-nvme-held", "other"):
        (tmp_path / name).mkdir()
    for name in ("framework-nvme-dead", "framework-nvme-held", "other"):
        (tmp_path / name / "rank00000.optim.swap").write_bytes(bytes(8192))
        (tmp_path / name / "rank00000.optim.swap.manifest.json").write_text("{}")
    held = os.open(tmp_path / "framework-nvme-held" / "rank00000.optim.swap", os.O_RDONLY)
    fcntl.flock(held, fcntl.LOCK_EX)   # (a live process's swap file)

    def placement():
        return build(resolve(NVMeOffloadConfig(), "zero2", {}), for_device(torch.device("cpu")))

    live = placement()
    mine = live.folder()   # a live run's private folder, still without files
    capsys.readouterr()
    try:
        late = placement()
        late.clean_stale()
        late.close()
        assert capsys.readouterr().out.startswith(
            f"nvme: removed 1 stale swap file and 2 folders of dead processes from {tmp_path}/framework-nvme-*, "
            "freeing 0.00 GiB (")
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["framework-nvme-held", "other",
                                                                      os.path.basename(mine)])
        assert len(os.listdir(tmp_path / "framework-nvme-held")) == 2 and len(os.listdir(tmp_path / "other")) == 2
    finally:
        os.close(held)
        live.close()
    assert not os.path.exists(mine)


def test_a_private_folder_swept_before_it_is_opened_is_made_again(tmp_path, monkeypatch):
    """Another run's start-up sweep may remove a new private folder between its making and its opening (still
    unlocked): another is made, no traceback."""
    import os
    import tempfile
    import types

    from framework.offload import _swapfolder

    made = []

    def mkdtemp(**kw):
        made.append(tempfile.mkdtemp(**kw))
        if len(made) == 1:
            _swapfolder.sweep_private(str(tmp_path))   # another run's sweep, right after the first is made
        return made[-1]

    monkeypatch.setattr(_swapfolder, "tempfile", types.SimpleNamespace(mkdtemp=mkdtemp))
    path, fd = _swapfolder.make_private(str(tmp_path))
    try:
        assert path == made[1] and not os.path.exists(made[0]) and os.listdir(tmp_path) == [os.path.basename(path)]
    finally:
        os.close(fd)


def test_recover_raises_a_write_still_in_flight_that_failed(tmp_path, monkeypatch):
    """A failed step's (or a load's) ``recover`` frees every slot: a piece whose write-behind failed is then
    stale in the swap file, so the write's error is raised (once), never dropped."""
    import errno

    from framework.core.errors import SwapIOError
    store, tensors, _ = _store(tmp_path, 3, False, True)
    real = AsyncIO._piece

    def piece(self, handle, *a):
        if handle.op == "write" and "piece 2 " in handle.what:
            raise OSError(errno.EIO, "injected EIO")
        return real(self, handle, *a)
    monkeypatch.setattr(AsyncIO, "_piece", piece)
    h = store.acquire(2)
    store.wait(h)
    tensors[2][0].add_(1)
    store.release(h, None)   # write-behind: the slot stays ``writing``, its handle unread
    with pytest.raises(SwapIOError, match="swap write of .test piece 2 tensor 0.* Input/output error"):
        store.recover()
    assert all(slot.state == "free" for slot in store.slots)
    monkeypatch.setattr(AsyncIO, "_piece", real)
    store.recover()   # raised once: the store is settled
    h = store.acquire(2)
    store.wait(h)
    store.release(h, None, dirty=False)
    store.close()
