"""``python -m framework.recipe``: run a recipe and check its numbers (see framework/cli/recipe.py, --help)."""
from framework.cli import open_closed_streams
from framework.cli.recipe import main

if __name__ == "__main__":
    open_closed_streams()
    raise SystemExit(main())
