#!/usr/bin/env bash
# The tests marked slow (deselected from the suite to keep it under 10 minutes on 2 cores):
# the remaining model x mesh cases of the sharded-step, communication-free and user-jit
# checks, training and bfloat16 runs of the models the suite leaves out, the reshaped-heads
# model through three passes on 2x4, the scanned and remat stacks through three passes, and
# --device-preset here fitted once for a profile and its search; steps handed to autoshard as
# functions (NNX, Equinox, a notebook run by a real kernel, a profile found again and a changed
# step profiled again) and a bfloat16 Hugging Face Flax LLaMA on meshes 8 and 2x4.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pytest -q -m slow cfp_test "$@"
