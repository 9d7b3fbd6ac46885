import sys
from pathlib import Path

import pytest

from tests.cli._forkrun import ForkRunner


@pytest.fixture(scope="session")
def forkrun():
    """``python -m framework.X`` commands forked from one process that imported the framework once
    (tests/cli/_forkrun.py): each command pays for its own work, not for importing torch again."""
    runner = ForkRunner(str(Path(__file__).resolve().parents[2]))
    yield runner
    runner.close()


@pytest.fixture
def own_component(tmp_path, monkeypatch):
    """``use(group, name, code, yaml)``: a module ``name`` of ``code`` in the group's package (a folder of its own
    added to the package's path) with conf/<group>/<name>.yaml in a folder on Hydra's search path (returned)."""
    import importlib

    from framework.core.registry import GROUPS, registry

    added = []

    def use(group, name, code, yaml):
        package = importlib.import_module(GROUPS[group])
        folder = tmp_path / f"code{len(added)}"
        folder.mkdir()
        (folder / f"{name}.py").write_text(code)
        (tmp_path / "conf" / group).mkdir(parents=True, exist_ok=True)
        (tmp_path / "conf" / group / f"{name}.yaml").write_text(yaml)
        monkeypatch.setattr(package, "__path__", [*package.__path__[:1], str(folder)])
        added.append((package, name))
        sys.modules.pop(f"{package.__name__}.{name}", None)
        registry.cache_clear()
        return f"hydra.searchpath=[file://{tmp_path / 'conf'}]"

    yield use
    for package, name in added:
        sys.modules.pop(f"{package.__name__}.{name}", None)
        vars(package).pop(name, None)
    registry.cache_clear()
