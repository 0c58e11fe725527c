#!/usr/bin/env bash
# cfp against the baselines for the llama workload on 8 virtual CPU devices, meshes 8, 2x4, 4x2.
# 8 virtual devices share this machine's cores: sharding buys no compute here, so these numbers
# validate the machinery and the ranking on CPU, not GPU speedups.
set -euo pipefail
cd "$(dirname "$0")/.."
for mesh in ${MESHES:-8 2x4 4x2}; do
  python scripts/benchmark.py --model llama --config tiny --num-heads 8 --mesh "$mesh" \
    --memory-budget 2 --max-combinations ${MAX_COMBINATIONS:-64} --rounds ${ROUNDS:-15} "$@"
done
