"""``asyncside bench pipeline``: a pipeline of ranks on this machine beside one process.

Measured side by side, round after round (each run a fresh set of processes):

- aggregate tokens/s with ``--requests`` concurrent requests: one process pinned to one core
  (the baseline) against ``--ranks`` ranks each pinned to its own core (``--no-pin`` leaves both
  unpinned);
- the boundary's cost per decode step with no compute: rank 0 sends a step's messages (predicted
  ids, then a hidden state) round the ring and the last rank answers with a token, ``--ping``
  times, through the same boundary code as a real step (header on the control link, payload via
  ``mx.distributed`` on its own stream, awaited through the completion bridge);
- beside it, two floors measured in the same round: the transport's (``mx.distributed`` send and
  recv alone, the receiver's recv posted ahead and polling) and the host's (one byte each way
  between two idle processes pinned like the ranks, plain blocking sockets: the cross-process
  wake-ups a step's two crossings cannot avoid; :mod:`.wakefloor`);
- memory: each rank's pool bytes and peak RSS against the one process's, at equal residency;
- how busy each process kept its core (CPU time and run-queue wait against wall time), which
  tells pipeline bubbles from a machine shared with other work;
- whether every request's tokens are identical to the one process's.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
from typing import Any

from ..argtypes import directory, resident_fraction
from .launcher import LocalLaunch, python_argv


def add_pipeline_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``asyncside bench pipeline`` (the caller adds ``--json``)."""
    p.add_argument("--model", metavar="STORE_DIR", default=None,
                   help="a converted expert store (default: the embedded Qwen3-MoE model)")
    p.add_argument("--ranks", type=int, default=2, help="pipeline ranks (default 2)")
    p.add_argument("--split", default=None, help="decoder layers per rank (default even)")
    p.add_argument("--requests", type=int, default=4, help="concurrent requests (default 4)")
    p.add_argument("--tokens", type=int, default=32, help="tokens per request (default 32)")
    p.add_argument("--warmup", type=int, default=4, help="tokens of an untimed request first (default 4)")
    p.add_argument("--resident", type=resident_fraction(allow_auto=False), default=0.25,
                   help="share of each layer's experts in pools, in [0, 1] (default 0.25)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of (one process, pipeline) (default 3)")
    p.add_argument("--ping", type=int, default=300, help="boundary round trips per pipeline run (default 300)")
    p.add_argument("--no-pin", action="store_true", help="do not pin processes to cores")
    p.add_argument("--reader", default="auto", help="read backend (default auto)")
    p.add_argument("--deadline", type=float, default=900.0, help="seconds before a run is stopped (default 900)")
    p.add_argument("--quick", action="store_true", help="CI smoke run: 1 round, few tokens (numbers are noise)")
    p.add_argument("--cache-dir", type=directory, default=None,
                   help="where the embedded model is built (default: $ASYNCSIDE_CACHE, else $XDG_CACHE_HOME/asyncside, "
                        "else ~/.cache/asyncside)")


def _single(store: str, common: list[str], out: str, cpus: list[int] | None, deadline: float) -> dict[str, Any]:
    argv = python_argv(store, "--single", "--out", out, *common)
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=deadline,
                          preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)
    if proc.returncode != 0:
        raise RuntimeError(f"the one-process run failed (status {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads((pathlib.Path(out) / "single.json").read_text())


def _pipeline(store: str, common: list[str], out: str, ranks: int, split: str | None, ping: int,
              cpus: list[list[int]] | None, deadline: float) -> list[dict[str, Any]]:
    extra = ["--out", out, "--ping", str(ping)] + (["--split", split] if split else [])
    with LocalLaunch([python_argv(store, *common, *extra)] * ranks, cpus=cpus) as launch:
        res = launch.wait(deadline)
    if not res.ok:
        errs = "\n".join(f"--- rank {r.rank}:\n{r.stderr[-2000:]}" for r in res.ranks)
        raise RuntimeError(f"the pipeline failed: {res.reason}\n{errs}")
    return [json.loads((pathlib.Path(out) / f"rank{r}.json").read_text()) for r in range(ranks)]


def _wake_floor(cpus: list[int] | None, n: int) -> dict[str, float]:
    """The host's one-byte round trip between two idle processes on ``cpus`` (see :mod:`.wakefloor`)."""
    argv = [sys.executable, "-m", "asyncside.distributed.wakefloor", "-n", str(max(n, 10))]
    if cpus:
        argv += ["--cpus", ",".join(map(str, cpus))]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise RuntimeError(f"the wake-up floor's run failed (status {proc.returncode}):\n{proc.stderr[-2000:]}")
    return {k: v * 1e3 for k, v in json.loads(proc.stdout).items() if k not in ("n", "gap_s")}


def _busy(report: dict[str, Any]) -> dict[str, Any]:
    """CPU / wall while generating (the core's busy share) and the threads' run-queue wait (Linux).

    cpu + wait close to wall: the process always had work (other processes or its own threads held
    the core the rest of the time); cpu + wait well below wall: it waited for work (pipeline bubbles).
    """
    wall = report.get("pipeline_wall_s") or 0.0
    return {"cpu_s": report.get("pipeline_cpu_s"), "wall_s": wall,
            "busy": (report.get("pipeline_cpu_s") or 0.0) / wall if wall else None,
            "runqueue_wait_s": report.get("pipeline_runqueue_wait_s"),
            "threads_cpu_s": report.get("pipeline_threads_cpu_s")}


def run_pipeline_bench(args: argparse.Namespace) -> dict[str, Any]:
    from ..bench.machine import machine_info
    from ..models.embedded import ensure_embedded_default
    from .plan import PlanError, parse_split
    from .stage import plan_for_store

    if args.quick:
        args.rounds, args.tokens, args.ping, args.warmup = 1, min(args.tokens, 4), min(args.ping, 20), 1
    if args.ranks < 2 or args.requests < 1 or args.tokens < 1 or args.rounds < 1:
        raise SystemExit("asyncside bench pipeline: --ranks >= 2, --requests, --tokens and --rounds >= 1")
    store = args.model or str(ensure_embedded_default(args.cache_dir, progress=not args.json)[1])
    store = str(pathlib.Path(store).absolute())
    try:
        plan = plan_for_store(store, args.ranks, parse_split(args.split))
    except PlanError as exc:
        raise SystemExit(f"asyncside bench pipeline: {exc}") from None
    allowed = sorted(os.sched_getaffinity(0))
    pin = not args.no_pin
    common = ["--requests", str(args.requests), "--tokens", str(args.tokens), "--warmup", str(args.warmup),
              "--resident", str(args.resident), "--reader", args.reader]
    rounds: list[dict[str, Any]] = []
    identical = True
    for _ in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="asyncside-bench-pipeline-") as out:
            single = _single(store, common, out, [allowed[0]] if pin else None, args.deadline)
            ranks = _pipeline(store, common, out, args.ranks, ",".join(map(str, plan.split)), args.ping,
                              [[allowed[r % len(allowed)]] for r in range(args.ranks)] if pin else None,
                              args.deadline)
            floor = _wake_floor([allowed[0], allowed[1 % len(allowed)]] if pin else None, args.ping)
        identical = identical and ranks[0]["tokens"] == single["tokens"]
        ping = ranks[0]["ping_s"]
        rounds.append({
            "single": {"tokens_per_s": single["tokens_per_s"], "seconds": single["seconds"],
                       "pool_bytes": single["pool_bytes"], "max_rss_bytes": single["max_rss_bytes"],
                       "hit_rate": single["stats"]["runtime"]["hit_rate"], **_busy(single)},
            "pipeline": {"tokens_per_s": ranks[0]["tokens_per_s"], "seconds": ranks[0]["seconds"],
                         "ping_ms": {k: v * 1e3 for k, v in ping.items() if k not in ("n", "hidden_bytes")},
                         "hidden_bytes": ping["hidden_bytes"],
                         "wake_floor_ms": floor,
                         "ranks": [{"rank": r["rank"], "layers": [r["stage"]["start"], r["stage"]["stop"]],
                                    "pool_bytes": r["pool_bytes"], "max_rss_bytes": r["max_rss_bytes"],
                                    "hit_rate": r["stats"].get("runtime", {}).get("hit_rate"), **_busy(r),
                                    "boundary": r["stats"]["boundary"]} for r in ranks]},
            "ratio": ranks[0]["tokens_per_s"] / single["tokens_per_s"] if single["tokens_per_s"] else 0.0,
        })
    last = rounds[-1]
    result: dict[str, Any] = {
        "machine": machine_info(store),
        "store": store,
        "config": {"ranks": args.ranks, "split": list(plan.split), "requests": args.requests, "tokens": args.tokens,
                   "resident": args.resident, "pinned": pin, "cpus": allowed, "backend": "ring",
                   "transport": "loopback"},
        "rounds": rounds,
        "summary": {
            "aggregate_ratio_median": statistics.median(r["ratio"] for r in rounds),
            "single_tokens_per_s_median": statistics.median(r["single"]["tokens_per_s"] for r in rounds),
            "pipeline_tokens_per_s_median": statistics.median(r["pipeline"]["tokens_per_s"] for r in rounds),
            "boundary_ms_per_step_median": statistics.median(r["pipeline"]["ping_ms"]["median"] for r in rounds),
            "raw_transfer_ms_median": (statistics.median(r["pipeline"]["ping_ms"]["raw_median"] for r in rounds)
                                       if all("raw_median" in r["pipeline"]["ping_ms"] for r in rounds) else None),
            "wake_floor_ms_median": statistics.median(r["pipeline"]["wake_floor_ms"]["idle_median"] for r in rounds),
            "pool_bytes": {"single": last["single"]["pool_bytes"],
                           "ranks": [r["pool_bytes"] for r in last["pipeline"]["ranks"]]},
            "max_rss_bytes": {"single": last["single"]["max_rss_bytes"],
                              "ranks": [r["max_rss_bytes"] for r in last["pipeline"]["ranks"]]},
            "tokens_identical": identical,
        },
    }
    if not args.json:
        _table(result)
    return result


def _table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    cfg, s = result["config"], result["summary"]
    pin = "each pinned to one core" if cfg["pinned"] else "unpinned"
    table = Table(title=f"asyncside bench pipeline — {cfg['ranks']} ranks ({pin}) vs one process, "
                        f"{cfg['requests']} concurrent requests x {cfg['tokens']} tokens, "
                        f"{cfg['resident']:.0%} resident, {cfg['backend']} over {cfg['transport']}")
    table.add_column("round")
    table.add_column("one process tok/s", justify="right")
    table.add_column("pipeline tok/s", justify="right")
    table.add_column("ratio", justify="right")
    table.add_column("boundary per step (median)", justify="right")
    table.add_column("raw transfer", justify="right")
    table.add_column("host's idle round trip", justify="right")

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:.3f} ms"

    for i, r in enumerate(result["rounds"]):
        p = r["pipeline"]
        table.add_row(str(i + 1), f"{r['single']['tokens_per_s']:.2f}", f"{p['tokens_per_s']:.2f}",
                      f"{r['ratio']:.2f}x", ms(p["ping_ms"]["median"]), ms(p["ping_ms"].get("raw_median")),
                      ms(p["wake_floor_ms"]["idle_median"]))
    table.add_row("median", f"{s['single_tokens_per_s_median']:.2f}", f"{s['pipeline_tokens_per_s_median']:.2f}",
                  f"{s['aggregate_ratio_median']:.2f}x", ms(s["boundary_ms_per_step_median"]),
                  ms(s["raw_transfer_ms_median"]), ms(s["wake_floor_ms_median"]))
    Console().print(table)
    mem = Table(title="memory at equal residency (last round)")
    mem.add_column("")
    mem.add_column("pools", justify="right")
    mem.add_column("peak RSS", justify="right")
    mem.add_row("one process", f"{s['pool_bytes']['single'] / 2**20:.1f} MiB",
                f"{s['max_rss_bytes']['single'] / 2**20:.0f} MiB")
    for r, (pb, rss) in enumerate(zip(s["pool_bytes"]["ranks"], s["max_rss_bytes"]["ranks"])):
        mem.add_row(f"rank {r}", f"{pb / 2**20:.1f} MiB", f"{rss / 2**20:.0f} MiB")
    Console().print(mem)
    print(f"tokens identical to one process: {'yes' if s['tokens_identical'] else 'NO'}", file=sys.stdout)
