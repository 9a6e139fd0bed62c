"""A/B of one forward switch in one process: decode speed with a switch on and off, mlx-lm beside.

    python tools/ab_decode.py --switch speculate --resident 0.25 --rounds 6 --tokens 32 [--json]

This VM's speed drifts 10-20% within minutes, so two separate runs cannot compare a change of a
few percent. Here every round runs mlx-lm's ``generate_step`` (all experts resident), then the
streamed generation with ``AsyncForward.<switch>`` on and off (the order alternates by round),
each from a fresh :class:`Runtime` at the same residency, and reports each variant's decode speed
as the median of its per-round ratios to that round's mlx-lm run. Tokens are checked against
mlx-lm's every time. A diagnostic for choosing defaults; the benchmark is ``asyncside bench
generate``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Any

import anyio


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--switch", default="speculate", help="boolean attribute of AsyncForward to flip")
    p.add_argument("--resident", type=float, default=0.25)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--predictor", default="lookahead")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    from asyncside.bench.generate import _generate
    from asyncside.demo import DEFAULT_PROMPT, reference_run
    from asyncside.models import load_reference_model, load_streaming_model
    from asyncside.models.embedded import ensure_embedded_default
    from asyncside.runtime import Runtime
    from asyncside.store import ExpertStore

    _model_dir, store_dir = ensure_embedded_default(None, progress=False)
    store = ExpertStore.open(store_dir)
    sm = load_streaming_model(store_dir)
    fwd = sm.forward
    if not isinstance(getattr(fwd, args.switch, None), bool):
        p.error(f"AsyncForward has no boolean attribute {args.switch!r}")
    prompt = list(sm.tokenizer.encode(DEFAULT_PROMPT))
    ref_model, _ = load_reference_model(store_dir)

    async def streamed() -> Any:
        async with Runtime(store, resident=args.resident, policy="lfu") as rt:
            return await _generate(sm, rt, prompt, args.tokens, args.predictor)

    def run_variant(on: bool) -> Any:
        setattr(fwd, args.switch, on)
        return anyio.run(streamed, backend="asyncio", backend_options={"use_uvloop": True})

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
        rounds.append(row)
        if not args.json:
            print(f"round {r}: mlx-lm {row['mlx_lm_tok_s']} tok/s; {args.switch} on {row['on_ratio']}x, "
                  f"off {row['off_ratio']}x", flush=True)
    summary = {
        "switch": args.switch, "resident": args.resident, "tokens": args.tokens, "rounds": rounds,
        "on_ratio_median": round(statistics.median(r["on_ratio"] for r in rounds), 3),
        "off_ratio_median": round(statistics.median(r["off_ratio"] for r in rounds), 3),
        "on_over_off_per_round_median": round(statistics.median(r["on_ratio"] / r["off_ratio"] for r in rounds), 3),
        "tokens_identical": all(r["on_tokens_identical"] and r["off_tokens_identical"] for r in rounds),
    }
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        print(f"{args.switch} on: {summary['on_ratio_median']}x of mlx-lm, off: {summary['off_ratio_median']}x "
              f"(on/off per round, median {summary['on_over_off_per_round_median']}); "
              f"tokens identical: {summary['tokens_identical']}")
    return 0 if summary["tokens_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
