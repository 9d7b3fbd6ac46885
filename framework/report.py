"""``python -m framework.report``: a sweep report (see framework/cli/report.py, --help)."""
from framework.cli import open_closed_streams
from framework.cli.report import main

if __name__ == "__main__":
    open_closed_streams()
    main()
