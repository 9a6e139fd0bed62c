"""Where a streamed decode step's time goes, on the CPU: a diagnostic, not a benchmark.

    python tools/decode_profile.py --resident 0.25 --tokens 48 [--mode per-layer] [--json]

Runs mlx-lm's own generation (all experts resident) and then asyncside's streamed generation of
the embedded model in one process, and reports for the decode part of each:

* CPU time of each busy thread over the wall time (from /proc: the event-loop thread, MLX's
  stream thread, io_uring workers), i.e. how much of the time the stream computed;
* per MoE layer of a per-layer streamed run (``--mode per-layer``; queued steps have no host
  round trip per layer to time), from native completion timestamps: how long the stream spent
  on the speculative expert outputs after the routed ids, and how long it then sat idle before the
  host queued more work (the next layer, a recompute, or the token's logits);
* the routed experts the host found sound in the row snapshot, and of the others, whether they
  had been in the snapshot at all (a miss the prediction did not cover) or were refilled since.

The instrumentation wraps the forward's own methods (an extra completion signal after each
speculative gather), so the streamed figures are a little slower than an uninstrumented run.
Linux only (/proc).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import threading
import time
from typing import Any

import anyio
import mlx.core as mx
import numpy as np

from asyncside.argtypes import int_at_least


def _thread_cpu() -> dict[int, tuple[str, float, int, float]]:
    """Per thread: name, CPU seconds, voluntary context switches (times it went to sleep), and
    seconds it waited runnable for a CPU (schedstat: preempted or not yet placed after a wake)."""
    out: dict[int, tuple[str, float, int, float]] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/self/task/{tid}/status") as f:
                sleeps = next(int(ln.split()[1]) for ln in f if ln.startswith("voluntary_ctxt_switches"))
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                waited = int(f.read().split()[1]) / 1e9
        except (OSError, StopIteration, IndexError, ValueError):
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        out[int(tid)] = (name, (int(fields[11]) + int(fields[12])) / tick, sleeps, waited)
    return out


def _busy(before: dict[int, tuple[str, float, int, float]], after: dict[int, tuple[str, float, int, float]],
          wall: float) -> list[dict[str, Any]]:
    main = threading.get_native_id()
    rows = []
    for tid, (name, cpu, sleeps, waited) in after.items():
        was = before.get(tid, (name, 0.0, 0, 0.0))
        d = cpu - was[1]
        if d >= 0.02:
            role = "event loop" if tid == main else ("io_uring worker" if name.startswith("iou-") else name)
            rows.append({"thread": role, "tid": tid, "cpu_s": round(d, 3), "busy": round(d / wall, 3),
                         "sleeps": sleeps - was[2], "runnable_waiting": round((waited - was[3]) / wall, 3)})
    return sorted(rows, key=lambda r: -r["cpu_s"])


def _stream_gaps(events: list[tuple[str, int, int]],
                 posted: dict[int, int]) -> tuple[list[float], list[float], list[float]]:
    """From the recorded events and the stream's completion timestamps: per speculative gather, the
    stream's time on the expert outputs and its idle time until the host queued more; per plain
    await, the idle time until the host queued more (milliseconds each)."""
    experts_ms, idle_ms, boundary_ms = [], [], []
    for k, (kind, t, tk) in enumerate(events):
        if kind != "ids" or not t or tk not in posted:
            continue
        experts_ms.append((posted[tk] - t) / 1e6)
        nxt = next((e for e in events[k + 1 :] if e[0] == "queue"), None)
        if nxt is not None:
            idle_ms.append(max(0, nxt[1] - posted[tk]) / 1e6)
    for k, (kind, t, _tk) in enumerate(events):
        # The stream finished something the host awaited plainly (the token's argmax, a recompute):
        # it idles until the host queues the next work.
        if kind == "done":
            nxt = next((e for e in events[k + 1 :] if e[0] == "queue"), None)
            if nxt is not None:
                boundary_ms.append(max(0, nxt[1] - t) / 1e6)
    return experts_ms, idle_ms, boundary_ms


def _print_result(result: dict[str, Any]) -> None:
    """The human-readable report of :func:`main`'s result."""
    for name in ("mlx_lm", "asyncside"):
        r = result[name]
        print(f"{name}: decode {r['decode_tok_s']} tok/s")
        for t in r["threads"]:
            print(f"    {t['thread']:<16} cpu {t['cpu_s']:7.2f} s   busy {t['busy'] * 100:5.1f}% of the wall time"
                  f"   went to sleep {t['sleeps']} times   runnable, waiting for a CPU "
                  f"{t['runnable_waiting'] * 100:4.1f}%")
    a = result["asyncside"]
    print(f"tokens identical: {result['tokens_identical']}")
    print("speculative expert outputs on the stream: "
          f"{a['speculative_experts_ms_per_layer_median']} ms per layer (median)")
    print("stream idle between them and the next layer: "
          f"{a['stream_idle_after_experts_ms_per_token']} ms per token")
    print(f"stream idle after a plain await (the token, a recompute) until the host queued more: "
          f"{a['stream_idle_after_plain_awaits_ms_per_token']} ms per token")
    print(f"host waiting for fills (stall): {a['stall_ms_per_token']} ms per token")
    for k, v in sorted(a["routed_experts"].items()):
        print(f"    {v:6d}  {k}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--resident", type=float, default=0.25)
    p.add_argument("--tokens", type=int_at_least(2), default=48)
    p.add_argument("--mode", default="queued", choices=["queued", "per-layer", "whole"])
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    from asyncside import _native, bridge
    from asyncside.demo import DEFAULT_PROMPT, reference_run
    from asyncside.models import ForwardOptions, load_reference_model, load_streaming_model
    from asyncside.models.embedded import ensure_embedded_default
    from asyncside.runtime import Runtime
    from asyncside.store import ExpertStore

    _model_dir, store_dir = ensure_embedded_default(None, progress=False)
    store = ExpertStore.open(store_dir)
    sm = load_streaming_model(store_dir)
    prompt = list(sm.tokenizer.encode(DEFAULT_PROMPT))
    ref_model, _ = load_reference_model(store_dir)
    reference_run(ref_model, prompt, 2, set())  # warm-up
    t0, w0 = _thread_cpu(), time.perf_counter()
    ref = reference_run(ref_model, prompt, args.tokens, set())
    ref_threads = _busy(t0, _thread_cpu(), time.perf_counter() - w0)
    del ref_model

    options = ForwardOptions(mode=args.mode)
    pl = sm.forward_with(options).per_layer
    recorder = _native.CompletionQueue()  # nobody watches it: it only timestamps the stream
    events: list[tuple[str, int, int]] = []  # (kind, host ns, ticket or posted ns)
    spec: collections.Counter[str] = collections.Counter()
    ticket = [0]

    async def completed_then(x: mx.array, *then: mx.array) -> None:
        events.append(("queue", time.monotonic_ns(), 0))
        posted = await bridge.completed_at(x, then=list(then))
        ticket[0] += 1
        sig, _ = _native.signal(then[0], recorder, ticket[0], None)  # posts when the outputs are done
        if sig is not None:
            mx.async_eval(sig)
        events.append(("ids", posted or 0, ticket[0]))

    completed = pl.completed

    async def completed_any(x: mx.array, **kw: Any) -> None:
        events.append(("queue", time.monotonic_ns(), 0))  # x may be new work (the token's logits)
        if completed is bridge.completed:
            posted = await bridge.completed_at(x, **kw)
            if posted:
                events.append(("done", posted, 0))  # e.g. the token: the host reads it from here
        else:
            await completed(x, **kw)

    schedule = pl.schedule

    async def scheduled(*arrays: mx.array) -> None:
        events.append(("queue", time.monotonic_ns(), 0))
        await schedule(*arrays)

    serve = pl.serve_speculated

    async def serve_speculated(ctx: Any, layer: int, x_sw: mx.array, inds: np.ndarray, y_spec: mx.array,
                               snap: Any) -> mx.array:
        source = ctx.source
        uniq = np.unique(inds).astype(np.int64)
        sound = np.asarray(source.unchanged(layer, snap, uniq), dtype=bool)
        spec["sound"] += int(sound.sum())
        pred = last_prediction.get(layer)
        predicted = set(np.asarray(pred).reshape(-1).tolist()) if pred is not None else set()
        for e in uniq[~sound]:
            if snap.table[e] >= 0:
                spec["unsound, was in the snapshot (refilled since)"] += 1
            elif int(e) in predicted:
                spec["unsound, not in the snapshot: predicted, its read had not landed"] += 1
            else:
                spec["unsound, not in the snapshot: not predicted"] += 1
        return await serve(ctx, layer, x_sw, inds, y_spec, snap)

    pl._completed_then = completed_then  # type: ignore[method-assign, assignment]
    pl.schedule = scheduled
    pl.completed = completed_any
    pl.serve_speculated = serve_speculated  # type: ignore[method-assign]

    last_prediction: dict[int, Any] = {}  # layer -> the ids last handed to prefetch for it

    window: list[int] = []  # the streamed decode, CLOCK_MONOTONIC ns (for `perf record -k CLOCK_MONOTONIC`)

    async def streamed() -> dict[str, Any]:
        async with Runtime(store, resident=args.resident) as rt:
            prefetch = rt.prefetch

            def recording_prefetch(layer: int, ids: Any) -> Any:
                last_prediction[layer] = ids
                return prefetch(layer, ids)

            rt.prefetch = recording_prefetch  # type: ignore[method-assign]
            gen = sm.generate(prompt, max_tokens=args.tokens, source=rt, predictor="lookahead", options=options)
            toks = [await gen.__anext__()]
            events.clear()
            spec.clear()
            before, w, m0 = _thread_cpu(), time.perf_counter(), time.monotonic_ns()
            async for tok in gen:
                toks.append(tok)
            wall = time.perf_counter() - w
            window[:] = [m0, time.monotonic_ns()]
            threads = _busy(before, _thread_cpu(), wall)
            await anyio.sleep(0.1)
            stats = rt.stats()
        return {"tokens": toks, "wall": wall, "threads": threads, "stall_s": stats["stall_time_s"]}

    run = anyio.run(streamed, backend="asyncio", backend_options={"use_uvloop": True})
    posted = dict(recorder.drain())
    recorder.close()
    experts_ms, idle_ms, boundary_ms = _stream_gaps(events, posted)
    n_dec = len(run["tokens"]) - 1
    result = {
        "resident": args.resident,
        "mode": args.mode,
        "tokens_identical": run["tokens"] == ref.tokens[: len(run["tokens"])],
        "streamed_window_monotonic_ns": window,
        "mlx_lm": {"decode_tok_s": round(ref.decode_tokens_per_s, 2), "threads": ref_threads},
        "asyncside": {
            "decode_tok_s": round(n_dec / run["wall"], 2),
            "threads": run["threads"],
            "stall_ms_per_token": round(run["stall_s"] * 1e3 / max(1, len(run["tokens"])), 2),
            "speculative_experts_ms_per_layer_median": round(float(np.median(experts_ms)), 3) if experts_ms else None,
            "stream_idle_after_experts_ms_per_token": round(sum(idle_ms) / max(1, n_dec), 3),
            "stream_idle_after_plain_awaits_ms_per_token": round(sum(boundary_ms) / max(1, n_dec), 3),
            "routed_experts": dict(spec),
        },
    }
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        _print_result(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
