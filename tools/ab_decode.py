"""A/B of one forward option in one process: decode speed with two values of it, mlx-lm beside.

    python tools/ab_decode.py --switch mode --values "'queued'" "'per-layer'" --resident 0.25 --rounds 6
    python tools/ab_decode.py --switch lookahead_extra --values 2 0 ...

This VM's speed drifts 10-20% within minutes, so two separate runs cannot compare a change of a
few percent. Here every round runs mlx-lm's ``generate_step`` (all experts resident), then the
streamed generation with ``ForwardOptions.<switch>`` at either value (the order alternates by round),
each from a fresh :class:`Runtime` at the same residency, and reports each variant's decode speed
as the median of its per-round ratios to that round's mlx-lm run. Tokens are checked against
mlx-lm's every time. A diagnostic for choosing defaults; the benchmark is ``asyncside bench
generate``.
"""

from __future__ import annotations

import argparse
import ast
import json
import statistics
import sys
import time
from typing import Any

import anyio


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--switch", default="mode", help="field of ForwardOptions to set")
    p.add_argument("--values", nargs=2, default=["'queued'", "'per-layer'"], metavar=("ON", "OFF"),
                   help="the two values to compare (Python literals; default 'queued' 'per-layer')")
    p.add_argument("--resident", type=float, default=0.25)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--tokens", type=int, default=32)
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
            async for tok in sm.generate(prompt, max_tokens=args.tokens, source=rt, predictor=args.predictor,
                                         options=options[on]):
                run.first_token()
                run.tokens.append(tok)
            run.end = time.perf_counter()
            await rt.drain()
            run.stats = {"mb_read": round(rt.stats()["bytes_read"] / 1e6, 1),
                         "layers_with_unsound_pairs": fwd.counters["speculation_misses"] - misses}
            return run

    def run_variant(on: bool) -> Any:
        return anyio.run(streamed, on, backend="asyncio", backend_options={"use_uvloop": True})

    reference_run(ref_model, prompt, 2, set())  # warm-up of both paths
    run_variant(True)
    run_variant(False)
    rounds: list[dict[str, Any]] = []
    for r in range(args.rounds):
        ref = reference_run(ref_model, prompt, args.tokens, set())
        row: dict[str, Any] = {"mlx_lm_tok_s": round(ref.decode_tokens_per_s, 2)}
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
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        print(f"{args.switch}={values[True]!r}: {summary['on_ratio_median']}x of mlx-lm, {values[False]!r}: "
              f"{summary['off_ratio_median']}x "
              f"(on/off per round, median {summary['on_over_off_per_round_median']}); "
              f"tokens identical: {summary['tokens_identical']}")
        print(f"MB read (median): {summary['on_mb_read_median']} vs {summary['off_mb_read_median']}; layers with "
              f"unsound pairs: {summary['on_layers_with_unsound_pairs_median']} vs "
              f"{summary['off_layers_with_unsound_pairs_median']}")
    return 0 if summary["tokens_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
