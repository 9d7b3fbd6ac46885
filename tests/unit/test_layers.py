"""The import contract of the package: its layers, read from the source (no imports run).

Each module of ``framework`` belongs to one layer, lowest first; a module may import from its own
layer and the ones below, never from above. On top of that:

* no circles between modules (lazy imports inside functions and imports under
  ``if TYPE_CHECKING:`` count too: a type the other module needs goes below both of them, or the
  lower module states what it needs as a ``Protocol``);
* no private names across packages: ``framework.a._b`` and ``_name`` are for ``framework.a``
  itself, whether imported or reached through attributes (``framework.a._b.f``, ``Cls._m``); other
  packages use what a package's ``__init__`` exports, or a public module's public names (the
  package root's own modules, the command shims, form one package);
* no imports by name at run time (``importlib.import_module``, ``__import__``, loading a module
  from a file, ``sys.modules["framework..."]``) outside ``DYNAMIC``: they are invisible to the
  checks above.

A new module goes into the layer where it belongs (``LAYERS`` below and docs/architecture.md).
"""
from __future__ import annotations

import ast
import functools
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "framework"

# Lowest first. Keys are packages (or modules) under framework/, dotted below it; a module is in the
# layer of its longest key: engine.build (initialize, Engine) sits above persist, which saves an
# engine's state, while the rest of engine/ sits below it.
LAYERS = [
    ("base", "core"),
    ("devices and communication", "comm"),
    ("components", "ops optimizers schedulers precision models data loggers"),
    ("configuration", "config"),
    ("engine", "stages offload engine"),
    ("persistence", "persist"),
    ("assembly", "engine.build"),
    ("memory model", "memory"),
    ("entry points", "cli train estimate plan recipe report export"),
    # ``framework`` itself (its __init__): it re-exports initialize and the weights functions, so
    # nothing inside the package imports it; ``from framework import ops`` is an import of ops.
    ("public API", "__init__"),
]
LAYER = {name: i for i, (_, names) in enumerate(LAYERS) for name in names.split()}


def _modules() -> dict[str, Path]:
    out = {}
    for p in ROOT.rglob("*.py"):
        parts = p.relative_to(ROOT.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


MODULES = _modules()


def _package(mod: str) -> str:
    return mod if MODULES[mod].name == "__init__.py" else mod.rsplit(".", 1)[0]


def _imports(mod: str, source: str | None = None) -> list[tuple[str, str | None, int]]:
    """(target module, imported name or None, line) for every framework import of ``mod`` (of
    ``source`` if given), wherever it is: lazy, or under ``if TYPE_CHECKING:``. A name an import
    binds is followed through attribute access too: after ``import framework.stages``,
    ``framework.stages._flat.make_layout`` reaches (framework.stages._flat, "make_layout"), and after
    ``from framework.stages import Zero3``, ``Zero3._gather`` reaches (framework.stages, "Zero3._gather")."""
    tree, out, bound = ast.parse(MODULES[mod].read_text() if source is None else source), [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in MODULES:
                    out.append((a.name, None, node.lineno))
                    bound[a.asname or a.name.split(".")[0]] = (a.name if a.asname else "framework", None)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = _package(mod).split(".")[: len(_package(mod).split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            for a in node.names:
                full = f"{base}.{a.name}"
                if full in MODULES:
                    out.append((full, None, node.lineno))
                    bound[a.asname or a.name] = (full, None)
                elif base in MODULES:
                    out.append((base, a.name, node.lineno))
                    bound[a.asname or a.name] = (base, a.name)
    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or id(node) in inner:
            continue
        chain = []
        while isinstance(node, ast.Attribute):
            chain.insert(0, node.attr)
            node = node.value
        if not isinstance(node, ast.Name) or node.id not in bound:
            continue
        target, name = bound[node.id]
        while name is None and chain and f"{target}.{chain[0]}" in MODULES:
            target = f"{target}.{chain.pop(0)}"
        out.append((target, ".".join(([name] if name else []) + chain) or None, node.lineno))
    return out


@functools.cache
def _edges() -> dict[str, list[tuple[str, str | None, int]]]:
    """Every module's framework imports, read when a test first needs them: not at collection, which each
    pytest worker does for every file, whether it runs this one or not."""
    return {m: _imports(m) for m in MODULES}


def _layer(mod: str) -> int | None:
    parts = mod.split(".")[1:] or ["__init__"]
    keys = [".".join(parts[:n]) for n in range(len(parts), 0, -1)]
    return next((LAYER[k] for k in keys if k in LAYER), None)


def test_every_module_has_a_layer():
    missing = sorted({m.split(".")[-1] for m in MODULES if _layer(m) is None})
    assert not missing, f"add these to LAYERS in {__file__}: {missing}"


def _upward(edges) -> list[str]:
    return [f"{m}:{line} imports {t} ({LAYERS[_layer(t)][0]} above {LAYERS[_layer(m)][0]})"
            for m, es in edges.items() if _layer(m) is not None
            for t, _, line in es if _layer(t) is not None and _layer(t) > _layer(m)]


def _is_private(target: str, name: str | None) -> bool:
    return any(p.startswith("_") and not p.startswith("__") for p in [*target.split(".")[1:], *(name or "").split(".")])


def _private(edges) -> list[str]:
    return [f"{m}:{line} imports {t}{'.' + name if name else ''}" for m, es in edges.items()
            for t, name, line in es if _is_private(t, name) and _package(t) != _package(m)]


def _circles(edges) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's, iteratively)."""
    graph = defaultdict(set)
    for m, es in edges.items():
        graph[m] |= {t for t, _, _ in es if t != m}
    index, low, on, stack, circles = {}, {}, set(), [], []
    for root in sorted(graph):
        if root in index:
            continue
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        work = [(root, iter(sorted(graph[root])))]
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    circles.append(sorted(comp))
    return circles


def test_no_import_runs_upward():
    bad = _upward(_edges())
    assert not bad, "\n".join(bad)


def test_engine_folder_sits_above_stages_and_offload():
    """One row of LAYERS, read one way: engine/ assembles the stages and offload targets; they never import it."""
    bad = [f"{m}:{line} imports {t}" for m, es in _edges().items() if m.split(".")[1:2] in (["stages"], ["offload"])
           for t, _, line in es if t.startswith("framework.engine")]
    assert not bad, "\n".join(bad)


def test_no_private_names_across_packages():
    bad = _private(_edges())
    assert not bad, "export these from their package's __init__ (or move them):\n" + "\n".join(bad)


def _outside_private(files: dict[str, str]) -> list[str]:
    """The private framework names ``files`` (path -> source, absolute imports) use."""
    return [f"{path}:{line} imports {t}{'.' + name if name else ''}" for path, source in files.items()
            for t, name, line in _imports("framework", source=source) if _is_private(t, name)]


def test_bench_and_recipes_use_public_names_only():
    """bench/ and recipes/ use the package as a user does: what a package's ``__init__`` exports."""
    files = {str(p.relative_to(ROOT.parent)): p.read_text()
             for folder in ("bench", "recipes") for p in sorted((ROOT.parent / folder).rglob("*.py"))}
    assert files
    bad = _outside_private(files)
    assert not bad, "export these from their package's __init__:\n" + "\n".join(bad)


def test_no_import_circles():
    assert not _circles(_edges()), f"import circles: {_circles(_edges())}"


# The modules that import by name at run time, and why.
DYNAMIC = {
    # registry(): a config group's components are found in its package (stages, offload, ...) when
    # first asked for, so the layers below them (config) can name them without importing them.
    "framework.core.registry",
    # the compiled C++ extension, loaded from its build folder: not a module of the package.
    "framework.ops._loader",
}
_BY_NAME = {"import_module", "__import__", "spec_from_file_location", "module_from_spec", "load_module"}


def _by_name(node: ast.AST) -> bool:
    """A call that imports by name, or a framework module looked up in ``sys.modules``."""
    if isinstance(node, ast.Call):
        f = node.func
        if (f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")) in _BY_NAME:
            return True
        table, key = (f.value, node.args[0]) if isinstance(f, ast.Attribute) and node.args else (None, None)
    elif isinstance(node, ast.Subscript):
        table, key = node.value, node.slice
    else:
        return False
    return (isinstance(table, ast.Attribute) and table.attr == "modules"
            and isinstance(key, ast.Constant) and str(key.value).startswith("framework"))


def _dynamic(mod: str, source: str) -> list[str]:
    return [f"{mod}:{node.lineno} {ast.unparse(node)}" for node in ast.walk(ast.parse(source))
            if mod not in DYNAMIC and _by_name(node)]


def test_no_imports_by_name():
    bad = [line for m, p in MODULES.items() for line in _dynamic(m, p.read_text())]
    assert not bad, "import these with an import statement (or add the module to DYNAMIC, saying why):\n" + "\n".join(bad)


def test_each_check_finds_its_violation():
    """The checks are not vacuous: each finds a planted violation, and the real graph is read."""
    assert any(t == "framework.core.errors" for t, _, _ in _edges()["framework.engine.step"])
    assert _upward({"framework.core.errors": [("framework.engine.step", None, 1)]})
    assert _upward({"framework.persist.checkpoint": [("framework.engine.build", None, 1)]})
    assert not _upward({"framework.engine.build": [("framework.persist.weights", None, 1)]})
    assert _upward({"framework.models.gpt": [("framework", "initialize", 1)]})   # the public API is on top
    assert not _upward({"framework.models.gpt": [("framework.ops", None, 1)]})   # from framework import ops
    typed = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from framework.engine.build import Engine\n"
    assert _upward({"framework.models.gpt": _imports("framework.models.gpt", source=typed)})
    assert _circles({"framework.models.gpt": _imports("framework.models.gpt", source=typed),
                     "framework.engine.build": [("framework.models.gpt", None, 1)]})
    assert _private({"framework.engine.step": [("framework.stages._flat", None, 1)]})
    assert _private({"framework.cli.loop": [("framework.stages", "_hidden", 1)]})
    assert _private({"framework.cli.train": [("framework.comm.accelerator", "_Clocked", 1)]})
    assert _outside_private({"bench/x.py": "from framework.offload._aio import AsyncIO\n"})
    assert _outside_private({"bench/x.py": "from framework.offload import SwapFile\nSwapFile._held\n"})
    assert not _outside_private({"bench/x.py": "from framework.offload import AsyncIO\n"})
    assert not _private({"framework.stages.zero3": [("framework.stages._flat", None, 1)]})
    for source in ("import framework.stages.zero3 as z\nz._refuse_state_dict(None)\n",
                   "import framework.stages\nframework.stages._flat.make_layout\n",
                   "from framework import stages\nstages._flat.make_layout\n",
                   "from framework.stages import zero3\nzero3.Zero3._gather\n"):
        assert _private({"framework.engine.step": _imports("framework.engine.step", source=source)}), source
    assert not _private({"framework.engine.step": _imports("framework.engine.step", source=(
        "import framework.stages\nframework.stages.param_count\nframework.stages.Zero3.__name__\n"))})
    assert _circles({"framework.core.errors": [("framework.core.utils", None, 1)],
                     "framework.core.utils": [("framework.core.errors", None, 2)]})
    for call in ("importlib.import_module('framework.stages')", "__import__('framework.stages')",
                 "import_module('framework.stages')", "sys.modules['framework.cli.train']",
                 "sys.modules.get('framework.cli.train')",
                 "importlib.util.find_spec('framework.cli').loader.load_module('framework.cli.train')"):
        assert _dynamic("framework.config.checks", f"def _z():\n    {call}\n")
    assert not _dynamic("framework.core.registry", "importlib.import_module('framework.stages')")
    assert not _dynamic("framework.models.hf", "sys.modules.get('transformers')")
