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
