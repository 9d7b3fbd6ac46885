"""A Markdown table and PNG plots of a Hydra multirun folder (the command is framework/cli/report.py).

    python -m framework.report multirun/2026-12-01/10-00-00 [--out DIR] [--title TEXT]
"""
from framework.cli.report import main

if __name__ == "__main__":
    main()
