#!/usr/bin/env bash
# Checksum failures of O_DIRECT reads straight into host pool rows on the GPU machine (MLX CUDA
# build, MLX on its CPU: every array is CUDA managed memory), against reads through a buffer, on a
# store built just before and on one built earlier: decode runs of tools/ab_fault_chunk.py, reads
# forced in place (IN_PLACE=force), as the extension decides (auto: through a buffer where the rows
# are managed memory) and always through a buffer (0); each says whether every record verified and
# how many read in place. After tools/device/cuda-run.sh built the extension (or SETUP=1). Env: RUNS (default 2
# per setting), TOKENS (default 48), SETTINGS (default "force auto 0"), VOCABS (default "512 1024").
set -uo pipefail
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
. "$(dirname "$0")/bench-env.sh"
export PYTHONPATH=/tmp/site:$PWD
log() { echo "== $(date +%T) $*"; }
findmnt -T "$HOME" -o TARGET,SOURCE,FSTYPE,OPTIONS | tail -1
python3 -c "from asyncside.routing import preset; preset('low', tokens=512, n_layers=8, n_experts=128, top_k=8).save('$OUT/low.npz')"
for vocab in ${VOCABS:-512 1024}; do
  log "store, vocabulary $vocab"
  store=$(python3 -c "
from asyncside.bench.shapes import ensure_shape
b = ensure_shape('qwen3-30b-a3b', layers=8, vocab=$vocab, progress=False); print(b['built'], b['store'])" 2> "$OUT/build-$vocab.log" | tail -1)
  echo "built now, path: $store"; store=${store#* }
  for run in $(seq ${RUNS:-2}); do
    for inplace in ${SETTINGS:-force auto 0}; do
      log "vocab $vocab run $run in place $inplace"
      IN_PLACE=$inplace ASYNCSIDE_DIRECT=1 timeout 150 python3 tools/device/on_cpu.py tools/ab_fault_chunk.py --compare window \
        --window 4 --baseline-window 8 --model "$store" --resident 0 --routing "$OUT/low.npz" --tokens ${TOKENS:-48} \
        > "$OUT/run-$vocab-$run-$inplace.json" 2> "$OUT/run-$vocab-$run-$inplace.err"
      echo "rc $? $(grep -h -o 'FillError.*' "$OUT/run-$vocab-$run-$inplace.err" | tail -1)"
      python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print({k: d[k] for k in ('direct','hit_rate')}, d['chunk_counters'])" "$OUT/run-$vocab-$run-$inplace.json" 2>/dev/null
    done
  done
done
log done
