"""Host time of one decode step, phase by phase, beside mlx-lm's: a diagnostic, not a benchmark.

    python tools/step_host_time.py [--batch 1] [--steps 60] [--resident 0.5] [--json]

For the embedded model, times on the host (median over ``--steps`` decode steps, each awaited
before the next, so nothing else runs meanwhile):

* mlx-lm's own step (all experts resident): building the lazy graph of the forward and the
  greedy draw, then ``mx.async_eval`` of the token (on a GPU: encoding every kernel of the step);
* asyncside's queued step over a Runtime: ``begin_step``, building the graph, ``end_step``,
  walking it (``StepPlan``) and scheduling it (``advance``: the same ``async_eval`` work), and the
  draw; then the awaited completion for reference.

The step time a stream can reach is bounded below by the host time per step whenever the host
builds each step after the previous one's token (or, running ahead, while it computes).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from typing import Any


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--resident", type=float, default=0.5)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    import anyio
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from asyncside.models import load_reference_model, load_streaming_model
    from asyncside.models import queued as queued_mod
    from asyncside.models.embedded import ensure_embedded_default
    from asyncside.runtime import Runtime

    _model_dir, store_dir = ensure_embedded_default(None, progress=False)
    sm = load_streaming_model(store_dir)
    ref = load_reference_model(store_dir)[0]
    prompt = mx.array([sm.tokenizer.encode("The quick brown fox jumps over")] * args.batch)

    def greedy(logits: mx.array) -> mx.array:
        last = logits[:, -1, :]
        return mx.argmax(last - mx.logsumexp(last, axis=-1, keepdims=True), axis=-1)

    def mlx_lm() -> dict[str, float]:
        cache = make_prompt_cache(ref)
        ref(prompt, cache=cache)
        mx.eval([c.state for c in cache])
        y = mx.array([[5]] * args.batch)
        t: dict[str, list[float]] = defaultdict(list)
        for _ in range(args.steps):
            t0 = time.perf_counter()
            nxt = greedy(ref(y, cache=cache))
            t1 = time.perf_counter()
            mx.async_eval(nxt)
            t2 = time.perf_counter()
            mx.eval(nxt)
            t3 = time.perf_counter()
            t["build"].append(t1 - t0)
            t["async_eval"].append(t2 - t1)
            t["wait"].append(t3 - t2)
            t["step"].append(t3 - t0)
            y = nxt[:, None]
        return {k: statistics.median(v) * 1e3 for k, v in t.items()}

    async def ours() -> dict[str, Any]:
        t: dict[str, list[float]] = defaultdict(list)
        async with Runtime(sm.store, resident=args.resident) as rt:
            fwd = sm.forward
            q = fwd.queued
            cache = sm.make_cache()
            await fwd(prompt, cache, rt, logits=False)
            timed: list[tuple[Any, str, str]] = [(rt, "begin_step", "begin_step"), (rt, "end_step", "end_step")]
            saved = [(obj, name, getattr(obj, name)) for obj, name, _ in timed]

            def wrap(fn: Any, key: str) -> Any:
                def inner(*a: Any, **k: Any) -> Any:
                    s = time.perf_counter()
                    try:
                        return fn(*a, **k)
                    finally:
                        t[key].append(time.perf_counter() - s)
                return inner

            for obj, name, key in timed:
                setattr(obj, name, wrap(getattr(obj, name), key))
            build = q._build

            async def timed_build(*a: Any, **k: Any) -> Any:
                s = time.perf_counter()
                try:
                    return await build(*a, **k)
                finally:
                    t["build"].append(time.perf_counter() - s)

            q._build = timed_build  # type: ignore[method-assign]
            native_plan = queued_mod._native.StepPlan

            class TimedPlan:
                def __init__(self, outs: Any) -> None:
                    s = time.perf_counter()
                    self.plan = native_plan(outs)
                    t["plan"].append(time.perf_counter() - s)

                def advance(self) -> Any:
                    s = time.perf_counter()
                    try:
                        return self.plan.advance()
                    finally:
                        t["advance"].append(time.perf_counter() - s)

            queued_mod._native = _Proxy(queued_mod._native, StepPlan=TimedPlan)
            try:
                y = mx.array([[5]] * args.batch)
                for _ in range(args.steps):
                    ctx = fwd.context(cache, rt)
                    s0 = time.perf_counter()
                    nxt = greedy(await fwd.step(ctx, y))
                    s1 = time.perf_counter()
                    await fwd.finish(ctx, nxt)
                    s2 = time.perf_counter()
                    t["launch"].append(s1 - s0)
                    t["wait"].append(s2 - s1)
                    t["step"].append(s2 - s0)
                    y = nxt[:, None]
            finally:
                queued_mod._native = queued_mod._native._inner
                for obj, name, fn in saved:
                    setattr(obj, name, fn)
                q._build = build  # type: ignore[method-assign]
            out: dict[str, Any] = {k: statistics.median(v) * 1e3 for k, v in t.items()}
            out["queued"] = fwd.counters["queued"]
            return out

    res = {"device": str(mx.default_device()), "batch": args.batch, "resident": args.resident}
    for r in range(2):  # twice each, alternated: the first pass compiles kernels
        res[f"mlx_lm_{r}"] = mlx_lm()
        res[f"asyncside_{r}"] = anyio.run(ours)
    if args.json:
        print(json.dumps(res, indent=1))
    else:
        for k, v in res.items():
            if isinstance(v, dict):
                print(k, " ".join(f"{a}={b:.3f}" if isinstance(b, float) else f"{a}={b}" for a, b in v.items()))
            else:
                print(k, v)
    return 0


class _Proxy:
    """A module stand-in with some attributes replaced."""

    def __init__(self, inner: Any, **over: Any) -> None:
        self._inner = inner
        self.__dict__.update(over)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


if __name__ == "__main__":
    sys.exit(main())
