#!/usr/bin/env bash
# The profile pass and the composition check for the README: 4-layer GPT and MoE on 8 virtual
# CPU devices, meshes 8 and 2x4. Appends to scripts/results/<date>-profile-cpu.txt and
# scripts/results/<date>-composition-cpu.csv.
set -euo pipefail
cd "$(dirname "$0")/.."
out="scripts/results/$(date +%F)-profile-cpu.txt"
for model in gpt moe; do
  for mesh in 8 2x4; do
    echo "=== $model, 4 layers, mesh $mesh (cpu, 8 virtual devices on $(nproc) cores)" | tee -a "$out"
    python -m cfp --model "$model" --num-layers 4 --mesh "$mesh" --mode analysis \
      | grep -E "plan space|unique segment|analysis time" | tee -a "$out"
    /usr/bin/time -f "profile wall: %e s" python -m cfp --model "$model" --num-layers 4 \
      --mesh "$mesh" --mode profile 2>&1 \
      | grep -E "window types|search space|combinations:|reshardings|overall time|wall|plan space" \
      | tee -a "$out"
    python scripts/composition_check.py --model "$model" --num-layers 4 --mesh "$mesh" \
      --plans 20 | tee -a "$out"
  done
done
