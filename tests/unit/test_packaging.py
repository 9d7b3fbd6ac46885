"""A regular (non-editable) install ships conf/ and csrc/ and finds them."""
import subprocess
import sys
import zipfile
from pathlib import Path

from framework.core.paths import REPO_ROOT


def test_wheel_contains_every_package_and_config(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(REPO_ROOT), "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(tmp_path)], check=True, capture_output=True, cwd=tmp_path)
    names = set(zipfile.ZipFile(next(tmp_path.glob("*.whl"))).namelist())
    for yaml in (REPO_ROOT / "conf").rglob("*.yaml"):
        assert f"framework/_conf/{yaml.relative_to(REPO_ROOT / 'conf')}" in names
    for py in (REPO_ROOT / "framework").rglob("*.py"):
        assert str(py.relative_to(REPO_ROOT)) in names, f"{py} missing from the wheel: add its package"


def test_installed_package_finds_conf(tmp_path):
    wheels, target = tmp_path / "w", tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(REPO_ROOT), "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(wheels)], check=True, capture_output=True, cwd=tmp_path)
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target),
                    *map(str, wheels.glob("*.whl"))], check=True, capture_output=True, cwd=tmp_path)
    code = ("import framework, framework.core.paths as p; print(framework.__file__); print(p.conf_dir()); "
            "print(framework.compose(['optimizer=lion']).choices['optimizer'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                         env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    module, conf, choice = out.stdout.split()
    assert module.startswith(str(target)) and Path(conf) == target / "framework" / "_conf" and choice == "lion"
