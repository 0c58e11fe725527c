#!/usr/bin/env bash
# The composition check at the compute-bound size (hidden 256, sequence 128, 8 heads, 2
# layers, batch 8) as the bar is judged: GPT and MoE on meshes 8 and 2x4, whole segments
# (128 ranked combinations per window type plus those the baselines use), each row profiled
# afresh (an earlier work dir is moved aside, not deleted) and its 40 random plans measured
# right after, in the same sitting, one row at a time.
# Usage: bash scripts/compose_compute_bound.sh [RESULTS_PREFIX] [MODEL...]
# (default scripts/results/<date>, gpt moe): appends to <prefix>-composition-final-cpu.csv
# and writes the printouts to <prefix>-composition-final-cpu.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
prefix=${1:-scripts/results/$(date +%F)}
shift || true
models=${*:-gpt moe}
size="--num-layers 2 --hidden-size 256 --seq-len 128 --num-heads 8"
out="$prefix-composition-final-cpu.txt"
for mesh in 8 2x4; do
  for model in $models; do
    workdir="profiles/$model-tiny-L2-s128-h256-nh8-whole-$mesh"
    [[ -d $workdir ]] && mv "$workdir" "$workdir.before-$(date +%s)"
    echo "=== $model $size, mesh $mesh, whole segments, profiled afresh, $(date -u +%FT%TZ)" \
      | tee -a "$out"
    start=$SECONDS
    python scripts/composition_check.py --model "$model" $size --mesh "$mesh" \
      --whole-segments --max-combinations 128 --plans 40 \
      --out "$prefix-composition-final-cpu.csv" 2>&1 \
      | grep -v '^\[' \
      | grep -E "combinations|cheapest|reshardings timed|profile pass|random plans|warning|others took|anchor|as timed" \
      | tee -a "$out"
    echo "row wall time $((SECONDS - start)) s" | tee -a "$out"
    # the name above follows benchmark.workload_label; if that changes, no old work dir is
    # moved aside and a row could reuse a profile: stop instead
    [[ -d $workdir ]] || { echo "no work dir $workdir: its name no longer follows workload_label" >&2; exit 1; }
  done
done
