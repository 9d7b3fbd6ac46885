"""The NVMe offload's IO engine (framework.offload._aio) and swap files (framework.offload._swapfile).

Faults are injected through the engine's system-call seam (``Syscalls``), never by patching."""
import contextlib
import errno
import fcntl
import json
import mmap
import os
import shutil
import stat
import threading
import warnings
import weakref

import pytest
import torch

from framework.comm.accelerator import for_device
from framework.core.errors import ConfigError, SwapIOError
from framework.offload._aio import AsyncIO, aligned_empty
from framework.offload._swapfile import (ALIGN, DirectIOFallback, SwapFile, Syscalls, padded, remove_stale,
                                        reserved_bytes, swap_path)
from framework.offload._swapfolder import preflight

ACC = for_device(torch.device("cpu"), "check")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ODD = [1, 3, 1021, 4099, 40_001]     # element counts: tails that are not multiples of 512 or 4096
BLOCK = 16 * 1024                    # small blocks: every larger tensor is cut into several pieces


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


def _random(numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(numel, generator=g).to(dtype)


def _accepts_direct(folder) -> bool:
    probe = os.path.join(folder, ".direct-probe")
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError:
        return False
    try:
        import mmap
        buf = mmap.mmap(-1, ALIGN)
        os.pwritev(fd, [buf], 0)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        os.unlink(probe)


def _swap(folder, sizes: dict, dtype, syscalls=None, name="rank00000.optim.swap", layout="layout-a"):
    itemsize = torch.empty((), dtype=dtype).element_size()
    return SwapFile.create(os.path.join(folder, name), {k: n * itemsize for k, n in sizes.items()},
                           layout_hash=layout, world_size=1, rank=0, dtype=dtype, syscalls=syscalls)


def _round_trip(folder, dtype, *, direct=True, aligned=True, syscalls=None):
    sizes = {f"t{i}": n for i, n in enumerate(ODD)}
    src = {k: _random(n, dtype, i) for i, (k, n) in enumerate(sizes.items())}
    with _swap(folder, sizes, dtype, syscalls) as f, AsyncIO(BLOCK, 4, 1, direct) as io:
        bufs = {}
        for k, t in src.items():
            bufs[k] = aligned_empty(t.numel(), dtype, pin=True, acc=ACC) if aligned else torch.empty_like(t)
            bufs[k].copy_(t)
        for h in [io.pwrite(f, f.extent(k)[0], bufs[k], k) for k in sizes]:
            h.wait()
        back = {k: (aligned_empty(t.numel(), dtype, pin=True, acc=ACC) if aligned else torch.empty_like(t))
                for k, t in src.items()}
        for b in back.values():
            b.fill_(7)
        handles = [io.pread(f, f.extent(k)[0], back[k], k) for k in sizes]
        for h in handles:
            h.wait()
            assert h.done() and h.exception() is None
        for k in sizes:
            assert torch.equal(_bits(back[k]), _bits(src[k])), k
        assert all(f.checksums(k) for k in sizes)   # every extent's pieces were checksummed
        return f


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "torch-buffers"])
def test_round_trip_bitwise_on_odd_sizes(tmp_path, dtype, aligned):
    _round_trip(tmp_path, dtype, aligned=aligned)


def test_round_trip_buffered(tmp_path):
    _round_trip(tmp_path, torch.bfloat16, direct=False)


def test_aligned_empty_is_page_aligned_and_a_host_buffer():
    for dtype in DTYPES:
        for n in (0, 1, 4099):
            t = aligned_empty(n, dtype, pin=True, acc=ACC)
            assert t.numel() == n and t.dtype == dtype and t.is_contiguous()
            assert n == 0 or t.data_ptr() % ALIGN == 0
            ACC.on_host(t, what="aligned buffer")   # the checking accelerator knows it as host memory
    big = aligned_empty(3 << 20, torch.bfloat16, pin=True, acc=ACC)   # huge-page candidates: 2 MiB aligned
    assert big.data_ptr() % (2 << 20) == 0 and big.numel() == 3 << 20
    ACC.on_host(big, what="aligned buffer")


def test_direct_io_on_a_real_disk(tmp_path):
    if not _accepts_direct(tmp_path):
        pytest.skip(f"{tmp_path} refuses O_DIRECT")
    with warnings.catch_warnings():
        warnings.simplefilter("error", DirectIOFallback)
        f = _round_trip(tmp_path, torch.float32)
    # the descriptor the engine used was an O_DIRECT one (checked while the file is open)
    with _swap(tmp_path, {"x": 1024}, torch.float32) as f:
        fd, refused = f.descriptor(True)
        assert refused is None and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT


def test_unaligned_sub_ranges_keep_their_neighbours(tmp_path):
    """Writes that start and end inside 4 KiB blocks (read-modify-write through the bounce buffer)."""
    n = 10_000
    full = _random(n, torch.float32, 1)
    with _swap(tmp_path, {"x": n}, torch.float32) as f, AsyncIO(BLOCK, 2, 1) as io:
        off = f.extent("x")[0]
        io.pwrite(f, off, full, "x").wait()
        patch = _random(3001, torch.float32, 2)
        io.pwrite(f, off + 4 * 777, patch, "x[777:3778]").wait()
        expect = full.clone()
        expect[777:3778] = patch
        back = torch.empty(n)
        io.pread(f, off, back, "x").wait()
        assert torch.equal(back, expect)
        part = torch.empty(5)
        io.pread(f, off + 4 * 3775, part, "x[3775:3780]").wait()
        assert torch.equal(part, expect[3775:3780])
        # memory aligned like the file offset: partial head and tail blocks bounced, the body direct
        mirror = aligned_empty(n, torch.float32, pin=False, acc=ACC)
        mirror.copy_(_random(n, torch.float32, 3))
        io.pwrite(f, off + 4 * 1500, mirror[1500:9100], "x[1500:9100]").wait()
        expect[1500:9100] = mirror[1500:9100]
        mirror.zero_()
        io.pread(f, off + 4 * 1500, mirror[1500:9100], "x[1500:9100]").wait()
        io.pread(f, off, back, "x").wait()
        assert torch.equal(back, expect) and torch.equal(mirror[1500:9100], expect[1500:9100])


class _RefuseDirect(Syscalls):
    """A file system that refuses O_DIRECT: at open (tmpfs before Linux 6.6) or at the first IO (overlay)."""

    def __init__(self, at: str):
        self.at, self.direct_fds = at, set()

    def open(self, path, flags, mode=0o600):
        if flags & os.O_DIRECT and self.at == "open":
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), path)
        fd = super().open(path, flags, mode)
        if flags & os.O_DIRECT:
            self.direct_fds.add(fd)
        return fd

    def preadv(self, fd, buffers, offset):
        if fd in self.direct_fds:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return super().preadv(fd, buffers, offset)

    def pwritev(self, fd, buffers, offset):
        if fd in self.direct_fds:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return super().pwritev(fd, buffers, offset)


@pytest.mark.parametrize("at", ["open", "io"])
def test_einval_falls_back_to_buffered_io_with_one_warning(tmp_path, at):
    with pytest.warns(DirectIOFallback) as caught:
        _round_trip(tmp_path, torch.float16, syscalls=_RefuseDirect(at))
    assert len(caught) == 1, [str(w.message) for w in caught]
    assert "O_DIRECT" in str(caught[0].message) and str(tmp_path) in str(caught[0].message)


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm")
def test_dev_shm_round_trip_warns_at_most_once():
    """tmpfs refused O_DIRECT before Linux 6.6 (one warning, buffered IO); newer kernels accept it."""
    folder = f"/dev/shm/framework-test-aio-{os.getpid()}"
    os.makedirs(folder)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _round_trip(folder, torch.float32)
        fallbacks = [w for w in caught if issubclass(w.category, DirectIOFallback)]
        assert len(fallbacks) == (0 if _accepts_direct(folder) else 1)
    finally:
        shutil.rmtree(folder)


class _Faulty(Syscalls):
    """Fails the ``nth`` call of ``op`` (preadv / pwritev / fallocate) with ``how``."""

    def __init__(self, op: str, how: str, nth: int = 1):
        self.op, self.how, self.nth, self.calls = op, how, nth, 0

    def code(self) -> int:
        return {"eio": errno.EIO, "enospc": errno.ENOSPC, "efbig": errno.EFBIG}[self.how]

    def _maybe(self, op, fd, buffers, offset, real):
        if op == self.op:
            self.calls += 1
            if self.calls == self.nth:
                if self.how == "short":
                    n = len(memoryview(buffers[0]).cast("B"))
                    return real(fd, [memoryview(buffers[0]).cast("B")[: n - 512]], offset)
                raise OSError(self.code(), "injected")
        return real(fd, buffers, offset)

    def preadv(self, fd, buffers, offset):
        return self._maybe("preadv", fd, buffers, offset, super().preadv)

    def pwritev(self, fd, buffers, offset):
        return self._maybe("pwritev", fd, buffers, offset, super().pwritev)

    def fallocate(self, fd, offset, length):
        if self.op == "fallocate":
            raise OSError(self.code(), os.strerror(self.code()))
        super().fallocate(fd, offset, length)


@pytest.mark.parametrize("op,how,words", [
    ("pwritev", "enospc", "No space left on device"),
    ("pwritev", "short", "short write"),
    ("preadv", "eio", "Input/output error"),
    ("preadv", "short", "short read"),
])
def test_io_faults_are_swap_io_errors_naming_file_offset_tensor(tmp_path, op, how, words):
    n = 3 * BLOCK // 4 + 5                            # four pieces, the last with a tail
    src = aligned_empty(n, torch.float32, pin=False, acc=ACC)
    src.copy_(_random(n, torch.float32, 3))
    faulty = _Faulty(op, how, nth=2)                  # the second piece fails
    with _swap(tmp_path, {"pad": 3, "master.7": n}, torch.float32, faulty) as f, AsyncIO(BLOCK, 1, 1) as io:
        off = f.extent("master.7")[0]
        write = io.pwrite(f, off, src, "master.7")
        if op == "preadv":
            write.wait()
            faulty.calls = 0                          # (the write read its partial last block back)
            h = io.pread(f, off, torch.empty(n), "master.7")
        else:
            h = write
        with pytest.raises(SwapIOError, match=words) as info:
            h.wait()
        e = info.value
        second = (off // BLOCK + 1) * BLOCK           # pieces are cut at the file's block boundaries
        assert e.path == str(f.path) and e.what == "master.7" and e.offset == second
        assert str(f.path) in str(e) and f"offset {second}" in str(e) and "'master.7'" in str(e)
        assert "\n" not in str(e)
        assert h.exception() is e and h.done()
        # the engine keeps working after a failed request
        io.pwrite(f, off, src, "master.7").wait()
        back = torch.empty(n)
        io.pread(f, off, back, "master.7").wait()
        assert torch.equal(back, src)


@pytest.mark.parametrize("how,says", [
    ("enospc", r"No space left on device; free space or point offload\.nvme_path at a larger disk$"),
    # a file size limit: more room would not help
    ("efbig", r"File too large; a file size limit stops it: raise it \(ulimit -f\) or point offload\.nvme_path at "
              r"a file system that takes larger files$"),
])
def test_no_room_at_creation_is_a_swap_io_error_and_leaves_nothing(tmp_path, how, says):
    with pytest.raises(SwapIOError, match="cannot reserve .*: " + says) as info:
        _swap(tmp_path, {"a": 1000}, torch.float32, _Faulty("fallocate", how))
    assert info.value.offset == 0 and str(tmp_path) in info.value.path
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("checksum", ["sum64", "crc32"])
def test_corrupted_extent_is_detected_on_read(tmp_path, checksum):
    n = 5000
    src = _random(n, torch.bfloat16, 4)
    with _swap(tmp_path, {"a": 100, "exp_avg.2": n}, torch.bfloat16) as f, \
            AsyncIO(BLOCK, 2, 1, checksum=checksum) as io:
        off = f.extent("exp_avg.2")[0]
        io.pwrite(f, off, src, "exp_avg.2").wait()
        back = torch.empty(n, dtype=torch.bfloat16)
        io.pread(f, off, back, "exp_avg.2").wait()   # intact: reads fine
        with open(f.path, "r+b") as raw:               # one flipped bit behind the engine's back
            raw.seek(off + 4321)
            byte = raw.read(1)[0]
            raw.seek(off + 4321)
            raw.write(bytes([byte ^ 0x10]))
        with pytest.raises(SwapIOError, match="checksum mismatch") as info:
            io.pread(f, off, back, "exp_avg.2").wait()
        assert info.value.what == "exp_avg.2" and info.value.offset == off and str(f.path) in str(info.value)


def test_files_are_owner_only_and_removed_on_close_and_on_error(tmp_path):
    with _swap(tmp_path, {"a": 10}, torch.float32) as f:
        manifest = f.path.with_name(f.path.name + ".manifest.json")
        for p in (f.path, manifest):
            assert stat.S_IMODE(os.stat(p).st_mode) == 0o600
        assert os.path.getsize(f.path) == padded(40) == ALIGN
        assert os.stat(f.path).st_blocks * 512 >= ALIGN   # preallocated, not sparse
    assert os.listdir(tmp_path) == []
    with pytest.raises(RuntimeError, match="boom"):
        with _swap(tmp_path, {"a": 10}, torch.float32):
            raise RuntimeError("boom")
    assert os.listdir(tmp_path) == []


def test_layout_extents_are_4k_aligned_and_manifest_describes_them(tmp_path):
    with _swap(tmp_path, {"a": 3, "b": 1025, "c": 0, "d": 7}, torch.float16) as f:
        offs = [f.extent(k)[0] for k in "abcd"]
        assert offs == [0, ALIGN, 2 * ALIGN, 2 * ALIGN] and f.size == 3 * ALIGN
        assert reserved_bytes({"a": 6, "b": 2050, "c": 0, "d": 14}) == f.size == os.path.getsize(f.path)
        f.write_manifest()
        meta = json.loads(f.path.with_name(f.path.name + ".manifest.json").read_text())
        assert meta["layout_hash"] == "layout-a" and meta["world_size"] == 1 and meta["dtype"] == "float16"
        assert meta["extents"]["b"] == {"offset": ALIGN, "nbytes": 2050, "numel": 1025}


def test_swap_file_from_another_layout_is_refused(tmp_path):
    left = tmp_path / "left"
    left.mkdir()
    with _swap(tmp_path, {"a": 10}, torch.float32) as f:
        with pytest.raises(ConfigError, match=r"in use by another run or engine \(in this process or another\)"):
            _swap(tmp_path, {"a": 10}, torch.float32)              # same folder, live run
        shutil.copy(f.path, left / f.path.name)                   # what a crashed run leaves behind
        shutil.copy(f.path.with_name(f.path.name + ".manifest.json"), left)
    for kwargs, why in [({"layout": "layout-b"}, "layout_hash"), ({"dtype": torch.float16}, "dtype|size")]:
        dtype = kwargs.pop("dtype", torch.float32)
        with pytest.raises(ConfigError, match=f"belongs to another layout .*({why})") as info:
            _swap(left, {"a": 10}, dtype, **kwargs)
        assert "\n" not in str(info.value) and "nvme_path" in str(info.value)
    with pytest.raises(ConfigError, match="extents differ"):
        _swap(left, {"b": 10}, torch.float32)
    assert sorted(os.listdir(left)) == ["rank00000.optim.swap", "rank00000.optim.swap.manifest.json"]
    _swap(left, {"a": 10}, torch.float32).remove()                # the same layout is taken over
    (left / "orphan.swap").write_bytes(b"x" * 10)
    with pytest.raises(ConfigError, match="without a manifest"):
        _swap(left, {"a": 10}, torch.float32, name="orphan.swap")


def test_preflight_one_line_errors(tmp_path):
    preflight(tmp_path, 1 << 20)   # fine
    cases = [
        (dict(path=tmp_path / "missing"), "does not exist"),
        (dict(total_bytes=1 << 60), "need 1073741824.00 GiB .* free"),
    ]
    if os.geteuid() != 0:
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        cases.append((dict(path=locked), "is not writable"))
    elif os.path.isdir("/proc/self"):
        cases.append((dict(path="/proc/self"), "is not writable"))   # root may write anywhere else
    for change, words in cases:
        args = dict(path=tmp_path, total_bytes=1 << 20)
        args.update(change)
        with pytest.raises(ConfigError, match=words) as info:
            preflight(**args)
        assert "\n" not in str(info.value)
    made = tmp_path / "run" / "nvme"
    preflight(made, 1, create=True)
    assert made.is_dir() and stat.S_IMODE(os.stat(made).st_mode) == 0o700


def test_preflight_of_one_folder_by_several_ranks_at_once(tmp_path):
    """The ranks of one host share the default swap folder and make it at the same moment: none
    fails because another made it first (seen in bench.nvme_e2e: "cannot create it (File exists)")."""
    import threading

    for i in range(30):
        folder, errors = tmp_path / f"run{i}" / "nvme", []
        start = threading.Barrier(4)

        def rank():
            start.wait()
            try:
                preflight(folder, 1, create=True)
            except ConfigError as e:
                errors.append(str(e))
        threads = [threading.Thread(target=rank) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        assert not errors and folder.is_dir(), errors


def test_swap_path_names_rank_and_kind(tmp_path):
    assert swap_path(tmp_path, 3, "params").name == "rank00003.params.swap"


def test_requests_are_checked(tmp_path):
    with _swap(tmp_path, {"a": 10}, torch.float32) as f, AsyncIO(BLOCK, 1, 1) as io:
        with pytest.raises(ValueError, match="outside"):
            io.pwrite(f, f.size - 8, torch.zeros(10), "a")
        with pytest.raises(ValueError, match="contiguous"):
            io.pwrite(f, 0, torch.zeros(4, 4).t(), "a")
        h = io.pread(f, 0, torch.empty(0), "empty")
        assert h.done()
        h.wait()
    with pytest.raises(ValueError, match="block_size"):
        AsyncIO(1000, 1, 1)


def _aio_threads() -> list:
    return [t for t in threading.enumerate() if t.name.startswith("framework-aio-")]


def test_bounce_buffers_that_cannot_be_had_are_one_config_error_naming_block_size():
    """Allocated on the caller's thread: ENOMEM (a huge aio.block_size) is one line, no thread left behind."""
    made = []

    def bounce(nbytes):
        if len(made) == 2:
            raise OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))
        made.append(mmap.mmap(-1, nbytes))
        return made[-1]
    before = len(_aio_threads())
    with pytest.raises(ConfigError, match=r"offload\.aio\.block_size=16384: .*Cannot allocate memory") as info:
        AsyncIO(BLOCK, 4, 1, bounce=bounce)
    assert "\n" not in str(info.value)
    assert all(m.closed for m in made) and len(_aio_threads()) == before


@pytest.mark.timeout(60)
def test_io_threads_that_cannot_start_are_one_config_error():
    before = len(_aio_threads())
    old = threading.stack_size(1 << 40)   # no room for a thread's stack: "can't start new thread"
    try:
        with pytest.raises(ConfigError, match=r"offload\.aio\.queue_depth=4 x offload\.aio\.intra_op_parallelism=2: "
                                              "cannot start 8 IO threads"):
            AsyncIO(BLOCK, 4, 2)
    finally:
        threading.stack_size(old)
    assert len(_aio_threads()) == before


@pytest.mark.timeout(60)
def test_an_engine_collected_unclosed_stops_its_threads(tmp_path):
    """The threads hold their engine only while moving a piece: one dropped without close() ends them."""
    before = _aio_threads()   # (may hold an earlier test's dropped engine's threads, still ending)
    n = 3 * BLOCK
    with _swap(tmp_path, {"a": n}, torch.float32) as f:
        io = AsyncIO(BLOCK, 2, 2)
        io.pwrite(f, 0, torch.ones(n), "a").wait()
        ours, gone = [t for t in _aio_threads() if t not in before], weakref.ref(io)
        del io
        assert gone() is None   # (no cycle: freed at once)
        for t in ours:   # (they end a moment after the engine goes: judge only this test's own)
            t.join(30)
        assert len(ours) == 4 and not [t for t in ours if t.is_alive()]


class _Fatal(BaseException):
    """Escapes the engine's per-request error handling: its thread dies."""


class _Killing(Syscalls):
    def pwritev(self, fd, buffers, offset):
        raise _Fatal("injected")


@pytest.mark.timeout(60)
def test_a_dead_io_thread_fails_every_queued_and_later_request(tmp_path):
    """Never a silent dead pool: waits end with the thread's error instead of hanging."""
    n = 3 * BLOCK
    with _swap(tmp_path, {"a": n, "b": n}, torch.float32, _Killing()) as f, AsyncIO(BLOCK, 1, 1) as io:
        handles = [io.pwrite(f, f.extent(k)[0], torch.zeros(n), k) for k in ("a", "b")]
        for h in handles:
            with pytest.raises(SwapIOError, match="framework-aio-0 stopped .*_Fatal: injected"):
                h.wait()
        io._threads[0].join(30)   # (it fails the queued requests before it ends)
        assert not io._alive()
        with pytest.raises(SwapIOError, match="stopped"):
            io.pread(f, 0, torch.empty(n), "a").wait()


def test_checksums_off_and_pieces_rewritten_by_another_engine(tmp_path):
    n = 9000
    a, b = _random(n, torch.float32, 5), _random(n, torch.float32, 6)
    back = torch.empty(n)
    with _swap(tmp_path, {"x": n}, torch.float32) as f, AsyncIO(BLOCK, 2, 1) as io, \
            AsyncIO(4 * BLOCK, 2, 1, checksum="crc32") as other, AsyncIO(BLOCK, 1, 1, checksum="none") as plain:
        off = f.extent("x")[0]
        io.pwrite(f, off, a, "x").wait()
        other.pwrite(f, off, b, "x").wait()     # the first engine's checksums are now stale: dropped
        io.pread(f, off, back, "x").wait()
        assert torch.equal(back, b) and {p[3] for p in f.checksums("x")} == {"crc32"}
        other.pread(f, off, back, "x").wait()
        plain.pwrite(f, off, a, "x").wait()     # no checksum kept, none compared
        assert f.checksums("x") == []
        plain.pread(f, off, back, "x").wait()
        assert torch.equal(back, a)
    with pytest.raises(ValueError, match="checksum"):
        AsyncIO(BLOCK, 1, 1, checksum="md5")


def test_mapped_buffers_of_the_cuda_path_without_pinning(tmp_path):
    """The mmap buffers aligned_empty makes on CUDA (pinning needs a GPU and is not exercised here)."""
    class _Cuda:
        device = torch.device("cuda", 0)

    assert aligned_empty(1 << 21, torch.float32, pin=False, acc=_Cuda()).data_ptr() % (2 << 20) == 0
    # The 2 MiB alignment costs address space only: the storage (what is held, and pinned with pin=True)
    # is the buffer's own bytes, as the engine's memory report and the estimate count them.
    for n in (3 << 20, 12 << 20):
        pool = aligned_empty(n, torch.uint8, pin=False, acc=_Cuda())
        assert pool.data_ptr() % (2 << 20) == 0 and pool.untyped_storage().nbytes() == n
    t = aligned_empty(3001, torch.bfloat16, pin=False, acc=_Cuda())
    assert t.data_ptr() % ALIGN == 0 and t.numel() == 3001 and t.dtype == torch.bfloat16
    t.copy_(_random(3001, torch.bfloat16, 7))
    back = aligned_empty(3001, torch.bfloat16, pin=False, acc=_Cuda())
    with _swap(tmp_path, {"x": 3001}, torch.bfloat16) as f, AsyncIO(BLOCK, 2, 1) as io:
        io.pwrite(f, 0, t, "x").wait()
        io.pread(f, 0, back, "x").wait()
    assert torch.equal(_bits(back), _bits(t))


def _mapped_at(address: int) -> bool:
    with open("/proc/self/maps") as maps:
        for line in maps:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= address < hi:
                return True
    return False


def test_pinned_mapping_is_unregistered_before_it_is_unmapped():
    """cudaHostRegister'd buffers (a stand-in for cudart records the calls): unregistered once, when
    the last view of the memory goes, while the memory is still mapped."""
    from framework.offload._aio import _mapped

    calls = []

    class _Cudart:
        class cudaError:
            success = 0

        def cudaHostRegister(self, ptr, size, flags):
            calls.append(("register", ptr, size))
            return 0

        def cudaHostUnregister(self, ptr):
            calls.append(("unregister", ptr, _mapped_at(ptr)))
            return 0

    t = _mapped(10_000, True, _Cudart())
    ptr = t.data_ptr()
    assert ptr % ALIGN == 0 and calls == [("register", ptr, 12288)]
    view = t[4096:].view(torch.int32)
    view.fill_(3)
    del t
    assert len(calls) == 1 and int(view[0]) == 3        # a view keeps the memory registered
    del view   # freed by reference counting: no collection needed
    assert calls[1:] == [("unregister", ptr, True)]     # still mapped when unregistered
    # A 2 MiB-aligned one: only its own bytes are registered (page-locked), not the alignment's.
    big = _mapped(3 << 20, True, _Cudart(), align=2 << 20)
    assert big.data_ptr() % (2 << 20) == 0 and calls[2:] == [("register", big.data_ptr(), 3 << 20)]


@pytest.fixture
def small_fs(tmp_path):
    """A 1 MiB tmpfs, where this process may mount one (root with CAP_SYS_ADMIN); skipped elsewhere."""
    import subprocess
    folder = tmp_path / "small"
    folder.mkdir()
    if os.geteuid() != 0 or not shutil.which("mount"):
        pytest.skip("mounting a size-limited file system needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=0700", "tmpfs", str(folder)],
                          capture_output=True)
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=True)


def test_a_full_file_system_fails_at_preflight_and_creation(small_fs):
    with pytest.raises(ConfigError, match=r"need 2.00 MiB \(2097152 bytes\) but its file system has 1.00 MiB"):
        preflight(small_fs, 2 << 20)
    with pytest.raises(SwapIOError, match="cannot reserve 2097152 bytes .*No space left on device"):
        _swap(small_fs, {"a": 1 << 19}, torch.float32)
    assert os.listdir(small_fs) == []
    _round_trip(small_fs, torch.float16)   # what fits works (O_DIRECT or the one-warning fallback)


def test_many_requests_in_flight_on_two_files(tmp_path):
    """Writes to every extent of two files in flight at once, then reads in another order."""
    g = torch.Generator().manual_seed(8)
    sizes = {f"e{i}": int(n) for i, n in enumerate(torch.randint(1, 30_000, (24,), generator=g))}
    src = {k: _random(n, torch.float32, i) for i, (k, n) in enumerate(sizes.items())}
    with _swap(tmp_path, sizes, torch.float32, name="a.swap") as fa, \
            _swap(tmp_path, sizes, torch.float32, name="b.swap") as fb, AsyncIO(BLOCK, 8, 1) as io:
        writes = [io.pwrite(f, f.extent(k)[0], src[k] * (2 if f is fb else 1), k) for k in sizes for f in (fa, fb)]
        for h in writes:
            h.wait()
        back = {(f.path.name, k): torch.empty(n) for k, n in sizes.items() for f in (fa, fb)}
        reads = [io.pread(f, f.extent(k)[0], back[f.path.name, k], k) for k in reversed(sizes) for f in (fb, fa)]
        for h in reads:
            h.wait()
        for k in sizes:
            assert torch.equal(back["a.swap", k], src[k]) and torch.equal(back["b.swap", k], src[k] * 2), k


def test_removing_a_swap_file_spares_what_another_run_put_at_its_path(tmp_path):
    """A run whose file was deleted under it, and re-created by another run at the same path, must
    not delete that run's file and manifest when it ends."""
    a = _swap(tmp_path, {"a": 10}, torch.float32)
    a.write_manifest()
    manifest = a.path.with_name(a.path.name + ".manifest.json")
    a.path.unlink()
    manifest.unlink()
    # Files are told apart by inode: a's deleted files stay open (allocated) while a lives, so b's files at the
    # same paths cannot reuse their numbers (ext4 often hands a freed one to the next file made).
    held = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            held.add(os.readlink(f"/proc/self/fd/{fd}"))
    assert {f"{a.path} (deleted)", f"{manifest} (deleted)"} <= held
    with _swap(tmp_path, {"a": 10}, torch.float32, layout="layout-b") as b:
        b.write_manifest()
        a.remove()
        assert sorted(os.listdir(tmp_path)) == [b.path.name, manifest.name]
        assert json.loads(manifest.read_text())["layout_hash"] == "layout-b"
    assert os.listdir(tmp_path) == []


def test_a_live_runs_swap_file_is_in_use_whatever_its_layout(tmp_path):
    """Another layout's file that a live process holds: never advise deleting it."""
    with _swap(tmp_path, {"a": 10}, torch.float32) as f:
        f.write_manifest()
        for kwargs in ({"layout": "layout-b"}, {}):
            with pytest.raises(ConfigError, match=r"in use by another run or engine \(in this process or another\); "
                                                  "give each run its own offload.nvme_path") as info:
                _swap(tmp_path, {"a": 10}, torch.float32, **kwargs)
            assert "delete" not in str(info.value)
        assert os.path.exists(f.path)


class _CleanedMeanwhile(Syscalls):
    """Another run's ``remove_stale`` of the folder runs between the file's creation and its lock."""

    def __init__(self):
        self.removed = None

    def open(self, path, flags, mode=0o600):
        fd = super().open(path, flags, mode)
        if flags & os.O_CREAT and self.removed is None:
            self.removed = remove_stale(os.path.dirname(path))
        return fd


def test_a_swap_file_removed_before_it_is_locked_is_made_again(tmp_path):
    """Not yet locked, a new file looks like a dead run's to another run's clean-up: once locked, the
    path must still name it (else its writes would go to an unlinked file and O_DIRECT open another)."""
    seam = _CleanedMeanwhile()
    with _swap(tmp_path, {"a": 3000}, torch.float32, seam) as f, AsyncIO(BLOCK, 2, 1) as io:
        assert seam.removed[0] == 1   # the clean-up did take it
        assert os.path.samestat(os.stat(f.path), os.fstat(f._held.fd))
        src = _random(3000, torch.float32, 1)
        io.pwrite(f, 0, src, "a").wait()
        back = torch.empty(3000)
        io.pread(f, 0, back, "a").wait()
        assert torch.equal(back, src)
        assert remove_stale(tmp_path) == (0, 0)   # locked now: never taken for a dead run's
    assert os.listdir(tmp_path) == []
