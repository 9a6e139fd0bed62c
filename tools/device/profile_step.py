"""Where a decode step's host time goes, function by function: cProfile over the build and the
hand-off to MLX of mlx-lm's step and of asyncside's queued step (batch 1, 50% resident, the
embedded model). A diagnostic for the GPU machine, where the step is host-bound; the numbers
``asyncside bench step`` reports come without the profiler's overhead.

    python tools/device/profile_step.py [--steps 40] [--top 30]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import anyio
import mlx.core as mx


def _report(name: str, prof: cProfile.Profile, ms: float, top: int) -> None:
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    print(f"== {name}: {ms:.3f} ms per step (build + hand-off, profiled)")
    print("\n".join(line for line in out.getvalue().splitlines() if line.strip()))


def main() -> None:
    from mlx_lm.models.cache import make_prompt_cache

    from asyncside.bench.step import _greedy  # the draw `asyncside bench step` times
    from asyncside.models import load_reference_model, load_streaming_model
    from asyncside.models.embedded import ensure_embedded_default
    from asyncside.runtime import Runtime

    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    store = str(ensure_embedded_default(None, progress=False)[1])
    sm, ref = load_streaming_model(store), load_reference_model(store)[0]
    prompt = mx.array([sm.tokenizer.encode("The quick brown fox jumps over the lazy dog")])

    cache = make_prompt_cache(ref)
    ref(prompt, cache=cache)
    mx.eval([c.state for c in cache])
    y = mx.array([[5]])
    prof, spent = cProfile.Profile(), 0.0
    for i in range(8 + args.steps):
        t0 = time.perf_counter()
        if i >= 8:
            prof.enable()
        nxt = _greedy(ref(y, cache=cache))
        mx.async_eval(nxt)
        prof.disable()
        if i >= 8:
            spent += time.perf_counter() - t0
        mx.eval(nxt)
        y = nxt[:, None]
    _report("mlx-lm", prof, spent / args.steps * 1e3, args.top)

    async def ours() -> None:
        async with Runtime(sm.store, resident=0.5) as rt:
            fwd, cache = sm.forward, sm.make_cache()
            await fwd(prompt, cache, rt, logits=False)
            y = mx.array([[5]])
            prof, spent = cProfile.Profile(), 0.0
            for i in range(8 + args.steps):
                ctx = fwd.context(cache, rt)
                t0 = time.perf_counter()
                if i >= 8:
                    prof.enable()
                nxt = _greedy(await fwd.step(ctx, y))
                prof.disable()
                if i >= 8:
                    spent += time.perf_counter() - t0
                await fwd.finish(ctx, nxt)
                y = nxt[:, None]
            _report("asyncside", prof, spent / args.steps * 1e3, args.top)

    anyio.run(ours)


if __name__ == "__main__":
    main()
