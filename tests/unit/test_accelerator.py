"""The checking CPU accelerator catches what CUDA would get wrong: host/device mix-ups, pageable
buffers in asynchronous copies, and cross-stream uses not ordered by an event."""
import pytest
import torch

from framework import ConfigError
from framework.comm.accelerator import (CheckingCpuAccelerator, CpuAccelerator, DeviceMismatch, OrderError,
                                        for_device)


@pytest.fixture
def acc():
    return CheckingCpuAccelerator()


def _produce(acc, n=8):
    """A device tensor written by the compute stream (the current one)."""
    dev = torch.arange(n, dtype=torch.float32)
    acc.use(writes=[dev])
    return dev


def test_copy_on_a_side_stream_must_wait_for_the_producer(acc):
    dev, host = _produce(acc), acc.empty_host(8, torch.float32)
    side = acc.new_stream("copy")
    with acc.stream(side), pytest.raises(OrderError, match="stream 'copy' reads .* stream 'compute' wrote"):
        acc.copy(host, dev, non_blocking=True)
    # The same copy after an event recorded behind the producer is fine.
    produced = acc.event()
    produced.record()
    with acc.stream(side):
        produced.wait()
        acc.copy(host, dev, non_blocking=True)
        done = acc.event()
        done.record()
    with pytest.raises(OrderError, match="host code on the host reads"):
        acc.host_use(reads=[host])       # the copy may still be in flight
    done.synchronize()
    acc.host_use(reads=[host])
    assert torch.equal(host, dev)


def test_only_the_bytes_used_are_ordered(acc):
    dev, host = _produce(acc), acc.empty_host(4, torch.float32)
    ev = acc.event()
    ev.record()
    acc.use(writes=[dev[4:]])  # written again after the event, but not the half copied below
    side = acc.new_stream("copy")
    with acc.stream(side):
        ev.wait()
        acc.copy(host, dev[:4], non_blocking=True)
        with pytest.raises(OrderError):
            acc.copy(host, dev[4:], non_blocking=True)


def test_host_may_not_overwrite_a_buffer_a_stream_still_reads(acc):
    host, dev = acc.empty_host(8, torch.float32), torch.zeros(8)
    side = acc.new_stream("copy")
    with acc.stream(side):
        acc.copy(dev, host, non_blocking=True)   # host -> device, in flight
        done = acc.event()
        done.record()
    with pytest.raises(OrderError, match="host code on the host writes"):
        acc.host_use(writes=[host])
    done.synchronize()
    acc.host_use(writes=[host])


def test_events_order_transitively_and_work_queued_after_host_sync_is_ordered(acc):
    dev = _produce(acc)
    a, b = acc.new_stream("a"), acc.new_stream("b")
    first = acc.event()
    first.record()
    with acc.stream(a):
        first.wait()
        acc.use(reads=[dev])
        second = acc.event()
        second.record()
    with acc.stream(b):
        second.wait()
        acc.use(writes=[dev])    # ordered after compute's write and a's read, through a's event
    done = acc.event()
    done.record(b)
    done.synchronize()
    acc.use(reads=[dev])        # queued by a host that has seen b finish


def test_waiting_on_an_unrecorded_event_orders_nothing(acc):
    dev, host = _produce(acc), acc.empty_host(8, torch.float32)
    side = acc.new_stream("copy")
    ev = acc.event()
    with acc.stream(side):
        ev.wait()
        with pytest.raises(OrderError):
            acc.copy(host, dev, non_blocking=True)


def test_host_and_device_memory_are_told_apart(acc):
    host, dev = acc.empty_host(4, torch.float32), torch.zeros(4)
    acc.on_host(host, host[1:], what="x")
    acc.on_device(dev, what="x")
    with pytest.raises(DeviceMismatch, match="expected device memory, got a host buffer"):
        acc.on_device(host[2:], what="x")
    with pytest.raises(DeviceMismatch, match="expected a host buffer, got device memory"):
        acc.on_host(dev, what="x")
    # compute and collectives run on the device: NCCL fails on a host tensor
    acc.use(reads=[dev], writes=[dev])
    acc.collective_done(acc.collective([dev], "x"))
    for call in (lambda: acc.use(reads=[host]), lambda: acc.use(writes=[host[1:]]),
                 lambda: acc.collective([dev, host], "x")):
        with pytest.raises(DeviceMismatch, match="expected device memory, got a host buffer"):
            call()


def test_asynchronous_copies_need_pinned_host_buffers(acc):
    pageable, dev = acc.empty_host(4, torch.float32, pinned=False), torch.zeros(4)
    with pytest.raises(DeviceMismatch, match="needs a pinned host buffer"):
        acc.copy(pageable, dev, non_blocking=True)
    acc.copy(pageable, dev)   # a blocking copy is fine, and the host may read the result at once
    acc.host_use(reads=[pageable])


def test_a_freed_host_buffer_does_not_tag_its_address():
    acc = CheckingCpuAccelerator()
    host = acc.empty_host(1 << 16, torch.float32)
    ptr = host.data_ptr()
    del host
    again = torch.empty(1 << 16)
    if again.data_ptr() == ptr:   # the allocator reused the address: it is device memory now
        acc.on_device(again, what="x")


def test_selection(monkeypatch):
    monkeypatch.setenv("FRAMEWORK_ACCELERATOR", "check")
    assert isinstance(for_device(torch.device("cpu")), CheckingCpuAccelerator)
    monkeypatch.setenv("FRAMEWORK_ACCELERATOR", "plain")
    assert isinstance(for_device(torch.device("cpu")), CpuAccelerator)
    assert isinstance(for_device(torch.device("cpu"), mode="check"), CheckingCpuAccelerator)
    monkeypatch.setenv("FRAMEWORK_ACCELERATOR", "cuda-ish")
    with pytest.raises(ConfigError, match="FRAMEWORK_ACCELERATOR='cuda-ish' is not one of plain, check"):
        for_device(torch.device("cpu"))


def test_plain_cpu_copies_without_checks():
    acc = CpuAccelerator()
    host, dev = acc.empty_host(4, torch.float32), torch.arange(4.0)
    with acc.stream(acc.new_stream("copy")):
        acc.copy(host, dev, non_blocking=True)
    acc.event().synchronize()
    assert torch.equal(host, dev)


def test_bookkeeping_goes_with_the_buffers(acc):
    for _ in range(50):
        host, dev = acc.empty_host(64, torch.float32), torch.zeros(64)
        acc.copy(host, dev)
        acc.copy(dev[:32], host[:32])
    del host, dev
    assert len(acc._accesses) == 0 and len(acc._host_buffers) == 0


def test_a_storage_refilled_elsewhere_starts_a_new_history(acc):
    buf = torch.zeros(1024)
    old = buf.data_ptr()
    with acc.stream(acc.new_stream("copy")):
        acc.use(writes=[buf])
    buf.untyped_storage().resize_(0)       # released (zero3 style) ...
    other = torch.zeros(1024)              # another tensor, possibly at the old address
    buf.untyped_storage().resize_(4096)    # ... and buf refilled elsewhere
    if other.data_ptr() == old:
        acc.use(reads=[other])             # the copy stream's write was to buf's old storage


# --- what CUDA adds beyond copies: NCCL's stream, the caching allocator, threads, syncs, pinned memory


def test_a_collective_is_ordered_after_its_issuing_stream_and_before_its_waiter(acc):
    dev = _produce(acc)
    token = acc.collective([dev], "all-reduce")   # issued on compute, after the producer: fine
    with pytest.raises(OrderError, match="compute on stream 'compute' reads .* stream 'collectives' wrote"):
        acc.use(reads=[dev])                       # the result before the work's wait
    acc.collective_done(token)
    acc.use(reads=[dev])
    side, host = acc.new_stream("side"), acc.empty_host(8, torch.float32)
    with acc.stream(side):
        fresh = torch.zeros(8)                      # (from the side stream's pool: no wait for compute needed)
        acc.copy(fresh, host, non_blocking=True)    # a side stream writes the input...
    with pytest.raises(OrderError, match="collective 'x' on stream 'collectives'"):
        acc.collective([fresh], "x")                # ...and the collective is issued unordered on compute


def test_memory_made_in_a_compute_context_nested_in_a_side_stream_is_computes(acc):
    """A compute context inside a side stream's allocates from compute's pool: the side stream must wait for
    compute before using it, as for any compute allocation (one made directly on the side stream need not)."""
    _produce(acc)                                    # compute has queued work
    compute, side = acc.current_stream(), acc.new_stream("side")
    with acc.stream(side):
        own = torch.zeros(8)
        with acc.stream(compute):
            nested = torch.zeros(8)
        acc.use(writes=[own])
        with pytest.raises(OrderError, match="on stream 'side' uses a .* device buffer that the compute stream's "
                                             "allocator handed out"):
            acc.use(writes=[nested])


def test_freeing_memory_a_side_stream_still_reads_is_reported_at_the_next_call(acc):
    host, side = acc.empty_host(1 << 10, torch.float32), acc.new_stream("copy")
    tmp = torch.ones(1 << 10)
    with acc.stream(side):
        acc.copy(host, tmp, non_blocking=True)
    del tmp                                          # the caching allocator could hand it out now
    with pytest.raises(OrderError, match="used by stream 'copy' .* was freed .*record_stream"):
        acc.use(reads=[torch.zeros(2)])


def test_free_after_an_event_or_with_record_stream_is_fine(acc):
    host, side = acc.empty_host(1 << 10, torch.float32), acc.new_stream("copy")
    for fix in ("event", "record_stream"):
        tmp = torch.ones(1 << 10)
        with acc.stream(side):
            acc.copy(host, tmp, non_blocking=True)
            done = acc.event()
            done.record()
        if fix == "event":
            done.synchronize()
        else:
            acc.record_stream(tmp, side)
        del tmp
        acc.verify()


def test_threads_must_set_their_device(acc):
    import threading
    errors = []

    def work(bind):
        try:
            if bind:
                acc.bind_thread()
            acc.empty_host(4, torch.float32)          # pinned: needs the thread's device
            acc.use(writes=[torch.zeros(4)])
        except Exception as e:  # noqa: BLE001
            errors.append(e)
    for bind in (False, True):
        t = threading.Thread(target=work, args=(bind,), name=f"worker-{bind}")
        t.start()
        t.join()
    assert len(errors) == 1 and isinstance(errors[0], DeviceMismatch) and "worker-False" in str(errors[0])
    acc.empty_host(4, torch.float32, pinned=False)


def test_host_syncs_in_hooks_are_framework_code_only(acc):
    import os

    import framework
    from framework.comm.accelerator import HostSync
    x = torch.ones(3, requires_grad=True)
    x.register_post_accumulate_grad_hook(acc.hook(lambda p: None if bool(p.grad.sum()) else None, "a user hook"))
    (x * 2).sum().backward()                          # user code may sync (not ours to judge)
    # A function whose code lives in the framework package, as a stage's hook would.
    ours = eval(compile("lambda p: bool(p.grad.sum()) and None", os.path.join(os.path.dirname(framework.__file__),
                                                                        "stages", "hook.py"), "eval"))
    y = torch.ones(3, requires_grad=True)
    y.register_post_accumulate_grad_hook(acc.hook(ours, "a framework hook"))
    with pytest.raises(HostSync, match=r"host sync \(__bool__ .* inside a framework hook, at framework/stages/hook.py"):
        (y * 2).sum().backward()
    with acc.hot("a hot region"):
        with pytest.raises(HostSync, match="inside a hot region"):
            ours(y)
        bool(y.sum())                                 # (this test's own sync: not framework code)
    assert ours(y) is None                            # outside: fine


def test_a_signal_raised_while_a_hot_region_is_entered_leaves_nothing_hot(acc, monkeypatch):
    """SIGTERM's SystemExit landing inside the mode's push (its with-block and __exit__ never run): the run's
    abort and close then synchronize events outside any hook, which the checker blamed on "the backward pass"."""
    import os

    import framework
    from torch.overrides import TorchFunctionMode

    ours = eval(compile("lambda t: bool(t.sum()) and None", os.path.join(os.path.dirname(framework.__file__), "stages",
                                                                 "hook.py"), "eval"))
    enter = TorchFunctionMode.__enter__

    def pushed_then_signalled(mode):   # (the worst case: the mode is on torch's stack when the exit is raised)
        enter(mode)
        raise SystemExit(143)
    monkeypatch.setattr(TorchFunctionMode, "__enter__", pushed_then_signalled)
    mode = acc.hot("the backward pass (its hooks)")
    with pytest.raises(SystemExit):
        with mode:
            pass
    monkeypatch.undo()
    try:
        assert getattr(acc._local, "hot", ()) == ()
        event = acc.event()
        event.record()
        event.synchronize()                           # (refused inside a hot region)
        assert ours(torch.ones(2)) is None            # the pushed mode checks nothing
    finally:
        mode.__exit__(None, None, None)               # (this test's own pop of the mode left pushed)


def test_pinned_memory_is_rounded_and_cached_as_cudas_host_allocator_does(acc):
    before = acc.pinned_stats()
    a = acc.empty_host(3 << 18, torch.float32)        # 3 MiB -> 4 MiB
    assert acc.pinned_stats()["reserved"] - before["reserved"] == 4 << 20
    assert acc.pinned_stats()["requested"] - before["requested"] == 3 << 20
    del a
    b = acc.empty_host(1 << 20, torch.float32)        # 4 MiB: the cached block is reused
    assert acc.pinned_stats()["reserved"] - before["reserved"] == 4 << 20
    acc.empty_host(1 << 10, torch.float32, pinned=False)
    assert acc.pinned_stats()["requested"] - before["requested"] == 4 << 20
    del b


def test_a_blocking_copy_between_host_and_device_in_a_hook_is_a_host_sync(acc):
    """Either way: torch waits for the stream after a blocking copy (from pageable memory it could not queue it)."""
    import os

    import framework
    from framework.comm.accelerator import HostSync
    host, dev = acc.empty_host(8, torch.float32), torch.ones(8)
    src = ("def interface(): acc.copy(host, dev)\n"                     # the framework's interface, blocking
           "def plain(): host.copy_(dev)\n"                             # torch's own, blocking
           "def queued(): acc.copy(host, dev, non_blocking=True)\n"     # fine: ordered by an event later
           "def to_device(): acc.copy(dev, host)\n"                     # host-to-device, blocking
           "def queued_in(): acc.copy(dev, host, non_blocking=True)\n")
    ns = {"acc": acc, "host": host, "dev": dev}
    exec(compile(src, os.path.join(os.path.dirname(framework.__file__), "stages", "hook.py"), "exec"), ns)
    for name, what in (("interface", "device tensor"), ("plain", "device tensor"),
                       ("to_device", "host buffer into device memory")):
        with pytest.raises(HostSync, match=rf"host sync \((blocking )?copy_ of a \(8,\) torch.float32 {what}\) "
                                           r"inside a hook, at framework/stages/hook.py"):
            with acc.hot("a hook"):
                ns[name]()
    with acc.hot("a hook"):
        ns["queued"]()
        ns["queued_in"]()
    ns["interface"]()   # outside a hook: fine
    ns["to_device"]()


def test_every_kind_of_host_sync_in_a_hook_is_caught(acc):
    import os

    import numpy as np

    import framework
    from framework.comm.accelerator import HostSync
    host = acc.empty_host(4, torch.float32)
    syncs = {"is_nonzero": "torch.is_nonzero(t.sum())", "unique_consecutive": "t.unique_consecutive()",
             "__getitem__": "t[t > 0]", "where": "torch.where(t > 0)", "bincount": "t.long().bincount()",
             "repeat_interleave": "t.repeat_interleave(t.long())", "to": "t.to(host)",
             "__setitem__": "host.__setitem__(slice(None), t)", "cat": "torch.cat([t], out=host)",
             "__array__": "np.asarray(t)", "__format__": "f'{t}'", "__repr__": "repr(t)",
             "as_tensor": "torch.as_tensor(t, device='cpu')"}
    # blocking copies of a host buffer into device memory (torch waits for the stream after them)
    into = {"copy_": "t.copy_(host)", "__setitem__": "t.__setitem__(slice(None), host)", "to": "host.to(t)"}
    # (no wait: sizes known, asynchronous copies, no host buffer written, host memory only, device to device)
    fine = ["t[t.long() - 1]", "t.repeat_interleave(2)", "t.repeat_interleave(t.long(), output_size=10)",
            "torch.where(t > 0, t, 0)", "host.copy_(t, non_blocking=True)", "t.copy_(host, non_blocking=True)",
            "host.to(t, non_blocking=True)", "host.to(torch.bfloat16)", "t.__setitem__(slice(None), t * 2)",
            "host.__setitem__(slice(None), host * 2)", "torch.cat([t], out=torch.empty_like(t))",
            "f'{t.shape}'", "host.clone().sum().item()", "host[host > 0]", "t.to(t)", "np.asarray(host)"]
    path = os.path.join(os.path.dirname(framework.__file__), "stages", "hook.py")
    cases = [*((rf"{n} of a .* device tensor", e) for n, e in syncs.items()),
             *((rf"blocking {n} of a \(4,\) torch.float32 host buffer into device memory", e) for n, e in into.items()),
             *((None, e) for e in fine)]
    for what, expr in cases:
        ns = {"torch": torch, "np": np}
        exec(compile(f"def f(t, host):\n    return {expr}\n", path, "exec"), ns)
        t = torch.arange(4.0) + 1
        with acc.hot("a hook"):
            if what is None:
                ns["f"](t, host)
            else:
                with pytest.raises(HostSync, match=rf"host sync \({what}\) inside a hook"):
                    ns["f"](t, host)
        ns["f"](t, host)   # outside a hot region: not checked


def test_what_framework_code_makes_on_the_host_by_name_in_setup_or_a_hot_region_is_host_memory(acc):
    """``device="cpu"`` and ``acc.host`` name the host (on the CPU the run's device is an equal but other object):
    what framework code makes with them in ``building`` or ``hot`` is host memory; elsewhere it is not seen."""
    import os

    import framework
    src = ("def named(t):\n    return [torch.zeros(2, device='cpu'), torch.empty(2, device=acc.host)]\n"
           "def device(t):\n    return [torch.zeros(2, device=t.device), torch.empty(2, device=acc.device)]\n"
           "def moved(t):\n    return [t.to('cpu', copy=True), t.cpu(), t.to('cpu')]\n")
    ns = {"torch": torch, "acc": acc}
    exec(compile(src, os.path.join(os.path.dirname(framework.__file__), "stages", "setup.py"), "exec"), ns)
    t = torch.ones(2)
    with acc.building("setup"):
        named, device, moved = ns["named"](t), ns["device"](t), ns["moved"](t)
    with acc.hot("a hook"):
        named += ns["named"](t)
    acc.on_host(*named, moved[0], what="x")
    acc.on_device(*device, t, *moved[1:], *ns["named"](t), what="x")   # (``t`` itself returned: still device)


def test_what_torch_makes_of_host_buffers_in_a_hot_region_or_registered_is_host_memory(acc):
    """On CUDA an op's output lands beside its operands: derivatives of host buffers are (pageable) host memory.
    The checker sees torch's calls only in hot regions; elsewhere the code that makes them registers them."""
    host, dev = acc.empty_host(8, torch.float32), torch.zeros(8)
    with acc.hot("a hook"):
        made = [host.clone(), host.to(torch.bfloat16), host * 2, torch.empty_like(host), torch.zeros_like(host),
                host[2:] + 0, torch.cat([host, host]), *torch._foreach_mul([host], 2), host > 0]
        device = [host + dev, torch.empty_like(host, device="cpu"), host.to("cpu", torch.float64),
                  torch.ones(3, device="cpu")]
    outside = torch.zeros_like(host)
    acc.on_device(outside, what="x")           # (not seen: device memory to the checker, until registered)
    acc.register_host(outside, what="x")
    for t in [*made, outside]:
        acc.on_host(t, what="x")
        with pytest.raises(DeviceMismatch, match="expected device memory, got a host buffer"):
            acc.collective([t], "x")
    with pytest.raises(DeviceMismatch, match="expected device memory, got a host buffer"):
        acc.use(reads=[made[2]], writes=[dev])
    with pytest.raises(DeviceMismatch, match="needs a pinned host buffer"):
        acc.copy(dev, made[0], non_blocking=True)
    acc.on_device(*device, what="x")
    with pytest.raises(DeviceMismatch, match=r"expected a host buffer, got device memory .* acc.register_host it"):
        acc.on_host(torch.zeros_like(host), what="x")
    with pytest.raises(DeviceMismatch, match="expected a CPU tensor, got one on meta"):
        acc.register_host(torch.empty(2, device="meta"), what="x")
