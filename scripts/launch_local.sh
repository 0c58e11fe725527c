#!/usr/bin/env bash
# Start N processes of `python -m cfp ARGS...` on this machine, as N hosts would run it:
# process i gets --process-id i, all share --coordinator 127.0.0.1:$CFP_PORT (default 23450;
# the workers' runtimes use the ports above it). On CPU each process gets its share of the
# virtual devices (--num-devices, or the mesh's size, split evenly). Process 0 reports and
# writes the work dir; the others' output goes to $CFP_LOG_DIR/process-<i>.log (default
# /tmp). The exit status is process 0's, once every process has ended.
#
#   bash scripts/launch_local.sh 2 --model mlp --max-combinations 8 --memory-budget 1
set -u
n=${1:?usage: launch_local.sh N ARGS...}
shift
port=${CFP_PORT:-23450}
logs=${CFP_LOG_DIR:-/tmp}
pids=()
for ((i = 1; i < n; i++)); do
  python -m cfp "$@" --coordinator "127.0.0.1:$port" --num-processes "$n" --process-id "$i" \
    >"$logs/process-$i.log" 2>&1 &
  pids+=($!)
done
python -m cfp "$@" --coordinator "127.0.0.1:$port" --num-processes "$n" --process-id 0
status=$?
for pid in "${pids[@]}"; do
  wait "$pid" || true
done
exit $status
