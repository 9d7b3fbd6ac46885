"""``python -m framework.plan``: the setups that fit, fastest first (see framework/cli/plan.py, --help)."""
from framework.cli import open_closed_streams
from framework.cli.plan import main

if __name__ == "__main__":
    open_closed_streams()
    raise SystemExit(main())
