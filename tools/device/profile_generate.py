"""Where a GPU decode token's host time goes, generation loop and all: mlx-lm's ``generate_step``
and asyncside's ``StreamingModel.generate`` (queued steps, a Runtime at 50% in pools) in one
process, alternated, each run's loop-thread CPU per decode token, then one cProfile of each over
the decode tokens with the thread's CPU time as its clock (what the loop thread spends, not what it
waits). A diagnostic for the GPU machine, where decode is bound by the host; the benchmark is
``asyncside bench generate``.

    python tools/device/profile_generate.py [--tokens 200] [--rounds 3] [--resident 0.5] [--top 35]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

import anyio
import mlx.core as mx


class _DecodeClock:
    """Wall and loop-thread CPU time from the first token to the last (the decode tokens), the
    profiler (if any) running over the same span."""

    def __init__(self, prof: cProfile.Profile | None) -> None:
        self.prof = prof
        self.n = 0
        self.t_first = self.c_first = 0.0

    def token(self) -> None:
        self.n += 1
        if self.n == 1:
            self.t_first, self.c_first = time.perf_counter(), time.thread_time()
            if self.prof is not None:
                self.prof.enable()

    def per_token_ms(self) -> tuple[float, float]:
        """(wall ms, loop-thread CPU ms) per decode token."""
        if self.prof is not None:
            self.prof.disable()
        steps = max(self.n - 1, 1)
        return ((time.perf_counter() - self.t_first) / steps * 1e3,
                (time.thread_time() - self.c_first) / steps * 1e3)


def main() -> None:
    from mlx_lm.generate import generate_step

    from asyncside.bench.generate import DEFAULT_PROMPT
    from asyncside.models import load_reference_model, load_streaming_model
    from asyncside.models.embedded import ensure_embedded_default
    from asyncside.runtime import Runtime

    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=200)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--resident", type=float, default=0.5)
    p.add_argument("--top", type=int, default=35)
    args = p.parse_args()
    store = str(ensure_embedded_default(None, progress=False)[1])
    sm, ref = load_streaming_model(store), load_reference_model(store)[0]
    prompt = list(sm.tokenizer.encode(DEFAULT_PROMPT))

    def theirs(prof: cProfile.Profile | None = None) -> tuple[float, float]:
        clock = _DecodeClock(prof)
        for y, _ in generate_step(mx.array(prompt), ref, max_tokens=args.tokens):
            int(y)
            clock.token()
        return clock.per_token_ms()

    async def ours_async(prof: cProfile.Profile | None) -> tuple[float, float]:
        async with Runtime(sm.store, resident=args.resident) as rt:
            clock = _DecodeClock(prof)
            async for _tok in sm.generate(prompt, max_tokens=args.tokens, source=rt):
                clock.token()
            return clock.per_token_ms()

    def ours(prof: cProfile.Profile | None = None) -> tuple[float, float]:
        return anyio.run(ours_async, prof)

    theirs(), ours()  # compile kernels, fill the page cache
    rows: dict[str, list[tuple[float, float]]] = {"mlx-lm": [], "asyncside": []}
    for r in range(args.rounds):
        for name, fn in (("mlx-lm", theirs), ("asyncside", ours))[:: 1 if r % 2 == 0 else -1]:
            rows[name].append(fn())
    for name, v in rows.items():
        ms = [x[0] for x in v]
        cpu = [x[1] for x in v]
        print(f"{name}: ms per decode token {', '.join(f'{x:.3f}' for x in ms)} (median {statistics.median(ms):.3f}); "
              f"loop CPU ms per token {', '.join(f'{x:.3f}' for x in cpu)} (median {statistics.median(cpu):.3f})")
    for name, fn in (("mlx-lm", theirs), ("asyncside", ours)):
        prof = cProfile.Profile(time.thread_time)
        fn(prof)
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(args.top)
        print(f"== {name}, loop-thread CPU by function over {args.tokens - 1} decode tokens (profiled)")
        print("\n".join(line for line in out.getvalue().splitlines() if line.strip()))


if __name__ == "__main__":
    main()
