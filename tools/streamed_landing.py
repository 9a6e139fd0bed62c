"""When a streamed resolve's records land: after one ``begin_rows`` of four absent experts of a
store's first MoE layer (O_DIRECT, four lent rows), the time until the first slot's ``finish_rows``
returns and until all four have. Without a prediction, a layer's experts cannot compute before its
first missing record lands, so that first landing is time the disk adds to every layer of a token
(BENCHMARKS.md, "Streamed reads in order").

Two arms, alternated trial by trial in one process (this machine's disk is shared and noisy): the
records read in order through one ring (the default), and one background job per record, side by
side (window 0, as before). The background threads are fixed when the process starts: run once
per value of ASYNCSIDE_FAULT_BACKGROUND_THREADS to compare them; ``--window`` sets the ordered arm's.

    python tools/streamed_landing.py STORE [--trials 24] [--records 4] [--window 8]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import mlx.core as mx
import numpy as np

from asyncside import ExpertStore, _native
from asyncside.argtypes import int_at_least
from asyncside.pools import PoolSet


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("store", help="an expert store directory")
    ap.add_argument("--trials", type=int_at_least(5), default=24,
                    help="begin/finish rounds per arm; the first 4 are warm-up")
    ap.add_argument("--records", type=int, default=4, help="absent experts one begin reads")
    ap.add_argument("--window", type=int, default=_native.fault_read_window(),
                    help="the ordered arm's pieces in flight (default: the process's)")
    args = ap.parse_args()
    store = ExpertStore.open(args.store)
    spec = store.layer(sorted(store.layers)[0])
    n = args.records
    if not 1 <= n <= spec.n_experts:
        ap.error(f"--records: expected 1 to {spec.n_experts} (the layer's experts), got {n}")
    pools = PoolSet(spec, n, device=False)
    fd = os.open(spec.path, os.O_RDONLY | os.O_DIRECT)
    table = _native.FaultTable(0, spec.n_experts, [pools.arrays[s.key] for s in spec.segments],
                               [s.offset for s in spec.segments], [s.nbytes for s in spec.segments], fd,
                               str(spec.path), spec.stride)
    table.set_direct(True)
    cpu = mx.default_stream(mx.cpu)
    rng = np.random.default_rng(0)
    arms = {"ordered": args.window, "side_by_side": 0}
    first: dict[str, list[float]] = {a: [] for a in arms}
    every: dict[str, list[float]] = {a: [] for a in arms}
    for trial in range(args.trials):
        for arm, window in arms.items():
            _native.set_fault_read_window(window)
            table.reclaim()
            table.sync(np.full(spec.n_experts, -1, dtype=np.int32))  # every expert absent again
            table.lend(list(range(n)))
            ids = mx.array(rng.permutation(spec.n_experts)[:n].astype(np.uint32))
            t0 = time.perf_counter()
            rows = _native.begin_rows(ids, table, cpu)[:n]
            mx.eval(_native.finish_rows(ids[0:1], rows[0:1], table, cpu))
            t1 = time.perf_counter()
            mx.eval(_native.finish_rows(ids, rows, table, cpu))
            t2 = time.perf_counter()
            table.drain()
            if trial >= 4:
                first[arm].append((t1 - t0) * 1e3)
                every[arm].append((t2 - t0) * 1e3)
    out = {"background_threads": _native.fault_background_threads(), "window": args.window,
           "chunk_bytes": _native.fault_read_chunk(), "record_mb": spec.stride / 1e6, "records": n,
           "trials": args.trials - 4}
    for arm in arms:
        out[arm] = {"first_ms_median": round(float(np.median(first[arm])), 2),
                    "all_ms_median": round(float(np.median(every[arm])), 2)}
    print(json.dumps(out))

if __name__ == "__main__":
    main()
