"""Policies on the default decode path: queued steps of the embedded model, victims picked by the
fault tables natively, each policy's hits as the runtime counts them (BENCHMARKS.md, "Policies
against Belady's MIN").

    python tools/policy_native.py --policies lrfu,adaptive-lrfu --rounds 2 --json out.json

Routings: the model's own (the bench generate prompt), and replayed 64x4 traces of 8 layers: eight
requests of their own topics interleaved token by token, and topic switches every 200-500 tokens.
Rounds alternate the policies' order (ABBA) so a drift of a shared machine favours none; each
round's hits are kept (they move by a few with timing), the hit rate and MB are their means.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time
from typing import Any

import anyio

from asyncside import ExpertStore, Runtime, load_streaming_model
from asyncside.bench.generate import DEFAULT_PROMPT, set_step_mode
from asyncside.demo import prompt_tokens
from asyncside.models.embedded import ensure_embedded_default
from asyncside.routing import RoutingTrace


def family(name: str) -> RoutingTrace:
    """A replayed routing of 64 experts, top-4, 8 layers, 512 tokens: ``topics`` or ``interleaved8``
    (the generators tests/test_policy_cost_20.py replays, seed 0)."""
    if name not in ("topics", "interleaved8"):
        raise ValueError(f"--routings: unknown family {name!r}; expected own, topics or interleaved8")
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tests"))
    from test_policy_cost_20 import _family

    trace: RoutingTrace = _family(name, 64, 4, tokens=512, layers=8)
    return trace


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policies", default="lrfu,adaptive-lrfu")
    ap.add_argument("--routings", default="own,interleaved8,topics")
    ap.add_argument("--residency", type=float, default=0.25)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default=None, help="write the rows here too")
    args = ap.parse_args()
    store_dir = str(ensure_embedded_default(progress=False)[1])
    store = ExpertStore.open(store_dir)
    sm = load_streaming_model(store_dir)
    set_step_mode(sm, "default")
    ids = prompt_tokens(sm.tokenizer, DEFAULT_PROMPT, store_dir)
    record = store.layer(next(iter(store.layers))).stride
    policies = args.policies.split(",")

    async def run(policy: str) -> dict[str, Any]:
        async with Runtime(store, resident=args.residency, policy=policy) as rt:
            toks: list[int] = []
            first: dict[str, Any] = {}
            t0 = 0.0
            async for t in sm.generate(ids, max_tokens=args.tokens, source=rt):
                toks.append(t)
                if len(toks) == 1:  # decode only, as bench generate counts: from the first token on
                    first, t0 = rt.stats().as_dict(), time.perf_counter()
            dt = time.perf_counter() - t0
            await rt.drain()
            st = rt.stats().as_dict()
        hits, misses = int(st["hits"]) - int(first["hits"]), int(st["misses"]) - int(first["misses"])
        steps = len(toks) - 1
        return {"hits": hits, "misses": misses, "hit_rate": hits / max(1, hits + misses),
                "miss_mb_per_token": misses * record / 1e6 / steps, "tok_s": steps / dt, "tokens": toks}

    rows: list[dict[str, Any]] = []
    for routing in args.routings.split(","):
        sm.set_routing(None if routing == "own" else family(routing))
        runs: dict[str, list[dict[str, Any]]] = {p: [] for p in policies}
        anyio.run(run, policies[0])  # warm-up: compile and page cache
        for r in range(args.rounds):
            for p in policies if r % 2 == 0 else policies[::-1]:
                runs[p].append(anyio.run(run, p))
        for p in policies:
            first, n = runs[p][0], len(runs[p])
            # Hits move by a few between rounds: a fault log is applied when the stream has run its
            # steps, so where a policy's decision lands depends on timing.
            row = {"routing": routing, "policy": p, "hits": [x["hits"] for x in runs[p]],
                   "misses": [x["misses"] for x in runs[p]],
                   "hit_rate": round(sum(x["hit_rate"] for x in runs[p]) / n, 4),
                   "miss_mb_per_token": round(sum(x["miss_mb_per_token"] for x in runs[p]) / n, 3),
                   "tok_s": [round(x["tok_s"], 2) for x in runs[p]],
                   "tokens_repeat": all(x["tokens"] == first["tokens"] for x in runs[p])}
            rows.append(row)
            print(json.dumps(row), flush=True)
    sm.set_routing(None)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"residency": args.residency, "tokens": args.tokens, "rounds": args.rounds, "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
