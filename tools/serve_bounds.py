"""What a batch of requests can gain under a memory budget where the disk binds: the fewest expert
reads per generated token a batch of B requests needs, against one request at a time.

    python tools/serve_bounds.py [--localities low,middle,high] [--routing TRACE.npz ...]
        [--layers 8] [--experts 128] [--top-k 8] [--rows 11,32] [--batches 1,2,4,8] [--json OUT]

Model: B requests decode side by side, each on its own sequence of the trace, one token each a
step; a step's demand at a layer is the union of the B tokens' routed experts (what a batched step
reads: each expert once, however many requests route to it). Per layer, ``rows`` experts stay
between steps. Belady's MIN with bypass over those demands is the fewest reads any policy can do,
knowing the future; LRFU (the default policy) with one request at a time is what the runtime does
under the rows bound (docs/serving.md). Where the disk binds, tokens per second are at most the
disk's bandwidth over the bytes read per token, so the aggregate of B requests is at most
``reads per token (one request) / reads per token (B requests, MIN)`` times one request's: the
"ceiling" column. BENCHMARKS.md, "What eight clients can gain", cites the output.

Pure numpy and the project's replay code: no MLX, no I/O beyond the trace files.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from asyncside.argtypes import int_at_least, positive_ints
from asyncside.models.trace import belady
from asyncside.policy_replay import replay_steps
from asyncside.routing import RoutingTrace, preset


def batch_demands(trace: RoutingTrace, layer: int, group: list[int]) -> list[set[int]]:
    """The union of the group's sequences' routed experts at ``layer``, step by step, for as many
    steps as the group's shortest sequence has tokens."""
    seqs = [trace.sequence(s)[:, layer, :] for s in group]
    steps = min(len(s) for s in seqs)
    return [set().union(*(s[t].tolist() for s in seqs)) for t in range(steps)]


def reads_per_token(trace: RoutingTrace, rows: int, batch: int) -> dict[str, float]:
    """Reads per generated token (all layers) of ``batch`` requests stepping together, the
    trace's sequences taken ``batch`` at a time: MIN with bypass, and (for one request) LRFU."""
    groups = [list(range(g, g + batch)) for g in range(0, trace.n_sequences - batch + 1, batch)]
    if not groups:
        raise ValueError(f"a batch of {batch} needs {batch} sequences; the trace has {trace.n_sequences}")
    tokens = 0
    least = 0
    lrfu = 0
    for group in groups:
        for layer in range(trace.n_layers):
            demands = [sorted(d) for d in batch_demands(trace, layer, group)]
            if layer == 0:
                tokens += len(demands) * batch
            least += belady(demands, [], rows).misses
            if batch == 1:
                counts = replay_steps(demands, trace.n_experts, rows, "lrfu")
                lrfu += counts.accesses - counts.hits
    out = {"min": least / tokens}
    if batch == 1:
        out["lrfu"] = lrfu / tokens
    return out


def bound_rows(name: str, trace: RoutingTrace, rows_list: list[int], batches: list[int]) -> list[dict[str, Any]]:
    """One row per (rows, batch): reads per token and the disk-bound ceiling against one request."""
    out: list[dict[str, Any]] = []
    for rows in rows_list:
        if rows < trace.top_k:
            raise ValueError(f"{rows} rows cannot hold one token's {trace.top_k} experts")
        one = reads_per_token(trace, rows, 1)
        for batch in batches:
            r = one if batch == 1 else reads_per_token(trace, rows, batch)
            out.append({"trace": name, "rows": rows, "batch": batch, "min_reads_per_token": r["min"],
                        "one_request_lrfu_reads_per_token": one["lrfu"],
                        "ceiling_vs_one_request_lrfu": one["lrfu"] / r["min"],
                        "ceiling_vs_one_request_min": one["min"] / r["min"]})
    return out


def table(rows: list[dict[str, Any]]) -> str:
    head = ("| trace | rows a layer | requests at once | reads/token, MIN | one request, LRFU | "
            "ceiling vs one request (LRFU) | (MIN) |\n|---|---|---|---|---|---|---|")
    lines = [f"| {r['trace']} | {r['rows']} | {r['batch']} | {r['min_reads_per_token']:.2f} | "
             f"{r['one_request_lrfu_reads_per_token']:.2f} | {r['ceiling_vs_one_request_lrfu']:.2f}x | "
             f"{r['ceiling_vs_one_request_min']:.2f}x |" for r in rows]
    return "\n".join([head, *lines])


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--localities", default="low,middle,high",
                    help="synthetic presets to bound (comma-separated; '' for none)")
    ap.add_argument("--routing", action="append", default=[], metavar="TRACE.npz",
                    help="a recorded or hand-made trace with several sequences (repeatable)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--tokens", type=int_at_least(1), default=2048)
    ap.add_argument("--sequences", type=int, default=16)
    ap.add_argument("--rows", type=positive_ints, default=[11, 32], help="rows a layer keeps (comma-separated)")
    ap.add_argument("--batches", type=positive_ints, default=[1, 2, 4, 8], help="requests at once (comma-separated)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    traces: dict[str, RoutingTrace] = {}
    for loc in [v for v in args.localities.split(",") if v]:
        traces[loc] = preset(loc, tokens=args.tokens, n_layers=args.layers, n_experts=args.experts,
                             top_k=args.top_k, sequences=args.sequences)
    for path in args.routing:
        traces[Path(path).stem] = RoutingTrace.load(path)
    rows: list[dict[str, Any]] = []
    for name, trace in traces.items():
        try:
            rows += bound_rows(name, trace, args.rows, args.batches)
        except ValueError as e:
            print(f"serve_bounds: {name}: {e}", file=sys.stderr)
            return 2
        print(f"{name} done", file=sys.stderr, flush=True)
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k != "json"},
                                               "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
