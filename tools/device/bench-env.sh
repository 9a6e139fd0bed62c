# Sourced by the bench scripts here (gen-run.sh, serve-run.sh, ...): the environment of a bench run
# on the GPU machine after tools/device/cuda-run.sh built the extension in the same session, or
# builds it first with SETUP=1.
set -uo pipefail
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
if [ -n "${SETUP:-}" ]; then
  SETUP_ONLY=1 OUT=$OUT bash "$(dirname "${BASH_SOURCE[0]}")/cuda-run.sh" || exit 1
fi
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
export LD_LIBRARY_PATH=/tmp/site/mlx/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
[ -e asyncside/_native*.so ] || cp /tmp/asyncside/asyncside/_native*.so asyncside/ || { echo "build first (cuda-run.sh)"; exit 1; }
