#!/usr/bin/env bash
# All three passes through each driver script (2 layers, 8 virtual CPU devices), each in a
# fresh work dir with the compilation cache off; the search lines and the wall time of each.
# Usage: bash scripts/drivers.sh [OUT_FILE]  (default scripts/results/<date>-drivers-cpu.txt)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-scripts/results/$(date +%F)-drivers-cpu.txt}
tmp=$(mktemp -d)
: > "$out"
for driver in gpt/gpt llama2/llama moe/moe bert/bert; do
  echo "=== $driver" | tee -a "$out"
  SECONDS=0
  sh "cfp_test/${driver}_test.sh" --num_layer 2 --workdir "$tmp/${driver%%/*}" \
    --compilation-cache none \
    | grep -E "^search:|^plan on mesh|^  |numerical check|solution \(|step time" | tee -a "$out"
  echo "wall $SECONDS s" | tee -a "$out"
done
rm -rf "$tmp"
