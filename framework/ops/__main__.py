"""``python -m framework.ops [status|build]``: report on, or build ahead of time, the C++ kernels.

``status`` (the default) never compiles and exits 0. ``build`` compiles now (about a minute) and exits 1 with the
reason if that fails; ``build --if-needed`` only where there is no finished build (``make test`` runs it first).
"""

from __future__ import annotations

import argparse
import sys
import time

from framework import ops
from framework.ops import _loader
from framework.core.utils import plain_text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m framework.ops", description=plain_text(__doc__),
                                     epilog=f"environment:\n{_loader.ENVIRONMENT}",
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", nargs="?", default="status", choices=["status", "build"])
    parser.add_argument("--if-needed", action="store_true",
                        help="build: keep a finished build (import it), compile only where there is none")
    args = parser.parse_args(argv)
    if args.if_needed and args.command != "build":
        parser.error("--if-needed goes with build")
    if args.command == "build":
        start = time.perf_counter()
        try:
            ops.build(force=not args.if_needed)
        except ops.BuildUnavailable as exc:
            print(f"framework.ops: build failed: {exc}", file=sys.stderr)
            return 1
        print(f"framework.ops: {'ready' if args.if_needed else 'built'} in {time.perf_counter() - start:.1f} s")
    info = ops.status()
    print("framework.ops: C++ CPU optimizer kernels (csrc/cpu_optim)")
    if info["built"]:
        print(f"  built:        yes, usable: {', '.join(info['kernels'])}")
    else:
        state = info["reason"] if info["reason"] == ops.OFF else f"no ({info['reason']})"
        print(f"  built:        {state}; {_loader.FALLBACK}")
    print(f"  build dir:    {info['build_dir']}")
    print(f"  isa:          {info['isa'] or '-'} (detected: {info['detected_isa']})")
    prefetch = info["prefetch"]
    print(f"  prefetch:     {'-' if prefetch is None else f'{prefetch} floats ahead' if prefetch else 'off'}")
    print(f"  threads:      {info['threads']} (torch.get_num_threads())")
    return 0


if __name__ == "__main__":
    sys.exit(main())
