"""Estimate memory before training (the command is framework/cli/estimate.py; ``--help`` for its keys).

    python -m framework.estimate model=gpt2-medium gpus_per_node=8 nodes=2
    python -m framework.estimate params=2851M largest_layer=32M gpus_per_node=8
"""
from framework.cli.estimate import main

if __name__ == "__main__":
    raise SystemExit(main())
