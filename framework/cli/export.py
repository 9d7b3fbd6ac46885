"""Consolidate a training checkpoint into safetensors that the plain model loads.

    python -m framework.export outputs/.../checkpoints/step-100 --to exported/
    python -m framework.export outputs/.../checkpoints --to exported/ --dtype bf16 --max-shard-size 2GB
    python -m framework.export outputs/.../checkpoints --to exported/ --overwrite   # replace an earlier export

CHECKPOINT is a checkpoint step folder or the checkpoint directory (its newest committed step, the one a resume
loads). A Hugging Face model's checkpoint (model=hf) is exported with its config.json, from the config the checkpoint
records, so ``from_pretrained`` loads the folder. An output folder holding weights is refused: choose an empty one, or
``--overwrite`` to replace an earlier export's files there; so is a config.json there, unless it describes the
checkpoint's Hugging Face model (replaced by the export's, naming the dtype written). What the output holds, and
``get_fp32_state_dict_from_checkpoint`` for Python: ``framework.persist.export``.
"""
from __future__ import annotations

import argparse

from framework.cli import fail
from framework.cli._signals import signals_unwind, terminated_line
from framework.core.errors import ConfigError, FrameworkError
from framework.core.paths import user_path
from framework.core.utils import plain_text
from framework.persist.export import export
from framework.precision import DTYPES


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m framework.export", description=plain_text(__doc__.split("\n\n")[0]))
    p.add_argument("checkpoint", type=user_path,
                   help="a checkpoint step folder, or the checkpoint directory (its newest committed step)")
    p.add_argument("--to", required=True, dest="out", type=user_path, help="output folder")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--max-shard-size", default="5GB", help="bytes per output file: 5GB, 500MB, 2GiB, ...")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the model*.safetensors (and index) already in --to; without it a --to holding "
                        "weights is refused (a config.json there: see above)")
    args = p.parse_args(argv)
    try:   # SIGTERM (Slurm, timeout) unwinds as Ctrl-C does: export removes its partial files, lock and made folders
        with signals_unwind():
            paths = export(args.checkpoint, args.out, dtype=DTYPES[args.dtype], max_shard_size=args.max_shard_size,
                           overwrite=args.overwrite)
    except KeyboardInterrupt:
        return fail(f"export: interrupted; nothing of it left in {args.out} (an earlier export there stays whole)", 130)
    except SystemExit as e:
        if (line := terminated_line(e)) is None:
            raise
        return fail(f"export: {line}; nothing of it left in {args.out} (an earlier export there stays whole)",
                    e.code)
    except FrameworkError as e:   # a refused argument (before any write) exits 2, as in the other tools
        return fail(e, 2 if isinstance(e, ConfigError) else 1)
    except OSError as e:   # (export names every write error itself: this is a read of the checkpoint)
        return fail(f"export: cannot read {e.filename or args.checkpoint} ({e.strerror or e}); check the "
                    "checkpoint's files and their permissions", 1)
    for path in paths:
        print(path)
    return 0
