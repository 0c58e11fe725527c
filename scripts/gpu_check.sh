#!/usr/bin/env bash
# The GPU check (scripts/gpu_check.py) on a machine with one GPU, writing its CSVs and log to
# scripts/results/<date>-gpu-*. Usage: bash scripts/gpu_check.sh [OUT_DIR] [--tiny]
# (--tiny: toy sizes on the CPU, to check the script itself).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-scripts/results/$(date +%F)-gpu}
shift || true
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# the GPU's memory is cfp's to budget: no preallocation of 75% by the first process
export XLA_PYTHON_CLIENT_PREALLOCATE=false
python3 scripts/gpu_check.py --out "$out" "$@"
