"""Entry points: each command's code (``python -m framework.X`` runs ``framework/X.py``, which calls
``framework.cli.X.main``), the training loop and launcher they run, and the GPU-bug mutations the
checking accelerator is tested against."""
from __future__ import annotations

import sys
from typing import Callable

from framework.core.errors import FrameworkError


def run_command(doc: str, argv: list[str] | None, body: Callable[[list[str]], None]) -> int:
    """A ``key=value`` command's frame: ``-h``/``--help`` prints ``doc``; a ``FrameworkError`` is one
    ``error:`` line on stderr and exit code 2; otherwise 0."""
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(doc)
        return 0
    try:
        body(argv)
    except FrameworkError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
