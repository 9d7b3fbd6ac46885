"""``python -m framework.recipe``: run a recipe and check its numbers (see framework/cli/recipe.py, --help)."""
from framework.cli.recipe import main

if __name__ == "__main__":
    raise SystemExit(main())
