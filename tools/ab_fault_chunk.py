"""Chunked O_DIRECT fault reads against whole-record reads, token by token in one process (ABBA).

One runtime, one KV cache, one routing replay: each decode token is computed with the fault reads'
chunk (``_native.set_fault_read_chunk``, process-wide) set to 0 (one request a record) or to
``--chunk`` bytes, in the order ABBA BAAB ..., so the machine's load drifts over both alike. Both
arms use one forward (streamed switches, or plain faults with ``--plain``); greedy, the token each
step computes is the next step's input (both arms are exact: tests/test_fault_chunks.py). Prints
one JSON object: per-arm median and mean seconds per token, the ratio, and the chunk counters.
Meaningful only where the plan reads past the page cache (``direct`` true in the output), e.g.::

    python tools/ab_fault_chunk.py --model STORE --memory 780M --resident 0.1 --routing low.npz --tokens 64
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
from asyncside.memory import memory_arg
from asyncside.models import ForwardOptions, load_streaming_model
from asyncside.models.forward import StepMode


def _order(n: int) -> list[bool]:
    """ABBA BAAB ... for n tokens: True means the chunked arm."""
    block = [True, False, False, True, False, True, True, False]
    return [block[i % len(block)] for i in range(n)]


def _chunk_counters() -> dict[str, int]:
    return {k: v for k, v in _native.fault_counters().items() if k.startswith("chunk")}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    sm = load_streaming_model(args.model)
    if args.routing:
        sm.set_routing(args.routing)
    forward = sm.forward_with(ForwardOptions(mode=StepMode.QUEUED, streamed_switch=not args.plain))
    times: dict[bool, list[float]] = {True: [], False: []}
    faults: dict[bool, int] = {True: 0, False: 0}
    before = _chunk_counters()
    async with Runtime(sm.store, resident=args.resident, memory=args.memory, verify=not args.no_verify) as rt:
        cache = sm.make_cache()
        prompt = mx.array([list(range(1, args.prompt + 1))])
        logits = await sm(prompt, cache, source=rt)
        token = cast(int, mx.argmax(logits[0, -1]).item())
        warm = 4  # the first steps build and compile; not timed
        for i, chunked in enumerate([True, False] * (warm // 2) + _order(args.tokens)):
            _native.set_fault_read_chunk(args.chunk if chunked else 0)
            f0 = rt.stats()["faults"]
            t0 = time.perf_counter()
            logits = await forward(mx.array([[token]]), cache, rt)
            token = cast(int, mx.argmax(logits[0, -1]).item())
            if i >= warm:
                times[chunked].append(time.perf_counter() - t0)
                faults[chunked] += rt.stats()["faults"] - f0
        await rt.quiesce()
        stats = dict(rt.stats())
        plan = rt.memory
    med = {arm: statistics.median(v) for arm, v in times.items()}
    after = _chunk_counters()
    return {
        "model": str(args.model), "routing": args.routing, "resident": args.resident, "memory": args.memory,
        "direct": plan.get("direct"), "forward": "plain" if args.plain else "streamed", "chunk": args.chunk,
        "tokens_per_arm": len(times[True]),
        "chunked_s_per_token": {"median": med[True], "mean": statistics.fmean(times[True])},
        "whole_s_per_token": {"median": med[False], "mean": statistics.fmean(times[False])},
        "chunked_over_whole_tok_s": med[False] / med[True],
        "faults_per_arm": {"chunked": faults[True], "whole": faults[False]},
        "hit_rate": stats["hit_rate"], "bytes_read": stats["bytes_read"],
        "chunk_counters": {k: after[k] - before[k] for k in after},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="an expert store directory")
    p.add_argument("--memory", type=memory_arg, default=None, help="the runtime's memory budget, e.g. 780M")
    p.add_argument("--resident", type=float, default=0.1)
    p.add_argument("--routing", default=None, help="a routing trace to replay (.npz)")
    p.add_argument("--prompt", type=int, default=8, help="prompt tokens (1..N)")
    p.add_argument("--tokens", type=int, default=64, help="timed decode tokens, both arms together")
    p.add_argument("--chunk", type=int, default=1 << 20, help="the chunked arm's chunk in bytes (default 1 MiB)")
    p.add_argument("--plain", action="store_true", help="plain faults (reads before the gather), not streamed")
    p.add_argument("--no-verify", action="store_true", help="skip the records' checksums (the runtime's verify=False)")
    print(json.dumps(anyio.run(run, p.parse_args()), indent=1))


if __name__ == "__main__":
    main()
