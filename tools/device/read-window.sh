#!/usr/bin/env bash
# The read window measured on the GPU machine's disk against decode A/Bs of windows there (MLX on
# its CPU: streamed resolves are the host pools' path), in one call (BENCHMARKS.md, "The read window
# from the disk"). After tools/device/cuda-run.sh built the extension in the same session (or
# SETUP=1 to build it first). Env: SHAPES (default "qwen3-30b-a3b gpt-oss-20b"; 8 layers, vocabulary
# 512 each), PAIRS (window pairs, A against B, default "2:4 8:4 16:4"), TOKENS (per A/B, default 48),
# MEMORY (the runtime's budget; default none: ASYNCSIDE_DIRECT=1 has the plan read O_DIRECT), PROBES (default 3),
# WALL (seconds for the whole call, default 560).
set -uo pipefail
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
T_END=$(( $(date +%s) + ${WALL:-560} ))
. "$(dirname "$0")/bench-env.sh"
export PYTHONPATH=/tmp/site:$PWD
log() { echo "== $(date +%T) $*"; }
nproc; free -g | head -2; lsblk -d -o NAME,SIZE,ROTA,MODEL 2>/dev/null | head -5; df -h "$HOME" | tail -1
for shape in ${SHAPES:-qwen3-30b-a3b gpt-oss-20b}; do
  log "$shape: store"
  store=$(timeout $(( T_END - $(date +%s) - 5 )) python3 -c "
from asyncside.bench.shapes import ensure_shape
print(ensure_shape('$shape', layers=8, vocab=512, progress=False)['store'])" 2> "$OUT/build-$shape.log" | tail -1)
  [ -d "$store" ] || { tail -5 "$OUT/build-$shape.log"; continue; }
  python3 -c "
from asyncside.routing import preset
from asyncside import ExpertStore
s = ExpertStore.open('$store'); spec = s.layer(sorted(s.layers)[0])
top = {'qwen3-30b-a3b': 8, 'gpt-oss-20b': 4}['$shape']
preset('low', tokens=512, n_layers=len(s.layers), n_experts=spec.n_experts, top_k=top).save('$OUT/low-$shape.npz')"
  log "$shape: the window measured, ${PROBES:-3} times"
  python3 - "$store" > "$OUT/probe-$shape.json" <<'PY'
import json, sys
from asyncside import ExpertStore
from asyncside import read_window as rw
s = ExpertStore.open(sys.argv[1])
specs = [s.layer(i) for i in s.layers]
out = []
import os
for _ in range(int(os.environ.get("PROBES", "3"))):
    rw.forget_measured()
    out.append(rw.choose_read_window(specs).as_dict())
    print(out[-1]["window"], rw.describe_rates({int(k): v for k, v in out[-1]["rates"].items()}), file=sys.stderr)
print(json.dumps(out))
PY
  for pair in ${PAIRS:-2:4 8:4 16:4}; do
    a=${pair%:*}; b=${pair#*:}
    left=$(( T_END - $(date +%s) - 5 )); [ $left -lt 30 ] && { log "out of time"; break 2; }
    log "$shape: decode A/B window $a against $b ($left s left)"
    ASYNCSIDE_DIRECT=1 timeout $left python3 tools/device/on_cpu.py tools/ab_fault_chunk.py --compare window --window $a --baseline-window $b \
      --model "$store" ${MEMORY:+--memory $MEMORY} --resident 0 --routing "$OUT/low-$shape.npz" --tokens ${TOKENS:-48} \
      > "$OUT/ab-$shape-$a-$b.json" 2> "$OUT/ab-$shape-$a-$b.err"
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print({k: v for k, v in d.items() if k.endswith('tok_s') or k in ('direct','hit_rate','tokens_per_arm')})" "$OUT/ab-$shape-$a-$b.json" || tail -5 "$OUT/ab-$shape-$a-$b.err"
  done
done
log "done"
