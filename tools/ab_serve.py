"""A/B of one forward option under the serving engine, in one process, without HTTP.

    python tools/ab_serve.py --switch expert_slices --values True False --clients 8 --seconds 20 --rounds 3
    python tools/ab_serve.py --switch read_threads --values 7 0 ...   (the fault resolves' read pool)
    python tools/ab_serve.py --switch run_ahead --values True False ... (the engine's decode steps run ahead)
    python tools/ab_serve.py --switch overlap_prefill --values True False ... (prefill chunks awaited late)
    python tools/ab_serve.py --switch joint_prefill --values True False ... (fresh prompts' chunks in one forward)
    python tools/ab_serve.py --switch staged_switches --values True False ... (staging arrays, CUDA + host tier)
    python tools/ab_serve.py --switch resident --values 1.0 0.5 ...     (the Runtime's residency)
    python tools/ab_serve.py --switch host_tier --values "'auto'" 0 ... (the Runtime's host tier, CUDA)
    python tools/ab_serve.py --switch merge_chunked --values True False --model STORE ...
                                (llama4: chunked caches merged into one decode batch, or rows one by one)
    python tools/ab_serve.py --profile 40 --clients 8 --seconds 20    (where the engine's host time goes)

Every round runs the engine (:class:`asyncside.serving.engine.Batcher`) once per value of
``ForwardOptions.<switch>`` (or of the engine's ``run_ahead``, the read pool's threads, the
residency, the host tier; the order alternates by round), each over a fresh :class:`Runtime` at
the same residency, with ``--clients`` closed-loop clients submitting the prompts ``asyncside
bench serve`` sends (mixed lengths, each request numbered so no two share a prefix), greedy,
``--max-tokens`` each. Reports per variant: aggregate tok/s, time to first token and inter-token
p50/p99, the engine's wall time split into prefill and decode, its host time per decode step
(building and queuing it); and the median of the
per-round ratios A/B. The rounds are interleaved because this VM's speed drifts between runs; a
diagnostic for choosing defaults, the benchmark is ``asyncside bench serve``.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import itertools
import json
import statistics
import sys
import time
from typing import Any

from asyncside.argtypes import int_at_least


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--switch", default="expert_slices", help="field of ForwardOptions to set")
    p.add_argument("--values", nargs=2, default=["True", "False"], metavar=("A", "B"),
                   help="the two values to compare (Python literals)")
    p.add_argument("--resident", type=float, default=0.5)
    p.add_argument("--model", default=None, metavar="STORE",
                   help="a store (default: the embedded model); without a tokenizer the prompts are seeded ids")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--warmup", type=float, default=5.0)
    p.add_argument("--rounds", type=int_at_least(1), default=3)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prompt-lengths", default="8,32,128")
    p.add_argument("--prefill-chunk", type=int, default=None)
    p.add_argument("--json", action="store_true")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="instead: run variant A once (after its warm-up) under cProfile and print the N "
                        "functions with the most own time and the N with the most cumulative time")
    args = p.parse_args(argv)

    import anyio
    import mlx.core as mx

    from asyncside import _native
    from asyncside.bench.serve import percentile, prompt_of
    from asyncside.models import ForwardOptions, load_streaming_model
    from asyncside.models.embedded import ensure_embedded_default
    from asyncside.runtime import Runtime
    from asyncside.serving.engine import Batcher

    store_dir = args.model or ensure_embedded_default(None, progress=False)[1]
    fields = {f.name for f in dataclasses.fields(ForwardOptions)}
    others = ("read_threads", "run_ahead", "resident", "host_tier", "overlap_prefill", "joint_prefill",
              "merge_chunked")
    if args.switch not in fields and args.switch not in others:
        p.error(f"ForwardOptions has no field {args.switch!r}; fields: {sorted(fields)} (or one of {others})")
    values = [ast.literal_eval(v) for v in args.values]
    if args.switch in others:  # not a forward option: one model for both
        models = [load_streaming_model(store_dir)] * 2
    else:
        models = [load_streaming_model(store_dir, options=ForwardOptions(**{args.switch: v})) for v in values]

    def select(v: int) -> None:
        if args.switch == "read_threads":
            _native.set_fault_read_threads(values[v])
        if args.switch == "merge_chunked":
            _merge_chunked(values[v])
    lengths = [int(x) for x in args.prompt_lengths.split(",")]
    numbers = itertools.count()
    prompt_ids = _prompts(models[0], prompt_of)

    async def run_variant(v: int, seconds: float) -> dict[str, Any]:
        sm = models[v]
        resident = values[v] if args.switch == "resident" else args.resident
        run_ahead = values[v] if args.switch == "run_ahead" else True
        overlap = values[v] if args.switch == "overlap_prefill" else True
        joint = values[v] if args.switch == "joint_prefill" else None
        host_tier = values[v] if args.switch == "host_tier" else "auto"
        async with Runtime(sm.store, resident=resident, host_tier=host_tier) as rt:
            b = Batcher(sm, rt, prefill_chunk=args.prefill_chunk, run_ahead=run_ahead, overlap_prefill=overlap,
                        joint_prefill=joint)
            parts = _instrument(b, sm, rt)
            records: list[tuple[float, list[float]]] = []
            fwd_before = dict(sm.forward.counters)
            async with anyio.create_task_group() as tg:
                tg.start_soon(b.run)

                async def client(c: int) -> None:
                    n = 0
                    while True:
                        ids = prompt_ids(lengths[(c + n) % len(lengths)], next(numbers))
                        n += 1
                        sent = time.perf_counter()
                        times: list[float] = []
                        records.append((sent, times))
                        async for _ev in b.submit(ids, args.max_tokens):
                            times.append(time.perf_counter())

                async def clients() -> None:
                    async with anyio.create_task_group() as cg:
                        for c in range(args.clients):
                            cg.start_soon(client, c)

                start = time.perf_counter()
                with anyio.move_on_after(seconds):
                    await clients()
                wall = time.perf_counter() - start
                tg.cancel_scope.cancel()
            counters = {k: v - fwd_before.get(k, 0) for k, v in sm.forward.counters.items()}
            stats = rt.stats()
        tokens = sum(len(t) for _, t in records)
        ttft = [t[0] - s for s, t in records if t]
        gaps = [b2 - a for _, t in records for a, b2 in zip(t, t[1:])]
        return {"tok_s": tokens / wall, "requests": sum(1 for _, t in records if len(t) == args.max_tokens),
                "ttft_p50": percentile(ttft, 50), "ttft_p99": percentile(ttft, 99),
                "itl_p50": percentile(gaps, 50), "itl_p99": percentile(gaps, 99),
                # Prefill: queuing the chunks, and awaiting them; decode: building and queuing
                # steps, and awaiting them (with run-ahead the next step is built meanwhile).
                "prefill_s": parts.get("prefill", 0.0) + parts.get("finish_chunk", 0.0),
                "decode_s": parts.get("launch", 0.0) + parts.get("complete", 0.0), "wall_s": wall,
                "steps": b.steps, "steps_ahead": b.steps_ahead, "chunks_overlapped": b.chunks_overlapped,
                "prefill_chunks": b.prefill_chunks, "prefill_joined": b.prefill_joined,
                "launch_ms_per_step": b.launch_seconds / max(b.steps, 1) * 1e3,
                "breakdown_ms": _per_step(parts, b.steps, b.prefill_chunks, wall),
                "counters": {k: v for k, v in counters.items() if v},
                "bytes_read": stats.get("bytes_read"), "faults": stats.get("faults"),
                "tier_faults": stats.get("tier_faults"),
                "hit_rate": stats.get("hit_rate")}

    if args.profile:
        import cProfile
        import pstats

        select(0)
        if args.warmup > 0:
            anyio.run(run_variant, 0, args.warmup)
        prof = cProfile.Profile()
        prof.enable()
        row = anyio.run(run_variant, 0, args.seconds)
        prof.disable()
        print(f"{args.switch}={args.values[0]}: {row['tok_s']:.1f} tok/s, {row['steps']} steps, host "
              f"{row['launch_ms_per_step']:.2f} ms each (under the profiler)", file=sys.stderr)
        for key in ("tottime", "cumulative"):
            pstats.Stats(prof, stream=sys.stderr).sort_stats(key).print_stats(args.profile)
        return 0

    out: dict[str, Any] = {"switch": args.switch, "values": args.values, "resident": args.resident,
                           "clients": args.clients, "device": str(mx.default_device()), "rounds": []}
    for r in range(args.rounds):
        order = [0, 1] if r % 2 == 0 else [1, 0]
        res: dict[int, dict[str, Any]] = {}
        for v in order:
            select(v)
            if args.warmup > 0:
                anyio.run(run_variant, v, args.warmup)
            res[v] = anyio.run(run_variant, v, args.seconds)
            row = res[v]

            def ms(x: float | None) -> str:
                return "-" if x is None else f"{x * 1e3:.1f}"

            print(f"round {r} {args.switch}={args.values[v]}: {row['tok_s']:.1f} tok/s, ttft p50 "
                  f"{ms(row['ttft_p50'])} ms, itl p50/p99 {ms(row['itl_p50'])}/{ms(row['itl_p99'])} ms, "
                  f"prefill {row['prefill_s']:.1f} s decode {row['decode_s']:.1f} s, {row['steps']} steps "
                  f"({row['steps_ahead']} ahead, host {row['launch_ms_per_step']:.2f} ms each), "
                  f"{row['prefill_chunks']} prefill forwards ({row['prefill_joined']} requests joined), "
                  f"faults {row['faults']} ({row['tier_faults']} from the host tier), {row['counters']}\n"
                  f"  per decode step / prefill forward (ms): {row['breakdown_ms']}",
                  file=sys.stderr, flush=True)
        out["rounds"].append({args.values[v]: res[v] for v in (0, 1)})
    ratios = [rd[args.values[0]]["tok_s"] / max(rd[args.values[1]]["tok_s"], 1e-9) for rd in out["rounds"]]
    out["ratio_median"] = statistics.median(ratios)
    out["ratios"] = ratios
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        print(f"{args.switch}: {args.values[0]} / {args.values[1]} aggregate tok/s, median of {len(ratios)} "
              f"rounds: {out['ratio_median']:.3f} ({', '.join(f'{x:.3f}' for x in ratios)})")
    return 0


def _prompts(sm: Any, prompt_of: Any) -> Any:
    """(length, number) -> prompt ids: bench serve's prompts, or seeded ids for a store without a tokenizer."""
    tok = sm.tokenizer
    vocab = int(sm.config.get("vocab_size") or sm.config.get("text_config", {})["vocab_size"])

    def prompt_ids(length: int, number: int) -> list[int]:
        if tok is None:
            import numpy as np

            return [int(t) for t in np.random.default_rng(number).integers(0, vocab, length)]
        return list(tok.encode(prompt_of(tok, length, number)))
    return prompt_ids


_MERGEABLE: list[Any] = []


def _merge_chunked(on: bool) -> None:
    """False: the engine merges only caches with mlx-lm's own batched form, as it did before chunked
    caches merged (BatchChunkedKVCache), so a llama4 batch decodes its rows one after the other."""
    from asyncside.serving import engine

    if not _MERGEABLE:
        _MERGEABLE.append(engine.mergeable)
    engine.mergeable = _MERGEABLE[0] if on else (lambda cache: all(hasattr(c, "merge") for c in cache))


def _instrument(b: Any, sm: Any, rt: Any) -> dict[str, float]:
    """Wrap the engine's pieces with wall clocks (seconds, summed): where a decode step's and a
    prefill forward's time goes, host phase by host phase (the forward's ``host_ns``)."""
    parts: dict[str, float] = {}
    host = sm.forward.queued.host_ns

    def add(key: str, dt: float) -> None:
        parts[key] = parts.get(key, 0.0) + dt

    def wrap(obj: Any, name: str, key: str, phases: bool = False) -> None:
        fn = getattr(obj, name)

        async def timed(*a: Any, **k: Any) -> Any:
            before = dict(host) if phases else None
            t = time.perf_counter()
            try:
                return await fn(*a, **k)
            finally:
                add(key, time.perf_counter() - t)
                if before is not None:
                    for h, v in host.items():
                        if h != "steps":
                            add(f"{key}.{h}", (v - before[h]) * 1e-9)

        setattr(obj, name, timed)

    wrap(b, "step", "engine_step")
    wrap(b, "_launch", "launch", phases=True)
    wrap(b, "_prefill", "prefill", phases=True)
    wrap(b, "_finish_chunk", "finish_chunk")
    wrap(b, "_complete", "complete")
    fwd = sm.forward
    completed = fwd.completed

    async def timed_completed(*a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        try:
            return await completed(*a, **k)
        finally:
            add("completed_await", time.perf_counter() - t)

    fwd.completed = timed_completed
    after = rt.after_step

    def timed_after(step: int | None = None) -> None:
        t = time.perf_counter()
        try:
            after(step)
        finally:
            add("after_step", time.perf_counter() - t)

    rt.after_step = timed_after
    return parts


def _per_step(parts: dict[str, float], steps: int, chunks: int, wall: float) -> dict[str, float]:
    """The breakdown per decode step (launch, complete and the engine's step) and per prefill
    forward (prefill, finish_chunk), in ms; ``outside_step_s``: the loop's time outside the engine."""
    out: dict[str, float] = {}
    for k, v in sorted(parts.items()):
        per = chunks if k.startswith(("prefill", "finish_chunk")) else steps
        out[k] = round(v / max(per, 1) * 1e3, 3)
    out["outside_step_s"] = round(wall - parts.get("engine_step", 0.0), 3)
    return out


if __name__ == "__main__":
    sys.exit(main())
