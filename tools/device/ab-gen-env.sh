#!/usr/bin/env bash
# `asyncside bench generate` with and without an environment setting, alternated in one GPU
# session, after tools/device/cuda-run.sh built the extension there.
# Usage: tools/device/ab-gen-env.sh "VAR=value" ROUNDS [bench generate args...]
# Writes $OUT/ab-gen-{on,off}-N.json and prints each run's asyncside rows (tok/s, vs mlx-lm).
. "$(dirname "$0")/bench-env.sh"
export PYTHONPATH=/tmp/site:$PWD
setting=$1; rounds=$2; shift 2
for n in $(seq 1 "$rounds"); do
  for side in off on; do
    f="$OUT/ab-gen-$side-$n.json"
    if [ $side = on ]; then env "$setting" python3 -m asyncside.cli bench generate "$@" --plot none --json > "$f" 2> "${f%.json}.err"
    else python3 -m asyncside.cli bench generate "$@" --plot none --json > "$f" 2> "${f%.json}.err"; fi
    python3 - "$f" "$side" "$setting" <<'PY' || tail -5 "${f%.json}.err"
import json, sys
d = json.load(open(sys.argv[1]))
label = sys.argv[3] if sys.argv[2] == "on" else "default"
ref = {r["residency"]: r["decode_tokens_per_s"] for r in d["rows"] if r["system"] == "mlx-lm"}
for r in d["rows"]:
    if r["system"] == "asyncside":
        print(f"{label:32s} {r['residency']:.2f}: asyncside {r['decode_tokens_per_s']:.1f} tok/s, "
              f"mlx-lm {ref[r['residency']]:.1f}, vs mlx-lm {r['vs_all_resident']:.3f}, "
              f"identical {r['tokens_identical']}, hit rate {r['hit_rate']:.3f}")
PY
  done
done
