"""The compute ceiling of batched decoding: one decode step of B rows of the all-resident mlx-lm
model (every expert in memory, no reads), each row routed to its own sequence of a routing trace.

Row ``b`` replays the trace's sequence ``b`` at position ``--position`` (as the serving engine
replays request ``b``'s), after a prefill of that many tokens; the median of ``--steps`` timed
single-token steps. What 8 clients can gain over one when nothing is read from the disk: the
aggregate tokens/s of B rows over that of one row. Needs the model in memory (no budget).

    .venv/bin/python tools/serve_batch_cost.py STORE TRACE.npz [--batches 1,2,4,8] [--json]
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from asyncside.argtypes import int_at_least
from asyncside.models import load_reference_model, load_streaming_model
from asyncside.models.forcing import ForcedBlock, RowsReplay, sequence_replays


def batch_costs(store: str, trace: str, batches: list[int], position: int = 16, steps: int = 5) -> dict[str, Any]:
    """Per batch size: the median step time, tokens/s, and distinct experts per MoE layer."""
    model, _ = load_reference_model(store)
    sm = load_streaming_model(store)
    replay = sm.set_routing(trace)
    sm.set_routing(None)
    assert replay is not None
    seqs = sequence_replays(replay)
    if max(batches) > len(seqs):
        raise SystemExit(f"{trace}: {len(seqs)} sequences, fewer than the largest batch {max(batches)}")
    attr = sm.arch.block_attr
    out: dict[str, Any] = {}
    for b in batches:
        rows = RowsReplay([(seqs[i], 0) for i in range(b)])
        blocks = []
        for i in replay.moe_layers:
            layer = model.layers[i]
            block = getattr(layer, attr)
            block = block.block if isinstance(block, ForcedBlock) else block
            blocks.append(ForcedBlock(block, i, rows))
            setattr(layer, attr, blocks[-1])
        cache = make_prompt_cache(model)
        prompt = mx.array(np.random.default_rng(0).integers(0, 500, (b, position)))
        mx.eval(model(prompt, cache=cache))  # each block counts the positions it routed
        distinct = float(np.mean([len(np.unique(rows.host_ids(i, position, 1))) for i in replay.moe_layers]))
        times = []
        for _ in range(steps + 1):  # the first step is not timed
            t = time.perf_counter()
            mx.eval(model(mx.array([[7]] * b), cache=cache))
            times.append(time.perf_counter() - t)
        step = float(np.median(times[1:]))
        out[str(b)] = {"step_s": step, "tokens_per_s": b / step, "distinct_experts_per_layer": distinct}
    one = out[str(batches[0])]["tokens_per_s"]
    for v in out.values():
        v["vs_first"] = v["tokens_per_s"] / one
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("store")
    p.add_argument("trace")
    p.add_argument("--batches", default="1,2,4,8")
    p.add_argument("--position", type=int, default=16)
    p.add_argument("--steps", type=int_at_least(2), default=5)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    out = batch_costs(args.store, args.trace, [int(x) for x in args.batches.split(",")], args.position, args.steps)
    if args.json:
        print(json.dumps(out, indent=1))
        return
    for b, v in out.items():
        print(f"B={b}: step {v['step_s']:.3f} s, {v['tokens_per_s']:.2f} tok/s ({v['vs_first']:.2f}x), "
              f"{v['distinct_experts_per_layer']:.1f} distinct experts per layer")


if __name__ == "__main__":
    main()
