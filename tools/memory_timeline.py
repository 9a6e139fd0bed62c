"""Where a generation's memory goes: the process's anonymous resident size and MLX's active and
cached bytes, sampled every 10 ms through one greedy generation of the embedded model under a
memory budget, their largest values per phase (entry, prompt, each decode token) (BENCHMARKS.md,
"A long prompt at the smallest budget: where the memory goes").

    python tools/memory_timeline.py --memory 300M --prompt-tokens 2694 --tokens 4

No cgroup: the plan is made against ``--memory`` as ``demo --memory`` makes it; run
``tools/memory_sweep.py`` for the cgroup's charge.
"""

from __future__ import annotations

import argparse
import threading
import time

import anyio
import mlx.core as mx

from asyncside import ExpertStore, Runtime, load_streaming_model
from asyncside.memory import proc_self_bytes
from asyncside.models.embedded import ensure_embedded_default

MIB = 1 << 20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--memory", default="300M", help="the runtime's memory budget (default 300M)")
    ap.add_argument("--prompt-tokens", type=int, default=2694, help="prompt length in tokens (default 2694)")
    ap.add_argument("--tokens", type=int, default=4, help="tokens to generate (default 4)")
    args = ap.parse_args()

    store_dir = ensure_embedded_default(None)[1]
    sm = load_streaming_model(store_dir)
    phase = ["load"]
    samples: list[tuple[str, int, int, int]] = []
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            samples.append((phase[0], proc_self_bytes("status", "RssAnon"), mx.get_active_memory(),
                            mx.get_cache_memory()))
            time.sleep(0.01)

    async def run() -> None:
        async with Runtime(ExpertStore.open(store_dir), memory=args.memory, resident="auto") as rt:
            assert rt.plan is not None
            print(rt.plan.describe())
            phase[0] = "entered"
            await anyio.sleep(0.05)  # a few samples of the entered runtime before the prompt
            phase[0] = "prompt"
            ids = [(i * 7) % 200 + 10 for i in range(args.prompt_tokens)]
            n = 0
            async for _ in sm.generate(ids, max_tokens=args.tokens, source=rt, stop_at_eos=False):
                n += 1
                phase[0] = f"decode {n}"

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        anyio.run(run)
    finally:
        done.set()
        sampler.join()
    print(f"{'phase':<10} {'anon RSS MiB':>13} {'MLX active MiB':>15} {'MLX cache MiB':>14}  (largest of each)")
    for name in dict.fromkeys(p for p, *_ in samples):
        rows = [s for s in samples if s[0] == name]
        print(f"{name:<10} {max(r[1] for r in rows) / MIB:13.1f} {max(r[2] for r in rows) / MIB:15.1f} "
              f"{max(r[3] for r in rows) / MIB:14.1f}")


if __name__ == "__main__":
    main()
