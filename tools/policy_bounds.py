"""Why 75% of Belady's MIN is out of reach on low-locality routing, and what per-layer row budgets
(split_rows) buy on a model whose layers differ; docs/policies.md cites the output.

    python tools/policy_bounds.py [--tokens 2048] [--json OUT]

1. Uniform i.i.d. routing (64 experts, top-6, 8 layers): every online policy's expected hit rate
   is rows / experts exactly (what it holds is independent of the next token), against MIN's.
2. The "low" preset's generator: the best static set measured on a long trace (16x the tokens,
   so its fit to the sample is small) estimates the most popular experts' true share, the bound
   for any online policy up to the preset's small token-to-token overlap.
3. A mixed trace (layers alternating low and high locality): an even split of the rows against
   split_rows over LRU miss curves, replayed with each policy.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from asyncside.argtypes import int_at_least
from asyncside.policy_replay import lru_miss_curve, replay_trace, split_rows, total, trace_rows
from asyncside.routing import LOCALITIES, RoutingTrace, preset, synthetic

POLICIES = ("lru", "lrfu", "adaptive-lrfu")


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int_at_least(1), default=2048)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    out: dict[str, dict[str, object]] = {}
    shape = {"n_layers": 8, "n_experts": 64, "top_k": 6}
    uni = synthetic(tokens=args.tokens, skew=0.0, overlap=0.0, layer_corr=0.0, **shape)
    loc = LOCALITIES["low"]
    long_low = synthetic(tokens=16 * args.tokens, skew=loc["skew"], overlap=loc["overlap"],
                         layer_corr=loc["layer_corr"], **shape)
    low = preset("low", tokens=args.tokens)
    for frac in (0.25, 0.5):
        rows = trace_rows(uni, frac)
        mn = total(replay_trace(uni, rows, method="min")).hit_rate
        row: dict[str, object] = {"uniform_min": mn, "uniform_online_expected": rows / 64,
                                 "uniform_bound_over_min": rows / 64 / mn}
        for p in POLICIES:
            row[f"uniform_{p}"] = total(replay_trace(uni, rows, p)).hit_rate
        low_min = total(replay_trace(low, rows, method="min")).hit_rate
        static_long = total(replay_trace(long_low, rows, method="static")).hit_rate
        hindsight = total(replay_trace(low, rows, method="static")).hit_rate
        row.update({"low_min": low_min, "low_static_in_hindsight": hindsight,
                    "low_static_long_trace": static_long, "low_static_long_over_min": static_long / low_min})
        out[f"{frac:.0%}"] = row
    # Mixed layers: even rows vs split_rows from each layer's LRU miss curve (same total).
    lo = preset("low", tokens=args.tokens, seed=3)
    hi = preset("high", tokens=args.tokens, seed=4)
    ids = np.stack([(lo if layer % 2 == 0 else hi).ids[:, layer, :] for layer in range(8)], axis=1)
    mixed = RoutingTrace(ids, np.array([args.tokens]), 64, {"source": "synthetic", "mixed": "low/high alternate"})
    curves = [lru_miss_curve(mixed.ids[:, layer, :].tolist(), 64) for layer in range(8)]
    for frac in (0.25, 0.5):
        rows = trace_rows(mixed, frac)
        alloc = split_rows(curves, rows * 8, min_rows=6)
        row = {"rows_even": rows, "rows_split": alloc}
        for p in POLICIES:
            row[f"{p}_even"] = total(replay_trace(mixed, rows, p)).hit_rate
            row[f"{p}_split"] = total(replay_trace(mixed, alloc, p)).hit_rate
        row["min_even"] = total(replay_trace(mixed, rows, method="min")).hit_rate
        row["min_split"] = total(replay_trace(mixed, alloc, method="min")).hit_rate
        out[f"mixed {frac:.0%}"] = row
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
