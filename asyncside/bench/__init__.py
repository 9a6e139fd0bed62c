"""Benchmarks: one module per ``asyncside bench <what>``, and what they share.

Each module defines ``add_<what>_arguments(parser)`` and ``run_<what>_bench(args) -> dict`` (which
prints its table unless ``args.json``). :data:`BENCHES` names them; :func:`bench_main` is the one
entry point behind both ``asyncside bench <what>`` and ``python -m asyncside.bench.<what>``.
Importing this package imports no benchmark (and no MLX): ``asyncside --help`` stays fast.

The benchmarks' plotting (matplotlib) and HTTP client (httpx) are not core dependencies: they come with
``pip install 'asyncside[bench]'``, and :func:`require_extra` names that command when they are missing.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import pathlib
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from ..argtypes import CommandParser
from ..errors import MissingExtraError

__all__ = ["BENCHES", "Bench", "add_bench_arguments", "bench_main", "check_store_dir", "json_ready", "median",
           "require_extra", "run_bench"]

#: The extra that installs the benchmarks' optional packages (matplotlib, httpx).
BENCH_EXTRA = "bench"


@dataclass(frozen=True)
class Bench:
    """One ``asyncside bench <name>``: where its code lives and what its exit status means."""

    name: str
    help: str
    add: str  #: the function adding the bench's options to a parser
    run: str  #: the function running it (prints its table unless args.json) and returning a dict
    #: False when the result says the run is wrong (tokens differ, the device path is missing).
    ok: Callable[[dict[str, Any]], bool] = lambda result: True
    #: Listed by ``asyncside bench`` (the device bench needs a GPU build and runs as a module).
    on_cli: bool = True
    #: The module, when it is not ``asyncside.bench.<name>``.
    where: str = ""

    @property
    def module(self) -> str:
        return self.where or f"asyncside.bench.{self.name}"

    def function(self, attr: str) -> Callable[..., Any]:
        """The module's function ``attr`` (imports the module)."""
        fn: Callable[..., Any] = getattr(importlib.import_module(self.module), attr)
        return fn


BENCHES: dict[str, Bench] = {
    b.name: b
    for b in (
        Bench("io", "read path GB/s per reader, cold and warm, beside fio, memcpy and the side-region design's read",
              "add_io_arguments", "run_io_bench"),
        Bench("bridge", "completion latency on asyncio, uvloop and trio beside executor and polling",
              "add_bridge_arguments", "run_bridge_bench"),
        Bench("generate", "tokens/s by residency, prefetch on/off, policies vs Belady",
              "add_generate_arguments", "run_generate_bench",
              ok=lambda result: bool(result.get("tokens_identical", False))),
        Bench("serve", "concurrent streaming clients against `asyncside serve`",
              "add_serve_bench_arguments", "run_serve_bench",
              # Failed when a phase of asyncside's finished no request (every one refused or failed).
              ok=lambda result: all(p.get("requests_done", 0) > 0 for p in result.get("phases", [])
                                    if p.get("server") == "asyncside")),
        Bench("step", "host time per decode step, phase by phase, beside mlx-lm's",
              "add_step_arguments", "run_step_bench"),
        Bench("policy", "cache policies' hit rates against Belady's MIN on routing traces",
              "add_policy_arguments", "run_policy_bench"),
        Bench("offload", "larger than memory: asyncside, the slot cache and mlx-lm, each in a memory cgroup",
              "add_offload_arguments", "run_offload_bench",
              # Failed when tokens differ, when no run finished (nothing was measured or compared),
              # and when a run of asyncside's did not (what the bench is for; the baselines may fail:
              # mlx-lm killed under the limit is a finding).
              ok=lambda result: bool(result.get("tokens_identical", False))
              and any(r.get("status") == "ok" for r in result.get("runs", []))
              and all(r.get("status") == "ok" for r in result.get("runs", [])
                      if str(r.get("system", "")).startswith("asyncside"))),
        Bench("pipeline", "pipeline ranks on this machine vs one process: tok/s, boundary cost, memory",
              "add_pipeline_arguments", "run_pipeline_bench", where="asyncside.distributed.bench"),
        Bench("device", "upload bandwidth into MLX CUDA device pools beside pinned cudaMemcpy",
              "add_device_arguments", "run_device_bench", ok=lambda result: "error" not in result, on_cli=False),
    )
}


def add_bench_arguments(name: str, parser: argparse.ArgumentParser) -> None:
    """``--json`` plus the bench's own options."""
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    bench = BENCHES[name]
    bench.function(bench.add)(parser)


def check_store_dir(option: str, path: str | os.PathLike[str]) -> pathlib.Path:
    """``path`` given to ``option`` as an expert store, checked before anything loads: a ValueError
    leading with the option (a usage error from the CLI) when it is none, saying what it is."""
    p = pathlib.Path(path).expanduser()  # a quoted "~/stores/q", as --model reads "~"
    if (p / "manifest.json").is_file():
        return p
    if not p.exists():
        what = "no such directory"
    elif (p / "config.json").is_file():
        what = "a model directory (config.json), not an expert store: asyncside convert MODEL_DIR STORE_DIR writes one"
    else:
        what = "no manifest.json: asyncside convert MODEL_DIR STORE_DIR writes an expert store"
    raise ValueError(f"{option} {p}: not an expert store ({what})")


def require_extra(module: str, what: str, extra: str = BENCH_EXTRA) -> ModuleType:
    """Import ``module``, or raise :class:`MissingExtraError` naming ``pip install 'asyncside[extra]'``.

    ``what`` names the command or option that needs it, for the message.
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingExtraError(module.partition(".")[0], extra, what) from exc


def json_ready(value: Any) -> Any:
    """``value`` with each NaN or infinite float as None, through dicts, lists and tuples: a figure
    with nothing to divide by (a ratio over a hit rate of zero) has no value, and JSON has no NaN
    (Python writes one that strict parsers refuse)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_ready(v) for v in value]
    return value


def run_bench(name: str, args: argparse.Namespace) -> int:
    """Run bench ``name`` with parsed ``args``; print the JSON result with ``--json``; exit status.

    A missing optional package is reported on stderr with the extra to install (exit status 2).
    """
    bench = BENCHES[name]
    try:
        result: dict[str, Any] = bench.function(bench.run)(args)
    except MissingExtraError as exc:
        print(f"asyncside bench {name}: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(json_ready(result), indent=2, default=str, allow_nan=False))
    return 0 if bench.ok(result) else 1


def bench_main(name: str, argv: Sequence[str] | None = None) -> int:
    """``python -m asyncside.bench.<name> [--json] ...``: parse, run, exit status."""
    module = importlib.import_module(BENCHES[name].module)
    doc = (module.__doc__ or "").strip().splitlines()
    parser = CommandParser(prog=f"python -m {BENCHES[name].module}", description=doc[0] if doc else None)
    add_bench_arguments(name, parser)
    try:
        return run_bench(name, parser.parse_args(argv))
    except ValueError as exc:
        # A bad combination of options, checked once parsed: a usage error in one line, as the
        # asyncside command says it (the message starts with the option's name).
        if not str(exc).startswith("--"):
            raise
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2


def median(values: Sequence[float]) -> float:
    """The median, NaN for no values (a cell that did not run)."""
    return float(statistics.median(values)) if values else math.nan
