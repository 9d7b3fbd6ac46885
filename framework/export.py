"""Consolidate a training checkpoint into safetensors (the command is framework/cli/export.py).

    python -m framework.export outputs/.../checkpoints/step-100 --to exported/
"""
from framework.cli.export import main

if __name__ == "__main__":
    raise SystemExit(main())
