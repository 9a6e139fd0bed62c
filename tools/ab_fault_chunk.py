"""Two settings of the O_DIRECT fault reads, token by token in one process (ABBA).

``--compare chunk`` (the default): chunked reads against whole-record reads, the fault reads' chunk
(``_native.set_fault_read_chunk``, process-wide) set to ``--chunk`` bytes or to 0 (one request a
record). ``--compare window``: a streamed resolve's records read in order with ``--window`` pieces in
flight against one background job per record, side by side (``_native.set_fault_read_window`` to
``--window`` or 0; BENCHMARKS.md, "Streamed reads in order"), or against another window
(``--baseline-window``). ``--compare predictor``: queued steps that prefetch the next MoE layer's
predicted experts (``--predictor``, default ``trace``: the replayed trace's predictions) against
none (BENCHMARKS.md, "Prefetch inside queued steps").

One runtime, one KV cache, one routing replay: each decode token is computed with one arm's setting,
in the order ABBA BAAB ..., so the machine's load drifts over both alike. Both arms use one forward
(streamed switches, or plain faults with ``--plain``); greedy, the token each step computes is the
next step's input (both arms are exact: tests/test_fault_chunks.py, tests/test_ordered_reads.py).
Prints one JSON object: per-arm median and mean seconds per token, the ratio, and the read
counters. Meaningful only where the plan reads past the page cache (``direct`` true in the
output), e.g.::

    python tools/ab_fault_chunk.py --model STORE --memory 780M --resident 0.1 --routing low.npz --tokens 64
    python tools/ab_fault_chunk.py --compare window --model STORE --memory 980M --resident 0 --routing low.npz
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any, cast

import anyio
import mlx.core as mx

from asyncside import Runtime, _native
from asyncside.argtypes import int_at_least
from asyncside.memory import memory_arg
from asyncside.models import ForwardOptions, load_streaming_model
from asyncside.models.forward import StepMode
from asyncside.models.predict import PredictionQuality


def _order(n: int) -> list[bool]:
    """ABBA BAAB ... for n tokens: True means arm A (the chunked or ordered one)."""
    block = [True, False, False, True, False, True, True, False]
    return [block[i % len(block)] for i in range(n)]


def _chunk_counters() -> dict[str, int]:
    return {k: v for k, v in _native.fault_counters().items()
            if k.startswith("chunk") or k in ("ordered_reads", "direct_in_place")}


def _set(args: argparse.Namespace, arm_a: bool) -> None:
    if args.compare == "predictor":
        return  # chosen per step, see run()
    if args.compare == "window":
        _native.set_fault_read_window(args.window if arm_a else args.baseline_window)
    else:
        _native.set_fault_read_chunk(args.chunk if arm_a else 0)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    sm = load_streaming_model(args.model)
    if args.routing:
        sm.set_routing(args.routing)
    forward = sm.forward_with(ForwardOptions(mode=StepMode.QUEUED, streamed_switch=not args.plain))
    times: dict[bool, list[float]] = {True: [], False: []}
    faults: dict[bool, int] = {True: 0, False: 0}
    hits: dict[bool, int] = {True: 0, False: 0}
    routed: dict[bool, int] = {True: 0, False: 0}
    waited: dict[bool, float] = {True: 0.0, False: 0.0}
    read: dict[bool, int] = {True: 0, False: 0}
    predictor = forward.make_predictor(args.predictor) if args.compare == "predictor" else None
    before = _chunk_counters()
    # Set for the process before the runtime is entered, so that the runtime keeps the process's
    # window (which _set switches token by token) instead of measuring the disk for one of its own.
    _set(args, True)
    async with Runtime(sm.store, resident=args.resident, memory=args.memory, verify=not args.no_verify) as rt:
        cache = sm.make_cache()
        prompt = mx.array([list(range(1, args.prompt + 1))])
        logits = await sm(prompt, cache, source=rt)
        token = cast(int, mx.argmax(logits[0, -1]).item())
        warm = 4  # the first steps build and compile; not timed
        for i, chunked in enumerate([True, False] * (warm // 2) + _order(args.tokens)):
            _set(args, chunked)
            s0 = rt.stats()
            t0 = time.perf_counter()
            logits = await forward(mx.array([[token]]), cache, rt, predictor if chunked else None)
            token = cast(int, mx.argmax(logits[0, -1]).item())
            if i >= warm:
                times[chunked].append(time.perf_counter() - t0)
                s1 = rt.stats()
                faults[chunked] += s1["faults"] - s0["faults"]
                hits[chunked] += s1["hits"] - s0["hits"]
                routed[chunked] += s1["hits"] + s1["misses"] - s0["hits"] - s0["misses"]
                waited[chunked] += s1["read_wait_s"] - s0["read_wait_s"]
                read[chunked] += s1["bytes_read"] - s0["bytes_read"]
        await rt.quiesce()
        stats = dict(rt.stats())
        plan = rt.memory
    med = {arm: statistics.median(v) for arm, v in times.items()}
    after = _chunk_counters()
    if args.compare == "predictor":
        a, b = f"predictor_{args.predictor}", "predictor_none"
    elif args.compare == "window":
        a, b = ("ordered", "side_by_side") if args.baseline_window == 0 else (
            f"window_{args.window}", f"window_{args.baseline_window}")
    else:
        a, b = "chunked", "whole"
    return {
        "model": str(args.model), "routing": args.routing, "resident": args.resident, "memory": args.memory,
        "direct": plan.get("direct"), "forward": "plain" if args.plain else "streamed", "compare": args.compare,
        "chunk": args.chunk if args.compare == "chunk" else _native.fault_read_chunk(),
        "window": args.window if args.compare == "window" else _native.fault_read_window(),
        "baseline_window": args.baseline_window if args.compare == "window" else None,
        "tokens_per_arm": len(times[True]),
        f"{a}_s_per_token": {"median": med[True], "mean": statistics.fmean(times[True])},
        f"{b}_s_per_token": {"median": med[False], "mean": statistics.fmean(times[False])},
        f"{a}_over_{b}_tok_s": med[False] / med[True],
        "faults_per_arm": {a: faults[True], b: faults[False]},
        "hit_rate_per_arm": {a: hits[True] / max(routed[True], 1), b: hits[False] / max(routed[False], 1)},
        "read_wait_s_per_token": {a: waited[True] / max(len(times[True]), 1),
                                  b: waited[False] / max(len(times[False]), 1)},
        "mb_read_per_token": {a: read[True] / 1e6 / max(len(times[True]), 1),
                              b: read[False] / 1e6 / max(len(times[False]), 1)},
        "hit_rate": stats["hit_rate"], "bytes_read": stats["bytes_read"],
        "prefetch": {k: stats[k] for k in ("prefetch_reads", "prefetch_hits", "prefetch_failures")},
        "prediction": PredictionQuality.from_counters(forward.counters).as_dict(),
        "chunk_counters": {k: after[k] - before[k] for k in after},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="an expert store directory")
    p.add_argument("--memory", type=memory_arg, default=None, help="the runtime's memory budget, e.g. 780M")
    p.add_argument("--resident", type=float, default=0.1)
    p.add_argument("--routing", default=None, help="a routing trace to replay (.npz)")
    p.add_argument("--prompt", type=int, default=8, help="prompt tokens (1..N)")
    p.add_argument("--tokens", type=int_at_least(2), default=64, help="timed decode tokens, both arms together")
    p.add_argument("--compare", choices=["chunk", "window", "predictor"], default="chunk",
                   help="chunked against whole-record reads, ordered against side-by-side streamed reads, or "
                        "queued steps that prefetch predicted experts against none")
    p.add_argument("--predictor", default="trace", choices=["trace", "lookahead"],
                   help="--compare predictor: the prefetching arm's predictor (default trace)")
    p.add_argument("--chunk", type=int, default=1 << 20, help="the chunked arm's chunk in bytes (default 1 MiB)")
    p.add_argument("--window", type=int, default=_native.fault_read_window(),
                   help="the ordered arm's pieces in flight (default: the process's)")
    p.add_argument("--baseline-window", type=int, default=0,
                   help="--compare window: the other arm's window (default 0: a background job per record)")
    p.add_argument("--plain", action="store_true", help="plain faults (reads before the gather), not streamed")
    p.add_argument("--no-verify", action="store_true", help="skip the records' checksums (the runtime's verify=False)")
    print(json.dumps(anyio.run(run, p.parse_args()), indent=1))


if __name__ == "__main__":
    main()
