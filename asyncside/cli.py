"""The ``asyncside`` command: demo, convert, bench, serve.

Each subcommand lives in its own module and is imported only when it runs, so ``asyncside
--help`` stays fast and a broken optional piece cannot take the others down.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

# bench name -> (module, function adding arguments, function running it and returning a dict)
_BENCHES: dict[str, tuple[str, str, str, str]] = {
    "io": ("asyncside.bench.io", "add_io_arguments", "run_io_bench",
           "read path GB/s per reader, cold and warm, beside fio, memcpy and the original design"),
    "bridge": ("asyncside.bench.bridge", "add_bridge_arguments", "run_bridge_bench",
               "completion latency on asyncio, uvloop and trio beside executor and polling"),
    "generate": ("asyncside.bench.generate", "add_generate_arguments", "run_generate_bench",
                 "tokens/s by residency, prefetch on/off, policies vs Belady"),
    "serve": ("asyncside.bench.serve", "add_serve_bench_arguments", "run_serve_bench",
              "concurrent streaming clients against `asyncside serve`"),
    "pipeline": ("asyncside.distributed.bench", "add_pipeline_arguments", "run_pipeline_bench",
                 "pipeline ranks on this machine vs one process: tok/s, boundary cost, memory"),
}


def _attr(module: str, name: str) -> Callable[..., Any]:
    return getattr(importlib.import_module(module), name)


def _add_bench(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="measure the read path, the bridge, generation, serving")
    kinds = bench.add_subparsers(dest="bench", metavar="{" + ",".join(_BENCHES) + "}", required=True)
    for name, (module, add, _run, help_text) in _BENCHES.items():
        p = kinds.add_parser(name, help=help_text)
        p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
        try:
            _attr(module, add)(p)
        except ImportError as exc:  # a missing optional dependency disables one bench only
            p.set_defaults(_unavailable=f"{module}: {exc}")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``asyncside`` command."""
    parser = argparse.ArgumentParser(
        prog="asyncside",
        description="Stream MoE expert weights from an SSD expert store into MLX pools.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="streaming generation on the embedded default model")
    _attr("asyncside.demo", "add_demo_arguments")(demo)

    convert = sub.add_parser("convert", help="turn an mlx-lm model directory into an expert store")
    _attr("asyncside.models.cli", "add_convert_arguments")(convert)

    serve = sub.add_parser("serve", help="OpenAI-compatible streaming HTTP server")
    try:
        _attr("asyncside.server", "add_serve_arguments")(serve)
        _attr("asyncside.distributed.serve", "add_pipeline_serve_arguments")(serve)
    except ImportError as exc:
        serve.set_defaults(_unavailable=f"asyncside.server: {exc}")

    _add_bench(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``asyncside`` console script."""
    args = build_parser().parse_args(argv)
    unavailable = getattr(args, "_unavailable", None)
    if unavailable:
        print(f"asyncside {args.command}: not available: {unavailable}", file=sys.stderr)
        return 2
    if args.command == "demo":
        return int(_attr("asyncside.demo", "demo_main")(args))
    if args.command == "convert":
        return int(_attr("asyncside.models.cli", "convert_main")(args))
    if args.command == "serve":
        if args.store is not None and args.model is None:
            args.model = args.store
        if args.pipeline:
            return int(_attr("asyncside.distributed.serve", "serve_pipeline_main")(args))
        return int(_attr("asyncside.server", "serve_main")(args))
    module, _add, run, _help = _BENCHES[args.bench]
    result = _attr(module, run)(args)
    if args.json:
        print(json.dumps(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
