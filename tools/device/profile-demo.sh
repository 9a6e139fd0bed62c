#!/usr/bin/env bash
# Where the host time of a GPU decode goes: py-spy over `asyncside demo` (50% resident) on the H200.
set -uo pipefail
OUT=${OUT:-$PWD/device-out}
TESTS_ONLY=1 TESTS="tests/test_build.py -q" bash tools/device/cuda-run.sh > "$OUT/setup.log" 2>&1 || { tail -30 "$OUT/setup.log"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD
python3 -m asyncside.cli demo --resident 0.5 --tokens 8 --json > /dev/null 2>&1  # builds the embedded model
chmod +x .venv/bin/py-spy
.venv/bin/py-spy record --subprocesses -r 1000 -f raw -o /tmp/spy.txt -- sh -c "python3 -m asyncside.cli demo --resident 0.5 --tokens 160 --json > $OUT/demo.json" 2> "$OUT/spy.err"
python3 - /tmp/spy.txt <<'PY'
import collections, sys
self_c, incl = collections.Counter(), collections.Counter()
total = 0
for line in open(sys.argv[1]):
    stack, n = line.rsplit(" ", 1); n = int(n); total += n
    frames = stack.split(";")
    if not any("StreamingModel.generate" in f for f in frames):
        continue
    self_c[frames[-1].strip()] += n
    for f in set(frames):
        incl[f.strip()] += n
print("samples", total)
print("-- self (inside generate)")
for k, v in self_c.most_common(20): print(v, k)
print("-- inclusive, asyncside frames (function and line)")
for k, v in [kv for kv in incl.most_common(400) if "asyncside" in kv[0]][:40]: print(v, k)
PY
python3 -c "import json; d=json.load(open('$OUT/demo.json')); print(d['streaming'], d['all_resident'], d['tokens_identical'], d['hit_rate'])"
