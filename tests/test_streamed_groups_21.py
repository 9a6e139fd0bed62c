"""A streamed switch computes its slots in growing groups, one ``finish_rows`` node a group.

One group a slot, a switch of many small records (a fine-grained MoE's, Qwen3-Next-like) built a
fault node and a gather a slot in every layer, whose loop-thread and stream CPU cost more a token
than grouped. Groups of 1, 1, 2, 3, ... slots keep the overlap of a layer's reads with its compute
(asyncside/models/queued.py, slot_groups; BENCHMARKS.md, "Fine-grained records") at about the
square root of the nodes; the tokens stay mlx-lm's.
"""

from __future__ import annotations

import math
import pathlib

import anyio
import mlx.core as mx
import pytest
from _fault_helpers import model_store

from asyncside.bridge import completed
from asyncside.models import ForwardOptions, load_streaming_model, reference_generate
from asyncside.models.queued import slot_groups
from asyncside.runtime import Runtime

STREAMED = ForwardOptions(mode="queued", streamed_switch=True)
NEW_TOKENS = 6


def test_slot_groups_grow_by_one_and_cover_every_slot() -> None:
    assert slot_groups(1) == [1]
    assert slot_groups(2) == [1, 1]
    assert slot_groups(3) == [1, 1, 1]
    assert slot_groups(4) == [1, 1, 2]
    assert slot_groups(8) == [1, 1, 2, 3, 1]
    assert slot_groups(10) == [1, 1, 2, 3, 3]
    for k in range(1, 65):
        sizes = slot_groups(k)
        assert sum(sizes) == k and min(sizes) >= 1
        # the first two single, then every group but the last one larger than the one before
        assert sizes[:-1] == ([1] + list(range(1, len(sizes) - 1)))[:len(sizes) - 1]
        assert len(sizes) <= math.ceil(math.sqrt(2 * k)) + 1


def test_a_streamed_switch_builds_one_finish_node_a_group(tmp_path: pathlib.Path) -> None:
    if mx.default_device() == mx.gpu:
        pytest.skip("streamed switches are the CPU stream's (host pools)")
    store_dir, model, prompt = model_store(tmp_path, "qwen3_moe", {"group_size": 64, "bits": 4})
    ref = reference_generate(model, prompt, max_tokens=NEW_TOKENS)
    sm = load_streaming_model(store_dir, completed=completed, options=STREAMED)
    k = int(sm.forward.walk.top_k)
    assert k == 4  # groups 1, 1, 2: fewer nodes than slots
    finishes: list[int] = []

    async def main() -> list[int]:
        async with Runtime(sm.store, resident=0.0, min_side_rows=k) as rt:
            real = rt.finish_rows

            def counted(layer: int, ids: mx.array, rows: mx.array) -> mx.array:
                finishes.append(int(ids.shape[-1]))
                return real(layer, ids, rows)

            rt.finish_rows = counted  # type: ignore[method-assign]
            tokens = [t async for t in sm.generate(prompt, max_tokens=NEW_TOKENS, source=rt)]
            await rt.quiesce()
            reports = rt.audit()
            assert all(r.ok for r in reports.values()), {l: r.problems for l, r in reports.items()}
            return tokens

    tokens = anyio.run(main)
    assert tokens == ref
    switches = sm.forward_with(STREAMED).counters["streamed_switches"]
    assert switches >= (NEW_TOKENS - 1) * len(sm.moe_layers)
    assert len(finishes) == switches * len(slot_groups(k))  # one node a group, not one a slot
    assert finishes[:len(slot_groups(k))] == slot_groups(k)
