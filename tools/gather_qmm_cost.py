"""What a batch saves in MLX's quantized expert matmul: the time of ``gather_qmm`` for T tokens of
top-8 routing, each token on its own experts or all on the same ones, sorted by expert or not.

    python tools/gather_qmm_cost.py [--experts 128] [--hidden 2048] [--width 768] [--bits 4] [--tokens 1,8]

On a device whose kernel reads each expert's weights once for every token routed to it, T tokens
on the same experts cost about one token's time; where it works pair by pair, T times. BENCHMARKS.md,
"What eight clients can gain", cites the output (the CPU's case: why batching does not pay there).
"""

from __future__ import annotations

import argparse
import sys
import time

import mlx.core as mx
import numpy as np

from asyncside.argtypes import int_at_least, positive_ints


def timed(x: mx.array, w: tuple[mx.array, mx.array, mx.array], idx: mx.array, bits: int, sort: bool,
          repeat: int) -> float:
    """Seconds of one ``gather_qmm`` (best of ``repeat``, after a warm-up)."""
    wq, scales, biases = w

    def once() -> mx.array:
        return mx.gather_qmm(x, wq, scales, biases, rhs_indices=idx, transpose=True, group_size=64, bits=bits,
                             sorted_indices=sort)

    mx.eval(once())
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        mx.eval(once())
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--tokens", type=positive_ints, default=[1, 8])
    ap.add_argument("--repeat", type=int_at_least(1), default=5)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    w = mx.quantize(mx.random.normal((args.experts, args.width, args.hidden)).astype(mx.bfloat16),
                    group_size=64, bits=args.bits)
    mx.eval(*w)
    print(f"device {mx.default_device()}, {args.experts} experts of {args.width}x{args.hidden}, {args.bits}-bit, "
          f"top-{args.top_k}")
    print(f"| tokens | experts | sorted | ms | vs {args.tokens[0]} token(s) |\n|---|---|---|---|---|")
    one: dict[tuple[str, bool], float] = {}
    for t in args.tokens:
        for routing in ("own", "same"):
            if routing == "own":
                ids = np.stack([rng.choice(args.experts, args.top_k, replace=False) for _ in range(t)])
            else:
                ids = np.tile(rng.choice(args.experts, args.top_k, replace=False), (t, 1))
            for sort in (False, True):
                if sort:  # the pairs sorted by expert, one row each (mlx-lm's sorted switch)
                    flat = np.sort(ids.reshape(-1))
                    x = mx.random.normal((flat.size, 1, args.hidden)).astype(mx.bfloat16)
                    idx = mx.array(flat.astype(np.uint32))
                else:
                    x = mx.random.normal((t, 1, 1, args.hidden)).astype(mx.bfloat16)
                    idx = mx.array(ids.astype(np.uint32))
                s = timed(x, w, idx, args.bits, sort, args.repeat)
                if t == args.tokens[0]:
                    one[(routing, sort)] = s
                print(f"| {t} | {'each its own' if routing == 'own' else 'all the same'} | {'yes' if sort else 'no'} | "
                      f"{s * 1e3:.1f} | {s / one[(routing, sort)]:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
