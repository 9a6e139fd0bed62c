"""``asyncside bench policy``: cache policies against Belady's MIN on routing traces.

Per trace (the synthetic locality presets at several shapes and seeds, plus any ``--trace`` file),
per cache size (a fraction of the experts, per MoE layer), per policy: the hit rate replayed
through the real Ledger, beside Belady's MIN with and without bypass and the best static set in
hindsight, and each policy's fraction of MIN. Prints a table (unless ``--json``), writes JSON with
``--out``.

``--split``: rows split between layers from a profile instead. Each trace is cut in two (its first
two sequences, or halves): the split (:func:`asyncside.policy_replay.split_rows` over the first
part's LRU miss curves, the total of an even cache) is replayed on the second part (a holdout)
with the default policy, beside even rows and MIN at even rows.

Pure Python and numpy (no MLX); docs/policies.md explains the columns.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import time
from typing import Any

#: (experts, top_k) of the default synthetic traces: the recorded public trace's shape (64 experts,
#: top-6) and two larger ones.
DEFAULT_SHAPES = ((64, 6), (128, 8), (256, 8))


def add_policy_arguments(parser: argparse.ArgumentParser) -> None:
    """The bench's options."""
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per synthetic trace (default 2048)")
    parser.add_argument("--layers", type=int, default=8, help="MoE layers per synthetic trace (default 8)")
    parser.add_argument("--fractions", default="0.25,0.5",
                        help="per-layer cache sizes as fractions of the experts (default 0.25,0.5)")
    parser.add_argument("--policies", default="lru,lfu,aging-lfu,lrfu,adaptive-lrfu",
                        help="policies to replay, comma-separated (default: every named policy but one-shot)")
    parser.add_argument("--presets", default="low,middle,high",
                        help="synthetic locality presets (default low,middle,high); 'mixed' takes its layers in "
                             "turn from low, middle and high (layers that differ)")
    parser.add_argument("--shapes", default=",".join(f"{e}x{k}" for e, k in DEFAULT_SHAPES),
                        help="synthetic shapes EXPERTSxTOP_K, comma-separated (default 64x6,128x8,256x8)")
    parser.add_argument("--seeds", default="0", help="seeds of the synthetic traces, comma-separated (default 0)")
    parser.add_argument("--trace", action="append", default=[], metavar="NPZ",
                        help="also replay this routing trace file (docs/routing-traces.md); repeatable")
    parser.add_argument("--out", default=None, help="write the result as JSON to this file")
    parser.add_argument("--split", action="store_true",
                        help="rows split between layers from a profile (the first sequence or half of each "
                             "trace), replayed on a holdout (the second), against even rows and MIN")
    parser.add_argument("--quick", action="store_true",
                        help="tiny run for CI smoke tests: 256 tokens, 2 layers, 64x6 only (numbers are noise)")


def _ints(text: str, what: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--{what}: expected comma-separated integers, got {text!r}") from None


def mixed_preset(_name: str = "mixed", **kw: Any) -> Any:
    """A synthetic trace whose layers differ: layer l is layer l of the ``low``, ``middle`` or
    ``high`` preset (in turn, l mod 3) of the same shape, seed and sequences."""
    from ..routing import RoutingTrace, preset

    parts = [preset(name, **kw) for name in ("low", "middle", "high")]
    ids = parts[0].ids.copy()
    for layer in range(ids.shape[1]):
        ids[:, layer] = parts[layer % 3].ids[:, layer]
    return RoutingTrace(ids, parts[0].lengths.copy(), parts[0].n_experts,
                        {**parts[0].meta, "locality": "mixed (layers in turn from low, middle, high)"})


def build_traces(args: argparse.Namespace, sequences: int = 1) -> dict[str, Any]:
    """The traces the arguments name, by label (synthetic ones of ``sequences`` sequences of
    ``--tokens`` each)."""
    from ..routing import LOCALITIES, RoutingTrace, preset

    traces: dict[str, Any] = {}
    presets = [p for p in args.presets.split(",") if p]
    for p in presets:
        if p not in LOCALITIES and p != "mixed":
            raise SystemExit(f"--presets: unknown preset {p!r}; known: {sorted(LOCALITIES)}")
    shapes = []
    for s in args.shapes.split(","):
        try:
            e, k = (int(x) for x in s.lower().split("x"))
        except ValueError:
            raise SystemExit(f"--shapes: expected EXPERTSxTOP_K like 64x6, got {s!r}") from None
        shapes.append((e, k))
    for seed in _ints(args.seeds, "seeds"):
        for e, k in shapes:
            for p in presets:
                make = mixed_preset if p == "mixed" else preset
                try:
                    traces[f"{p} {e}x{k} s{seed}"] = make(p, tokens=args.tokens * sequences, n_layers=args.layers,
                                                           n_experts=e, top_k=k, seed=seed, sequences=sequences)
                except ValueError as exc:  # a shape or size the generator cannot make: the options' fault
                    raise SystemExit(f"--tokens {args.tokens} --layers {args.layers} --shapes {e}x{k}: {exc}") from None
    for path in args.trace:
        tr = RoutingTrace.load(path)
        traces[f"{pathlib.Path(path).stem} {tr.n_experts}x{tr.top_k}"] = tr
    return traces


def format_table(rows: list[dict[str, Any]], policies: list[str]) -> str:
    """The rows as a Markdown table: hit rates, and each policy's fraction of MIN in brackets."""
    head = ["trace", "cache", "MIN", "MIN no bypass", "static", *policies]
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join(["---"] * 2 + ["---:"] * (len(head) - 2)) + " |"]
    for r in rows:
        cells = [r["trace"], f"{r['fraction']:.0%} ({r['rows']})", f"{r['min']:.3f}", f"{r['min-no-bypass']:.3f}",
                 f"{r['static']:.3f} ({r['static'] / r['min'] if r['min'] else math.nan:.2f})"]
        cells += [f"{r[p]:.3f} ({r[p + '/min']:.2f})" for p in policies]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_split_table(rows: list[dict[str, Any]], policy: str) -> str:
    """The ``--split`` rows as a Markdown table: hit rates on the holdout, ratios in brackets."""
    head = ["trace", "cache", "MIN (even)", f"{policy} even", f"{policy} split from profile", "split/even",
            "rows per layer (split)"]
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join(["---"] * 2 + ["---:"] * (len(head) - 3) + ["---"])
             + " |"]
    for r in rows:
        lines.append("| " + " | ".join([
            r["trace"], f"{r['fraction']:.0%} ({r['rows']})", f"{r['min']:.3f}",
            f"{r['even']:.3f} ({r['even/min']:.2f} of MIN)", f"{r['split_hit_rate']:.3f} ({r['split/min']:.2f} of MIN)",
            f"{r['split/even']:.3f}x", " ".join(str(x) for x in r["split"])]) + " |")
    return "\n".join(lines)


def run_split_bench(args: argparse.Namespace, fractions: list[float]) -> dict[str, Any]:
    """``--split``: each trace's profile part plans the split, its holdout part is replayed."""
    from ..policies import DEFAULT_POLICY
    from ..policy_replay import compare_split, holdout_pair

    started = time.time()
    traces = build_traces(args, sequences=2)
    pairs = {}
    for name, t in traces.items():
        try:
            pairs[name] = holdout_pair(t)
        except ValueError as exc:  # a trace too short to cut in two
            raise SystemExit(f"--split: trace {name!r}: {exc}") from None
    rows = compare_split(pairs, fractions, DEFAULT_POLICY)
    result: dict[str, Any] = {
        "bench": "policy --split",
        "hit_rate": "demanded experts already in the layer's cache over all demanded, all layers, one token a step, "
                    "on the holdout part",
        "policy": DEFAULT_POLICY,
        "split": "split_rows over the profile part's LRU miss curves, the total of an even cache, each layer at "
                 "least top_k",
        "traces": {name: {"experts": t.n_experts, "top_k": t.top_k, "layers": t.n_layers, "tokens": t.n_tokens,
                          "sequences": t.n_sequences, "meta": t.meta} for name, t in traces.items()},
        "fractions": fractions,
        "rows": rows,
        "seconds": round(time.time() - started, 1),
    }
    if not getattr(args, "json", False):
        print(format_split_table(rows, DEFAULT_POLICY))
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(result, indent=1, default=str) + "\n", encoding="utf-8")
    return result


def run_policy_bench(args: argparse.Namespace) -> dict[str, Any]:
    """Replay every policy on every trace; print the table unless ``args.json``; return the result."""
    from ..policies import make_policy
    from ..policy_replay import compare_policies

    fractions = []
    for f in args.fractions.split(","):
        try:
            v = float(f)
        except ValueError:
            raise SystemExit(f"--fractions: expected numbers in (0, 1], got {f!r}") from None
        if not 0 < v <= 1:
            raise SystemExit(f"--fractions: expected numbers in (0, 1], got {f!r}")
        fractions.append(v)
    if getattr(args, "quick", False):
        args.tokens, args.layers, args.shapes = 256, 2, "64x6"
    if getattr(args, "split", False):
        return run_split_bench(args, fractions)
    policies = [p for p in args.policies.split(",") if p]
    for p in policies:
        make_policy(p)  # an unknown name fails here, naming the known ones
    started = time.time()
    traces = build_traces(args)
    rows = compare_policies(traces, fractions, policies)
    worst = {p: {f: min(r[f"{p}/min"] for r in rows if r["fraction"] == f) for f in fractions} for p in policies}
    result: dict[str, Any] = {
        "bench": "policy",
        "hit_rate": "demanded experts already in the layer's cache over all demanded, all layers, one token a step",
        "traces": {name: {"experts": t.n_experts, "top_k": t.top_k, "layers": t.n_layers, "tokens": t.n_tokens,
                          "meta": t.meta} for name, t in traces.items()},
        "fractions": fractions,
        "policies": policies,
        "rows": rows,
        "worst_fraction_of_min": worst,
        "seconds": round(time.time() - started, 1),
    }
    if not getattr(args, "json", False):
        print(format_table(rows, policies))
        print()
        for p in policies:
            print(f"{p}: worst fraction of MIN " + ", ".join(
                f"{f:.0%} {v:.2f}" for f, v in worst[p].items() if not math.isnan(v)))
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(result, indent=1, default=str) + "\n", encoding="utf-8")
    return result


if __name__ == "__main__":
    import sys

    from . import bench_main

    sys.exit(bench_main("policy"))
