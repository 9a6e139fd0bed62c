"""``python -m asyncside.bench.device``: the device-pool path on an MLX GPU (CUDA), in one run.

Measured side by side:

* the physical limit: pinned host -> device ``cudaMemcpy`` bandwidth (native, no MLX);
* upload alone: host mirror -> device pool rows through ``upload_rows`` on MLX's stream, timed
  like the limit (uploads queued back to back, one wait at the end), and one upload on its own;
* expert streaming end to end: ``Runtime.ensure`` of every expert of a layer (read from the store
  into the pinned mirror, uploaded, published), page cache warm, as GB/s of expert bytes;
* the completion bridge on the GPU stream: latency from the stream reaching the signal to the
  awaiting task resuming (median, p99), beside the time of one round trip.

Record layout: a Qwen3-30B-A3B-like expert (4-bit, group 64: 9 segments, about 2.65 MB).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..argtypes import int_at_least
from . import bench_main


def _qwen3_30b_layer(n_experts: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    hidden, inter, group = 2048, 768, 64
    layer: dict[str, np.ndarray] = {}
    for name, (out_dim, in_dim) in {"gate_proj": (inter, hidden), "up_proj": (inter, hidden),
                                    "down_proj": (hidden, inter)}.items():
        layer[f"{name}.weight"] = rng.integers(0, 2**32, size=(n_experts, out_dim, in_dim // 8), dtype=np.uint32)
        layer[f"{name}.scales"] = rng.standard_normal((n_experts, out_dim, in_dim // group)).astype(np.float16)
        layer[f"{name}.biases"] = rng.standard_normal((n_experts, out_dim, in_dim // group)).astype(np.float16)
    return layer


def add_device_arguments(p: argparse.ArgumentParser) -> None:
    """Options of the device bench; counts of at least one, a reader the runtime knows."""
    p.add_argument("--experts", type=int_at_least(1), default=64, help="experts in the bench layer (default 64)")
    p.add_argument("--side-rows", type=int_at_least(1), default=32,
                   help="side region rows, at most --experts (default 32)")
    p.add_argument("--reader", default="auto", choices=["auto", "io_uring", "threads", "aiofiles"],
                   help="read backend (default: io_uring where the kernel allows it)")
    p.add_argument("--repeats", type=int_at_least(1), default=3)
    p.add_argument("--upload-queue", type=int_at_least(1), default=10,
                   help="uploads queued back to back per timed pass, as the limit's 10 copies (default 10)")
    p.add_argument("--bridge-samples", type=int_at_least(1), default=300)


def _device_problem(args: argparse.Namespace) -> str | None:
    """Why the options cannot run together (None: they can), said before anything is measured or
    built: more side rows than the bench layer has experts (every row holds a distinct expert)."""
    if args.side_rows > args.experts:
        return (f"--side-rows {args.side_rows}: at most --experts ({args.experts}) rows: each row holds a "
                f"distinct expert of the bench layer")
    return None


async def _measure(args: argparse.Namespace, store: Any) -> dict[str, Any]:
    import mlx.core as mx

    from ..bridge import completed, completed_at, schedule
    from ..runtime import Runtime

    out: dict[str, Any] = {}
    spec = store.layer(0)
    record = sum(s.nbytes for s in spec.segments)
    async with Runtime(store, pinned={0: []}, side_rows=args.side_rows, reader=args.reader) as rt:
        pools = rt._s.layer(0).pools  # private on purpose: the bench times the pools themselves
        out["device_pools"] = bool(pools.device)
        out["reader"] = rt.reader
        rows = list(range(pools.rows))
        # Upload alone: every row of the mirror to the device pools. Timed like the limit beside
        # it (`cuda_h2d_bandwidth`: back-to-back copies, one wait at the end): `--upload-queue`
        # upload primitives queued on the stream, one completion awaited after the last. One
        # upload awaited on its own is reported too: it adds a launch and a wake-up per copy.
        await completed(pools.upload(rows))
        single, queued = [], []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            await completed(pools.upload(rows))
            single.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            ups = [pools.upload(rows) for _ in range(args.upload_queue)]
            await schedule(*ups[:-1])
            await completed(ups[-1])
            queued.append(time.perf_counter() - t0)
        out["upload_gbps"] = record * len(rows) * args.upload_queue / min(queued) / 1e9
        out["upload_single_gbps"] = record * len(rows) / min(single) / 1e9
        out["upload_queue"] = args.upload_queue
        # End to end: ensure every expert in batches of side_rows (read into the mirror, upload,
        # publish); each batch evicts the previous one, so every repeat reads. Warm page cache.
        ids = list(range(spec.n_experts))
        best = 0.0
        for _ in range(args.repeats):
            before = rt.stats()["bytes_read"]
            t0 = time.perf_counter()
            for i in range(0, len(ids), args.side_rows):
                await rt.ensure(0, ids[i : i + args.side_rows])
            dt = time.perf_counter() - t0
            best = max(best, (rt.stats()["bytes_read"] - before) / dt / 1e9)
        out["streaming_gbps"] = best
        # Bridge latency on the GPU stream.
        lat, rtt = [], []
        x = mx.zeros((1,))
        for _ in range(args.bridge_samples):
            x = x + 1.0
            t0 = time.monotonic_ns()
            posted = await completed_at(x)
            t1 = time.monotonic_ns()
            rtt.append((t1 - t0) / 1e3)
            if posted is not None:
                lat.append((t1 - posted) / 1e3)
        lat.sort()
        out["bridge_latency_us"] = {
            "median": statistics.median(lat) if lat else None,
            "p99": lat[int(0.99 * (len(lat) - 1))] if lat else None,
            "samples": len(lat),
            "round_trip_median": statistics.median(rtt),
        }
        out["stats"] = {k: v for k, v in rt.stats().items()}
    return out


def run_device_bench(args: argparse.Namespace) -> dict[str, Any]:
    """Run the measurements; print them (one per line) unless ``args.json``; return the result. Options
    that cannot run together are a ValueError naming the option (a usage error), before any work."""
    problem = _device_problem(args)
    if problem is not None:
        raise ValueError(problem)
    result = _run(args)
    if not getattr(args, "json", False):
        for k, v in result.items():
            print(f"{k:24} {v}")
    return result


def _run(args: argparse.Namespace) -> dict[str, Any]:
    import anyio
    import mlx.core as mx

    from .. import _native
    from ..store import ExpertStore

    result: dict[str, Any] = {
        "device": str(mx.default_device()),
        "cuda_upload": bool(_native.cuda_upload_available()),
    }
    if not result["cuda_upload"]:
        result["error"] = "this build has no CUDA upload path (needs MLX CUDA and -DASYNCSIDE_CUDA=ON)"
        return result
    result["pinned_h2d_limit_gbps"] = _native.bench.cuda_h2d_bandwidth(256 << 20, 10) / 1e9
    with tempfile.TemporaryDirectory(prefix="asyncside-bench-device-") as tmp:
        rng = np.random.default_rng(0)
        store = ExpertStore.create(Path(tmp) / "store", {0: _qwen3_30b_layer(args.experts, rng)}, checksum=None)
        result["record_bytes"] = sum(s.nbytes for s in store.layer(0).segments)
        for e in range(args.experts):  # warm the page cache: this bench measures the device side
            store.read_record(0, e, verify=False)
        result.update(anyio.run(_measure, args, store))
    limit = result["pinned_h2d_limit_gbps"]
    result["upload_vs_limit"] = result["upload_gbps"] / limit
    result["upload_single_vs_limit"] = result["upload_single_gbps"] / limit
    result["streaming_vs_limit"] = result["streaming_gbps"] / limit
    return result


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m asyncside.bench.device [--json] ...``"""
    return bench_main("device", argv)


if __name__ == "__main__":
    sys.exit(main())
