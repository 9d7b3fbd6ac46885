"""No host syncs in the hot paths (hooks, the per-piece pipeline, the step) unless the line says why.

On CUDA each of these makes the host wait for the device queue: ``.item()``, ``.cpu()``,
``.tolist()``, ``.numpy()``, ``bool/int/float(tensor)``, a tensor's truth tested (``if t.all():``,
``not torch.isfinite(t).any()``, in a condition, comprehension or ``and``/``or``), calls whose
result size or value the host needs (``nonzero``, ``unique``, ``masked_select``, ``argwhere``,
``torch.equal``, ``allclose``, ``bincount``, one-argument ``torch.where``, ``repeat_interleave`` by
a tensor without ``output_size``, a boolean-mask index ``t[t > 0]``), ``synchronize()`` on torch, a
device or a stream, ``.to("cpu")`` in any spelling, a blocking copy to or from host memory (``copy_``,
``.to(host)``, ``host[...] = t``, ``out=host``), ``np.asarray(t)``, and
``torch.tensor(..., device=<not cpu>)`` (a copy from pageable memory that blocks the host). A
deliberate one is marked with a ``# host sync: <why>`` comment on its line or the line above;
event waits (``event.synchronize()``) are the sanctioned host waits and are not listed (the check mode catches one inside a hook).
The CPU check mode catches syncs at run time inside hooks; this catches them everywhere in the
hot modules, in code paths no test reaches too. Not caught: formatting a tensor (``f"{t}"``) and
syncs whose tensor the names do not reveal (a copy into a host buffer not called host/cpu/pinned).

Placement, over all of framework/: every torch factory call (``torch.empty``, ``zeros``, ``tensor``...)
names its ``device=``: without it the tensor lands on the host, which the CPU suite cannot tell from
device memory (the checking accelerator takes everything but ``empty_host`` buffers, those ``register_host``
names, what torch makes of them in hot regions and, in hot regions and setup, what is made with the host
named, ``device="cpu"`` or ``acc.host``, for device memory).
A deliberate host tensor says so: ``device="cpu"``, a host device variable, or a ``# host: <why>``
comment on its line. ``*_like`` and ``new_*`` calls inherit their source's device and are not read.

Threads, over all of framework/: each thread pool binds its device (``initializer=<acc>.bind_thread``) and each
thread's target calls ``bind_thread`` (CUDA's current device is per thread: GPU 0 in a new one), or the thread is
listed as host-only.
"""
import ast
import io
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HOT = ["framework/engine/step.py", "framework/comm/collectives.py",
       "framework/offload/_pipeline.py", "framework/offload/base.py", "framework/offload/_store.py",
       "framework/offload/_diskstore.py", "framework/offload/cpu.py", "framework/offload/_disk.py", "framework/offload/_diskshards.py",
       "framework/offload/_swapfile.py", "framework/core/utils.py", "framework/stages", "framework/engine/build.py",
       # (per micro batch: the loss of a model, the forward pre-hook that casts the inputs)
       "framework/models/_base.py", "framework/models/_hf_batch.py", "framework/precision"]
MARK = "host sync:"
METHODS = {"item", "cpu", "tolist", "numpy", "nonzero"}
# Calls whose result size or value the host must know: each waits for the device queue.
SYNC_CALLS = {"equal", "allclose", "unique", "unique_consecutive", "masked_select", "argwhere", "is_nonzero",
              "bincount"}
# Tensor-valued calls whose truth is tested (``if t.all():``, ``not torch.isfinite(t).all()``): ``bool``
# on a device tensor is a host sync just as ``bool(t)`` is. Python's own ``all(...)``/``any(...)`` are
# plain names, not methods, and are not listed.
TENSOR_TRUTH = {"all", "any", "isfinite", "isnan", "isinf", "eq", "ne", "gt", "ge", "lt", "le", "sum", "max",
                "min", "count_nonzero", "logical_and", "logical_or", "logical_not"}
# Functions the lint does not read, each with why (setup code in a hot module runs before any hook).
NOT_HOT = {
    ("framework/offload/_swapfile.py", "reserved_bytes"): "setup: sizes the swap file; int() of Python ints",
    ("framework/offload/_swapfile.py", "create"): "setup: makes the swap file; int() of Python ints",
}


def _is_cpu(node) -> bool:
    """``"cpu"`` or ``torch.device("cpu")``."""
    if isinstance(node, ast.Constant):
        return node.value == "cpu"
    return isinstance(node, ast.Call) and ast.unparse(node.func) == "torch.device" and bool(node.args) \
        and _is_cpu(node.args[0])


def _truth_tested(tree) -> list[ast.expr]:
    """Expressions whose truth Python asks for: conditions, ``not`` and ``and``/``or`` operands."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.If, ast.While, ast.IfExp, ast.Assert)):
            out.append(node.test)
        elif isinstance(node, ast.comprehension):
            out += node.ifs
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            out.append(node.operand)
        elif isinstance(node, ast.BoolOp):
            out += node.values
    return out


def _tensor_valued(node) -> bool:
    if isinstance(node, ast.Compare):
        return any(_tensor_valued(x) for x in [node.left, *node.comparators])
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in TENSOR_TRUTH \
        and ast.unparse(node.func.value) != "math"   # math.isfinite(x) tests a Python float


def _hostish(node) -> bool:
    """A name that says the tensor lives in host memory (``host``, ``cpu_buf``, ``pinned``)."""
    text = ast.unparse(node).lower()
    return any(w in text for w in ("host", "cpu", "pinned")) or \
        (isinstance(node, ast.Call) and any(k.arg == "device" and _is_cpu(k.value) for k in node.keywords))


def _what(node: ast.Call) -> str | None:
    fn = node.func
    if isinstance(fn, ast.Attribute) and fn.attr in METHODS:
        return f".{fn.attr}()"
    if isinstance(fn, ast.Attribute) and fn.attr in SYNC_CALLS:
        return f".{fn.attr}()"
    if isinstance(fn, ast.Name) and fn.id in ("bool", "int", "float") and node.args \
            and not isinstance(node.args[0], ast.Constant):
        return f"{fn.id}(tensor)"
    if isinstance(fn, ast.Attribute) and fn.attr == "synchronize":
        # An event's synchronize waits for that event only (the sanctioned wait); a device's or a
        # stream's waits for everything queued on it.
        receiver = ast.unparse(fn.value)
        if receiver.startswith("torch.") or "stream" in receiver.lower() or "device" in receiver.lower():
            return f"{receiver}.synchronize()"
    if isinstance(fn, ast.Attribute) and fn.attr == "to" and \
            (any(_is_cpu(a) for a in node.args) or any(k.arg == "device" and _is_cpu(k.value) for k in node.keywords)):
        return '.to("cpu")'
    if isinstance(fn, ast.Attribute) and ast.unparse(fn) in ("torch.tensor", "torch.as_tensor") and \
            any(k.arg == "device" and not _is_cpu(k.value) for k in node.keywords):
        return "torch.tensor(..., device=...)"
    blocking = not any(k.arg == "non_blocking" for k in node.keywords)
    if isinstance(fn, ast.Attribute) and fn.attr == "copy_" and node.args and blocking \
            and (_hostish(fn.value) or _hostish(node.args[0])):
        return "blocking .copy_() to or from host memory"
    if isinstance(fn, ast.Attribute) and fn.attr == "to" and blocking and any(_hostish(a) for a in node.args):
        return ".to(<host tensor>)"
    if any(k.arg == "out" and _hostish(k.value) for k in node.keywords):
        return "out=<host memory> (a blocking copy)"
    if isinstance(fn, ast.Attribute) and fn.attr == "where" and len(node.args) == 1 and not node.keywords:
        return "torch.where(condition)"
    if isinstance(fn, ast.Attribute) and fn.attr == "repeat_interleave" \
            and not any(k.arg == "output_size" for k in node.keywords):
        repeats = node.args[ast.unparse(fn.value) == "torch":][:1]   # (torch.repeat_interleave(t, repeats))
        if not (repeats and isinstance(repeats[0], ast.Constant)):
            return "repeat_interleave without output_size"
    if ast.unparse(fn) in ("np.asarray", "np.array", "numpy.asarray", "numpy.array"):
        return f"{ast.unparse(fn)}(tensor)"
    return None


def _other(node) -> str | None:
    """Host syncs that are not calls: a boolean-mask index (``t[t > 0]``), a store into host memory."""
    if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) \
            and any(isinstance(i, ast.Compare) for i in (node.slice.elts if isinstance(node.slice, ast.Tuple)
                                                         else [node.slice])):
        return "boolean-mask index"
    if isinstance(node, ast.Assign) and not isinstance(node.value, ast.Constant) \
            and any(isinstance(t, ast.Subscript) and _hostish(t.value) for t in node.targets):
        return "host[...] = tensor (a blocking copy)"
    return None


def _unmarked(source: str, path: str = "") -> list[tuple[int, str]]:
    """(line, what) of every unmarked host sync in ``source``."""
    marked = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT and MARK in tok.string:
            marked |= {tok.start[0], tok.start[0] + 1}   # its line, or the statement below a comment line
    tree = ast.parse(source)
    known = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and (path, node.name) in NOT_HOT:
            known |= set(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    found = [(node, "truth test of a tensor") for node in _truth_tested(tree) if _tensor_valued(node)]
    found += [(node, what) for node in ast.walk(tree) if isinstance(node, ast.Call) and (what := _what(node))]
    found += [(node, what) for node in ast.walk(tree) if (what := _other(node))]
    return sorted({(node.lineno, what) for node, what in found if node.lineno not in known
                   and not marked & set(range(node.lineno, (node.end_lineno or node.lineno) + 1))})


FACTORIES = {"empty", "zeros", "ones", "full", "tensor", "as_tensor", "arange", "range", "linspace", "logspace",
             "eye", "rand", "randn", "randint", "randperm", "normal", "empty_strided", "scalar_tensor"}
HOST_MARK = "# host:"


def _no_device(source: str) -> list[int]:
    """Lines of torch factory calls without ``device=`` and without a ``# host:`` mark."""
    marked = {tok.start[0] for tok in tokenize.generate_tokens(io.StringIO(source).readline)
              if tok.type == tokenize.COMMENT and tok.string.startswith(HOST_MARK)}
    return sorted({node.lineno for node in ast.walk(ast.parse(source))
                   if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                   and ast.unparse(node.func.value) == "torch" and node.func.attr in FACTORIES
                   and not any(k.arg == "device" for k in node.keywords)
                   and not marked & set(range(node.lineno, (node.end_lineno or node.lineno) + 1))})


def test_every_tensor_factory_names_its_device():
    problems = [f"{path.relative_to(ROOT)}:{line}" for path in sorted((ROOT / "framework").rglob("*.py"))
                for line in _no_device(path.read_text())]
    assert not problems, ("torch factory calls without device= (on CUDA the tensor would land on the host, which "
                          "the CPU suite cannot see): pass the compute device, or device=\"cpu\" / a host device "
                          "for a deliberate host tensor, or mark the line '# host: <why>':\n  " + "\n  ".join(problems))


def test_the_device_lint_sees_each_factory_and_honours_the_mark():
    source = "\n".join([
        "def f(n, dev, t):",
        "    a = torch.empty(n, dtype=torch.float32)",           # 2
        "    b = torch.zeros(n)",                                # 3
        "    c = torch.tensor([1, 2])",                          # 4
        "    d = torch.arange(",                                 # 5
        "        n)",
        "    e = torch.empty(n, device=dev)",
        "    f = torch.zeros(n, device='cpu')",
        "    g = torch.empty_like(t)",
        "    h = t.new_empty(n)",
        "    i = torch.tensor([1.0])   # host: compared on the host at config time",
        "    j = torch.randint(0, 9, (1,), generator=gen)",     # 12
        "    k = torch.full((n,), 1.0, dtype=t.dtype, device=t.device)",
    ])
    assert _no_device(source) == [2, 3, 4, 5, 12]


def _files() -> list[Path]:
    out = []
    for entry in HOT:
        p = ROOT / entry
        out += sorted(p.glob("*.py")) if p.is_dir() else [p]
    return out


def test_hot_paths_have_no_unmarked_host_syncs():
    problems = [f"{path.relative_to(ROOT)}:{line}: {what}" for path in _files()
                for line, what in _unmarked(path.read_text(), str(path.relative_to(ROOT)))]
    assert not problems, ("host syncs in hot paths (on CUDA the host waits for the device queue); move them out, "
                          "keep the value on the device, or mark the line '# host sync: <why>':\n  "
                          + "\n  ".join(problems))


def test_the_lint_sees_each_kind_and_honours_the_mark():
    source = "\n".join([
        "def hook(t, ev, u, host, names):",
        "    a = t.item()",
        "    b = t.sum().cpu()",
        "    if bool(t.any()):",
        "        pass",
        "    c = int(t.max())",
        "    d = t.nonzero()",
        "    torch.cuda.synchronize()",
        "    e = t.to('cpu')",
        "    f = torch.tensor([1, 2], device=t.device)",
        "    g = t.tolist()",
        "    h = t.item()   # host sync: once a step, to decide the skip",
        "    # host sync: consolidation, between steps",
        "    i = t.cpu()",
        "    ev.synchronize()",
        "    j = bool(True) and int(3)",
        "    if t.isfinite().all(): pass",                  # 17
        "    ok = not torch.isfinite(t).all()",             # 18
        "    k = [n for n in names if t.any()]",            # 19
        "    while t.sum() > 0: pass",                      # 20
        "    m = u if t.eq(u).all() else t",                # 21
        "    torch.equal(t, u)",                            # 22
        "    t.unique()",                                   # 23
        "    t.masked_select(t > 0)",                       # 24
        "    torch.argwhere(t)",                            # 25
        "    t.to(device='cpu')",                           # 26
        "    t.to(torch.device('cpu'))",                    # 27
        "    host.copy_(t)",                                # 28
        "    t.copy_(torch.empty(4, device='cpu'))",        # 29
        "    torch.cuda.current_stream().synchronize()",    # 30
        "    self.stream.synchronize()",                    # 31
        "    if all(names) and any(n for n in names) and path.exists(): pass",
        "    host.copy_(t, non_blocking=True)",
        "    t.to(device, non_blocking=True)",
        "    u.copy_(t)",
        "    copy.result().synchronize()",
        "    ok = not (math.isfinite(x) and math.isfinite(y))",
        "    n = torch.tensor([1, 2], device='cpu')",
        "    torch.is_nonzero(t)",                          # 39
        "    t.unique_consecutive()",                       # 40
        "    t.bincount()",                                 # 41
        "    torch.where(t > 0)",                           # 42
        "    t.repeat_interleave(u)",                       # 43
        "    torch.repeat_interleave(t, u)",                # 44
        "    t[t > 0]",                                     # 45
        "    host[:] = t",                                  # 46
        "    t.to(host)",                                   # 47
        "    torch.cat([t], out=host)",                     # 48
        "    np.asarray(t)",                                # 49
        "    torch.where(t > 0, t, u)",
        "    t.repeat_interleave(2)",
        "    t.repeat_interleave(u, output_size=8)",
        "    t[u]",
        "    host[:] = 0",
        "    t[:] = host",
        "    t.to(host, non_blocking=True)",
        "    torch.cat([t], out=u)",
    ])
    assert [line for line, _ in _unmarked(source)] == [2, 3, 4, 6, 7, 8, 9, 10, 11, *range(17, 32), *range(39, 50)]
    assert all(p.exists() for p in _files()) and len(_files()) > 10


def test_each_exception_names_a_function_that_exists():
    """A renamed or removed function must leave the list, not silently stop meaning anything."""
    for path, name in NOT_HOT:
        tree = ast.parse((ROOT / path).read_text())
        assert any(isinstance(n, ast.FunctionDef) and n.name == name for n in ast.walk(tree)), (path, name)


# Threads that never touch the device (no stream, event, pinned memory or CUDA call), each with why.
HOST_ONLY_THREADS = {
    ("framework/offload/_aio.py", "_worker"): "file IO between host bounce buffers and the swap file",
    ("framework/cli/launch.py", "watch"): "the launcher watch: polls the parent process, sends signals",
    ("framework/cli/_signals.py", "soon"): "sends a signal again to the main thread",
    ("framework/comm/rendezvous.py", "make"): "makes the TCPStore client (sockets only), waited for in short joins",
}
# what starts a thread -> (keyword, position) of what it runs first
_STARTERS = {"ThreadPoolExecutor": ("initializer", 2), "Thread": ("target", 1), "Timer": ("function", 1),
             "start_new_thread": ("function", 0)}


def _unbound_threads(source: str, path: str = "") -> list[tuple[int, str]]:
    """(line, what) of every thread started without binding its device: a pool without
    ``initializer=<acc>.bind_thread``, a thread whose target calls no ``bind_thread`` and is not host-only."""
    tree = ast.parse(source)
    binds = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
             and any(isinstance(c, ast.Call) and ast.unparse(c.func).endswith("bind_thread") for c in ast.walk(n))}
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        fn = ast.unparse(node.func).rsplit(".", 1)[-1]
        if fn == "partial" and node.args:   # partial(ThreadPoolExecutor, ...)
            fn = ast.unparse(node.args[0]).rsplit(".", 1)[-1]
        if fn not in _STARTERS:
            continue
        key, at = _STARTERS[fn]
        args = node.args[1:] if ast.unparse(node.func).endswith("partial") else node.args
        arg = args[at] if len(args) > at else next((k.value for k in node.keywords if k.arg == key), None)
        name = ast.unparse(arg).rsplit(".", 1)[-1] if arg is not None else ""
        if fn == "ThreadPoolExecutor":
            if name != "bind_thread":
                found.append((node.lineno, "thread pool without initializer=<accelerator>.bind_thread"))
        elif name not in binds and (path, name) not in HOST_ONLY_THREADS:
            found.append((node.lineno, f"thread running {name or '?'}, which calls no bind_thread"))
    return sorted(found)


def test_every_thread_binds_its_device():
    problems = [f"{path.relative_to(ROOT)}:{line}: {what}" for path in sorted((ROOT / "framework").rglob("*.py"))
                for line, what in _unbound_threads(path.read_text(), str(path.relative_to(ROOT)))]
    assert not problems, ("threads that do not set their device (on CUDA their first stream, event or pinned "
                          "buffer opens a context on GPU 0, hundreds of MB per rank): pass initializer=acc.bind_thread "
                          "or call acc.bind_thread() first in the target, or list a host-only thread in "
                          "HOST_ONLY_THREADS:\n  " + "\n  ".join(problems))


def test_the_thread_lint_sees_each_kind():
    source = "\n".join([
        "def bound(acc):",
        "    acc.bind_thread()",
        "def loose():",
        "    pass",
        "def f(acc):",
        "    concurrent.futures.ThreadPoolExecutor(1)",                          # 6
        "    ThreadPoolExecutor(max_workers=1, initializer=acc.bind_thread)",
        "    partial(ThreadPoolExecutor, max_workers=1)",                         # 8
        "    partial(ThreadPoolExecutor, max_workers=1, initializer=self.acc.bind_thread)",
        "    threading.Thread(target=loose)",                                     # 10
        "    threading.Thread(target=self.bound, daemon=True)",
        "    _thread.start_new_thread(loose, ())",                                # 12
        "    threading.Timer(1.0, loose)",                                        # 13
        "    ThreadPoolExecutor(1, initializer=setup)",                           # 14
        "    threading.Timer(1.0, bound)",
        "    threading.Thread(None, loose)",                                      # 16
        "    ThreadPoolExecutor(1, 'x', acc.bind_thread)",
    ])
    assert [line for line, _ in _unbound_threads(source)] == [6, 8, 10, 12, 13, 14, 16]


def test_each_host_only_thread_names_a_function_that_exists():
    for path, name in HOST_ONLY_THREADS:
        tree = ast.parse((ROOT / path).read_text())
        assert any(isinstance(n, ast.FunctionDef) and n.name == name for n in ast.walk(tree)), (path, name)
