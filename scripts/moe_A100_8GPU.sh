#!/usr/bin/env bash
# cfp against the baselines for the GShard MoE 380M preset on one node of 8 GPUs, meshes 8 and 2x4.
# Nobody ran this in this repo (no 8-GPU machine); the CSVs name the backend they came from.
set -euo pipefail
cd "$(dirname "$0")/.."
for mesh in ${MESHES:-8 2x4}; do
  python scripts/benchmark.py --model moe --config 380m --batch-size 32 --mesh "$mesh" \
    --max-combinations 128 --rounds "${ROUNDS:-15}" "$@"
done
