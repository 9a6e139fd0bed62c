"""A/B of one forward option in one process: decode speed with two values of it, mlx-lm beside.

    python tools/ab_decode.py --switch mode --values "'queued'" "'per-layer'" --resident 0.25 --rounds 6
    python tools/ab_decode.py --switch lookahead_extra --values 2 0 ...

This VM's speed drifts 10-20% within minutes, so two separate runs cannot compare a change of a
few percent. Here every round runs mlx-lm's ``generate_step`` (all experts resident), then the
streamed generation with ``ForwardOptions.<switch>`` at either value (the order alternates by round),
each from a fresh :class:`Runtime` at the same residency, and reports each variant's decode speed
as the median of its per-round ratios to that round's mlx-lm run. Tokens are checked against
mlx-lm's every time. On Linux each run also reports the CPU time per decode token of the loop
(main) thread and of the busiest other thread, MLX's stream thread (``/proc/self/task/*/schedstat``,
first token to last), and that thread's share of the wall time: whether the step is fed fast
enough to keep the stream busy, which a tok/s figure alone does not say. A diagnostic for
choosing defaults; the benchmark is ``asyncside bench generate``.
"""

from __future__ import annotations

import argparse
import ast
import glob
import json
import os
import statistics
import sys
import time
from typing import Any

import anyio

from asyncside.argtypes import int_at_least


def thread_cpu_ms() -> dict[int, float]:
    """CPU time (ms) of each thread of this process so far ({} where /proc has no schedstat)."""
    out: dict[int, float] = {}
    for d in glob.glob(f"/proc/{os.getpid()}/task/*"):
        try:
            with open(os.path.join(d, "schedstat")) as f:
                out[int(os.path.basename(d))] = int(f.read().split()[0]) / 1e6
        except (OSError, ValueError, IndexError):
            pass
    return out


def cpu_per_token(first: dict[int, float], last: dict[int, float], steps: int, wall_s: float) -> dict[str, float]:
    """The main thread's and the busiest other thread's CPU ms per decode step, and that thread's busy share."""
    if not first or steps < 1 or wall_s <= 0:
        return {}
    main = os.getpid()
    spent = {t: last[t] - first.get(t, 0.0) for t in last}
    other = max((v for t, v in spent.items() if t != main), default=0.0)
    return {"main_cpu_ms": round(spent.get(main, 0.0) / steps, 2), "stream_cpu_ms": round(other / steps, 2),
            "stream_busy": round(other / 1e3 / wall_s, 3)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--switch", default="mode", help="field of ForwardOptions to set")
    p.add_argument("--values", nargs=2, default=["'queued'", "'per-layer'"], metavar=("ON", "OFF"),
                   help="the two values to compare (Python literals; default 'queued' 'per-layer')")
    p.add_argument("--resident", type=float, default=0.25)
    p.add_argument("--rounds", type=int_at_least(1), default=6)
    p.add_argument("--tokens", type=int_at_least(2), default=32)
    p.add_argument("--predictor", default="lookahead")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    import dataclasses

    from asyncside.demo import DEFAULT_PROMPT, Run, reference_run
    from asyncside.models import ForwardOptions, load_reference_model, load_streaming_model
    from asyncside.models.embedded import ensure_embedded_default
    from asyncside.runtime import Runtime
    from asyncside.store import ExpertStore

    _model_dir, store_dir = ensure_embedded_default(None, progress=False)
    store = ExpertStore.open(store_dir)
    sm = load_streaming_model(store_dir)
    values = {True: ast.literal_eval(args.values[0]), False: ast.literal_eval(args.values[1])}
    fields = {f.name for f in dataclasses.fields(ForwardOptions)}
    if args.switch not in fields:
        p.error(f"ForwardOptions has no field {args.switch!r}; fields: {sorted(fields)}")
    options = {on: ForwardOptions(**{args.switch: values[on]}) for on in (True, False)}
    forwards = {on: sm.forward_with(options[on]) for on in (True, False)}
    prompt = list(sm.tokenizer.encode(DEFAULT_PROMPT))
    ref_model, _ = load_reference_model(store_dir)

    async def streamed(on: bool) -> Any:
        fwd = forwards[on]
        async with Runtime(store, resident=args.resident) as rt:
            misses = fwd.counters["speculation_misses"]
            run = Run(start=time.perf_counter())
            first: dict[int, float] = {}
            async for tok in sm.generate(prompt, max_tokens=args.tokens, source=rt, predictor=args.predictor,
                                         options=options[on]):
                if not run.tokens:
                    first = thread_cpu_ms()
                run.first_token()
                run.tokens.append(tok)
            run.end = time.perf_counter()
            cpu = cpu_per_token(first, thread_cpu_ms(), len(run.tokens) - 1, run.end - run.first)
            await rt.drain()
            run.stats = {"mb_read": round(rt.stats()["bytes_read"] / 1e6, 1),
                         "layers_with_unsound_pairs": fwd.counters["speculation_misses"] - misses, **cpu}
            return run

    def run_variant(on: bool) -> Any:
        return anyio.run(streamed, on, backend="asyncio", backend_options={"use_uvloop": True})

    def reference(tokens: int) -> tuple[Any, dict[str, float]]:
        """mlx-lm's own generate_step (as the demo's reference_run), with its threads' CPU."""
        import mlx.core as mx
        from mlx_lm.generate import generate_step

        run = Run(start=time.perf_counter())
        first: dict[int, float] = {}
        for y, _ in generate_step(mx.array(prompt), ref_model, max_tokens=tokens):
            if not run.tokens:
                first = thread_cpu_ms()
            run.first_token()
            run.tokens.append(int(y))
        run.end = time.perf_counter()
        return run, cpu_per_token(first, thread_cpu_ms(), len(run.tokens) - 1, run.end - run.first)

    reference_run(ref_model, prompt, 2, set())  # warm-up of both paths
    run_variant(True)
    run_variant(False)
    rounds: list[dict[str, Any]] = []
    for r in range(args.rounds):
        ref, ref_cpu = reference(args.tokens)
        row: dict[str, Any] = {"mlx_lm_tok_s": round(ref.decode_tokens_per_s, 2),
                               **{f"mlx_lm_{k}": v for k, v in ref_cpu.items()}}
        for on in ((True, False) if r % 2 == 0 else (False, True)):
            run = run_variant(on)
            key = "on" if on else "off"
            row[f"{key}_tok_s"] = round(run.decode_tokens_per_s, 2)
            row[f"{key}_ratio"] = round(run.decode_tokens_per_s / ref.decode_tokens_per_s, 3)
            row[f"{key}_tokens_identical"] = run.tokens == ref.tokens
            row.update({f"{key}_{k}": v for k, v in run.stats.items()})
        rounds.append(row)
        if not args.json:
            print(f"round {r}: mlx-lm {row['mlx_lm_tok_s']} tok/s; {args.switch}={values[True]!r} {row['on_ratio']}x, "
                  f"{values[False]!r} {row['off_ratio']}x", flush=True)
    summary = {
        "switch": args.switch, "on": values[True], "off": values[False], "resident": args.resident,
        "tokens": args.tokens, "rounds": rounds,
        "on_ratio_median": round(statistics.median(r["on_ratio"] for r in rounds), 3),
        "off_ratio_median": round(statistics.median(r["off_ratio"] for r in rounds), 3),
        "on_over_off_per_round_median": round(statistics.median(r["on_ratio"] / r["off_ratio"] for r in rounds), 3),
        "on_mb_read_median": statistics.median(r["on_mb_read"] for r in rounds),
        "off_mb_read_median": statistics.median(r["off_mb_read"] for r in rounds),
        "on_layers_with_unsound_pairs_median": statistics.median(r["on_layers_with_unsound_pairs"] for r in rounds),
        "off_layers_with_unsound_pairs_median": statistics.median(r["off_layers_with_unsound_pairs"] for r in rounds),
        "tokens_identical": all(r["on_tokens_identical"] and r["off_tokens_identical"] for r in rounds),
    }
    for key in ("main_cpu_ms", "stream_cpu_ms", "stream_busy"):
        for side in ("mlx_lm", "on", "off"):
            vals = [r[f"{side}_{key}"] for r in rounds if f"{side}_{key}" in r]
            if vals:
                summary[f"{side}_{key}_median"] = round(statistics.median(vals), 3)
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        print(f"{args.switch}={values[True]!r}: {summary['on_ratio_median']}x of mlx-lm, {values[False]!r}: "
              f"{summary['off_ratio_median']}x "
              f"(on/off per round, median {summary['on_over_off_per_round_median']}); "
              f"tokens identical: {summary['tokens_identical']}")
        if "on_stream_busy_median" in summary:
            print("CPU ms per decode token, main / stream thread (stream busy share), medians: " + "; ".join(
                f"{side} {summary[f'{side}_main_cpu_ms_median']} / {summary[f'{side}_stream_cpu_ms_median']} "
                f"({summary[f'{side}_stream_busy_median']})" for side in ("mlx_lm", "on", "off")))
        print(f"MB read (median): {summary['on_mb_read_median']} vs {summary['off_mb_read_median']}; layers with "
              f"unsound pairs: {summary['on_layers_with_unsound_pairs_median']} vs "
              f"{summary['off_layers_with_unsound_pairs_median']}")
    return 0 if summary["tokens_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
