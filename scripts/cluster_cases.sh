#!/usr/bin/env bash
# Plans for clusters that are not here (README), bfloat16, all passes here; wall time and peak
# memory per case. train: LLaMA-2-13B on alpa-50x4 and GPT-39B on 8 nodes of 8 A100s (within
# 32 GB and 80 GB), the last choosing LLaMA-2-13B's logical mesh (--mesh auto). forward:
# LLaMA-2-13B's forward alone (Alpa's simulation) on alpa-50x4, batch 8 and 200.
# The a100 cases: LLaMA-2-7B (batch 32 and 128, sequence 2048) and GPT-6.7B (batch 16 and 128)
# on 8 A100s, whole steps compiled for them with no GPU here (the gpu-compile extra); at the
# larger batches no plan fits without recomputing.
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
run --model llama --config 7b --dtype bfloat16 --batch-size 128 --seq-len 2048 --cluster a100-8
run --model gpt --config 6.7b --dtype bfloat16 --batch-size 16 --cluster a100-8
run --model gpt --config 6.7b --dtype bfloat16 --batch-size 128 --cluster a100-8
echo "wrote $out" && exit 0
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
