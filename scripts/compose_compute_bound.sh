#!/usr/bin/env bash
# The composition check at the compute-bound size (hidden 256, sequence 128, 8 heads, 2
# layers, batch 8): GPT and MoE on meshes 8 and 2x4 with windows split to fit 32 combinations
# (on mesh 8 composed from 5 profiles against the same measured steps), and on 2x4 with
# whole segments (128 ranked combinations each) plus the ranking's recall.
# Usage: bash scripts/compose_compute_bound.sh [RESULTS_PREFIX] [MODEL...]
# (default scripts/results/<date>, gpt moe): appends to <prefix>-composition-cpu.csv and
# <prefix>-ranking-recall-cpu.csv, and writes <prefix>-compute-bound-composition-cpu.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
prefix=${1:-scripts/results/$(date +%F)}
shift || true
models=${*:-gpt moe}
size="--num-layers 2 --hidden-size 256 --seq-len 128 --num-heads 8"
out="$prefix-compute-bound-composition-cpu.txt"
for model in $models; do
  for mesh in 8 2x4; do
    echo "=== $model $size, mesh $mesh, split windows (cpu, $(nproc) cores)" | tee -a "$out"
    profiles=1; [[ $mesh == 8 ]] && profiles=5  # a 2x4 profile takes minutes, not seconds
    python scripts/composition_check.py --model "$model" $size --mesh "$mesh" \
      --profiles $profiles --out "$prefix-composition-cpu.csv" 2>&1 \
      | grep -E "combinations:|reshardings timed|profile pass|random plans|warning|others took|^profile [0-9]|profiles of one" | tee -a "$out"
  done
  python scripts/ranking_recall.py --model "$model" $size --mesh 2x4 --ranked 128 2>&1 \
    | grep -v spmd_partitioner | tee -a "$out"
  echo "=== $model $size, mesh 2x4, whole segments" | tee -a "$out"
  python scripts/composition_check.py --model "$model" $size --mesh 2x4 --whole-segments \
    --max-combinations 128 --out "$prefix-composition-cpu.csv" 2>&1 \
    | grep -E "combinations:|cheapest|reshardings timed|profile pass|random plans|warning|others took" | tee -a "$out"
done
