"""``python -m framework.export``: a checkpoint as safetensors (see framework/cli/export.py, --help)."""
from framework.cli import open_closed_streams
from framework.cli.export import main

if __name__ == "__main__":
    open_closed_streams()
    raise SystemExit(main())
