#!/usr/bin/env bash
# Serving under a memory budget on the GPU machine: `asyncside bench serve --memory` with one client
# then eight, on the store tools/device/three-tier.sh built (the qwen3-30b-a3b shape, all 48 layers),
# every request replaying its own sequence of a synthetic trace; then, if PROBE=1, the quantized
# direct-plan probe (tools/device/probe_q4_direct.py). Run it in the same warm session after
# three-tier.sh (SETUP there installed MLX CUDA and built the extension).
# Env: MEMORY (the budget, default 4200M), LOCALITIES (default high,middle), CLIENTS (default 1,8),
# DURATION / WARMUP (seconds a phase, default 30 / 10), PROBE (default 1), WALL (default 580),
# SHAPE (default qwen3-30b-a3b), LAYERS (MoE layers of the shape, default all: a fresh machine builds
# a smaller store faster), VOCAB (the store's vocabulary as three-tier.sh's EXTRA built it, default the shape's),
# ROWS (values of ASYNCSIDE_ROWS_CONCURRENCY to run in turn per locality, default "auto"), RESIDENT
# (the pools' share of each layer, default auto: sized to the budget; a fraction keeps the rows a
# layer of the 48-layer run on a smaller store), SEQUENCES (the trace's sequences, default 16: request n
# replays sequence n mod SEQUENCES; 1 makes every request route as the first, a workload whose
# requests share their experts, as parallel samples of one prompt do).
set -uo pipefail
. "$(dirname "$0")/bench-env.sh"
export PYTHONPATH=/tmp/site:$PWD
T_END=$(( $(date +%s) + ${WALL:-580} ))
log() { echo "== $(date +%T) $*"; }
SHAPE=${SHAPE:-qwen3-30b-a3b}
read -r STORE NL NE K < <(python3 -c "from asyncside.bench.shapes import ensure_shape as e
s = e('$SHAPE', layers=${LAYERS:-None}, vocab=${VOCAB:-None}, progress=False)
import json, os; c = json.load(open(os.path.join(s['store'], 'config.json')))
print(s['store'], c['num_hidden_layers'], c.get('num_experts') or c.get('n_routed_experts'), c['num_experts_per_tok'])") || exit 1
log "store $STORE"
for loc in $(echo "${LOCALITIES:-high,middle}" | tr , ' '); do
  left=$(( T_END - $(date +%s) - 5 ))
  [ $left -lt 120 ] && { log "no time left for $loc"; break; }
  python3 -c "from asyncside.routing import preset
preset('$loc', tokens=2048, n_layers=$NL, n_experts=$NE, top_k=$K, sequences=${SEQUENCES:-16}).save('/tmp/$loc-seq.npz')" || exit 1
  for rows in ${ROWS:-auto}; do
    left=$(( T_END - $(date +%s) - 5 ))
    [ $left -lt 60 ] && { log "no time left for $loc rows $rows"; break; }
    log "bench serve, $loc, memory ${MEMORY:-4200M}, rows bound $rows ($left s left)"
    ASYNCSIDE_ROWS_CONCURRENCY=$rows timeout -k 5 $left bash "$(dirname "$0")/serve-run.sh" "memory-$SHAPE-$loc-L$NL-seq${SEQUENCES:-16}-rows-$rows" \
      --model "$STORE" --resident "${RESIDENT:-auto}" \
      --memory "${MEMORY:-4200M}" --routing "/tmp/$loc-seq.npz" --clients "${CLIENTS:-1,8}" \
      --duration "${DURATION:-30}" --warmup "${WARMUP:-10}" --max-tokens 16 --prompt-lengths 4 --long-prompt 0 \
      --no-mlx-lm --predictor none
    log "serve $loc rows $rows exit status $?"
  done
done
if [ "${PROBE:-1}" = 1 ]; then
  left=$(( T_END - $(date +%s) - 3 ))
  if [ $left -ge 30 ]; then
    log "q4 direct-plan probe ($left s left)"
    timeout -k 5 $left python3 tools/device/probe_q4_direct.py q4 2>&1 | tee "$OUT/probe-q4-direct.log" | grep -v "^layer stride"
  fi
fi
log done
