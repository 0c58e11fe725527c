#!/usr/bin/env bash
# cfp against the baselines for one model on 8 virtual CPU devices, meshes 8, 2x4, 4x2.
# 8 virtual devices share this machine's cores: sharding buys no compute here, so these numbers
# validate the machinery and the ranking on CPU, not GPU speedups.
# Usage: bash scripts/cpu_8dev.sh MODEL [benchmark.py flags]   MODEL: mlp, gpt, llama, bert, moe
#        (MESHES, MAX_COMBINATIONS and ROUNDS in the environment override the defaults)
set -euo pipefail
cd "$(dirname "$0")/.."
model=${1:?give the model: mlp, gpt, llama, bert or moe}
shift
case $model in  # the matrix's workloads: 8 heads (and 8 experts) so that 8 devices divide them
  mlp) size=() ;;
  moe) size=(--num-heads 8 --num-experts 8) ;;
  *) size=(--num-heads 8) ;;
esac
for mesh in ${MESHES:-8 2x4 4x2}; do
  python scripts/benchmark.py --model "$model" --config tiny "${size[@]}" --mesh "$mesh" \
    --memory-budget 2 --max-combinations "${MAX_COMBINATIONS:-64}" --rounds "${ROUNDS:-15}" "$@"
done
