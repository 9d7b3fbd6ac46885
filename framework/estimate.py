"""``python -m framework.estimate``: estimate memory before training (see framework/cli/estimate.py, --help)."""
from framework.cli import open_closed_streams
from framework.cli.estimate import main

if __name__ == "__main__":
    open_closed_streams()
    raise SystemExit(main())
