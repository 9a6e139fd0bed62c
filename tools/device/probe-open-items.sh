#!/usr/bin/env bash
# The GPU's open items, one question each, in one call after cuda-run.sh installed and built
# (REUSE=1 SETUP_ONLY=1 bash tools/device/cuda-run.sh && QUESTIONS="threads bridge" bash tools/device/probe-open-items.sh).
# threads: the two-thread generation test alone (a worker once aborted in StepPlan.advance under xdist);
# bridge: test_bridge's error paths on MLX CUDA; growth: the decode cache growth test; seeded: the
# seeded-sampler test alone; forktest: the fork test (a forked child cannot use MLX on CUDA).
set -uo pipefail
OUT=${OUT:-$PWD/device-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD:/tmp/site LD_LIBRARY_PATH=/tmp/site/mlx/lib PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
log() { echo "== $(date +%T) $*"; }
T="python3 -m pytest -q -rfE -p no:cacheprovider -p no:xdist"
for q in ${QUESTIONS:-threads bridge growth seeded forktest}; do
case $q in
threads)
  log "P1 two threads, trio and asyncio, alone"
  timeout 150 $T --timeout 120 -s "tests/test_api_lifecycle_14.py::test_one_model_generating_on_two_threads_loops_under_budgets_wakes_the_waiter" > "$OUT/p1.log" 2>&1; echo "rc $?"
  grep -nE "terminate|what\(\)|Error|error|passed|failed|Abort" "$OUT/p1.log" | head -30
  if command -v gdb >/dev/null; then
    log "P1 under gdb (trio)"
    timeout 150 gdb -q -batch -ex "set pagination off" -ex run -ex "thread apply all bt 12" --args python3 -m pytest -q -p no:cacheprovider -p no:xdist -s --timeout 120 \
      "tests/test_api_lifecycle_14.py::test_one_model_generating_on_two_threads_loops_under_budgets_wakes_the_waiter[trio]" > "$OUT/p1-gdb.log" 2>&1
    grep -nE "SIGABRT|terminate|what\(\)|^#[0-9]+ " "$OUT/p1-gdb.log" | grep -vE "pthread_cond|futex|epoll|poll \(|__GI___poll|sem_|select" | head -60
  fi ;;
bridge)
  log "P3 test_bridge on the GPU"
  timeout 150 $T --timeout 60 --tb=short tests/test_bridge.py > "$OUT/p3.log" 2>&1; echo "rc $?"
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/p3.log" | tail -15
  grep -nE "^E " "$OUT/p3.log" | head -30 ;;
growth)
  log "P4 decode cache growth"
  timeout 150 $T --timeout 140 --tb=line tests/test_memory_growth_15.py -k grows > "$OUT/p4.log" 2>&1; echo "rc $?"; tail -8 "$OUT/p4.log" ;;
seeded)
  log "P5 seeded sampler alone"
  timeout 200 $T --timeout 190 --durations=3 "tests/test_facade_unseen_17.py::test_a_seeded_sampler_and_logits_processors_give_mlx_lms_tokens" > "$OUT/p5.log" 2>&1; echo "rc $?"; tail -8 "$OUT/p5.log" ;;
forktest)
  log "P2b the fork test"
  timeout 150 $T --timeout 140 --tb=short tests/test_unseen_inputs_17a.py -k fork > "$OUT/p2b.log" 2>&1; echo "rc $?"; tail -15 "$OUT/p2b.log" ;;
esac
done
log done
