"""``python -m framework.train``: train from the command line (see framework/cli/train.py, --help)."""
from framework.cli.train import main

if __name__ == "__main__":
    main()
