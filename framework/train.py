"""Train from the command line (the command is framework/cli/train.py; ``--help`` for Hydra's help).

    python -m framework.train                              # default job: gpt-nano on synthetic data
    python -m framework.train +stage=zero3 offload=cpu     # compose a stage and an offload target
"""
from framework.cli.train import main

if __name__ == "__main__":
    main()
