#!/usr/bin/env bash
# Three tiers under a memory budget on the GPU machine (device pools <- pinned host tier <- SSD):
# tools/device/three_tier.py (its docstring says what it measures), then optionally a bisection of
# the GPU-only hang of tests/test_queued.py. Usage, in a warm session:
#   SETUP=1 tools/device/three-tier.sh   (first: install MLX CUDA and build the extension, cuda-run.sh)
# Env: MEMORY_MAX (the cgroup's memory.max and the budget, default 12G), LOCALITIES (default middle),
# TOKENS (default 64), WALL (seconds for the whole call, default 580), BUILD_ONLY=1 (build the store and measure the disk, then stop), RUNS=0 (skip
# the runs), BISECT="group ..." (after the runs: the page-cache test's q4 cases after each named
# group of earlier tests; groups below), BISECT_BUDGET (seconds, default 300).
set -uo pipefail
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
T_END=$(( $(date +%s) + ${WALL:-580} ))  # the whole call's wall time: the runs get what is left
if [ -n "${SETUP:-}" ]; then
  SETUP_ONLY=1 OUT=$OUT bash "$(dirname "$0")/cuda-run.sh" || exit 1
fi
. "$(dirname "$0")/bench-env.sh"
export PYTHONPATH=/tmp/site:$PWD
log() { echo "== $(date +%T) $*"; }
free -g | head -2; df -h /root | tail -1; nproc
if [ "${RUNS:-1}" = 1 ]; then
  log "three tiers: memory.max ${MEMORY_MAX:-12G}, localities ${LOCALITIES:-middle}"
  name=three-tier-${MEMORY_MAX:-12G}-$(echo "${LOCALITIES:-middle}" | tr , -)
  timeout $(( T_END - $(date +%s) )) python3 tools/device/three_tier.py --memory-max "${MEMORY_MAX:-12G}" \
    --localities "${LOCALITIES:-middle}" --tokens "${TOKENS:-64}" ${BUILD_ONLY:+--build-only} \
    --json "$OUT/$name.json" 2>&1 | tee "$OUT/$name.log"
fi
if [ -n "${BISECT:-}" ]; then
  # The q4 cases of the page-cache test hang in mlx-lm's reference generation after the rest of
  # tests/test_queued.py (they pass alone): run them after each group of the earlier tests.
  declare -A G=(
    [none]="nothing_at_all"
    [steps]="test_queued_steps_exact_and_fault_in_every_layer"
    [sched]="head_is_scheduled or armed_as_it_is_scheduled or fails_while_queued or failed_fault_fails or ensure_while or mlx_refuses"
    [tables]="fault_table_reads or no_expert_ids or fault_table_refuses or fault_victims"
    [plans]="step_plan or process_exits_cleanly"
    [device]="device_fault_table or device_lookup or host_fault_tables or flipped_byte"
    [all]="not past_the_page_cache"
  )
  end=$(( $(date +%s) + ${BISECT_BUDGET:-300} )); [ $end -gt $T_END ] && end=$T_END
  for g in $BISECT; do
    left=$(( end - $(date +%s) )); [ $left -lt 30 ] && { log "bisect: out of time before $g"; break; }
    log "bisect: page-cache q4 after group $g (${left} s left)"
    timeout -s INT -k 10 $left python3 -m pytest -q -rfE -p no:cacheprovider --timeout=${TEST_TIMEOUT:-45} -x \
      tests/test_queued.py -k "(${G[$g]}) or (past_the_page_cache and q4)" 2>&1 | tee "$OUT/bisect-$g.log" \
      | grep -E "passed|failed|Timeout|timeout|Error|error" | tail -8
  done
fi
log done
