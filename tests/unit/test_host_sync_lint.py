"""No host syncs in the hot paths (hooks, the per-piece pipeline, the step) unless the line says why.

On CUDA each of these makes the host wait for the device queue: ``.item()``, ``.cpu()``,
``.tolist()``, ``.numpy()``, ``bool/int/float(tensor)``, ``nonzero``, ``torch.cuda.synchronize``,
``.to("cpu")``, and ``torch.tensor(..., device=...)`` (a copy from pageable memory that blocks the
host). A deliberate one is marked with a ``# host sync: <why>`` comment on its line or the line
above; event waits (``event.synchronize()``) are the sanctioned host waits and are not listed.
The CPU check mode catches syncs at run time inside hooks; this catches them everywhere in the
hot modules, in code paths no test reaches too.
"""
import ast
import io
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HOT = ["framework/engine/step.py", "framework/engine/update.py", "framework/comm/collectives.py",
       "framework/offload/_pipeline.py", "framework/offload/base.py", "framework/offload/_store.py",
       "framework/offload/_diskstore.py", "framework/offload/cpu.py", "framework/offload/_disk.py", "framework/offload/_diskshards.py",
       "framework/stages"]
MARK = "host sync:"
METHODS = {"item", "cpu", "tolist", "numpy", "nonzero"}


def _unmarked(source: str) -> list[tuple[int, str]]:
    """(line, what) of every unmarked host sync in ``source``."""
    marked = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT and MARK in tok.string:
            marked |= {tok.start[0], tok.start[0] + 1}   # its line, or the statement below a comment line
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        fn, what = node.func, None
        if isinstance(fn, ast.Attribute) and fn.attr in METHODS:
            what = f".{fn.attr}()"
        elif isinstance(fn, ast.Name) and fn.id in ("bool", "int", "float") and node.args \
                and not isinstance(node.args[0], ast.Constant):
            what = f"{fn.id}(tensor)"
        elif isinstance(fn, ast.Attribute) and fn.attr == "synchronize" and ast.unparse(fn.value) == "torch.cuda":
            what = "torch.cuda.synchronize()"
        elif isinstance(fn, ast.Attribute) and fn.attr == "to" and node.args and \
                isinstance(node.args[0], ast.Constant) and node.args[0].value == "cpu":
            what = '.to("cpu")'
        elif isinstance(fn, ast.Attribute) and ast.unparse(fn) in ("torch.tensor", "torch.as_tensor") and \
                any(k.arg == "device" for k in node.keywords):
            what = "torch.tensor(..., device=...)"
        if what and not marked & set(range(node.lineno, (node.end_lineno or node.lineno) + 1)):
            found.append((node.lineno, what))
    return sorted(found)


def _files() -> list[Path]:
    out = []
    for entry in HOT:
        p = ROOT / entry
        out += sorted(p.glob("*.py")) if p.is_dir() else [p]
    return out


def test_hot_paths_have_no_unmarked_host_syncs():
    problems = [f"{path.relative_to(ROOT)}:{line}: {what}" for path in _files()
                for line, what in _unmarked(path.read_text())]
    assert not problems, ("host syncs in hot paths (on CUDA the host waits for the device queue); move them out, "
                          "keep the value on the device, or mark the line '# host sync: <why>':\n  "
                          + "\n  ".join(problems))


def test_the_lint_sees_each_kind_and_honours_the_mark():
    source = "\n".join([
        "def hook(t, ev):",
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
    ])
    assert [line for line, _ in _unmarked(source)] == [2, 3, 4, 6, 7, 8, 9, 10, 11]
    assert all(p.exists() for p in _files()) and len(_files()) > 10
