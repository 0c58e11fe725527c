#!/usr/bin/env bash
# The test suite's wall time and its slowest tests, as the README quotes them.
# Usage: bash scripts/suite_time.sh [OUT_FILE]  (default scripts/results/<date>-suite-cpu.txt)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-scripts/results/$(date +%F)-suite-cpu.txt}
start=$(date +%s)
tmp=$(mktemp)  # outside scripts/results, whose index the suite checks
trap 'rm -f "$tmp"' EXIT
status=0
python3 -m pytest -q cfp_test --durations=15 -p no:cacheprovider 2>&1 | tee "$tmp" || status=$?
end=$(date +%s)
{ echo "# $(nproc) cores; $(python3 -c 'import cfp, jax; print("jax", jax.__version__)')"
  echo "# wall: $((end - start)) s"
  cat "$tmp"; } > "$out"
echo "wrote $out (wall $((end - start)) s)"
exit $status
