#!/usr/bin/env bash
# The memory-bound CPU matrix (README, *Where memory binds*): gpt and llama at the compute-bound
# size (hidden 256, sequence 128, 8 heads, 2 layers, batch 8) on mesh 8 (windows split to 32
# combinations) and on 2x4 with whole segments (128 ranked combinations), each under a budget
# of 1.1 x the fsdp hand plan's compiled peak (its state donated), so that dp and megatron do
# not fit and fsdp does. Rows go to scripts/results/memory-bound/<date>-<backend>*.csv; each
# row's printout, with every plan's compiled peak and those over the budget marked, is the
# table the README quotes. MODELS and MESHES pick the rows.
set -euo pipefail
cd "$(dirname "$0")/.."
for mesh in ${MESHES:-8 2x4}; do
  for model in ${MODELS:-gpt llama}; do
    windows=(--max-combinations 32)
    [[ $mesh == 8 ]] || windows=(--whole-segments --max-combinations 128)
    start_s=$(date +%s)
    python scripts/benchmark.py --model "$model" --config tiny --num-layers 2 --num-heads 8 \
      --hidden-size 256 --seq-len 128 --budget-of fsdp --budget-factor 1.1 --rounds 15 \
      --out scripts/results/memory-bound --mesh "$mesh" "${windows[@]}" "$@"
    echo "=== $model mesh $mesh: $(( $(date +%s) - start_s )) s wall"
  done
done
