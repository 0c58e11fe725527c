#!/usr/bin/env bash
# Pipeline stages for clusters that are not here (README, "Pipeline stages"): LLaMA-2-13B on
# alpa-50x4 and GPT-39B on 8 nodes of 8 A100s, the cases of scripts/cluster_cases.sh, with
# 8 micro-batches; then a 4-layer GPT staged and run on this machine's 8 virtual devices.
# Usage: bash scripts/stage_cases.sh [OUT]  (default scripts/results/<date>-stages-cpu.txt)
set -uo pipefail  # a case that has no plan says so and the next one runs
cd "$(dirname "$0")/.."
out=${1:-scripts/results/$(date +%F)-stages-cpu.txt}
: > "$out"
run() {
  echo "=== python -m cfp --mode stages $* ($(nproc) cores)" | tee -a "$out"
  /usr/bin/time -f "wall %e s, peak RSS %M KB" python -m cfp --mode stages "$@" \
    --workdir "$(mktemp -d)" 2>&1 | grep -Ev "^\[|^wrote" | tee -a "$out"
}
run --model llama --config 13b --dtype bfloat16 --batch-size 8 --seq-len 1024 --cluster alpa-50x4 \
  --micro-batches 8
run --model gpt --config 39b --dtype bfloat16 --batch-size 64 --cluster a100-64 --memory-budget 32 \
  --micro-batches 8
run --model gpt --config 39b --dtype bfloat16 --batch-size 64 --cluster a100-64 --micro-batches 8
run --model gpt --num-layers 4 --batch-size 16 --micro-batches 4 --memory-budget 2
echo "wrote $out"
