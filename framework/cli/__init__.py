"""Entry points: each command's code (``python -m framework.X`` runs ``framework/X.py``, which calls
``framework.cli.X.main``), and the training loop and launcher they run."""
from __future__ import annotations

import os
import sys
from typing import Callable, Mapping

from framework.config import GROUPS, ROOT_KEYS, leaf_key, override_key
from framework.core.errors import ConfigError, FrameworkError, say
from framework.core.registry import closest_hint
from framework.core.utils import plain_text


HYDRA_PACKAGES = ("hydra", "omegaconf", "antlr4")   # the command line's composer (core dependencies)


def hydra_missing(e: ModuleNotFoundError, command: str) -> str:
    """The one line for ``python -m framework.<command>`` where Hydra or OmegaConf is not installed (an image
    that installed torch's stack but not this project's dependencies); any other missing module is raised."""
    if (e.name or "").split(".")[0] not in HYDRA_PACKAGES:
        raise e
    return (f"python -m framework.{command} needs Hydra, and {e.name} is not installed for {sys.executable}: "
            f"pip install -e . (from the checkout; or pip install 'hydra-core>=1.3.2,<1.4'); "
            f"the library (framework.compose, framework.initialize) runs without it")


def open_closed_streams() -> None:
    """Give a standard stream closed when the command started (``>&-``, ``2>&-``: Python's ``sys.stdout`` is then
    None) ``os.devnull``, at its own descriptor: what the run and Hydra print goes nowhere instead of failing on
    None, and the next file opened does not take descriptor 1 or 2, where the ranks' output would land in it."""
    for fd, name, mode in ((0, "stdin", "r"), (1, "stdout", "w"), (2, "stderr", "w")):
        if getattr(sys, name) is None:
            null = os.open(os.devnull, os.O_RDWR)
            if null != fd:   # (a lower descriptor closed too, not yet reopened: the loop goes in order)
                os.dup2(null, fd)
                os.close(null)
            setattr(sys, name, open(fd, mode, closefd=False))


# Other tools' names for a rank count (torchrun's nproc, a world size, a GPU count): estimate's and plan's hints.
RANK_NAMES = ("world_size", "nproc", "nproc_per_node", "gpus", "num_gpus", "gpu", "num_gpu")


def fail(error: object, code: int) -> int:
    """Print ``error`` as one ``error:`` line on stderr; return the exit status ``code``."""
    say(f"error: {error}")
    return code


def run_command(doc: str, argv: list[str] | None, tool: str, own_keys, flags: dict,
                body: Callable[[dict[str, str], list[str], dict], None],
                aliases: Mapping[str, str | tuple[str, str]] | None = None) -> int:
    """A ``key=value`` command's frame: ``-h``/``--help`` prints ``doc``; ``body(own, overrides, flags)`` gets the
    arguments whose key is in ``own_keys``, the rest as Hydra overrides, and the ``--name`` flags (an int default: a
    whole number >= 1); a ``FrameworkError`` is one ``error:`` line and exit code 2. ``aliases``: other tools' names
    (lower case) for own keys or the training config's, for an unknown key's "did you mean" (a pair: with a note)."""
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(plain_text(doc))
        return 0
    try:
        own, overrides, flags = {}, [], dict(flags)
        it = iter(argv)
        for arg in it:
            name = arg[2:]
            if arg.startswith("--") and type(flags.get(name)) is int:
                try:
                    flags[name] = int(next(it))
                except (StopIteration, ValueError):
                    raise ConfigError(f"{tool}: {arg} needs a number") from None
                if flags[name] < 1:
                    raise ConfigError(f"{tool}: {arg} needs a whole number >= 1, got {flags[name]}")
            elif arg.startswith("--") and name in flags:
                flags[name] = True
            elif arg.startswith("--"):
                known = ", ".join(f"--{k} N" if type(v) is int else f"--{k}" for k, v in flags.items())
                raise ConfigError(f"{tool}: unknown flag {arg} (known: {known}, --help)")
            else:
                key, eq, value = arg.partition("=")
                if not eq and not arg.startswith("~"):   # (Hydra's delete, ~KEY, has no value)
                    raise ConfigError(f"{tool}: expected key=value or ~key, got {arg!r} "
                                      f"(see python -m framework.{tool} --help)")
                top = override_key(key).split(".")[0].split("@")[0]
                if key in own_keys:
                    own[key] = value
                elif top in (*ROOT_KEYS, *GROUPS, "hydra"):
                    overrides.append(arg)
                else:   # neither this tool's key nor the training config's: most likely a mistyped own key
                    valid = (*own_keys, *ROOT_KEYS, *GROUPS)
                    raise ConfigError(f"{tool}: unknown key {top!r}{_key_hint(top, valid, aliases)}; {tool}'s keys: "
                                      f"{', '.join(own_keys)}; any other key=value overrides the training "
                                      f"config (conf/train.yaml: {', '.join((*ROOT_KEYS, *GROUPS))})")
        body(own, overrides, flags)
    except FrameworkError as e:
        return fail(e, 2)
    return 0


def _key_hint(top: str, valid, aliases: Mapping[str, str | tuple[str, str]] | None) -> str:
    """An unknown key's "did you mean": the tool's alias (and its note), else the training config's key of that
    name or its common alias anywhere (``seq_len``: model.context), else the closest key by spelling."""
    said = (aliases or {}).get(top.lower())
    key, note = (said, "") if said is None or isinstance(said, str) else said
    if (key := key or leaf_key(top)) is not None:
        return f" (did you mean {key!r}?{f' {note}' if note else ''})"
    return closest_hint(top, valid)
