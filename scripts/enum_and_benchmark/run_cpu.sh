#!/usr/bin/env bash
# The exhaustive check on 8 virtual CPU devices: the mlp workload on meshes 8, 2x4 and 4x2
# (spaces of 9, 81 and 81 layer-uniform plans; about 10 minutes on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/../.."
for mesh in ${MESHES:-8 2x4 4x2}; do
  python scripts/enum_and_benchmark/enumerate_plans.py --model mlp --config tiny --mesh "$mesh" \
    --memory-budget 2 --max-combinations "${MAX_COMBINATIONS:-64}" --rounds "${ROUNDS:-9}" "$@"
done
