#!/usr/bin/env bash
# The whole CPU matrix, mesh by mesh: every workload on meshes 8, 2x4 and 4x2 (about two hours
# on 2 cores; the 2-D meshes cost most, their strategy spaces are larger).
set -euo pipefail
cd "$(dirname "$0")/.."
for mesh in ${MESHES:-8 2x4 4x2}; do
  for m in ${MODELS:-gpt llama bert moe mlp}; do
    MESHES="$mesh" bash scripts/cpu_8dev.sh "$m" "$@"
  done
done
