#!/usr/bin/env bash
# Three tiers under a memory budget on the GPU machine (device pools <- pinned host tier <- SSD), beside
# the slot cache: tools/device/three_tier.py (its docstring says what it measures), in one call that
# ends inside WALL seconds and prints a markdown table at the end. Usage, in a fresh session:
#   SETUP=1 tools/device/three-tier.sh   (installs MLX CUDA and builds the extension first: cuda-run.sh)
# Env: MEMORY_MAX (the cgroup's limit and the budget, default 4200M: the 48-layer store is 4.1x it),
# RESIDENT (device pools' share of each layer's experts, or auto; default 0.10), TIER_SHARE (host
# tier's share of the layers, default 0), LOCALITIES (default low,middle,high; with ROUTING none unless set),
# ROUTING (your own routing traces, .npz paths separated by spaces or commas: each a locality labelled by
# its file's stem, fitted onto the shape as bench offload --routing fits it), ARMS (default
# asyncside,asyncside-whole,slot-cache), TOKENS (default 24: a run ends by its tokens), SECONDS_CAP
# (decode seconds a run, default 20), DISK_BYTES (each disk pass, default 2G), WALL (seconds for the whole call, default 580),
# BUILD_ONLY=1 (build the store and measure the disk, then stop), RUNS=0 (skip the runs), BISECT="group
# ..." (after the runs: the page-cache test's q4 cases after each named group of earlier tests;
# groups below), BISECT_BUDGET (seconds, default 300), EXTRA (more three_tier.py arguments, e.g. a smaller
# shape for a check on another machine: "--layers 8 --vocab 512").
set -uo pipefail
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
T_END=$(( $(date +%s) + ${WALL:-580} ))  # the whole call's wall time: the runs get what is left
. "$(dirname "$0")/bench-env.sh"
echo "set up; $(( T_END - $(date +%s) )) s of WALL left"
export PYTHONPATH=/tmp/site:$PWD
log() { echo "== $(date +%T) $*"; }
free -g | head -2; df -h /root | tail -1; nproc
if [ "${RUNS:-1}" = 1 ]; then
  MEM=${MEMORY_MAX:-4200M}
  ROUTING_ARGS=()
  for f in $(echo "${ROUTING:-}" | tr , ' '); do ROUTING_ARGS+=(--routing "$f"); done
  if [ -n "${ROUTING:-}" ]; then LOCS=${LOCALITIES-}; else LOCS=${LOCALITIES:-low,middle,high}; fi
  name=three-tier-$MEM-$(echo "$LOCS" | tr , -)${ROUTING:+-routing}
  log "three tiers: limit $MEM, resident ${RESIDENT:-0.10}, tier share ${TIER_SHARE:-0}, localities ${LOCS:-none}, routing ${ROUTING:-none} ($(( T_END - $(date +%s) )) s left)"
  # three_tier.py stops starting runs before the deadline and prints the table itself; the timeout
  # (a few seconds later) is the backstop, and the table is printed from the JSON if it fired.
  left=$(( T_END - $(date +%s) - 3 )); [ $left -lt 10 ] && left=10
  timeout -k 5 $left python3 tools/device/three_tier.py --memory-max "$MEM" \
    --resident "${RESIDENT:-0.10}" --tier-share "${TIER_SHARE:-0}" --localities "$LOCS" ${ROUTING_ARGS[@]+"${ROUTING_ARGS[@]}"} \
    --arms "${ARMS:-asyncside,asyncside-whole,slot-cache}" --tokens "${TOKENS:-24}" --seconds "${SECONDS_CAP:-20}" \
    --disk-bytes "${DISK_BYTES:-2G}" --deadline $(( T_END - 8 )) ${BUILD_ONLY:+--build-only} ${EXTRA:-} \
    --json "$OUT/$name.json" > "$OUT/$name.md" 2> "$OUT/$name.log"
  rc=$?
  tail -40 "$OUT/$name.log"
  log "three_tier.py exit status $rc; the table:"
  if [ -s "$OUT/$name.md" ]; then cat "$OUT/$name.md"
  elif [ -s "$OUT/$name.json" ]; then python3 tools/device/three_tier.py --markdown-from "$OUT/$name.json"
  else echo "no results: the store build did not finish inside WALL (run again: a built store is reused)"; fi
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
