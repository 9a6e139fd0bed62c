#!/usr/bin/env bash
# Host time per decode step (`asyncside bench step`) with and without an environment setting,
# alternated in one GPU session, after tools/device/cuda-run.sh built the extension there.
# Usage: tools/device/ab-step-env.sh "VAR=value" ROUNDS [bench step args...]
# Writes $OUT/ab-step-{on,off}-N.json and prints each run's host and step medians.
. "$(dirname "$0")/bench-env.sh"
export PYTHONPATH=/tmp/site:$PWD
setting=$1; rounds=$2; shift 2
for n in $(seq 1 "$rounds"); do
  for side in off on; do
    if [ $side = on ]; then env "$setting" python3 -m asyncside.bench.step "$@" --json > "$OUT/ab-step-$side-$n.json" 2> "$OUT/ab-step-$side-$n.err"
    else python3 -m asyncside.bench.step "$@" --json > "$OUT/ab-step-$side-$n.json" 2> "$OUT/ab-step-$side-$n.err"; fi
    python3 - "$OUT/ab-step-$side-$n.json" "$side" "$setting" <<'PY' || tail -5 "$OUT/ab-step-$side-$n.err"
import json, sys
d = json.load(open(sys.argv[1]))
label = sys.argv[3] if sys.argv[2] == "on" else "default"
for r in d["rows"]:
    a, m = r["asyncside_ms"], r["mlx_lm_ms"]
    print(f"{label:32s} batch {r['batch']}: asyncside host {a['host']:.3f} step {a['step']:.3f} ms;"
          f" mlx-lm host {m['host']:.3f} step {m['step']:.3f} ms")
PY
  done
done
