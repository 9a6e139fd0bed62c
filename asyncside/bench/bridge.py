"""``asyncside bench bridge``: how fast a finished MLX computation wakes its awaiter.

Latency of one completion is measured on one clock (CLOCK_MONOTONIC, ``time.monotonic_ns``):

* t0: the native timestamp taken on MLX's stream thread when the stream reaches the completion
  signal placed right after x, i.e. when x's computation has finished;
* t1: the moment the awaiting task resumes.

Every method below is timed against the same native t0 (the same signal primitive, posting to a
queue), side by side in one run, on asyncio, uvloop and trio:

* ``bridge``: ``await asyncside.completed_at(x)`` (eventfd wakes the loop);
* ``executor``: ``await loop.run_in_executor(None, mx.eval, y)`` on asyncio/uvloop,
  ``anyio.to_thread.run_sync(mx.eval, y)`` on trio (a worker thread waits, then hops back);
* ``polling``: ``await anyio.sleep(0)`` until the native ready flag (the ticket was posted) flips.

Beside them, the physical floor: a native thread writes an eventfd and another native thread
sleeping in poll() wakes (no Python). Latency runs are sequential (one completion in flight);
throughput runs keep ``--concurrency`` completions in flight and report completions per second.
The loop-thread cost of issuing a completion (building x and the signal and ``async_eval``-ing
them, which MLX does on the calling thread) is reported too: it is time the loop is busy.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import anyio
import mlx.core as mx
import numpy as np

from .. import _native
from ..bridge import completed_at
from . import bench_main
from .machine import machine_info

TARGET_MEDIAN_US = 30.0
TARGET_P99_US = 100.0

BACKENDS: list[tuple[str, str, dict[str, Any]]] = [
    ("asyncio", "asyncio", {}),
    ("uvloop", "asyncio", {"use_uvloop": True}),
    ("trio", "trio", {}),
]
METHODS = ("bridge", "executor", "polling")


def add_bridge_arguments(parser: argparse.ArgumentParser) -> None:
    """Add this bench's options (the caller adds ``--json``)."""
    parser.add_argument("--quick", action="store_true", help="tiny run for CI smoke tests (numbers are noise)")
    parser.add_argument("--n", type=int, default=None, help="sequential completions per method and backend per round")
    parser.add_argument("--rounds", type=int, default=None, help="rounds; cells run interleaved, round-robin")
    parser.add_argument("--concurrency", type=int, default=None, help="completions in flight in the throughput runs")
    parser.add_argument("--throughput-n", type=int, default=None, help="completions per throughput run")
    parser.add_argument(
        "--size",
        type=int,
        default=1 << 18,
        help="float32 elements of the array each completion computes, x = a * i + 1 (default 2^18: "
        "enough work that the loop is parked when the stream posts; a tiny size measures the issue "
        "path instead, the stream finishing before the loop waits)",
    )


def _settings(args: argparse.Namespace) -> dict[str, int]:
    quick = bool(getattr(args, "quick", False))
    s = {
        "n": args.n if args.n is not None else (40 if quick else 400),
        "rounds": args.rounds if args.rounds is not None else (1 if quick else 5),
        "concurrency": args.concurrency if args.concurrency is not None else (4 if quick else 32),
        "throughput_n": args.throughput_n if args.throughput_n is not None else (40 if quick else 2000),
        "warmup": 5 if quick else 50,
        "size": args.size,
        "floor_n": 20 if quick else 300,
        "nice": os.nice(0),
    }
    for key in ("n", "rounds", "concurrency", "throughput_n", "size"):
        if s[key] <= 0:
            raise ValueError(f"--{key.replace('_', '-')} must be > 0, got {s[key]}")
    return s


# -- one completion per method -------------------------------------------------------------------


class _Recorder:
    """A native completion queue nobody watches: baselines read the stream's post time from it."""

    def __init__(self) -> None:
        self.q = _native.CompletionQueue()
        self.ticket = 0
        self.posted: dict[int, int] = {}

    def signal(self, x: mx.array) -> tuple[int, mx.array | None]:
        self.ticket += 1
        return self.ticket, _native.signal(x, self.q, self.ticket, None)[0]

    def post_time(self, ticket: int) -> int:
        for t, ns in self.q.drain():
            self.posted[t] = ns
        return self.posted.pop(ticket)

    def is_posted(self, ticket: int) -> bool:
        # The ready flag: the queue's post count passes the ticket (tickets post in order).
        return self.q.posted >= ticket

    def close(self) -> None:
        self.q.close()


async def _one_bridge(x: mx.array, rec: _Recorder) -> tuple[int, int]:
    t0 = await completed_at(x)
    t1 = time.monotonic_ns()
    assert t0 is not None
    return t0, t1


def _executor_waiter(library: str) -> Callable[[mx.array], Awaitable[None]]:
    if library == "asyncio":

        async def wait(y: mx.array) -> None:
            await asyncio.get_running_loop().run_in_executor(None, mx.eval, y)

    else:

        async def wait(y: mx.array) -> None:
            await anyio.to_thread.run_sync(mx.eval, y)

    return wait


async def _one_executor(x: mx.array, rec: _Recorder, wait: Callable[[mx.array], Awaitable[None]]) -> tuple[int, int]:
    ticket, y = rec.signal(x)
    await wait(y if y is not None else x)
    t1 = time.monotonic_ns()
    return rec.post_time(ticket), t1


async def _one_polling(x: mx.array, rec: _Recorder) -> tuple[int, int]:
    ticket, _ = rec.signal(x)
    while not rec.is_posted(ticket):  # polling is the baseline this bench measures
        await anyio.lowlevel.checkpoint()
    t1 = time.monotonic_ns()
    return rec.post_time(ticket), t1


# -- one cell: a (backend, method) pair in its own event loop --------------------------------------


async def _cell(library: str, method: str, s: dict[str, int]) -> dict[str, Any]:
    a = mx.array(np.linspace(0.0, 1.0, s["size"], dtype=np.float32))
    rec = _Recorder()
    wait = _executor_waiter(library)

    async def one(i: int) -> tuple[int, int]:
        x = a * float(i) + 1.0
        if method == "bridge":
            return await _one_bridge(x, rec)
        if method == "executor":
            return await _one_executor(x, rec, wait)
        return await _one_polling(x, rec)

    try:
        for i in range(s["warmup"]):
            await one(i)
        latencies: list[int] = []
        for i in range(s["n"]):
            t0, t1 = await one(i)
            latencies.append(t1 - t0)

        # Throughput: `concurrency` workers, each awaiting completions back to back.
        per_worker = max(1, s["throughput_n"] // s["concurrency"])
        done = 0

        async def worker(w: int) -> None:
            nonlocal done
            for i in range(per_worker):
                await one(w * per_worker + i)
                done += 1

        start = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for w in range(s["concurrency"]):
                tg.start_soon(worker, w)
        wall = time.perf_counter() - start
    finally:
        rec.close()
    return {"latencies_ns": latencies, "throughput_completions": done, "throughput_wall_s": wall}


def _issue_cost(s: dict[str, int]) -> list[int]:
    """Loop-thread nanoseconds to build x and schedule it plus its signal (no loop needed)."""
    a = mx.array(np.linspace(0.0, 1.0, s["size"], dtype=np.float32))
    q = _native.CompletionQueue()
    costs: list[int] = []
    try:
        for i in range(s["warmup"] + s["n"]):
            t = time.perf_counter_ns()
            x = a * float(i) + 1.0
            _native.signal(x, q, i + 1, None)
            dt = time.perf_counter_ns() - t
            if i >= s["warmup"]:
                costs.append(dt)
            mx.eval(x)  # one in flight, as in the latency runs (a backlog would hit MLX's throttle)
            mx.synchronize()
            q.drain()
    finally:
        q.close()
    return costs


def _stats_us(samples_ns: Sequence[int]) -> dict[str, float]:
    xs = sorted(samples_ns)
    if not xs:
        return {"n": 0}

    def pct(p: float) -> float:
        k = min(len(xs) - 1, max(0, int(round(p / 100.0 * (len(xs) - 1)))))
        return xs[k] / 1000.0

    return {
        "n": len(xs),
        "median": statistics.median(xs) / 1000.0,
        "p90": pct(90),
        "p99": pct(99),
        "mean": statistics.fmean(xs) / 1000.0,
        "min": xs[0] / 1000.0,
        "max": xs[-1] / 1000.0,
    }


def _machine() -> dict[str, Any]:
    return {**machine_info(), "native_paths": list(_native.bridge_paths())}


def _available_backends() -> tuple[list[tuple[str, str, dict[str, Any]]], list[str]]:
    import importlib.util

    ok, skipped = [], []
    for name, library, options in BACKENDS:
        needed = "uvloop" if options.get("use_uvloop") else library
        if importlib.util.find_spec(needed) is None:
            skipped.append(f"{name}: {needed} is not installed")
        else:
            ok.append((name, library, options))
    return ok, skipped


def run_bridge_bench(args: argparse.Namespace) -> dict[str, Any]:
    """Run every (backend, method) cell, interleaved over rounds; print a table unless --json."""
    s = _settings(args)
    # This bench measures the CPU stream's bridge (on a GPU build MLX would default to the GPU;
    # `python -m asyncside.bench.device` measures the GPU stream's).
    device = mx.default_device()
    mx.set_default_device(mx.cpu)
    try:
        return _run_cells(args, s)
    finally:
        mx.set_default_device(device)


def _run_cells(args: argparse.Namespace, s: dict[str, int]) -> dict[str, Any]:
    backends, skipped = _available_backends()
    samples: dict[tuple[str, str], list[int]] = {(b, m): [] for b, _, _ in backends for m in METHODS}
    tput: dict[tuple[str, str], list[tuple[int, float]]] = {k: [] for k in samples}
    floor: list[int] = []
    issue: list[int] = []
    started = time.time()
    for _ in range(s["rounds"]):
        floor += _native.bench.wakeup_floor_ns(s["floor_n"])
        issue += _issue_cost(s)
        for name, library, options in backends:
            for method in METHODS:
                r = anyio.run(_cell, library, method, s, backend=library, backend_options=options)
                samples[(name, method)] += r["latencies_ns"]
                tput[(name, method)].append((r["throughput_completions"], r["throughput_wall_s"]))

    results = []
    for (name, method), lat in samples.items():
        n_done = sum(c for c, _ in tput[(name, method)])
        wall = sum(w for _, w in tput[(name, method)])
        st = _stats_us(lat)
        results.append(
            {
                "backend": name,
                "method": method,
                "latency_us": st,
                "completions_per_s": n_done / wall if wall > 0 else None,
                "meets_target": method == "bridge"
                and st["median"] <= TARGET_MEDIAN_US
                and st["p99"] <= TARGET_P99_US,
            }
        )
    result: dict[str, Any] = {
        "bench": "bridge",
        "definition": "latency = (awaiter resumes, time.monotonic_ns) - (stream thread posts the ticket "
        "right after x, CLOCK_MONOTONIC); one completion in flight. completions/s: "
        "`concurrency` completions in flight, each x = a * i + 1 of `size` float32. Cells (backend x "
        "method) run interleaved, round-robin, each in a fresh event loop.",
        "settings": s,
        "machine": _machine(),
        "seconds": round(time.time() - started, 2),
        "targets_us": {"median": TARGET_MEDIAN_US, "p99": TARGET_P99_US},
        "floor_eventfd_wakeup_us": _stats_us(floor),
        "loop_thread_issue_cost_us": _stats_us(issue),
        "results": results,
        "skipped_backends": skipped,
    }
    if not getattr(args, "json", False):
        render_bridge_table(result)
    return result


def render_bridge_table(result: dict[str, Any]) -> None:
    """Print the result as a rich table (stdout)."""
    from rich.console import Console
    from rich.table import Table

    t = Table(
        title="asyncside bench bridge: completion -> awaiter resumes (µs)",
        caption="floor: native eventfd wakeup between two native threads (no Python)",
    )
    for col in ("backend", "method", "median", "p90", "p99", "max", "compl/s", "target"):
        t.add_column(col, justify="right" if col not in ("backend", "method") else "left")
    for r in result["results"]:
        st = r["latency_us"]
        target = ""
        if r["method"] == "bridge":
            target = "met" if r["meets_target"] else "missed"
        t.add_row(
            r["backend"],
            r["method"],
            f"{st['median']:.1f}",
            f"{st['p90']:.1f}",
            f"{st['p99']:.1f}",
            f"{st['max']:.0f}",
            f"{r['completions_per_s']:.0f}" if r["completions_per_s"] else "-",
            target,
        )
    fl = result["floor_eventfd_wakeup_us"]
    t.add_row("native", "floor", f"{fl['median']:.1f}", f"{fl['p90']:.1f}", f"{fl['p99']:.1f}",
              f"{fl['max']:.0f}", "-", "limit")
    ic = result["loop_thread_issue_cost_us"]
    console = Console()
    console.print(t)
    console.print(
        f"loop-thread cost to issue one completion (build x, async_eval x + signal): median {ic['median']:.1f} µs, "
        f"p99 {ic['p99']:.1f} µs; {result['machine']['nproc']} CPUs, load at start "
        f"{result['machine']['loadavg_at_start']}; {result['seconds']} s"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m asyncside.bench.bridge [--json] [--quick] ...``"""
    return bench_main("bridge", argv)


if __name__ == "__main__":
    sys.exit(main())
