"""``python -m framework.plan``: the setups that fit, fastest first (see framework/cli/plan.py, --help)."""
from framework.cli.plan import main

if __name__ == "__main__":
    raise SystemExit(main())
