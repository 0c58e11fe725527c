#!/usr/bin/env bash
# The profile pass and the composition check for the README: 4-layer GPT and MoE on 8 virtual
# CPU devices, meshes 8 and 2x4, profiled from scratch with the compilation cache off.
# Usage: bash scripts/profile_and_compose.sh [RESULTS_PREFIX] [MODEL:MESH...]
# (default scripts/results/<date>, all four rows): writes <prefix>-profile-cpu.txt and appends
# to <prefix>-composition-cpu.csv.
set -euo pipefail
cd "$(dirname "$0")/.."
prefix=${1:-scripts/results/$(date +%F)}
shift || true
rows=${*:-gpt:8 gpt:2x4 moe:8 moe:2x4}
out="$prefix-profile-cpu.txt"
: > "$out"
for row in $rows; do
  model=${row%%:*} mesh=${row##*:}
  {
    workdir="profiles/$model-tiny-L4-$mesh"
    rm -rf "$workdir"
    echo "=== $model, 4 layers, mesh $mesh (cpu, 8 virtual devices on $(nproc) cores)" | tee -a "$out"
    python -m cfp --model "$model" --num-layers 4 --mesh "$mesh" --mode analysis -v \
      | grep -E "plan space|^segment type|^analysis:" | tee -a "$out"
    /usr/bin/time -f "profile wall: %e s" python -m cfp --model "$model" --num-layers 4 \
      --mesh "$mesh" --mode profile --compilation-cache none -v 2>&1 \
      | grep -E "window types|search space|combinations:|reshardings|profile pass|wall|plan space" \
      | tee -a "$out"
    python scripts/composition_check.py --model "$model" --num-layers 4 --mesh "$mesh" \
      --plans 20 --out "$prefix-composition-cpu.csv" | tee -a "$out"
  }
done
