"""llama4's chunked-attention caches decoding as one batch (:class:`BatchChunkedKVCache`, kept merged
by the engine's :class:`BatchCaches`): each row's logits are mlx-lm's for that sequence alone.

A tiny llama4 (chunks of 8 positions, three chunked layers and a global one; its attention
temperature made to vary with the position, so each row's own positions matter in the global layer
too; plain rotary embeddings, and Llama-4-Scout's llama3 scaling) prefills four prompts alone in chunks of 8, some past one chunk (their caches dropped their
front), some not; their caches merge and decode together through asyncside's walk of the model,
rows crossing chunk boundaries mid-way, one row dropped and another joined between steps. Every
step, each row's logits equal mlx-lm's ``model(tokens, cache)`` of that row alone (float32
tolerance, same greedy token), and a row extracted from the batch is the cache it would hold alone.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from _archs_support import prompt_of
from mlx_lm.models.cache import ChunkedKVCache, KVCache
from test_archs_16 import LLAMA4, _tiny

from asyncside.models.arch import arch_for
from asyncside.models.chunked_batch import BatchChunkedKVCache
from asyncside.serving.batch_caches import BatchCaches, mergeable

CHUNK = 8


#: Llama-4-Scout's rotary scaling (its config's rope_scaling), beside the tiny config's none
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
               "original_max_position_embeddings": 64}


@pytest.fixture(scope="module", params=["plain-rope", "llama3-rope"])
def model(request: pytest.FixtureRequest) -> nn.Module:
    fields = {} if request.param == "plain-rope" else {
        "text_config": {**LLAMA4["text_config"], "rope_scaling": LLAMA3_ROPE}}  # type: ignore[dict-item]
    model, _config = _tiny("llama4", **fields)
    for layer in model.language_model.model.layers:
        layer.self_attn.floor_scale = 4  # the global layer's query scale changes every 4 positions
    return model


def _walk(model: nn.Module, tokens: mx.array, cache: list[Any]) -> mx.array:
    """Logits of ``tokens`` through asyncside's walk of the model (its masks and attention, the
    model's own blocks): what the engine's forward computes, without the expert source."""
    arch = arch_for("llama4")
    inner = arch.inner(model)
    h = inner.embed_tokens(tokens)
    masks = arch.masks(model, h, cache)
    for i, layer in enumerate(inner.layers):
        h = h + arch.attention(layer, layer.input_layernorm(h), masks[i], cache[i])
        h = h + layer.feed_forward(layer.post_attention_layernorm(h))
    return model.language_model.lm_head(inner.norm(h))


def _prefilled(model: nn.Module, prompt: list[int]) -> list[Any]:
    """mlx-lm's cache of ``prompt`` fed in chunks of 8 (its chunked layers drop their front as they go)."""
    cache = model.make_cache()
    for i in range(0, len(prompt), CHUNK):
        mx.eval(model(mx.array([prompt[i:i + CHUNK]]), cache=cache))
    return cache


def _same_cache(got: list[Any], alone: list[Any]) -> None:
    for g, a in zip(got, alone):
        assert type(g) is type(a)
        if isinstance(a, ChunkedKVCache):
            assert (g.start_position, g.offset, g.chunk_size) == (a.start_position, a.offset, a.chunk_size)
            n = a.offset - a.start_position
        else:
            assert g.offset == a.offset
            n = a.offset
        assert g.keys.shape[2] == n
        np.testing.assert_allclose(np.array(g.keys), np.array(a.keys[..., :n, :]), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.array(g.values), np.array(a.values[..., :n, :]), rtol=1e-5, atol=1e-5)


def test_merged_chunked_caches_decode_as_each_row_alone(model: nn.Module) -> None:
    lengths = [19, 5, 9, 3, 12]  # the last joins later
    prompts = [prompt_of({"vocab_size": 128}, n, seed=20 + i) for i, n in enumerate(lengths)]
    alone = [_prefilled(model, p) for p in prompts]
    mine = [_prefilled(model, p) for p in prompts]
    # Fed 8, 8 then 3: kept 8 on, one chunk behind; fed 8 then 1: kept all 9.
    assert [(c[0].start_position, c[0].offset) for c in alone[:3]] == [(8, 19), (0, 5), (0, 9)]
    assert mergeable(alone[0]) and isinstance(alone[0][3], KVCache)
    nxt = [int(mx.argmax(model(mx.array([p[-1:]]), cache=_prefilled(model, p[:-1]))[0, -1])) for p in prompts]

    batch = BatchCaches()
    rows = [0, 1, 2, 3]  # sequence of each row of the batch, in order
    batch.join([mine[i] for i in rows])
    assert batch.tracked and all(isinstance(batch.layers[i], BatchChunkedKVCache) for i in (0, 1, 2))
    crossed = set()
    for step in range(12):
        if step == 4:  # sequence 2 leaves: its own cache back, as alone
            _same_cache(batch.extract(rows.index(2)), alone[2])
            batch.drop([rows.index(2)])
            rows.remove(2)
        if step == 6:  # sequence 4 joins, its cache prefilled alone
            batch.join([mine[4]])
            rows.append(4)
        tokens = mx.array([[nxt[i]] for i in rows])
        logits = _walk(model, tokens, batch.layers)[:, -1, :]
        for r, i in enumerate(rows):
            ref = model(mx.array([[nxt[i]]]), cache=alone[i])[0, -1, :]
            np.testing.assert_allclose(np.array(logits[r]), np.array(ref), rtol=1e-4, atol=1e-4)
            assert int(mx.argmax(logits[r])) == int(mx.argmax(ref))
            pos = alone[i][0].offset - 1  # the position this step fed
            if pos % CHUNK == 0 and pos > 0:
                crossed.add(i)
            nxt[i] = int(mx.argmax(ref))
    assert {0, 1, 3, 4} <= crossed  # rows entered a new chunk while decoding in the batch
    for r, i in enumerate(rows):
        got = batch.extract(r)
        _same_cache(got, alone[i])
        # The extracted cache decodes on alone as the row's own does.
        a = model(mx.array([[nxt[i]]]), cache=alone[i])
        b = model(mx.array([[nxt[i]]]), cache=got)
        np.testing.assert_allclose(np.array(b), np.array(a), rtol=1e-4, atol=1e-4)


def test_batch_cache_holds_each_window_plus_padding() -> None:
    """Memory stays bounded: decoding far past a chunk, the buffer holds no more columns than the
    longest row's window plus one growth step; rows dropped free the front they alone needed."""
    big, small = ChunkedKVCache(CHUNK), ChunkedKVCache(CHUNK)
    for c, n in ((big, 30), (small, 2)):
        for _ in range(n):
            c.maybe_trim_front()
            c.update_and_fetch(mx.ones((1, 1, 1, 2)), mx.ones((1, 1, 1, 2)))
    b = BatchChunkedKVCache.merge([big, small])
    assert b.size() == CHUNK + 1 and b.starts == [big.start_position, 0]
    for _ in range(600):
        b.maybe_trim_front()
        b.make_mask(1)
        b.update_and_fetch(mx.ones((2, 1, 1, 2)), mx.ones((2, 1, 1, 2)))
        assert b.keys is not None and b.keys.shape[2] <= CHUNK + 1 + b.step
    assert b.offsets == [630, 602] and b.starts == [630 - 1 - CHUNK, 602 - 1 - CHUNK]
    e = b.extract(1)
    assert (e.start_position, e.offset, e.keys.shape[2]) == (602 - 1 - CHUNK, 602, CHUNK + 1)
