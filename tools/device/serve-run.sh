#!/usr/bin/env bash
# `asyncside bench serve` on the GPU machine, after tools/device/cuda-run.sh built the extension
# in the same (still warm) session: asyncside's server and mlx_lm.server (all-resident, batching
# on) on the same model, phase by phase. Usage: tools/device/serve-run.sh NAME [bench serve args...]
# Writes $OUT/serve-NAME.json (and the log beside it) and prints the phases.
. "$(dirname "$0")/bench-env.sh"
name=$1; shift
# A fresh machine builds the embedded model first (a minute or two): not inside the bench's time.
python3 -c "from asyncside.models.embedded import ensure_embedded_default as e; print('embedded model:', e(None)[0])"
echo "== $(date +%T) bench serve $name: $*"
python3 -m asyncside.cli bench serve "$@" --json > "$OUT/serve-$name.json" 2> "$OUT/serve-$name.log"
rc=$?
tail -5 "$OUT/serve-$name.log"
python3 - "$OUT/serve-$name.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print("engine:", d.get("engine"))
keys = ("server", "clients", "tokens_per_s", "per_stream_tokens_per_s_p50", "ttft_p50_s", "ttft_p99_s",
        "itl_p50_s", "itl_p99_s", "requests_done", "error_count", "vs_mlx_lm", "vs_own_single")
for p in d["phases"]:
    print({k: (round(p[k], 3) if isinstance(p.get(k), float) else p.get(k)) for k in keys})
    if p.get("concurrency"):
        print("   concurrency:", json.dumps(p["concurrency"])[:400])
    if p.get("engine"):
        print("   engine:", {k: round(v, 3) for k, v in p["engine"].items()})
print("audit_ok_after:", d.get("audit_ok_after"), "stats:", json.dumps(d.get("runtime_stats"))[:600])
PY
exit $rc
