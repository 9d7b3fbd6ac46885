"""Our ddp stage vs torch DistributedDataParallel: step time and peak RSS per rank.

    .venv/bin/python -m bench.ddp_vs_torch [--rounds 3] [--steps 20]

A thin wrapper of ``bench.stages`` (see there for the set-up): ``--systems ddp,torch-ddp``.
"""
from __future__ import annotations

import os
import sys

if __package__ in (None, ""):  # run as a file path: make ``bench`` importable (and so the spawned ranks)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.stages import main  # noqa: E402

if __name__ == "__main__":
    main(["--systems", "ddp,torch-ddp", *sys.argv[1:]])
