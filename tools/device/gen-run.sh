#!/usr/bin/env bash
# `asyncside bench generate` on the GPU machine, after tools/device/cuda-run.sh built the extension
# in the same (still warm) session. Usage: tools/device/gen-run.sh NAME [bench generate args...]
# Writes $OUT/gen-NAME.json (and the log beside it) and prints the rows.
. "$(dirname "$0")/bench-env.sh"
name=$1; shift
echo "== $(date +%T) bench generate $name: $*"
python3 -m asyncside.cli bench generate "$@" --plot none --json > "$OUT/gen-$name.json" 2> "$OUT/gen-$name.log"
rc=$?
tail -5 "$OUT/gen-$name.log"
python3 - "$OUT/gen-$name.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["rows"]:
    print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()
           if isinstance(v, (int, float, str, bool)) and not k.endswith("per_round")})
print("targets:", json.dumps(d.get("targets", {}).get("checks", []))[:3000])
PY
exit $rc
