#!/usr/bin/env bash
# The exhaustive check on 8 virtual CPU devices (about 40 minutes on 2 cores):
# - the uniform space (one combination per window type) of the mlp on meshes 8, 2x4 and 4x2
#   (5, 65 and 65 plans with cfp's own);
# - the space around cfp's plan (one window type changed) of gpt and bert on mesh 8 (81 and 93
#   plans). Larger spaces (llama's 204 plans on 4x2, moe's) exceed --max-plans: holding ~200
#   compiled 8-device programs at once made XLA's CPU JIT fail here (LLVM 'Cannot allocate
#   memory' with RAM free; likely the kernel's memory-map limit).
set -euo pipefail
cd "$(dirname "$0")/../.."
E=scripts/enum_and_benchmark/enumerate_plans.py
COMMON=(--memory-budget 2 --max-combinations "${MAX_COMBINATIONS:-64}" --rounds "${ROUNDS:-9}")
for mesh in ${MESHES:-8 2x4 4x2}; do
  python $E --model mlp --config tiny --mesh "$mesh" --space uniform "${COMMON[@]}" "$@"
done
python $E --model gpt --num-heads 8 --mesh 8 --space around "${COMMON[@]}" "$@"
python $E --model bert --num-heads 8 --mesh 8 --space around "${COMMON[@]}" "$@"
