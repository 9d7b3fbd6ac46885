#!/usr/bin/env bash
# GPU readiness in one command (at most 8 minutes on one H200, start-up included):
#   bash bench/gpu_check.sh [--dry-run] [--out DIR] [--budget SECONDS] [--skip CHECK,...]
# Runs with $PYTHON (default: python3) as it is: nothing is installed, and Hydra, OmegaConf and
# W&B are not needed. The C++ host kernels build on first use (ninja next to the interpreter).
# Writes DIR/gpu_check.md and DIR/gpu_check.json (default DIR: gpu_check_out). See bench/gpu_check.py.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$(dirname "$(command -v "$PY")"):$PATH"
export HF_HUB_OFFLINE=1 WANDB_MODE=disabled
exec timeout --kill-after=10 480 "$PY" -m bench.gpu_check "$@"
