"""Plan a run: the setups that fit, fastest first (the command is framework/cli/plan.py; ``--help`` for its
keys and flags).

    python -m framework.plan model=gpt2-medium
    python -m framework.plan model=gpt-mini --verify 3
"""
from framework.cli.plan import main

if __name__ == "__main__":
    raise SystemExit(main())
