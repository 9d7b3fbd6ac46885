"""A regular (non-editable) install ships conf/ and csrc/ and finds them."""
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from framework.core.paths import REPO_ROOT


def _wheel(tmp_path: Path, out: Path) -> None:
    """Build the wheel from a copy of what it is made of: setuptools reuses the checkout's build/
    folder, where a module deleted since the last build would still be packed."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO_ROOT / name, src / name)
    for name in ("framework", "conf", "csrc"):
        shutil.copytree(REPO_ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "build"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(out)], check=True, capture_output=True, cwd=tmp_path)


def test_wheel_contains_every_package_and_config(tmp_path):
    _wheel(tmp_path, tmp_path)
    names = set(zipfile.ZipFile(next(tmp_path.glob("*.whl"))).namelist())
    for yaml in (REPO_ROOT / "conf").rglob("*.yaml"):
        assert f"framework/_conf/{yaml.relative_to(REPO_ROOT / 'conf')}" in names
    for py in (REPO_ROOT / "framework").rglob("*.py"):
        assert str(py.relative_to(REPO_ROOT)) in names, f"{py} missing from the wheel: add its package"


def test_installed_package_finds_conf(tmp_path):
    wheels, target = tmp_path / "w", tmp_path / "site"
    _wheel(tmp_path, wheels)
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target),
                    *map(str, wheels.glob("*.whl"))], check=True, capture_output=True, cwd=tmp_path)
    code = ("import framework, framework.core.paths as p; print(framework.__file__); print(p.conf_dir()); "
            "print(framework.compose(['optimizer=lion']).choices['optimizer'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                         env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    module, conf, choice = out.stdout.split()
    assert module.startswith(str(target)) and Path(conf) == target / "framework" / "_conf" and choice == "lion"


def test_every_package_framework_imports_is_declared():
    """A third-party module imported anywhere in framework/ is a dependency or an extra's of pyproject.toml
    (one pulled in by another package, as PyYAML by OmegaConf, goes missing where that one is not installed)."""
    import ast
    import importlib.metadata
    import re
    import tomllib

    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"].values()
    requirements = [*project["dependencies"], *(r for extra in extras for r in extra)]
    declared = {re.sub(r"[-_.]+", "-", re.split(r"[<>=!~;\[ ]", r)[0]).lower() for r in requirements}
    dists = importlib.metadata.packages_distributions()
    undeclared = set()
    for path in (REPO_ROOT / "framework").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else []
            for top in {n.split(".")[0] for n in names} - set(sys.stdlib_module_names) - {"framework"}:
                if not {re.sub(r"[-_.]+", "-", d).lower() for d in dists.get(top, [top])} & declared:
                    undeclared.add(f"{top} ({path.relative_to(REPO_ROOT)})")
    assert not undeclared, f"imported but not in pyproject.toml's dependencies or extras: {sorted(undeclared)}"


def test_every_hint_to_install_an_extra_is_the_one_that_works_from_a_checkout():
    """``pip install -e '.[NAME]'`` (NAME an extra of pyproject.toml) wherever the code, docs or recipes say how
    to get an extra: ``pip install 'framework[NAME]'`` looks for a package of that name on the index, and the
    checkout is often used through PYTHONPATH, not installed."""
    import re
    import tomllib

    extras = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    wrong = []
    for folder in ("framework", "docs", "recipes", "tests"):
        for path in (REPO_ROOT / folder).rglob("*"):
            if path.suffix not in (".py", ".md", ".yaml", ".sh") or path == Path(__file__):
                continue
            text = path.read_text(encoding="utf-8")
            for hint in re.findall(r"pip install (?:-e )?['\"]?[\w.]*\[[\w,]+\]['\"]?", text):
                names = re.fullmatch(r"pip install -e '\.\[([\w,]+)\]'", hint)
                if names is None or not set(names.group(1).split(",")) <= set(extras):
                    wrong.append(f"{path.relative_to(REPO_ROOT)}: {hint}")
    assert not wrong, wrong


def test_checkpoints_record_pyprojects_version_also_from_a_checkout_not_installed(monkeypatch):
    """train_state.json's framework_version: the checkout's pyproject.toml's, also where it is run by PYTHONPATH
    without pip install (the GPU image: no package metadata; it recorded null) or beside an older install."""
    import importlib.metadata
    import tomllib

    from framework.persist.checkpoint import _save

    version = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert _save.VERSION == _save._version() == version

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    assert _save._version() == version
    # An older install in the same environment is not the checkout that runs: its metadata is not the version.
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.0.1")
    assert _save._version() == version
