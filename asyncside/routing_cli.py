"""``asyncside routing``: look at, make and widen routing trace files (docs/routing-traces.md).

- ``info FILE``: the trace's shape, sequences, source, predictions, and the hit rates of per-layer
  caches under the runtime's LRU and Belady's MIN (with bypass) at a quarter and at half of the
  experts: how local its routing is, before a benchmark replays it (``bench policy --trace FILE``
  compares policies).
- ``preset NAME OUT``: a synthetic trace of a locality preset at a given shape.
- ``widen FILE OUT --top-k K``: a trace for a model whose router picks more experts per token
  than the recorded one (:meth:`asyncside.routing.RoutingTrace.widen`); replaying a trace of
  fewer choices than the model routes is refused, since the missing choices cannot be known.

Only numpy is imported (MIN on a trace of more experts than its vectorised pass takes loads the
trace module of the models).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import numpy as np

from .argtypes import file_name, int_at_least
from .errors import TraceError


def _count(n: int, noun: str) -> str:
    """``n noun``, the noun plural unless ``n`` is one."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _experts(text: str) -> int:
    """``--experts``: an integer in [1, MAX_EXPERTS], the trace format's range."""
    from .routing import MAX_EXPERTS

    n = int_at_least(1)(text)
    if n > MAX_EXPERTS:
        raise argparse.ArgumentTypeError(f"expected at most {MAX_EXPERTS} experts per layer (the trace format's "
                                         f"limit), got {text!r}")
    return n


def add_routing_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``routing`` subcommand's own subcommands and options."""
    from .routing import LOCALITIES, MAX_EXPERTS

    sub = parser.add_subparsers(dest="routing_command", required=True)
    info = sub.add_parser("info", help="shape, source and locality (LRU and MIN hit rates) of a trace file")
    info.add_argument("file", type=file_name, help="a routing trace (.npz)")
    info.add_argument("--json", action="store_true", help="print one JSON object")
    info.add_argument("--no-min", action="store_true",
                      help="skip Belady's MIN (vectorised: about as long again as the LRU figures; on layers "
                           "of tens of thousands of experts it steps each layer in Python, much slower)")
    make = sub.add_parser("preset", help="write a synthetic trace of a locality preset")
    make.add_argument("name", choices=sorted(LOCALITIES), help="the locality preset")
    make.add_argument("out", type=file_name, help="the .npz to write")
    make.add_argument("--layers", type=int_at_least(1), default=8, help="MoE layers (default 8)")
    make.add_argument("--experts", type=_experts, default=64,
                      help=f"experts per layer, at most {MAX_EXPERTS} (default 64)")
    make.add_argument("--top-k", type=int_at_least(1), default=6, help="experts per token and layer (default 6)")
    make.add_argument("--tokens", type=int_at_least(1), default=2048, help="tokens of all sequences (default 2048)")
    make.add_argument("--sequences", type=int_at_least(1), default=1, help="sequences (default 1)")
    make.add_argument("--seed", type=int_at_least(0), default=0, help="seed (default 0)")
    widen = sub.add_parser("widen", help="add choices per token for a model that routes more experts")
    widen.add_argument("file", type=file_name, help="a routing trace (.npz)")
    widen.add_argument("out", type=file_name, help="the .npz to write")
    widen.add_argument("--top-k", type=int_at_least(1), required=True, help="experts per token and layer wanted")
    widen.add_argument("--seed", type=int_at_least(0), default=0, help="seed of the added choices (default 0)")


def trace_info(trace: Any, *, with_min: bool = True) -> dict[str, Any]:
    """The figures ``routing info`` prints: shape, source, and per-layer caches' hit rates over
    all sequences in order (the runtime's LRU, :func:`asyncside.policy_replay.trace_lru_hits`,
    and Belady's MIN with bypass unless ``with_min`` is False)."""
    from .policy_replay import trace_lru_hits, trace_min_hits

    out: dict[str, Any] = {
        "tokens": trace.n_tokens, "layers": trace.n_layers, "experts": trace.n_experts, "top_k": trace.top_k,
        "sequences": trace.n_sequences, "source": trace.meta.get("source"),
        "predicted_per_token": None if trace.predicted is None else int(trace.predicted.shape[2]),
        "mapped_from": trace.meta.get("mapped_from"), "widened": trace.meta.get("widened"), "caches": []}
    accesses = trace.n_tokens * trace.top_k * trace.n_layers
    sizes = [max(trace.top_k, int(round(fraction * trace.n_experts))) for fraction in (0.25, 0.5)]
    used, first_uses = used_experts_only(trace)
    # Rows for every expert a layer routes to: no eviction, so every access but a first use hits.
    replayed = [r for r in sizes if r < used.n_experts]
    every = {r: accesses - first_uses for r in sizes if r >= used.n_experts}
    lru = dict(zip(replayed, trace_lru_hits(used, replayed) if replayed else []))
    lru_hits = [lru.get(r, every.get(r, 0)) for r in sizes]  # the runtime's LRU, as bench policy replays it
    mins = dict(zip(replayed, trace_min_hits(used, replayed) if replayed and with_min else []))
    min_hits = [mins.get(r, every.get(r, 0)) for r in sizes] if with_min else None
    out["accesses"] = accesses
    for i, (fraction, rows) in enumerate(zip((0.25, 0.5), sizes)):
        entry: dict[str, Any] = {"fraction": fraction, "rows": rows, "lru": round(lru_hits[i] / accesses, 4),
                                 "lru_hits": lru_hits[i]}
        if min_hits is not None:
            # The ratio from the hits, not from the rounded rates (which a trace of few hits over
            # many accesses rounds to nothing); None where MIN hits nothing.
            entry.update(min=round(min_hits[i] / accesses, 4), min_hits=min_hits[i],
                         lru_of_min=round(lru_hits[i] / min_hits[i], 4) if min_hits[i] else None)
        out["caches"].append(entry)
    return out


def used_experts_only(trace: Any) -> tuple[Any, int]:
    """``trace`` with each layer's ids renumbered in order over the experts that layer routes to
    (``n_experts`` the most any layer uses, at least the top-k), so the same caches hit the same:
    an expert never routed never takes a row, and ties broken by id keep their order; and the
    experts the layers route to, summed (each one's first use, which no cache hits).

    The replays of :mod:`asyncside.policy_replay` step through arrays of every expert per step;
    a trace of a million experts of which it routes a few thousand took minutes a layer."""
    from .routing import RoutingTrace

    ids = np.empty(trace.ids.shape, dtype=np.int32)
    most, first_uses = trace.top_k, 0
    for layer in range(trace.n_layers):
        kept, inverse = np.unique(trace.ids[:, layer, :], return_inverse=True)
        ids[:, layer, :] = inverse.reshape(ids.shape[0], ids.shape[2])
        most, first_uses = max(most, len(kept)), first_uses + len(kept)
    if most == trace.n_experts:
        return trace, first_uses
    return RoutingTrace(ids=ids, lengths=trace.lengths, n_experts=most, meta={}), first_uses


def _print_info(path: str, info: dict[str, Any]) -> None:
    predicted = info["predicted_per_token"]
    print(f"{path}: {_count(info['tokens'], 'token')} in {_count(info['sequences'], 'sequence')}, "
          f"{_count(info['layers'], 'MoE layer')} x {_count(info['experts'], 'expert')}, top-{info['top_k']}; "
          f"source {info['source'] or 'not said'}; "
          f"predictions: {_count(predicted, 'id') + ' per token' if predicted else 'none'}")
    if info["mapped_from"]:
        print(f"  mapped from {info['mapped_from']}")
    widened = info["widened"]
    if isinstance(widened, dict) and "from_top_k" in widened:
        print(f"  widened from top-{widened['from_top_k']}" + (f" ({widened['rule']})" if "rule" in widened else ""))
    elif widened:  # a "widened" key some other writer put in the meta: shown as it is
        print(f"  widened: {json.dumps(widened)}")
    for c in info["caches"]:
        share = int(round(c["fraction"] * info["experts"]))
        raised = f", raised to the top-{info['top_k']} from {share}" if c["rows"] > share else ""
        text = (f"  per-layer caches of {c['fraction']:.0%} ({_count(c['rows'], 'row')}{raised}): "
                f"LRU {c['lru_hits'] / info['accesses']:.1%} hits")
        if "min" in c:  # no hit at all (a trace of one token a layer): no ratio to MIN
            text += (f", Belady's MIN {c['min_hits'] / info['accesses']:.1%}"
                     + (f" (LRU {c['lru_of_min']:.2f} of MIN)" if c["lru_of_min"] is not None else ""))
        print(text)


def routing_main(args: argparse.Namespace) -> int:
    """Run ``asyncside routing``; 0 on success, 2 on a bad file or option (one line, no traceback)."""
    from .routing import RoutingTrace, preset, synthetic_too_large

    try:
        if args.routing_command == "info":
            info = trace_info(RoutingTrace.load(args.file), with_min=not args.no_min)
            if args.json:
                print(json.dumps({"file": args.file, **info}, indent=1))
            else:
                _print_info(args.file, info)
            return 0
        if args.routing_command == "preset":
            broken = ([f"--top-k {args.top_k} must be at most --experts {args.experts}"]
                      if args.top_k > args.experts else []) + (
                [f"--tokens {args.tokens} must be at least --sequences {args.sequences}"]
                if args.tokens < args.sequences else [])
            too_large = synthetic_too_large(args.tokens * args.layers * args.top_k, args.layers * args.experts)
            if too_large:
                broken.append(f"--tokens {args.tokens} x --layers {args.layers} x --top-k {args.top_k}, --layers "
                              f"{args.layers} x --experts {args.experts}: {too_large}")
            if broken:
                print(f"asyncside routing preset: error: {'; '.join(broken)}", file=sys.stderr)
                return 2
            trace = preset(args.name, tokens=args.tokens, n_layers=args.layers, n_experts=args.experts,
                           top_k=args.top_k, sequences=args.sequences, seed=args.seed)
        else:
            source = RoutingTrace.load(args.file)
            try:
                trace = source.widen(args.top_k, seed=args.seed)
            except ValueError as exc:
                print(f"asyncside routing widen: error: {args.file}: --top-k: {exc}", file=sys.stderr)
                return 2
        trace.save(args.out)
    except TraceError as exc:
        print(f"asyncside routing {args.routing_command}: {exc}", file=sys.stderr)
        return 2
    # As routing info says it: a preset's --sequences (or a widened file's) are its shape too.
    sequences = f" in {trace.n_sequences} sequences" if trace.n_sequences > 1 else ""
    print(f"wrote {args.out}: {_count(trace.n_tokens, 'token')}{sequences}, {_count(trace.n_layers, 'layer')} x "
          f"{_count(trace.n_experts, 'expert')}, top-{trace.top_k}")
    return 0
