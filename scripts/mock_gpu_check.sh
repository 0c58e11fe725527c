#!/usr/bin/env bash
# An 8-GPU node planned on the one GPU here, and the checks one GPU allows
# (scripts/mock_gpu_check.py, within 9 minutes); then, while LIMIT_S seconds from the start
# (default 0: none) are not spent, the GPU check (scripts/gpu_check.sh).
# Usage: [LIMIT_S=N] bash scripts/mock_gpu_check.sh [OUT_PREFIX]  (scripts/results/<date>-gpu)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-scripts/results/$(date +%F)-gpu}
start=$SECONDS
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false
python3 scripts/mock_gpu_check.py --out "$out-mock"
left=$(( ${LIMIT_S:-0} - (SECONDS - start) ))
if [ "$left" -gt 30 ]; then
    timeout --kill-after=5 "$left" bash scripts/gpu_check.sh "$out"
fi
