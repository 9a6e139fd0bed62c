#!/usr/bin/env bash
# Build, check and time asyncside on the lent NVIDIA H200 (MLX CUDA), in one go.
# Runs in the repository root on the GPU machine. Expects /root/stage to hold both halves of the
# MLX CUDA wheel and the transformers wheel (staged on the machine before the run; carried as
# .devwheels/a, .devwheels/w1 and .devwheels/b), the fmt headers in .devwheels/fmt, and the other
# wheels the machine lacks in .whl or /root/stage/whl (staged by an earlier call where one call
# cannot carry them all; tools/device/stage-extras.sh writes .devwheels/w1 and .devwheels/fmt). The
# three staging calls, made one after the other while the machine stays warm: carry .devwheels/a,
# `mkdir -p /root/stage/whl && cp .devwheels/a/* /root/stage/`; carry .devwheels/w1,
# `mv .devwheels/w1/transformers-*.whl /root/stage/ && cp .devwheels/w1/*.whl /root/stage/whl/`;
# carry .devwheels/b and .devwheels/fmt, `cp .devwheels/b/* /root/stage/ && bash tools/device/cuda-run.sh`.
# Writes logs and JSON
# to $OUT (or ./device-out); the runs BENCHMARKS.md cites are kept in benchmarks/device/.
# Env: SETUP_ONLY=1 (stop once the extension is built), TESTS (pytest arguments), TEST_BUDGET (seconds), TESTS_ONLY=1 (stop after the tests),
# REUSE=1 (a later call on the same warm machine: keep the installed wheels and the built extension,
# skip the embedded model's warm-up; on a fresh machine it still installs and builds, and skipping
# the warm-up saves minutes where the tests build their own models), SHARD=i/n (the whole suite in n calls: the i-th of every n test
# files in name order, spread over WORKERS pytest-xdist processes, default 12; staged with the wheels),
# BENCH=0 (skip the device bench), DEMO=0 (skip the demo runs), MODES="auto whole" (the demo's
# --mode values), AB="switch v1 v2" (after the demo: tools/ab_decode.py of that ForwardOptions
# field at 50% and 25%, AB_ROUNDS rounds), AB_SERVE="args" (then tools/ab_serve.py with those
# arguments, once per client count in AB_SERVE_CLIENTS, default "1 8"), HOST_TIME="1 8" (then
# asyncside bench step at those batch sizes), PREFILL_TIME=L (then bench step --prefill L at
# batch PREFILL_BATCH, default "1 4", and residency PREFILL_RESIDENT, default "0.5 1.0"), SERVE="args" (last: tools/device/serve-run.sh
# SERVE_NAME with those bench serve arguments, within SERVE_BUDGET seconds).
set -uo pipefail
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
log() { echo "== $(date +%T) $*"; }

# The checkout first (tests, tools and examples start children that import asyncside from it), then
# the staged wheels.
export PYTHONPATH=$PWD:/tmp/site
# The extension finds libmlx through its RPATH when installed beside mlx; copied into the checkout
# (below) it needs the library path.
export LD_LIBRARY_PATH=/tmp/site/mlx/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
if [ -z "${REUSE:-}" ] || ! ls asyncside/_native*.so >/dev/null 2>&1; then
log "install MLX CUDA and carried wheels"
(cd /root/stage && cat part.aa part.ab > "$(cat NAME)" && sha256sum -c <(echo "$(cat SHA256)  $(cat NAME)")) || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /root/stage/mlx-*.whl \
  /root/stage/mlx_cuda_13-*.whl /root/stage/transformers-*.whl $(ls .whl/*.whl /root/stage/whl/*.whl 2>/dev/null) || exit 1
python3 -c "import mlx.core as mx; print('mlx', mx.__version__, mx.default_device(), 'cuda', mx.cuda.is_available())"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

log "build the extension with the CUDA path"
python3 -m pip install -q --no-build-isolation --no-deps --no-compile --target /tmp/asyncside \
  --config-settings=cmake.define.ASYNCSIDE_CUDA=ON \
  --config-settings=cmake.define.ASYNCSIDE_FMT_INCLUDE="$PWD/.devwheels/fmt" \
  --config-settings=build-dir=/tmp/asyncside-build . > "$OUT/build.log" 2>&1 || { tail -60 "$OUT/build.log"; exit 1; }
# Tests and examples import the package from the checkout; the compiled module comes from the build.
cp /tmp/asyncside/asyncside/_native*.so asyncside/
python3 -c "import mlx.core, asyncside._native as n; print(n.build_info(), n.bridge_paths(), 'upload', n.cuda_upload_available(), 'device faults', n.device_faults_available())"
fi
# (Also under REUSE, for a machine set up before these steps existed; both are idempotent.)
# The distribution's metadata beside the wheels: its pytest11 entry point loads asyncside.testing's
# fixtures (expert_store, asyncside_runtime) into every pytest run, as an installed asyncside does.
if ls -d /tmp/asyncside/asyncside-*.dist-info >/dev/null 2>&1; then
  rm -rf /tmp/site/asyncside-*.dist-info && cp -r /tmp/asyncside/asyncside-*.dist-info /tmp/site/
fi
# Some tests start a child without PYTHONPATH, as a user's own project runs with asyncside
# installed (tests/test_plugin_external.py): a .pth in the interpreter's site-packages puts the
# checkout and the wheels on every child's path, in PYTHONPATH's order.
python3 - "$PWD" <<'PY' || echo "warning: no .pth written: children started without PYTHONPATH cannot import asyncside"
import pathlib, sys, sysconfig
pth = pathlib.Path(sysconfig.get_paths()["purelib"]) / "asyncside-device-run.pth"
paths = [sys.argv[1], "/tmp/site"]
pth.write_text(f"import sys; sys.path[:0] = [p for p in {paths!r} if p not in sys.path]\n")
PY
[ -n "${SETUP_ONLY:-}" ] && { log "set up (SETUP_ONLY)"; exit 0; }

if [ -z "${REUSE:-}" ]; then
log "embedded model (a fresh machine builds it: not inside a test's timeout)"
python3 -c "from asyncside.models.embedded import ensure_embedded_default as e; print(e(None)[0])"
# ... and a first generation compiles MLX's CUDA kernels for it (a minute on a fresh machine, which
# once ran past the first GPU test's 60 s timeout).
python3 -c "
from asyncside.models import load_reference_model, reference_generate
from asyncside.models.embedded import ensure_embedded_default as e
ref = load_reference_model(str(e(None)[1]))[0]
print('warm-up tokens:', reference_generate(ref, list(range(1, 80)), max_tokens=4, prefill_step_size=32))"

fi
log "GPU tests"
if [ -n "${SHARD:-}" ]; then
  # Every n-th file from the i-th, so slow and fast files spread evenly over the calls.
  TESTS="-n ${WORKERS:-12} --dist loadfile $(ls tests/test_*.py | awk -v i="${SHARD%/*}" -v n="${SHARD#*/}" 'NR % n == i % n' | tr '\n' ' ')"
fi
# SIGINT at the budget: pytest stops and still prints the failures so far (a SIGTERM loses them).
timeout -s INT -k 20 ${TEST_BUDGET:-300} python3 -m pytest -q -rfE -p no:cacheprovider --timeout=${TEST_TIMEOUT:-60} \
  ${TESTS:-tests/test_queued.py tests/test_device_pools.py tests/test_runtime.py tests/test_models.py tests/test_bridge_asyncio.py} 2>&1 | tee "$OUT/tests.log" | grep -vE "^\s*$" | tail -60

[ -n "${TESTS_ONLY:-}" ] && exit 0
if [ "${BENCH:-1}" = 1 ]; then
log "device bench"
timeout 300 python3 -m asyncside.bench.device --json > "$OUT/bench-device.json" 2> "$OUT/bench-device.err"; tail -5 "$OUT/bench-device.err"; cat "$OUT/bench-device.json"
fi

if [ "${DEMO:-1}" = 1 ]; then
log "demo on the GPU (50% and 25% resident; modes: ${MODES:-auto})"
for m in ${MODES:-auto}; do
for r in 0.5 0.25; do
  timeout 300 python3 -m asyncside.cli demo --resident $r --tokens 48 --mode $m --json > "$OUT/demo-$m-$r.json" 2> "$OUT/demo-$m-$r.err"
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print({k: d[k] for k in ('mode','decode_steps','resident_fraction','tokens_identical','speed_ratio','decode_speed_ratio','hit_rate','faults_per_step','fault_latency_p50_ms','fault_latency_p99_ms','bytes_read','reader')}, d['streaming'], d['all_resident'], d['forward'])" "$OUT/demo-$m-$r.json" || tail -20 "$OUT/demo-$m-$r.err"
done
done
fi
if [ -n "${AB:-}" ]; then
set -- $AB
for r in 0.5 0.25; do
  log "A/B of $1 ($2 vs $3) at $r resident"
  timeout 300 python3 tools/ab_decode.py --switch "$1" --values "$2" "$3" --resident $r --rounds ${AB_ROUNDS:-3} \
    --tokens 48 --json > "$OUT/ab-$1-$r.json" 2> "$OUT/ab-$1-$r.err"
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print({k: v for k, v in d.items() if k != 'rounds'}); [print(r) for r in d['rounds']]" "$OUT/ab-$1-$r.json" || tail -20 "$OUT/ab-$1-$r.err"
done
fi
if [ -n "${HOST_TIME:-}" ]; then
for b in $HOST_TIME; do
  log "host time per decode step, batch $b"
  timeout 300 python3 -m asyncside.bench.step --batch $b --json > "$OUT/bench-step-$b.json" 2> "$OUT/bench-step-$b.err"
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); [print(r['batch'], k, {a: round(b, 3) for a, b in r[k].items()}) for r in d['rows'] for k in ('mlx_lm_ms', 'asyncside_ms')]" "$OUT/bench-step-$b.json" || tail -20 "$OUT/bench-step-$b.err"
done
fi
if [ -n "${PREFILL_TIME:-}" ]; then
for r in ${PREFILL_RESIDENT:-0.5 1.0}; do
  log "host time per prefill chunk of $PREFILL_TIME tokens, batch ${PREFILL_BATCH:-1 4}, $r resident"
  timeout 300 python3 -m asyncside.bench.step --batch ${PREFILL_BATCH:-1 4} --prefill $PREFILL_TIME --steps 30 \
    --resident $r --json > "$OUT/bench-prefill-$r.json" 2> "$OUT/bench-prefill-$r.err"
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); [print(r['batch'], k, {a: round(b, 3) for a, b in r[k].items()}, 'faults/step', round(r['faults_per_step'], 1)) for r in d['rows'] for k in ('mlx_lm_ms', 'asyncside_ms')]" "$OUT/bench-prefill-$r.json" || tail -20 "$OUT/bench-prefill-$r.err"
done
fi
if [ -n "${AB_SERVE:-}" ]; then
for c in ${AB_SERVE_CLIENTS:-1 8}; do
  log "engine A/B, $c clients: $AB_SERVE"
  timeout 400 python3 tools/ab_serve.py $AB_SERVE --clients $c --json > "$OUT/ab-serve-$c.json" 2> "$OUT/ab-serve-$c.err"
  tail -8 "$OUT/ab-serve-$c.err"
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print('ratio median', d['ratio_median'], d['ratios'])" "$OUT/ab-serve-$c.json"
done
fi
if [ -n "${SERVE:-}" ]; then
  log "bench serve: $SERVE"
  timeout ${SERVE_BUDGET:-330} bash tools/device/serve-run.sh ${SERVE_NAME:-h200} $SERVE
fi
log done
