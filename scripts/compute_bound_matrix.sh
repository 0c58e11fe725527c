#!/usr/bin/env bash
# The compute-bound CPU matrix (README, *The compute-bound matrix*): gpt, llama, bert and moe at
# hidden 256, sequence 128, 8 heads, 2 layers, batch 8, on mesh 8 (windows split to 32
# combinations) and on 2x4 with whole segments (128 ranked combinations). Each row profiles
# in its own work dir, then times its plans in 15 rounds; a rerun of a row replaces its rows
# in scripts/results/compute-bound/<date>-<backend>*.csv. MODELS and MESHES pick the rows;
# each row's wall time is printed after it.
set -euo pipefail
cd "$(dirname "$0")/.."
for mesh in ${MESHES:-8 2x4}; do
  for model in ${MODELS:-gpt llama bert moe}; do
    windows=(--max-combinations 32)
    [[ $mesh == 8 ]] || windows=(--whole-segments --max-combinations 128)
    start_s=$(date +%s)
    python scripts/benchmark.py --model "$model" --config tiny --num-layers 2 --num-heads 8 \
      --hidden-size 256 --seq-len 128 --memory-budget 2 --rounds 15 \
      --out scripts/results/compute-bound --mesh "$mesh" "${windows[@]}" "$@"
    echo "=== $model mesh $mesh: $(( $(date +%s) - start_s )) s wall"
  done
done
