"""Model-side measurements: async forward overhead, predictor quality, cache policies vs Belady.

``python -m asyncside.models.report [STORE_DIR] [--json OUT]`` (default: the embedded model).
Runs in one process, side by side:

- greedy decode tokens/s of the plain mlx-lm model (mlx-lm's ``generate_step``) and of the async
  forward over a ResidentSource (all experts resident, lookup = identity), same prompt, same
  tokens (checked), so the ratio is the cost of per-layer routing round trips;
- the recall/precision of the ``lookahead`` and ``temporal`` predictors on decode steps;
- for each resident fraction and side-region size: the hit rate of each ledger policy replayed
  over the recorded routing (demand only, and with the lookahead predictions as prefetches) beside
  Belady's MIN (the best any demand policy can do).

Prints a table and writes JSON. The streaming runtime's own numbers (bytes read, stall time) are
``asyncside bench generate``'s business; this report needs no runtime.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time
from typing import Any

import anyio
import numpy as np

DEFAULT_PROMPT = ("Once upon a time, in a small village by the sea, there lived an old fisherman "
                  "who had three sons.")


def _timed_decode(run: Any, n: int) -> tuple[list[int], float, float]:
    """(tokens, prefill+first token seconds, decode tokens/s) from runs with 1 and n tokens."""
    t0 = time.perf_counter()
    run(1)
    t1 = time.perf_counter()
    toks = run(n)
    t2 = time.perf_counter()
    first = t1 - t0
    return toks, first, (n - 1) / max((t2 - t1) - first, 1e-9)


def measure(store_dir: str | pathlib.Path, *, prompt: str = DEFAULT_PROMPT, max_tokens: int = 48,
            fractions: tuple[float, ...] = (0.125, 0.25, 0.5), side_rows: tuple[int, ...] = (4, 8, 16),
            policies: tuple[str, ...] = ("lfu", "lru", "aging-lfu", "oneshot")) -> dict[str, Any]:
    from ..bridge import completed
    from .convert import resident_sets
    from .loading import load_reference_model, load_streaming_model, reference_generate
    from .trace import CacheResult, RoutingTrace, belady, replay_policy

    sm = load_streaming_model(store_dir, completed=completed)
    ref_model, _ = load_reference_model(store_dir)
    ids = sm.tokenizer.encode(prompt)
    eos = sm.tokenizer.eos_token_ids
    src = sm.resident_source()

    def run_ref(n: int) -> list[int]:
        return reference_generate(ref_model, ids, max_tokens=n, eos_token_ids=eos)

    def run_async(n: int, predictor: str = "none", trace: RoutingTrace | None = None) -> list[int]:
        async def go() -> list[int]:
            return [t async for t in sm.generate(ids, max_tokens=n, source=src, predictor=predictor, trace=trace)]
        return anyio.run(go)

    ref_toks, ref_first, ref_tps = _timed_decode(run_ref, max_tokens)
    async_toks, async_first, async_tps = _timed_decode(run_async, max_tokens)
    out: dict[str, Any] = {
        "model_id": sm.model_id,
        "prompt_tokens": len(ids),
        "generated": len(async_toks),
        "tokens_equal": ref_toks == async_toks,
        "text": sm.tokenizer.decode(async_toks),
        "decode_tok_s": {"mlx_lm_reference": ref_tps, "async_resident": async_tps,
                         "ratio": async_tps / ref_tps},
        "prefill_first_token_s": {"mlx_lm_reference": ref_first, "async_resident": async_first},
    }

    traces = {}
    for pred in ("lookahead", "temporal"):
        tr = RoutingTrace()
        toks = run_async(max_tokens, pred, tr)
        assert toks == async_toks, "predictors must not change tokens"
        traces[pred] = tr
    quality = {}
    for pred, tr in traces.items():
        rec, prec = [], []
        for l in tr.layers:
            for d, p in list(zip(tr.demands(l), tr.predictions(l)))[2:]:  # decode steps only
                if p is None:
                    continue
                hit = len(np.intersect1d(d, p))
                rec.append(hit / len(d))
                prec.append(hit / len(p))
        # None where the predictor named nothing on a decode step (a short run): no figure, not NaN
        quality[pred] = {"recall": float(np.mean(rec)) if rec else None,
                         "precision": float(np.mean(prec)) if prec else None}
    out["predictor_decode_quality"] = quality

    tr = traces["lookahead"]
    n_exp = {l: s.n_experts for l, s in sm.store.layers.items()}
    rows = []
    for frac in fractions:
        res = resident_sets(sm.store, frac)
        for side in side_rows:
            line: dict[str, Any] = {"resident_fraction": frac, "side_rows": side}
            b = sum((belady(tr.demands(l), res[l], side) for l in tr.layers), start=CacheResult())
            line["belady"] = b.hit_rate
            for pol in policies:
                r = sum((replay_policy(tr.demands(l), n_exp[l], res[l], side, pol) for l in tr.layers),
                        start=CacheResult())
                rp = sum((replay_policy(tr.demands(l), n_exp[l], res[l], side, pol, predictions=tr.predictions(l))
                          for l in tr.layers), start=CacheResult())
                line[pol] = r.hit_rate
                line[f"{pol}+lookahead"] = rp.hit_rate
                line[f"{pol}+lookahead_prefetch_reads"] = rp.prefetch_reads
            rows.append(line)
    out["hit_rates"] = rows
    out["hit_rate_definition"] = ("distinct experts demanded per layer per step that were resident or already "
                                  "in the side region (prefetched ones count as hits), over the whole run")
    return out


def _figure(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def format_table(res: dict[str, Any]) -> str:
    lines = [
        f"model {res['model_id']}: prompt {res['prompt_tokens']} tokens, {res['generated']} generated, "
        f"tokens equal to mlx-lm: {res['tokens_equal']}",
        "decode tok/s: mlx-lm {mlx_lm_reference:.1f} | async resident {async_resident:.1f} | ratio {ratio:.2f}".format(
            **res["decode_tok_s"]),
        "predictors (decode): " + ", ".join(
            f"{k} recall {_figure(v['recall'])} precision {_figure(v['precision'])}"
            for k, v in res["predictor_decode_quality"].items()),
    ]
    cols = [c for c in res["hit_rates"][0] if not c.endswith("_reads")]
    lines.append(" | ".join(f"{c:>14}" for c in cols))
    for r in res["hit_rates"]:
        lines.append(" | ".join(f"{r[c]:>14.3f}" if isinstance(r[c], float) else f"{r[c]:>14}" for c in cols))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    # (__doc__ is None under python -OO, which strips docstrings)
    ap = argparse.ArgumentParser(prog="python -m asyncside.models.report",
                                 description=(__doc__ or "").partition("\n")[0])
    ap.add_argument("store", nargs="?", help="converted store directory (default: the embedded model)")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    store = args.store
    if store is None:
        from .embedded import ensure_embedded_default

        store = ensure_embedded_default()[1]
    res = measure(store, max_tokens=args.max_tokens)
    print(format_table(res))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(res, indent=1) + "\n", encoding="utf-8")
    return 0 if res["tokens_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
