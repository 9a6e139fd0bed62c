"""A decode batch under a memory plan that reads past the page cache (O_DIRECT): cut in parts
sorted by expert when its experts exceed a layer's lent rows, so each expert the batch routes is
read once per step; a prefill chunk is not cut (it goes layer by layer); and the bound on such a
batch's tokens at 0 (the default) leaves the batch to one-row steps.

The embedded model (top-4, four lent rows per layer at ``resident=0.0``) decodes a batch of four
rows replaying two disjoint sets of experts, A, B, A, B (forced ids): eight distinct experts per
layer, twice the rows. Cut by whole tokens, every part would evict the previous part's experts and
each expert would be read twice; sorted, each is read once.
"""

from __future__ import annotations

from typing import Any

import anyio
import mlx.core as mx
import numpy as np
import pytest

from asyncside.models import load_streaming_model
from asyncside.models.forcing import RoutingReplay, RowsReplay
from asyncside.models.forward import StepMode
from asyncside.routing import RoutingTrace as TraceFile
from asyncside.runtime import Runtime
from asyncside.runtime._queued import DIRECT_DECODE_TOKENS, direct_decode_tokens
from asyncside.serving import embedded_store_dir
from asyncside.serving.step_shapes import StepShapes

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

TOKENS = 4  # positions of each replayed sequence


@pytest.fixture(scope="module")
def sm() -> Any:
    return load_streaming_model(embedded_store_dir())


def _replays(sm: Any) -> tuple[RoutingReplay, RoutingReplay]:
    """Sequence 0 routes experts 0..k-1 at every position of every layer, sequence 1 k..2k-1."""
    k, layers = sm.forward.walk.top_k, len(sm.moe_layers)
    n_experts = sm.store.layer(sm.moe_layers[0]).n_experts
    ids = np.zeros((2 * TOKENS, layers, k), dtype=np.uint32)
    ids[:TOKENS] = np.arange(k, dtype=np.uint32)
    ids[TOKENS:] = np.arange(k, 2 * k, dtype=np.uint32)
    trace = TraceFile(ids, np.array([TOKENS, TOKENS]), n_experts, {})
    a = RoutingReplay(trace, moe_layers=sm.moe_layers, n_experts=n_experts, top_k=k, sequence=0)
    return a, a.with_sequence(1)


def _runtime(sm: Any) -> Runtime:
    return Runtime(sm.store, resident=0.0, min_side_rows=sm.forward.walk.top_k, direct=True)


def test_a_decode_batch_past_the_page_cache_reads_each_expert_it_routes_once(
        sm: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASYNCSIDE_DIRECT_DECODE_TOKENS", "16")  # off by default (see DIRECT_DECODE_TOKENS)
    a, b = _replays(sm)
    rows = [(a, 0), (b, 0), (a, 0), (b, 0)]
    fwd, k, n_layers = sm.forward, sm.forward.walk.top_k, len(sm.moe_layers)
    tokens = mx.array([[5], [9], [5], [9]], dtype=mx.int32)

    async def main() -> tuple[np.ndarray, list[np.ndarray], dict[str, int], dict[str, int]]:
        async with _runtime(sm) as rt:
            assert rt.plan is not None and rt.plan.direct
            assert rt.plan.rows == {i: k for i in sm.moe_layers}  # eight distinct experts: twice the rows
            before = dict(fwd.counters)
            ctx = fwd.context(sm.make_cache(), rt)
            ctx.routing, ctx.position = RowsReplay(rows), 0
            assert fwd.kind(ctx, tokens) is StepMode.QUEUED
            start = rt.stats()
            out = await fwd.step(ctx, tokens)
            await fwd.finish(ctx, out)
            batched = np.array(out[:, -1, :].astype(mx.float32))
            end = rt.stats()
            read = {key: int(end[key] - start[key]) for key in ("faults", "misses")}
            spent = {key: fwd.counters[key] - before.get(key, 0) for key in fwd.counters}
            alone = []
            for (replay, pos), t in zip(rows, tokens.tolist()):
                c = fwd.context(sm.make_cache(), rt)
                c.routing, c.position = RowsReplay([(replay, pos)]), 0
                y = await fwd.step(c, mx.array([t], dtype=mx.int32))
                await fwd.finish(c, y)
                alone.append(np.array(y[0, -1, :].astype(mx.float32)))
        return batched, alone, read, spent

    batched, alone, read, spent = anyio.run(main)
    # Each of the 2k distinct experts of every layer read once (the pools start empty); cut by
    # whole tokens it would be 4k per layer.
    assert read["faults"] == 2 * k * n_layers, read
    assert spent["sorted_parts"] > 0 and spent.get("token_parts", 0) == 0, spent
    assert [int(np.argmax(row)) for row in batched] == [int(np.argmax(row)) for row in alone]
    np.testing.assert_allclose(batched, np.stack(alone), rtol=1e-4, atol=1e-4)


def test_past_the_page_cache_a_prefill_chunk_is_not_cut_and_the_decode_bound_can_be_zero(
        sm: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASYNCSIDE_DIRECT_DECODE_TOKENS", "16")

    async def main() -> tuple[bool, bool, bool, bool, int]:
        async with _runtime(sm) as rt:
            shapes = StepShapes(sm, rt)
            # two prompt tokens' experts may exceed the rows: that chunk goes layer by layer
            chunk, batch = shapes.queued((1, 2)), shapes.queued((4, 1))
            apart = shapes.rows_apart(4)
            monkeypatch.setenv("ASYNCSIDE_DIRECT_DECODE_TOKENS", "0")
            apart_at_zero = shapes.rows_apart(4)
            capacity_at_zero = rt.queued_capacity(4)
        return chunk, batch, apart, apart_at_zero, capacity_at_zero

    chunk, batch, apart, apart_at_zero, capacity_at_zero = anyio.run(main)
    assert not chunk and batch and not apart
    assert apart_at_zero and capacity_at_zero == 0


def test_the_direct_decode_bound_reads_its_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from asyncside.errors import AsyncsideError

    monkeypatch.delenv("ASYNCSIDE_DIRECT_DECODE_TOKENS", raising=False)
    assert direct_decode_tokens() == DIRECT_DECODE_TOKENS
    monkeypatch.setenv("ASYNCSIDE_DIRECT_DECODE_TOKENS", "3")
    assert direct_decode_tokens() == 3
    for bad in ("-1", "many"):
        monkeypatch.setenv("ASYNCSIDE_DIRECT_DECODE_TOKENS", bad)
        with pytest.raises(AsyncsideError, match="ASYNCSIDE_DIRECT_DECODE_TOKENS: expected a token count >= 0"):
            direct_decode_tokens()
