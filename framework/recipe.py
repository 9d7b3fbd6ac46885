"""Run a recipe and check it against its expected numbers (the command is framework/cli/recipe.py;
``--help`` for the rest).

    python -m framework.recipe --list
    python -m framework.recipe shakespeare_char_cpu --quick
"""
from framework.cli.recipe import main

if __name__ == "__main__":
    raise SystemExit(main())
