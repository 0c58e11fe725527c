#!/usr/bin/env bash
# Plans for clusters that are not here (README, "Planning for a cluster you do not have"):
# LLaMA-2-13B on alpa-50x4 and GPT-39B (Alpa's benchmark size) on 8 nodes of 8 A100s (within
# 32 GB, and within the preset's 80 GB), in
# bfloat16, analysis + profile + search on this machine; wall time and peak memory per case.
# The last case chooses LLaMA-2-13B's logical mesh (--mesh auto) and plans on it.
# Usage: bash scripts/cluster_cases.sh [OUT]  (default scripts/results/<date>-cluster-cpu.txt)
set -uo pipefail  # a case that has no plan says so and the next one runs
cd "$(dirname "$0")/.."
out=${1:-scripts/results/$(date +%F)-cluster-cpu.txt}
: > "$out"
run() {
  echo "=== python -m cfp $* ($(nproc) cores)" | tee -a "$out"
  /usr/bin/time -f "wall %e s, peak RSS %M KB" python -m cfp "$@" --workdir "$(mktemp -d)" 2>&1 \
    | grep -Ev "^\[|^  ParallelBlock|ParallelBlocks sequence|^window type|^wrote" | tee -a "$out"
}
run --model llama --config 13b --dtype bfloat16 --batch-size 8 --seq-len 1024 --cluster alpa-50x4
run --model llama --config 13b --dtype bfloat16 --batch-size 8 --seq-len 1024 --cluster alpa-50x4 \
  --mesh 5x10x4 --time-limit 60
run --model gpt --config 39b --dtype bfloat16 --batch-size 64 --cluster a100-64 --memory-budget 32
run --model gpt --config 39b --dtype bfloat16 --batch-size 64 --cluster a100-64
run --model llama --config 13b --dtype bfloat16 --batch-size 8 --seq-len 1024 --cluster alpa-50x4 \
  --mesh auto
echo "wrote $out"
