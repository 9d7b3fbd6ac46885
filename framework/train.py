"""``python -m framework.train``: train from the command line (see framework/cli/train.py, --help)."""
from framework.cli import hydra_missing, open_closed_streams

try:
    from framework.cli.train import main
except ModuleNotFoundError as e:
    # Without Hydra (the library runs without it): one line under ``python -m``, the error when imported.
    if __name__ != "__main__":
        raise
    raise SystemExit(f"error: {hydra_missing(e, 'train')}") from None

if __name__ == "__main__":
    open_closed_streams()
    main()
