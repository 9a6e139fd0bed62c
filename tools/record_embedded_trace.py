"""Record the embedded model's routing (prompt and greedy decode, three prompts, one sequence
each) as a routing-trace file (docs/routing-traces.md), for ``asyncside bench policy --trace``.

    python tools/record_embedded_trace.py TOKENS OUT.npz
"""

from __future__ import annotations

import sys

import anyio
import numpy as np

from asyncside.models import RoutingTrace, load_streaming_model
from asyncside.models.embedded import ensure_embedded_default
from asyncside.routing import RoutingTrace as FileTrace

PROMPTS = ("Once upon a time, in a city by the sea, there lived", "def fib(n):\n    ",
           "The history of the Roman empire")


def main(argv: list[str]) -> int:
    if len(argv) != 2 or not argv[0].isdigit():
        print(__doc__, file=sys.stderr)
        return 2
    tokens, out = int(argv[0]), argv[1]
    _, store_dir = ensure_embedded_default(progress=False)
    sm = load_streaming_model(store_dir)
    src = sm.resident_source()
    parts = []
    n_experts = 0
    for prompt in PROMPTS:
        ids = list(sm.tokenizer.encode(prompt))
        rec = RoutingTrace()

        async def go(ids: list[int] = ids, rec: RoutingTrace = rec) -> list[int]:
            return [t async for t in sm.generate(ids, max_tokens=tokens, source=src, trace=rec)]

        anyio.run(go)
        n_experts = sm.store.layer(rec.layers[0]).n_experts
        parts.append(rec.to_file_trace(n_experts).ids)
    trace = FileTrace(np.concatenate(parts), np.array([len(p) for p in parts]), n_experts,
                      {"source": "recorded", "model": sm.model_id, "prompts": list(PROMPTS), "max_tokens": tokens})
    trace.save(out)
    print(f"{out}: {trace.n_tokens} tokens, {trace.n_layers} layers, top-{trace.top_k} of {trace.n_experts}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
