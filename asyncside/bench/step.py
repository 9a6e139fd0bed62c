"""``asyncside bench step``: host time per decode step, phase by phase, beside mlx-lm's.

A decode step of a small model is host-bound on a GPU (the step takes as long as the host needs
to build and encode it) and shares two cores with its own compute on a small CPU machine, so the
host's time per step matters as much as the read path's GB/s. For each batch size, in rounds
(mlx-lm first on even rounds, asyncside first on odd ones), each side runs ``--steps`` greedy
decode steps of the same model from the same prompt, each step awaited before the next (nothing
else runs meanwhile), after ``--warmup-steps`` untimed ones:

- **mlx-lm** (every expert resident): ``build``, the lazy forward and greedy draw in Python;
  ``schedule``, ``mx.async_eval`` of the token (on a GPU: encoding every kernel of the step; on the
  CPU MLX's throttle may hold it until the stream has caught up); ``wait``, until the token is
  computed;
- **asyncside** (a :class:`~asyncside.Runtime` at ``--resident``, queued steps): ``begin`` and
  ``end`` (the expert source's bookkeeping), ``build`` (the graph; on the CPU with a checkpoint
  between layers), ``plan`` (the native walk of the graph), ``schedule`` (handing it to MLX, as
  above; on the CPU in chunks awaited in between, which are not counted), ``draw`` (the greedy
  draw's Python, built into the step's graph as mlx-lm's is: out of ``build``); ``wait``.

With ``--prefill L`` each timed step is instead a prefill chunk of ``L`` tokens per batch row
into an empty cache (fresh tokens every step, the same on both sides, so the chunks route as a
stream of new prompts does): mlx-lm's prefill (the model called, its caches' state evaluated, as
its generation does) beside asyncside's queued prefill chunk (``logits=False``), ``draw`` empty.

Reported per side: the median over the timed steps of every round after the first (the first
compiles kernels on a GPU) of each phase, the host's total (``host``: everything but ``wait``)
and the whole step; and asyncside's host time and step time over mlx-lm's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from ..argtypes import resident_fraction
from . import bench_main
from .machine import machine_info

PHASES_MLX_LM = ("build", "schedule", "wait")
PHASES_OURS = ("begin", "build", "end", "plan", "schedule", "draw", "wait")


def add_step_arguments(parser: argparse.ArgumentParser) -> None:
    """Add this bench's options (the caller adds ``--json``)."""
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="batch sizes (default: 1 8)")
    parser.add_argument("--steps", type=int, default=60, help="timed decode steps per run (default 60)")
    parser.add_argument("--warmup-steps", type=int, default=8, help="untimed steps before them (default 8)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds; the first is not reported (default 3)")
    parser.add_argument("--resident", type=resident_fraction(allow_auto=False), default=0.5,
                        help="share of each layer's experts in the pools, in [0, 1] (default 0.5)")
    parser.add_argument("--model", default=None, help="a converted model directory (default: the embedded one)")
    parser.add_argument("--prefill", type=int, default=0, metavar="L",
                        help="time prefill chunks of L tokens per row instead of decode steps (default: off)")
    parser.add_argument("--quick", action="store_true", help="tiny run for CI smoke tests (numbers are noise)")


def _greedy(logits: Any) -> Any:
    import mlx.core as mx

    last = logits[:, -1, :]
    return mx.argmax(last - mx.logsumexp(last, axis=-1, keepdims=True), axis=-1)


def _chunks(vocab: int, batch: int, length: int, count: int) -> list[Any]:
    """``count`` prefill chunks (batch, length) of fixed pseudo-random token ids (the same for
    both sides: each chunk routes as a new prompt does)."""
    import mlx.core as mx

    key = mx.random.key(1234)
    return [mx.random.randint(0, vocab, (batch, length), key=k) for k in mx.random.split(key, count)]


def _mlx_lm_prefill_run(ref: Any, chunks: list[Any], warmup: int) -> dict[str, list[float]]:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    t: dict[str, list[float]] = defaultdict(list)
    for i, chunk in enumerate(chunks):
        cache = make_prompt_cache(ref)
        t0 = time.perf_counter_ns()
        ref(chunk, cache=cache)
        state = [c.state for c in cache]
        t1 = time.perf_counter_ns()
        mx.async_eval(state)
        t2 = time.perf_counter_ns()
        mx.eval(state)
        t3 = time.perf_counter_ns()
        if i >= warmup:
            for key, ns in (("build", t1 - t0), ("schedule", t2 - t1), ("wait", t3 - t2), ("host", t2 - t0),
                            ("step", t3 - t0)):
                t[key].append(ns / 1e6)
    return t


def _mlx_lm_run(ref: Any, prompt: Any, steps: int, warmup: int) -> dict[str, list[float]]:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(ref)
    ref(prompt, cache=cache)
    mx.eval([c.state for c in cache])
    y = mx.array([[5]] * prompt.shape[0])
    t: dict[str, list[float]] = defaultdict(list)
    for i in range(warmup + steps):
        t0 = time.perf_counter_ns()
        nxt = _greedy(ref(y, cache=cache))
        t1 = time.perf_counter_ns()
        mx.async_eval(nxt)
        t2 = time.perf_counter_ns()
        mx.eval(nxt)
        t3 = time.perf_counter_ns()
        y = nxt[:, None]
        if i >= warmup:
            for key, ns in (("build", t1 - t0), ("schedule", t2 - t1), ("wait", t3 - t2), ("host", t2 - t0),
                            ("step", t3 - t0)):
                t[key].append(ns / 1e6)
    return t


async def _ours_prefill_run(sm: Any, chunks: list[Any], warmup: int, resident: float) -> dict[str, Any]:
    from ..runtime import Runtime

    t: dict[str, list[float]] = defaultdict(list)
    async with Runtime(sm.store, resident=resident) as rt:
        fwd = sm.forward
        host = fwd.queued.host_ns
        queued_before = faults_before = staged_before = 0
        for i, chunk in enumerate(chunks):
            if i == warmup:
                queued_before, faults_before = fwd.counters["queued_prefill"], int(rt.stats()["faults"])
                staged_before = int(rt.stats()["staged_copies"])
            before = dict(host)
            ctx = fwd.context(sm.make_cache(), rt)
            t0 = time.perf_counter_ns()
            h = await fwd.step(ctx, chunk, logits=False, finish=False)
            t1 = time.perf_counter_ns()
            await fwd.finish(ctx, h)
            t2 = time.perf_counter_ns()
            if i < warmup:
                continue
            for key in ("begin", "build", "end", "plan", "schedule"):
                t[key].append((host[key] - before[key]) / 1e6)
            t["draw"].append(0.0)
            t["wait"].append((t2 - t1) / 1e6)
            t["step"].append((t2 - t0) / 1e6)
            t["host"].append(sum(t[key][-1] for key in ("begin", "build", "end", "plan", "schedule")))
        stats = rt.stats()
        queued = fwd.counters["queued_prefill"] - queued_before
    return {"times": t, "queued": queued, "faults": stats["faults"] - faults_before,
            "staged": stats["staged_copies"] - staged_before, "hit_rate": stats.get("hit_rate")}


async def _ours_run(sm: Any, prompt: Any, steps: int, warmup: int, resident: float) -> dict[str, Any]:
    import mlx.core as mx

    from ..runtime import Runtime

    t: dict[str, list[float]] = defaultdict(list)
    async with Runtime(sm.store, resident=resident) as rt:
        fwd = sm.forward
        host = fwd.queued.host_ns
        cache = sm.make_cache()
        await fwd(prompt, cache, rt, logits=False)
        y = mx.array([[5]] * prompt.shape[0])
        queued_before = faults_before = staged_before = 0
        for i in range(warmup + steps):
            if i == warmup:  # the timed steps' only
                queued_before, faults_before = fwd.counters["queued"], int(rt.stats()["faults"])
                staged_before = int(rt.stats()["staged_copies"])
            before = dict(host)
            ctx = fwd.context(cache, rt)
            drew = [0]

            def draw(logits: Any, drew: list[int] = drew) -> Any:
                # Built into the step's graph (as mlx-lm's draw goes into its async_eval): timed
                # apart, and taken out of the build's time below.
                d0 = time.perf_counter_ns()
                try:
                    return _greedy(logits)
                finally:
                    drew[0] += time.perf_counter_ns() - d0

            t0 = time.perf_counter_ns()
            nxt = await fwd.step(ctx, y, head=draw)
            t2 = time.perf_counter_ns()
            await fwd.finish(ctx, nxt)
            t3 = time.perf_counter_ns()
            y = nxt[:, None]
            if i < warmup:
                continue
            for key in ("begin", "build", "end", "plan", "schedule"):
                t[key].append((host[key] - before[key]) / 1e6)
            t["build"][-1] -= drew[0] / 1e6
            t["draw"].append(drew[0] / 1e6)
            t["wait"].append((t3 - t2) / 1e6)
            t["step"].append((t3 - t0) / 1e6)
            # On the CPU fwd.step awaits chunks of the step in between (not host time): the host's
            # share is the phases it spent, not the call's wall time.
            t["host"].append(sum(t[key][-1] for key in ("begin", "build", "end", "plan", "schedule", "draw")))
        stats = rt.stats()
        queued = fwd.counters["queued"] - queued_before
    return {"times": t, "queued": queued, "faults": stats["faults"] - faults_before,
            "staged": stats["staged_copies"] - staged_before, "hit_rate": stats.get("hit_rate")}


def _medians(runs: Sequence[dict[str, list[float]]]) -> dict[str, float]:
    keys: dict[str, list[float]] = defaultdict(list)
    for run in runs:
        for k, v in run.items():
            keys[k].extend(v)
    return {k: statistics.median(v) for k, v in keys.items() if v}


def run_step_bench(args: argparse.Namespace) -> dict[str, Any]:
    """Run the bench; print its table unless ``args.json``; return the result."""
    import anyio
    import mlx.core as mx

    from ..models import load_reference_model, load_streaming_model
    from ..models.embedded import ensure_embedded_default

    steps, warmup, rounds = args.steps, args.warmup_steps, args.rounds
    if args.quick:
        steps, warmup, rounds = 4, 1, 2
    if steps < 1 or warmup < 0 or rounds < 1 or args.prefill < 0:
        raise ValueError("--steps and --rounds must be >= 1, --warmup-steps and --prefill >= 0")
    store_dir = args.model if args.model is not None else str(ensure_embedded_default(None, progress=False)[1])
    sm = load_streaming_model(store_dir)  # prefill chunks are queued steps, as decode steps are
    ref = load_reference_model(store_dir)[0]
    tokens = sm.tokenizer.encode("The quick brown fox jumps over the lazy dog")
    machine = machine_info(store_dir)
    started = time.perf_counter()
    rows = []
    for batch in args.batch:
        prompt = mx.array([tokens] * batch)
        chunks = _chunks(sm.config["vocab_size"], batch, args.prefill, warmup + steps) if args.prefill else []
        theirs: list[dict[str, list[float]]] = []
        ours: list[dict[str, list[float]]] = []
        queued = 0
        faults = staged = 0
        for r in range(rounds):
            for side in (("mlx_lm", "asyncside") if r % 2 == 0 else ("asyncside", "mlx_lm")):
                if side == "mlx_lm":
                    run = (_mlx_lm_prefill_run(ref, chunks, warmup) if chunks
                           else _mlx_lm_run(ref, prompt, steps, warmup))
                    if r or rounds == 1:
                        theirs.append(run)
                else:
                    res = (anyio.run(_ours_prefill_run, sm, chunks, warmup, args.resident) if chunks
                           else anyio.run(_ours_run, sm, prompt, steps, warmup, args.resident))
                    if r or rounds == 1:
                        ours.append(res["times"])
                        queued += res["queued"]
                        faults += res["faults"] or 0
                        staged += res["staged"] or 0
        m_theirs, m_ours = _medians(theirs), _medians(ours)
        rows.append({
            "batch": batch,
            "mlx_lm_ms": m_theirs,
            "asyncside_ms": m_ours,
            "host_ratio": m_ours["host"] / m_theirs["host"],
            "step_ratio": m_ours["step"] / m_theirs["step"],
            "queued_steps": queued,
            "faults": faults,
            "faults_per_step": faults / (steps * max(1, rounds - 1)),
            # misses a staged switch copied from the host tier (no row taken; MLX CUDA)
            "staged_per_step": staged / (steps * max(1, rounds - 1)),
        })
    result = {
        "bench": "step",
        "device": str(mx.default_device()),
        "model": store_dir,
        "resident": args.resident,
        "prefill": args.prefill,
        "steps": steps,
        "warmup_steps": warmup,
        "rounds": rounds,
        "reported_rounds": max(1, rounds - 1),
        "rows": rows,
        "machine": machine,
        "seconds": round(time.perf_counter() - started, 1),
    }
    if not args.json:
        render_step_table(result)
    return result


def render_step_table(result: dict[str, Any]) -> None:
    """Print the result as a rich table (stdout)."""
    from rich.console import Console
    from rich.table import Table

    what = f"prefill chunk of {result['prefill']} tokens per row" if result.get("prefill") else "decode step"
    t = Table(title=f"host time per {what}, ms (median of {result['steps']} steps x "
                    f"{result['reported_rounds']} rounds; {result['device']}, {result['resident']:.0%} resident)")
    for col in ("batch", "side", *PHASES_OURS, "host", "step", "host / mlx-lm", "step / mlx-lm", "faults / step",
                "staged / step"):
        t.add_column(col, justify="right", no_wrap=True)
    for row in result["rows"]:
        for side, key in (("mlx-lm", "mlx_lm_ms"), ("asyncside", "asyncside_ms")):
            m = row[key]
            cells = [f"{m[p]:.3f}" if p in m else "-" for p in PHASES_OURS]
            ours = side == "asyncside"
            t.add_row(str(row["batch"]), side, *cells, f"{m['host']:.3f}", f"{m['step']:.3f}",
                      f"{row['host_ratio']:.2f}x" if ours else "", f"{row['step_ratio']:.2f}x" if ours else "",
                      f"{row['faults_per_step']:.1f}" if ours else "",
                      f"{row.get('staged_per_step', 0.0):.1f}" if ours else "")
    Console(width=160).print(t)
    print(f"{result['machine']['nproc']} CPUs, load at start {result['machine']['loadavg_at_start']}; "
          f"{result['seconds']} s")


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m asyncside.bench.step [--json] [--quick] ...``"""
    return bench_main("step", argv)


if __name__ == "__main__":
    sys.exit(main())
