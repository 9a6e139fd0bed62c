"""When a streamed resolve's records land: after one ``begin_rows`` of four absent experts of a
store's first MoE layer (O_DIRECT, four lent rows), the time until the first slot's ``finish_rows``
returns and until all four have. Without a prediction, a layer's experts cannot compute before its
first missing record lands, so that first landing is time the disk adds to every layer of a token
(BENCHMARKS.md, "A shape not in the defaults: gpt-oss-20b's dimensions").

The background read threads are fixed when the process starts: run once per value of
ASYNCSIDE_FAULT_BACKGROUND_THREADS to compare them.

    ASYNCSIDE_FAULT_BACKGROUND_THREADS=1 python tools/streamed_landing.py STORE [--trials 24]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import mlx.core as mx
import numpy as np

from asyncside import ExpertStore, _native
from asyncside.pools import PoolSet


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("store", help="an expert store directory")
    ap.add_argument("--trials", type=int, default=24, help="begin/finish rounds; the first 4 are warm-up")
    args = ap.parse_args()
    store = ExpertStore.open(args.store)
    spec = store.layer(sorted(store.layers)[0])
    pools = PoolSet(spec, 4, device=False)
    fd = os.open(spec.path, os.O_RDONLY | os.O_DIRECT)
    table = _native.FaultTable(0, spec.n_experts, [pools.arrays[s.key] for s in spec.segments],
                               [s.offset for s in spec.segments], [s.nbytes for s in spec.segments], fd,
                               str(spec.path), spec.stride)
    table.set_direct(True)
    cpu = mx.default_stream(mx.cpu)
    rng = np.random.default_rng(0)
    first: list[float] = []
    every: list[float] = []
    for trial in range(args.trials):
        table.reclaim()
        table.sync(np.full(spec.n_experts, -1, dtype=np.int32))  # every expert absent again
        table.lend([0, 1, 2, 3])
        ids = mx.array(rng.permutation(spec.n_experts)[:4].astype(np.uint32))
        t0 = time.perf_counter()
        rows = _native.begin_rows(ids, table, cpu)[:4]
        mx.eval(_native.finish_rows(ids[0:1], rows[0:1], table, cpu))
        t1 = time.perf_counter()
        mx.eval(_native.finish_rows(ids, rows, table, cpu))
        t2 = time.perf_counter()
        table.drain()
        if trial >= 4:
            first.append((t1 - t0) * 1e3)
            every.append((t2 - t0) * 1e3)
    print(json.dumps({"background_threads": _native.fault_background_threads(), "record_mb": spec.stride / 1e6,
                      "first_ms_median": round(float(np.median(first)), 2),
                      "all_ms_median": round(float(np.median(every)), 2), "trials": len(first)}))


if __name__ == "__main__":
    main()
