#!/usr/bin/env bash
# Plans for clusters that are not here (README, "Planning for a cluster you do not have"):
# LLaMA-2-13B on alpa-50x4 and GPT-39B (Alpa's benchmark size) on 8 nodes of 8 A100s (within
# 32 GB, and within the preset's 80 GB), in
# bfloat16, analysis + profile + search on this machine; wall time and peak memory per case.
# The last training case chooses LLaMA-2-13B's logical mesh (--mesh auto) and plans on it.
# The forward cases plan LLaMA-2-13B's forward computation alone (--step forward, the case of
# Alpa's simulation) on alpa-50x4 within its 32 GB, at batch 8 and at batch 200 (which the
# 50 nodes and the 200 devices divide, so that data parallelism over nodes is a plan too).
# The a100 cases plan the runs people train on one node of 8 A100s (bfloat16): LLaMA-2-7B at
# batch 32, sequence 2048, and GPT-6.7B at batch 16, each plan's whole step (and each hand
# plan's) compiled for the A100s with no GPU here (the gpu-compile extra).
# Usage: bash scripts/cluster_cases.sh [OUT [train|forward|a100]]  (train and forward when
# left out; default OUT scripts/results/<date>-cluster-cpu.txt)
set -uo pipefail  # a case that has no plan says so and the next one runs
cd "$(dirname "$0")/.."
out=${1:-scripts/results/$(date +%F)-cluster-cpu.txt}
: > "$out"
run() {
  echo "=== python -m cfp $* ($(nproc) cores)" | tee -a "$out"
  /usr/bin/time -f "wall %e s, peak RSS %M KB" python -m cfp "$@" --driver-lines --workdir "$(mktemp -d)" 2>&1 \
    | grep -Ev "^\[|^  ParallelBlock|ParallelBlocks sequence|^window type|^wrote" | tee -a "$out"
}
cases=${2:-all}
if [ "$cases" = a100 ]; then
run --model llama --config 7b --dtype bfloat16 --batch-size 32 --seq-len 2048 --cluster a100-8
run --model gpt --config 6.7b --dtype bfloat16 --batch-size 16 --cluster a100-8
echo "wrote $out"
exit 0
fi
if [ "$cases" != forward ]; then
run --model llama --config 13b --dtype bfloat16 --batch-size 8 --seq-len 1024 --cluster alpa-50x4
run --model llama --config 13b --dtype bfloat16 --batch-size 8 --seq-len 1024 --cluster alpa-50x4 \
  --mesh 5x10x4 --time-limit 60
run --model gpt --config 39b --dtype bfloat16 --batch-size 64 --cluster a100-64 --memory-budget 32
run --model gpt --config 39b --dtype bfloat16 --batch-size 64 --cluster a100-64
run --model llama --config 13b --dtype bfloat16 --batch-size 8 --seq-len 1024 --cluster alpa-50x4 \
  --mesh auto
fi
if [ "$cases" != train ]; then
for batch in 8 200; do
  run --model llama --config 13b --dtype bfloat16 --batch-size $batch --seq-len 1024 \
    --cluster alpa-50x4 --step forward
done
fi
echo "wrote $out"
