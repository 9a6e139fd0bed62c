"""Streamed switches against plain faults, token by token in one process (paired, ABBA).

One runtime, one KV cache, one routing replay: each decode token is computed by one of the two
forwards (``ForwardOptions(streamed_switch=True)`` or ``False``) in the order ABBA BAAB ..., so
the machine's load drifts over both alike. Greedy, teacher-free: the token each step computes is
the next step's input, whichever forward computed it (both are exact, tests/test_streamed_faults.py).
With ``--versus-mlx-lm`` a third arm decodes its own sequence with mlx-lm's model, every expert in
memory and the same routing forced (the compute limit; it needs the whole model in memory, so run
it outside the cgroup). Prints one JSON object: per-arm median and mean seconds per token, the
ratios, and the runtime's read counters.

Run it in the memory cgroup of the benchmark (BENCHMARKS.md, "Larger than memory: reads past the
page cache"), e.g.::

    python tools/ab_streamed.py --model STORE --memory 780M --resident 0.1 --routing low.npz --tokens 64
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any, cast

import anyio
import mlx.core as mx

from asyncside import Runtime
from asyncside.argtypes import int_at_least
from asyncside.memory import memory_arg
from asyncside.models import ForwardOptions, load_streaming_model
from asyncside.models.forward import StepMode


def _order(n: int) -> list[bool]:
    """ABBA BAAB ... for n tokens: True means the streamed arm."""
    block = [True, False, False, True, False, True, True, False]
    return [block[i % len(block)] for i in range(n)]


def _reference(args: argparse.Namespace, sm: Any, replay: Any) -> tuple[Any, list[Any]]:
    """mlx-lm's model of the store with every expert in memory, forced to the same routing."""
    from mlx_lm.models.cache import make_prompt_cache

    from asyncside.models import load_reference_model
    from asyncside.models.forcing import force_reference

    model, _config = load_reference_model(args.model)
    if replay is not None:
        force_reference(model, sm.arch.block_attr, replay)
    return model, make_prompt_cache(model)


def _reference_step(model: Any, cache: list[Any], token: int) -> int:
    logits = model(mx.array([[token]]), cache)
    return cast(int, mx.argmax(logits[0, -1]).item())


async def run(args: argparse.Namespace) -> dict[str, Any]:
    sm = load_streaming_model(args.model)
    replay = sm.set_routing(args.routing) if args.routing else None
    arms = {True: ForwardOptions(mode=StepMode.QUEUED, streamed_switch=True),
            False: ForwardOptions(mode=StepMode.QUEUED, streamed_switch=False)}
    times: dict[bool, list[float]] = {True: [], False: []}
    async with Runtime(sm.store, resident=args.resident, memory=args.memory, verify=not args.no_verify) as rt:
        cache = sm.make_cache()
        prompt = mx.array([list(range(1, args.prompt + 1))])
        logits = await sm(prompt, cache, source=rt)  # per layer when the prompt's experts exceed the rows
        token = cast(int, mx.argmax(logits[0, -1]).item())
        ref: list[float] = []
        ours, theirs = [token], [token]  # the greedy sequences (mlx-lm decodes one token per pair of ours)
        if args.versus_mlx_lm:
            model, ref_cache = _reference(args, sm, replay)
            mx.eval(model(prompt, ref_cache))
            ref_token = token
        warm = 4  # the first steps of each forward build and compile; not timed
        for i, streamed in enumerate([True, False] * (warm // 2) + _order(args.tokens)):
            t0 = time.perf_counter()
            logits = await sm.forward_with(arms[streamed])(mx.array([[token]]), cache, rt)
            token = cast(int, mx.argmax(logits[0, -1]).item())
            ours.append(token)
            if i >= warm:
                times[streamed].append(time.perf_counter() - t0)
            if args.versus_mlx_lm and i % 2:  # one mlx-lm token per pair of ours
                t0 = time.perf_counter()
                ref_token = await anyio.to_thread.run_sync(_reference_step, model, ref_cache, ref_token)
                theirs.append(ref_token)
                if i >= warm:
                    ref.append(time.perf_counter() - t0)
        await rt.quiesce()
        stats = dict(rt.stats())
        plan = rt.memory
    med = {arm: statistics.median(v) for arm, v in times.items()}
    return {
        "model": str(args.model), "routing": args.routing, "resident": args.resident, "memory": args.memory,
        "direct": plan.get("direct"), "verify": not args.no_verify, "tokens_per_arm": len(times[True]),
        "streamed_s_per_token": {"median": med[True], "mean": statistics.fmean(times[True])},
        "plain_s_per_token": {"median": med[False], "mean": statistics.fmean(times[False])},
        "streamed_over_plain_tok_s": med[False] / med[True],
        "hit_rate": stats["hit_rate"], "faults": stats["faults"], "streamed_faults": stats["streamed_faults"],
        "fault_time_s": stats["fault_time_s"], "read_wait_s": stats["read_wait_s"],
        "background_read_s": stats["background_read_s"], "bytes_read": stats["bytes_read"],
        "mlx_lm_s_per_token": {"median": statistics.median(ref), "mean": statistics.fmean(ref)} if ref else None,
        "streamed_over_mlx_lm_tok_s": statistics.median(ref) / med[True] if ref else None,
        "plain_over_mlx_lm_tok_s": statistics.median(ref) / med[False] if ref else None,
        # mlx-lm's greedy tokens against the first as many of ours (both under the same forced routing)
        "tokens_equal_mlx_lm": f"{sum(a == b for a, b in zip(ours, theirs))}/{len(theirs)}" if ref else None,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="an expert store directory")
    p.add_argument("--memory", type=memory_arg, default=None, help="the runtime's memory budget, e.g. 780M")
    p.add_argument("--resident", type=float, default=0.1)
    p.add_argument("--routing", default=None, help="a routing trace to replay (.npz)")
    p.add_argument("--prompt", type=int, default=8, help="prompt tokens (1..N)")
    p.add_argument("--tokens", type=int_at_least(2), default=64, help="timed decode tokens, both arms together")
    p.add_argument("--no-verify", action="store_true", help="skip the records' checksums (the runtime's verify=False)")
    p.add_argument("--versus-mlx-lm", action="store_true",
                   help="a third arm: mlx-lm's model with every expert in memory (needs the whole model in memory)")
    print(json.dumps(anyio.run(run, p.parse_args()), indent=1))


if __name__ == "__main__":
    main()
