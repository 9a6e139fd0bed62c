"""Every policy variant tried for docs/policies.md, against Belady's MIN, on shortened traces.

    python tools/policy_variants.py [--tokens 1024] [--json OUT]

Variants: LRFU (half-life 8, the default); LRFU that keeps each expert's history after eviction
at fixed half-lives 16, 64, 256 (admission alone, no adaptation); AdaptiveLRFU with the candidate
half-lives (8, 256) (the one kept), (4, 128), (2, 16, 128), (4, 16, 64, 256). Traces (8 layers):
the three presets at 64x6, middle at 256x8, a "drift" trace (four sequences of the middle preset
with different seeds: each sequence has its own hot experts), and the recorded embedded trace.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from asyncside.argtypes import int_at_least
from asyncside.policies import LRFU, AdaptiveLRFU, Policy, _HeapPolicy
from asyncside.policy_replay import replay_trace, total, trace_rows
from asyncside.routing import LOCALITIES, RoutingTrace, preset, synthetic


class HistoryLRFU(LRFU):
    """LRFU whose use history survives eviction (fixed half-life)."""

    name = "history-lrfu"

    def on_remove(self, expert: int) -> None:
        _HeapPolicy.on_remove(self, expert)  # the score goes, the (count, time) history stays


VARIANTS: dict[str, Callable[[], Policy]] = {
    "lrfu h8": functools.partial(LRFU, 8.0),
    "history h16": functools.partial(HistoryLRFU, 16.0),
    "history h64": functools.partial(HistoryLRFU, 64.0),
    "history h256": functools.partial(HistoryLRFU, 256.0),
    "adaptive (8,256)": AdaptiveLRFU,
    "adaptive (4,128)": functools.partial(AdaptiveLRFU, (4.0, 128.0)),
    "adaptive (2,16,128)": functools.partial(AdaptiveLRFU, (2.0, 16.0, 128.0)),
    "adaptive (4,16,64,256)": functools.partial(AdaptiveLRFU, (4.0, 16.0, 64.0, 256.0)),
}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--tokens", type=int_at_least(1), default=1024)
    ap.add_argument("--embedded", default="benchmarks/policy-embedded-trace.npz")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    t = args.tokens
    traces = {f"{n} {e}x{k}": preset(n, tokens=t, n_experts=e, top_k=k)
              for n, e, k in (("low", 64, 6), ("middle", 64, 6), ("high", 64, 6), ("middle", 256, 8))}
    loc = LOCALITIES["middle"]
    parts = [synthetic(tokens=t // 4, n_layers=8, n_experts=64, top_k=6, seed=100 + s, skew=loc["skew"],
                       overlap=loc["overlap"], layer_corr=loc["layer_corr"]) for s in range(4)]
    traces["drift 64x6"] = RoutingTrace(np.concatenate([p.ids for p in parts]), np.array([t // 4] * 4), 64,
                                        {"source": "synthetic", "drift": "4 seeds of middle"})
    traces["embedded 64x4"] = RoutingTrace.load(args.embedded)
    rows_out = []
    print("| trace | cache | MIN | " + " | ".join(VARIANTS) + " |")
    print("| --- | --- | ---: | " + " | ".join("---:" for _ in VARIANTS) + " |")
    for name, tr in traces.items():
        for frac in (0.25, 0.5):
            rows = trace_rows(tr, frac)
            mn = total(replay_trace(tr, rows, method="min")).hit_rate
            line: dict[str, Any] = {"trace": name, "fraction": frac, "min": mn}
            for label, factory in VARIANTS.items():
                line[label] = total(replay_trace(tr, rows, factory)).hit_rate
            rows_out.append(line)
            print(f"| {name} | {frac:.0%} | {mn:.3f} | "
                  + " | ".join(f"{line[v]:.3f} ({line[v] / mn:.2f})" for v in VARIANTS) + " |", flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"tokens": t, "rows": rows_out}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
