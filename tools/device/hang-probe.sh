#!/usr/bin/env bash
# Run one test that may hang on the GPU machine; if it still runs after WAIT seconds, dump every
# thread's Python stack (faulthandler), kernel wait channel and native backtrace (gdb, where present).
# Usage: WAIT=90 bash tools/device/hang-probe.sh TEST_ID [more pytest args]
set -uo pipefail
OUT=${OUT:-$PWD/device-out}; mkdir -p "$OUT"
export PYTHONPATH=/tmp/site LD_LIBRARY_PATH=/tmp/site/mlx/lib
WAIT=${WAIT:-90}
command -v gdb py-spy || true
python3 -m pytest -q -p no:cacheprovider -s --timeout=0 -o faulthandler_timeout=$((WAIT - 20)) "$@" > "$OUT/hang.log" 2>&1 &
PID=$!
for _ in $(seq 1 "$WAIT"); do sleep 1; kill -0 $PID 2>/dev/null || break; done
if kill -0 $PID 2>/dev/null; then
  echo "STILL RUNNING after ${WAIT}s"
  for t in /proc/$PID/task/*; do echo "$(basename $t) $(cat $t/comm) wchan=$(cat $t/wchan) $(awk '{print $3}' $t/stat)"; done > "$OUT/threads.txt"
  command -v gdb >/dev/null && gdb -p $PID -batch -ex "set pagination off" -ex "thread apply all bt 30" > "$OUT/gdb.txt" 2>&1
  command -v py-spy >/dev/null && py-spy dump --native --pid $PID > "$OUT/pyspy.txt" 2>&1
  kill -9 $PID
else
  wait $PID; echo "exit $?"
fi
tail -80 "$OUT/hang.log"
