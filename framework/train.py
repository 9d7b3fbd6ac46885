"""``python -m framework.train``: train from the command line (see framework/cli/train.py, --help)."""
import sys

from framework.cli import fail, hydra_missing, open_closed_streams

try:
    from framework.cli.train import main
except ModuleNotFoundError as e:
    # Without Hydra (the library runs without it): one line under ``python -m``, the error when imported;
    # exit 2 as framework.recipe's same line and every refused setup
    if __name__ != "__main__":
        raise
    open_closed_streams()
    sys.exit(fail(hydra_missing(e, "train"), 2))

if __name__ == "__main__":
    open_closed_streams()
    main()
