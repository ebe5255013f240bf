#!/usr/bin/env bash
# `make demo` N times in a row (default 20); counts the runs that exited 0 with a complete summary and
# no abort at exit ("terminate called", a signal exit code). The log of every bad run is kept.
#
#   bash benchmarks/demo_repeat.sh [N] [LOG_DIR]
set -uo pipefail
cd "$(dirname "$0")/.."
runs=${1:-20}
logs=${2:-$(mktemp -d -t demo-repeat.XXXXXX)}
mkdir -p "$logs"
clean=0
for i in $(seq 1 "$runs"); do
  start=$(date +%s)
  make demo >"$logs/run-$i.log" 2>&1
  status=$?
  seconds=$(( $(date +%s) - start ))
  if [ "$status" -eq 0 ] && grep -q "^done: " "$logs/run-$i.log" \
     && ! grep -qE "terminate called|exitcode *: *-[0-9]+|Signal [0-9]+ \(SIG" "$logs/run-$i.log"; then
    clean=$((clean + 1)); verdict=clean; rm -f "$logs/run-$i.log"
  else
    verdict="NOT CLEAN (exit $status; log $logs/run-$i.log)"
  fi
  echo "run $i of $runs: ${seconds} s, $verdict"
done
echo "$clean of $runs make demo runs clean"
[ "$clean" -eq "$runs" ]
