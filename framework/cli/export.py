"""Consolidate a training checkpoint into safetensors that the plain model loads.

    python -m framework.export outputs/.../checkpoints/step-100 --to exported/
    python -m framework.export outputs/.../checkpoints --to exported/ --dtype bf16 --max-shard-size 2GB

CHECKPOINT is a checkpoint step folder or the checkpoint directory (its ``latest`` is followed); what the
output holds, and ``get_fp32_state_dict_from_checkpoint`` for Python: ``framework.persist.export``.
"""
from __future__ import annotations

import argparse
import errno
import sys
from pathlib import Path

from framework.core.errors import FrameworkError
from framework.persist.export import export
from framework.precision import DTYPES


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m framework.export", description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", help="a checkpoint step folder, or the checkpoint directory (its 'latest')")
    p.add_argument("--to", required=True, dest="out", help="output folder")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--max-shard-size", default="5GB", help="bytes per output file: 5GB, 500MB, 2GiB, ...")
    args = p.parse_args(argv)
    try:
        paths = export(args.checkpoint, args.out, dtype=DTYPES[args.dtype], max_shard_size=args.max_shard_size)
    except (FrameworkError, OSError) as e:
        msg, out = str(e), Path(args.out).resolve()
        # an OSError naming a file outside --to is a read; any other is a write (os.write names no file)
        if isinstance(e, OSError) and not (e.filename and out not in (p := Path(e.filename).resolve(), *p.parents)):
            msg = (f"--to {args.out}: cannot write {e.filename or args.out} ({e.strerror or e}); "
                   + ("no room on the disk (or a file size limit): free space or pass a folder on a larger disk"
                      if e.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT) else "pass a writable folder")
                   + "; an earlier export there is kept")
        print(f"error: {msg}", file=sys.stderr)
        return 1
    for path in paths:
        print(path)
    return 0
