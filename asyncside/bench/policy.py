"""``asyncside bench policy``: cache policies against Belady's MIN on routing traces.

Per trace (the synthetic locality presets at several shapes and seeds, plus any ``--trace`` file),
per cache size (a fraction of the experts, per MoE layer), per policy: the hit rate replayed
through the real Ledger, beside Belady's MIN with and without bypass and the best static set in
hindsight, and each policy's fraction of MIN. Prints a table (unless ``--json``), writes JSON with
``--out``.

``--split``: rows split between layers from a profile instead. Each trace is cut in two (its first
two sequences, or halves): the split (:func:`asyncside.policy_replay.split_rows` over the first
part's LRU miss curves, the total of an even cache) is replayed on the second part (a holdout)
with each policy of ``--policies`` (default: the default policy alone), beside even rows and MIN
at even rows.

Each replay writes a progress line to stderr (never to stdout, which ``--json`` keeps for the
JSON) unless ``--quiet``.

Pure Python and numpy (no MLX); docs/policies.md explains the columns.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
import time
from collections.abc import Callable
from typing import Any

from ..argtypes import file_name, int_at_least, writable_file

#: The policies replayed unless ``--policies`` names others (``--split``: the default policy alone).
DEFAULT_POLICIES = ("lru", "lfu", "aging-lfu", "lrfu", "adaptive-lrfu")

#: (experts, top_k) of the default synthetic traces: the recorded public trace's shape (64 experts,
#: top-6) and two larger ones.
DEFAULT_SHAPES = ((64, 6), (128, 8), (256, 8))


def _listed(parse: Callable[[str], Any], *, allow_empty: bool = False) -> Callable[[str], list[Any]]:
    """An argparse type: comma-separated items, each through ``parse`` (its error names the item);
    at least one unless ``allow_empty``. An item given twice (``lru,lru``, ``0.25,25%``) is kept
    once: twice would replay it twice into a second identical column or row."""

    def check(text: str) -> list[Any]:
        items = list(dict.fromkeys(parse(item.strip()) for item in text.split(",") if item.strip()))
        if not items and not allow_empty:
            raise argparse.ArgumentTypeError(f"expected at least one comma-separated value, got {text!r}")
        return items

    check.__name__ = "comma-separated list"
    return check


def _fraction(text: str) -> float:
    try:
        value = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        value = math.nan
    if value == 0.0:
        # A replayed cache holds at least its trace's top-k rows (policy_replay.trace_rows): a row
        # labelled 0% would state a cache it did not replay.
        raise argparse.ArgumentTypeError(
            f"expected fractions in (0, 1] such as 0.25 or 25%, got {text!r}: a replay needs a cache, and each "
            "layer's holds at least its trace's top-k rows (one token's experts; demo --resident 0 streams "
            "through as many), which a row labelled 0% would misstate: for the least cache give top_k/experts "
            "of the shape, such as 0.0938 for 64x6")
    if not 0.0 < value <= 1.0:  # NaN fails this too
        raise argparse.ArgumentTypeError(f"expected fractions in (0, 1] such as 0.25 or 25%, got {text!r}")
    return value


def _shape(text: str) -> tuple[int, int]:
    try:
        e, k = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected EXPERTSxTOP_K like 64x6, got {text!r}") from None
    if not 1 <= k <= e:
        raise argparse.ArgumentTypeError(f"expected EXPERTSxTOP_K with 1 <= TOP_K <= EXPERTS, got {text!r}")
    return e, k


def _seed(text: str) -> int:
    try:
        return int_at_least(0)(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 0, got {text!r}") from None


def _preset(text: str) -> str:
    from ..routing import LOCALITIES

    if text not in LOCALITIES and text != "mixed":
        raise argparse.ArgumentTypeError(f"unknown preset {text!r}; known: {[*sorted(LOCALITIES), 'mixed']}")
    return text


def _policy(text: str) -> str:
    from ..errors import LedgerError
    from ..policies import POLICIES, make_policy

    try:
        make_policy(text)
    except LedgerError:
        # make_policy's message offers a Policy instance too, which a command line cannot give
        raise argparse.ArgumentTypeError(f"unknown policy {text!r}; known: {', '.join(sorted(POLICIES))}") from None
    return text


def add_policy_arguments(parser: argparse.ArgumentParser) -> None:
    """The bench's options (each checked as it is parsed: a bad value is a usage error naming it)."""
    parser.add_argument("--tokens", type=int_at_least(1), default=None,
                        help="tokens per synthetic trace (default 2048, 256 with --quick)")
    parser.add_argument("--layers", type=int_at_least(1), default=None,
                        help="MoE layers per synthetic trace (default 8, 2 with --quick)")
    parser.add_argument("--fractions", type=_listed(_fraction), default="0.25,0.5",
                        help="per-layer cache sizes as fractions of the experts in (0, 1], or percentages "
                             "(default 0.25,0.5)")
    parser.add_argument("--policies", type=_listed(_policy), default=None,
                        help="policies to replay, comma-separated (default: every named policy but one-shot, "
                             f"{','.join(DEFAULT_POLICIES)}; with --split, the default policy alone; with --split "
                             "each policy named gets its even and split rows side by side)")
    parser.add_argument("--presets", type=_listed(_preset, allow_empty=True), default="low,middle,high",
                        help="synthetic locality presets (default low,middle,high); 'mixed' takes its layers in "
                             "turn from low, middle and high (layers that differ); '' for none (--trace files only)")
    parser.add_argument("--shapes", type=_listed(_shape), default=None,
                        help="synthetic shapes EXPERTSxTOP_K, comma-separated (default 64x6,128x8,256x8, "
                             "64x6 with --quick)")
    parser.add_argument("--seeds", type=_listed(_seed), default="0",
                        help="seeds of the synthetic traces, comma-separated (default 0)")
    parser.add_argument("--trace", action="append", type=file_name, default=[], metavar="NPZ",
                        help="also replay this routing trace file (docs/routing-traces.md); repeatable")
    parser.add_argument("--out", type=writable_file, default=None, help="write the result as JSON to this file")
    parser.add_argument("--split", action="store_true",
                        help="rows split between layers from a profile (the first sequence or half of each "
                             "trace), replayed on a holdout (the second) with each of --policies, against even "
                             "rows and MIN")
    parser.add_argument("--quiet", action="store_true",
                        help="no progress lines on stderr (one per replay; stdout holds only the table or JSON)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny run for CI smoke tests: 256 tokens, 2 layers, 64x6 only, unless those options "
                             "are given (numbers are noise)")


def _option(args: argparse.Namespace, name: str, parse: Callable[[str], Any], default: Any, quick: Any) -> Any:
    """``args.<name>`` as parsed: unset is its default (the ``--quick`` one with ``--quick``); a string
    (a namespace built without the parser) goes through the option's own type."""
    value = getattr(args, name, None)
    if value is None:
        return quick if getattr(args, "quick", False) else default
    if isinstance(value, str):
        try:
            return parse(value)
        except argparse.ArgumentTypeError as exc:
            raise ValueError(f"--{name}: {exc}") from None
    return value


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


def build_traces(args: argparse.Namespace, sequences: int = 1, files: dict[str, str] | None = None) -> dict[str, Any]:
    """The traces the arguments name, by label (synthetic ones of ``sequences`` sequences of
    ``--tokens`` each). A ``--trace`` file is labelled by its stem and shape, with ``-2``, ``-3``...
    after the stem where that label is taken (two files of one name in two directories, or one
    file given twice); ``files``, when given, gets each such label's path."""
    from ..routing import RoutingTrace, preset, synthetic_too_large

    traces: dict[str, Any] = {}
    presets = _option(args, "presets", _listed(_preset, allow_empty=True), [], [])
    shapes = _option(args, "shapes", _listed(_shape), list(DEFAULT_SHAPES), [(64, 6)])
    tokens = _option(args, "tokens", int_at_least(1), 2048, 256)
    layers = _option(args, "layers", int_at_least(1), 8, 2)
    if presets:  # before minutes of generating, or the OOM killer
        ids_per_slot = tokens * sequences * layers
        for e, k in shapes:
            too_large = synthetic_too_large(ids_per_slot * k, layers * e)  # the per-layer tables too
            if too_large:
                raise ValueError(f"--tokens {tokens} --layers {layers} --shapes {e}x{k}: {too_large}")
    for seed in _option(args, "seeds", _listed(_seed), [0], [0]):
        for e, k in shapes:
            for p in presets:
                make = mixed_preset if p == "mixed" else preset
                try:
                    traces[f"{p} {e}x{k} s{seed}"] = make(p, tokens=tokens * sequences, n_layers=layers,
                                                           n_experts=e, top_k=k, seed=seed, sequences=sequences)
                except ValueError as exc:  # a shape or size the generator cannot make: the options' fault
                    raise ValueError(f"--tokens {tokens} --layers {layers} --shapes {e}x{k}: {exc}") from None
    for path in args.trace:
        tr = RoutingTrace.load(path)  # a bad file: TraceError naming it
        stem, shape = pathlib.Path(path).stem, f"{tr.n_experts}x{tr.top_k}"
        label, n = f"{stem} {shape}", 1
        while label in traces:  # a label taken would replace that trace: its rows would be gone unsaid
            n += 1
            label = f"{stem}-{n} {shape}"
        traces[label] = tr
        if files is not None:
            files[label] = str(path)
    if not traces:
        raise ValueError("--presets '' and no --trace: nothing to replay; name a preset or a routing trace file")
    return traces


def _no_nan(value: Any) -> Any:
    """``value`` with each NaN as None: a ratio over a hit rate of zero (MIN's, or the even cache's, on
    a trace whose sequences are a token long) has no figure, and JSON has no NaN."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _no_nan(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_no_nan(v) for v in value]
    return value


def _ratio(value: float | None, fmt: str) -> str:
    """A table's ratio cell: ``-`` where there is no figure."""
    return "-" if value is None or math.isnan(value) else format(value, fmt)


def _cache_cell(r: dict[str, Any]) -> str:
    """A row's cache: what it holds of the layer's experts, its rows, and the share asked where the
    rows were raised to the trace's top-k (a replayed cache never holds fewer)."""
    rows, experts, asked = r["rows"], r["experts"], r["fraction"]
    cell = f"{rows / experts:.0%} ({rows}/{experts})"
    return cell if rows <= round(asked * experts) else f"{cell}, {asked:.0%} asked, raised to top-k"


def format_table(rows: list[dict[str, Any]], policies: list[str]) -> str:
    """The rows as a Markdown table: hit rates, and each policy's fraction of MIN in brackets."""
    head = ["trace", "cache", "MIN", "MIN no bypass", "static", *policies]
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join(["---"] * 2 + ["---:"] * (len(head) - 2)) + " |"]
    for r in rows:
        cells = [r["trace"], _cache_cell(r), f"{r['min']:.3f}", f"{r['min-no-bypass']:.3f}",
                 f"{r['static']:.3f} ({_ratio(r['static'] / r['min'] if r['min'] else None, '.2f')})"]
        cells += [f"{r[p]:.3f} ({_ratio(r[p + '/min'], '.2f')})" for p in policies]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_split_table(rows: list[dict[str, Any]]) -> str:
    """The ``--split`` rows as a Markdown table: hit rates on the holdout, ratios in brackets, one
    line per trace, cache and policy."""
    head = ["trace", "cache", "MIN (even)", "policy", "even", "split from profile", "split/even",
            "rows per layer (split)"]
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join(["---"] * 2 + ["---:"] + ["---"]
                                                                + ["---:"] * (len(head) - 5) + ["---"]) + " |"]
    for r in rows:
        lines.append("| " + " | ".join([
            r["trace"], _cache_cell(r), f"{r['min']:.3f}", str(r.get("policy", "-")),
            f"{r['even']:.3f} ({_ratio(r['even/min'], '.2f')} of MIN)",
            f"{r['split_hit_rate']:.3f} ({_ratio(r['split/min'], '.2f')} of MIN)",
            "-" if r["split/even"] is None else f"{r['split/even']:.3f}x",
            " ".join(str(x) for x in r["split"])]) + " |")
    return "\n".join(lines)


def _progress(args: argparse.Namespace, started: float) -> Callable[[str, float], None] | None:
    """The progress callback of a replay (a line on stderr each), or None under ``--quiet``."""
    if getattr(args, "quiet", False):
        return None

    def say(what: str, hit_rate: float) -> None:
        print(f"[bench policy] {what} {hit_rate:.3f} ({time.time() - started:.1f} s)", file=sys.stderr, flush=True)

    return say


def _split_policies(args: argparse.Namespace) -> list[str]:
    from ..policies import DEFAULT_POLICY

    return _option(args, "policies", _listed(_policy), [DEFAULT_POLICY], [DEFAULT_POLICY])


def run_split_bench(args: argparse.Namespace, fractions: list[float]) -> dict[str, Any]:
    """``--split``: each trace's profile part plans the split, its holdout part is replayed with
    each policy of ``--policies``."""
    from ..policy_replay import compare_split, holdout_pair

    policies = _split_policies(args)
    started = time.time()
    files: dict[str, str] = {}
    traces = build_traces(args, sequences=2, files=files)
    pairs = {}
    for name, t in traces.items():
        try:
            pairs[name] = holdout_pair(t)
        except ValueError as exc:  # a trace too short to cut in two
            raise ValueError(f"--split: trace {name!r}: {exc}") from None
    rows = _no_nan(compare_split(pairs, fractions, policies=policies, progress=_progress(args, started)))
    result: dict[str, Any] = {
        "bench": "policy --split",
        "hit_rate": "demanded experts already in the layer's cache over all demanded, all layers, one token a step, "
                    "on the holdout part",
        "policies": policies,
        "split": "split_rows over the profile part's LRU miss curves, the total of an even cache, each layer at "
                 "least top_k",
        "traces": {name: {"experts": t.n_experts, "top_k": t.top_k, "layers": t.n_layers, "tokens": t.n_tokens,
                          "sequences": t.n_sequences, "file": files.get(name), "meta": t.meta}
                   for name, t in traces.items()},
        "fractions": fractions,
        "rows": rows,
        "seconds": round(time.time() - started, 1),
    }
    if not getattr(args, "json", False):
        print(format_split_table(rows))
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(result, indent=1, default=str) + "\n", encoding="utf-8")
    return result


def run_policy_bench(args: argparse.Namespace) -> dict[str, Any]:
    """Replay every policy on every trace; print the table unless ``args.json``; return the result."""
    from ..policy_replay import compare_policies

    fractions = _option(args, "fractions", _listed(_fraction), [0.25, 0.5], [0.25, 0.5])
    if getattr(args, "split", False):
        return run_split_bench(args, fractions)
    policies = _option(args, "policies", _listed(_policy), list(DEFAULT_POLICIES), list(DEFAULT_POLICIES))
    started = time.time()
    files: dict[str, str] = {}
    traces = build_traces(args, files=files)
    rows = compare_policies(traces, fractions, policies, progress=_progress(args, started))
    # Over the rows with a figure: min() over a NaN answers NaN or not by the rows' order.
    worst = {p: {f: min((r[f"{p}/min"] for r in rows if r["fraction"] == f and not math.isnan(r[f"{p}/min"])),
                        default=None) for f in fractions} for p in policies}
    rows = _no_nan(rows)
    result: dict[str, Any] = {
        "bench": "policy",
        "hit_rate": "demanded experts already in the layer's cache over all demanded, all layers, one token a step",
        "traces": {name: {"experts": t.n_experts, "top_k": t.top_k, "layers": t.n_layers, "tokens": t.n_tokens,
                          "file": files.get(name), "meta": t.meta} for name, t in traces.items()},
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
            print(f"{p}: worst fraction of MIN " + (", ".join(
                f"{f:.0%} {v:.2f}" for f, v in worst[p].items() if v is not None) or "-"))
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(result, indent=1, default=str) + "\n", encoding="utf-8")
    return result


if __name__ == "__main__":
    import sys

    from ..cli import main

    sys.exit(main(["bench", "policy", *sys.argv[1:]]))
