"""Device probe: which part of a plan that reads past the page cache (ASYNCSIDE_DIRECT=1) changes
the tokens of a tiny quantized qwen3_moe on MLX CUDA (tests/test_queued.py's
test_queued_faults_past_the_page_cache_are_exact, q4, differed there from its first token and
passes on the CPU; it now skips on MLX CUDA like the other quantized prefill tests, whose cause is
MLX CUDA's quantized prefill depending on evaluation boundaries). This probe tells that cause from
a fault of the data: ``rows_wrong`` lists every held row whose bytes differ from the store's.

Each case: one Runtime over the same store, tokens against mlx-lm's; cases vary the direct plan,
the host tier, the fault read threads, the prompt's length (one token: no layer-by-layer prefill)
and the records' checksum verification. Prints one line a case."""
import os
import pathlib
import sys
import tempfile

sys.path.insert(0, "tests")
import anyio
import mlx.core as mx
import numpy as np
from _fault_helpers import model_store

from asyncside import _native
from asyncside.bridge import completed
from asyncside.models import ForwardOptions, load_streaming_model, per_layer, reference_generate
from asyncside.runtime import Runtime

QUEUED = ForwardOptions(mode="queued")
COUNTERS = ("capacity_splits", "groups", "subset_groups", "prefill", "queued_prefill")
quant = sys.argv[1] if len(sys.argv) > 1 else "q4"
tmp = pathlib.Path(tempfile.mkdtemp())
store_dir, model, prompt = model_store(tmp, "qwen3_moe", {"group_size": 64, "bits": 4} if quant == "q4" else None)
print("device", mx.default_device(), "quant", quant, flush=True)
sm0 = load_streaming_model(store_dir, completed=completed, options=QUEUED)
for spec in sm0.store.layers.values() if isinstance(sm0.store.layers, dict) else []:
    print("layer stride", spec.stride, "segments", [(s.offset, s.nbytes) for s in spec.segments])
    break


def row_mismatches(rt: Runtime, store: object) -> list[tuple[int, int, int, str]]:
    """(layer, expert, row, key) of every held row whose pool bytes differ from the store's record."""
    bad = []
    for layer in store.layers:
        table = np.array(rt.lookup(layer))
        pools = rt._s.layer(layer).pools
        for e, r in enumerate(table):
            if r < 0:
                continue
            for key, want in store.read_expert(layer, e).items():
                got = np.array(pools.arrays[key][int(r)])
                if got.tobytes() != np.array(want).tobytes():
                    bad.append((int(layer), e, int(r), key))
    return bad


def case(name: str, direct: str, host_tier: object, threads: int, p: list[int], verify: bool = True,
         rows: int | None = None) -> None:
    os.environ["ASYNCSIDE_DIRECT"] = direct
    ref = reference_generate(model, p, max_tokens=8)
    sm = load_streaming_model(store_dir, completed=completed, options=QUEUED)
    k = int(sm.config.get("num_experts_per_tok", 2))
    _native.set_fault_read_threads(threads)

    async def main() -> tuple[list[int], dict]:
        async with Runtime(sm.store, resident=0.0, min_side_rows=rows or k, host_tier=host_tier,
                           verify=verify) as rt:
            toks = [t async for t in sm.generate(p, max_tokens=8, source=rt)]
            await rt.quiesce()
            ok = all(r.ok for r in rt.audit().values())
            bad = row_mismatches(rt, sm.store)
            c = sm.forward_with(QUEUED).counters
            return toks, {**{x: rt.stats()[x] for x in ("faults", "fills", "direct", "tier_faults", "staged_copies")},
                          "audit_ok": ok, "rows_wrong": bad,
                          **{x: c.get(x) for x in COUNTERS}}

    try:
        toks, st = anyio.run(main)
        print(f"{name:40s} equal={toks == ref} got={toks} ref={ref} {st}", flush=True)
    except Exception as exc:  # a probe reports every case and goes on
        print(f"{name:40s} ERROR {type(exc).__name__}: {exc}", flush=True)


for direct in ("1", "0"):
    for tier in ("auto", 0):
        for threads in (0, 4):
            case(f"direct={direct} tier={tier} threads={threads}", direct, tier, threads, prompt)
case("direct=1 tier=0 threads=0 one-token prompt", "1", 0, 0, prompt[:1])
case("direct=1 tier=auto threads=0 one-token prompt", "1", "auto", 0, prompt[:1])
case("direct=1 tier=0 threads=0 verify=False", "1", 0, 0, prompt, verify=False)
case("direct=1 tier=0 threads=0 rows=all (no split)", "1", 0, 0, prompt, rows=16)
# Split groups each computing only their own pairs (the path of 64 pairs or more) instead of the
# whole switch input with the other groups' pairs pointed at one of this group's rows.
saved = per_layer.SORT_THRESHOLD
per_layer.SORT_THRESHOLD = 0
case("direct=1 tier=0 threads=0 subset groups", "1", 0, 0, prompt)
case("direct=1 tier=auto threads=0 subset groups", "1", "auto", 0, prompt)
per_layer.SORT_THRESHOLD = saved
case("direct=1 tier=auto threads=0 rows=all (no split)", "1", "auto", 0, prompt, rows=16)
