#!/usr/bin/env bash
# GPU readiness in one command (at most 8 minutes on one H200, start-up included):
#   bash bench/gpu_check.sh [--dry-run] [--out DIR] [--logs DIR] [--budget SECONDS] [--skip CHECK,...]
# Runs with $PYTHON (default: python3) as it is: nothing is installed, and Hydra, OmegaConf and
# W&B are not needed. The C++ host kernels build on first use (ninja next to the interpreter).
# Writes DIR/gpu_check.md, DIR/gpu_check.json and DIR/gpu_check.tgz (all of it, logs included; default
# DIR: gpu_check_out; the checks' own files go to --logs, default DIR/logs). On the device tool, which
# returns at most 8 files from $OUT: --out "$OUT" --logs /tmp/gpu_check_logs. See bench/gpu_check.py.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$(dirname "$(command -v "$PY")"):$PATH"
export HF_HUB_OFFLINE=1 WANDB_MODE=disabled
# The hard limit: --budget is clamped below it, and its SIGTERM still leaves the table written.
export GPU_CHECK_HARD_LIMIT_S=480
exec timeout --preserve-status --kill-after=10 "$GPU_CHECK_HARD_LIMIT_S" "$PY" -m bench.gpu_check "$@"
