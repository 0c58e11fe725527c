#!/usr/bin/env bash
# Driver in the style of the original artifact's cfp_test/<model>/<model>_test.sh.
#   run_model.sh MODEL [--num_layer N] [--batch_size B] [--device_num D] [--mode M] [--mesh S]
#                      [--config PRESET] [extra python -m cfp flags...]
# Without --mode, every pass runs in order.
set -euo pipefail
model="$1"; shift
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
args=(--model "$model")
device_num=8
while [ $# -gt 0 ]; do
  case "$1" in
    --num_layer) args+=(--num-layers "$2"); shift 2 ;;
    --batch_size) args+=(--batch-size "$2"); shift 2 ;;
    --device_num) device_num="$2"; shift 2 ;;
    --mode) args+=(--mode "$2"); shift 2 ;;
    *) args+=("$1"); shift ;;
  esac
done
cd "$root"
# On CPU the virtual devices share host memory, so search needs a budget: 2 GB per device
# unless one is given (on a GPU the device's memory is the default).
case " ${args[*]} " in
  *" --memory-budget "*) ;;
  *) if [ "$(python -c 'import jax; print(jax.default_backend())' 2>/dev/null)" = cpu ]; then
       args+=(--memory-budget 2); fi ;;
esac
exec python -m cfp --num-devices "$device_num" --driver-lines "${args[@]}"
