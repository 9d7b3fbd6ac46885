"""``python -m framework.export``: a checkpoint as safetensors (see framework/cli/export.py, --help)."""
from framework.cli.export import main

if __name__ == "__main__":
    raise SystemExit(main())
