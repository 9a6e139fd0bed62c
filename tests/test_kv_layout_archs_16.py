"""kv_layout's bytes per position match what mlx-lm's caches of every supported architecture
allocate per position (full-attention layers of the tiny test models)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from asyncside.kv_layout import kv_layout

from _models_support import BASE, tiny_model


def _arrays(state: Any) -> list[mx.array]:
    """The arrays of a cache's state, a CacheList's (nested lists: deepseek_v32's indexer) flattened."""
    if isinstance(state, mx.array):
        return [state]
    if isinstance(state, (list, tuple)):
        return [a for s in state for a in _arrays(s)]
    return []


@pytest.mark.parametrize("model_type", sorted(BASE))
def test_kv_layout_matches_the_caches(model_type: str) -> None:
    model, config = tiny_model(model_type)
    cache = make_prompt_cache(model)
    model(mx.array([[1, 2, 3, 4]]), cache=cache)
    layout = kv_layout(config, 4)  # float32 keys and values
    for i, (c, window) in enumerate(zip(cache, layout.windows)):
        if window is not None:
            continue
        arrays = _arrays(c.state)
        positions = arrays[0].shape[-2]  # allocated positions (a step of them)
        assert sum(a.nbytes for a in arrays) == layout.per_token[i] * positions, (model_type, i)


def test_replay_on_an_in_memory_ernie_model() -> None:
    """ernie4_5_moe's config names its expert count moe_num_experts: a model without a store
    (streaming_from_model) still fits a trace to it."""
    from asyncside.bridge import completed
    from asyncside.models import streaming_from_model
    from asyncside.routing import preset

    model, config = tiny_model("ernie4_5_moe")
    sm, _pools = streaming_from_model(model, config, completed=completed)
    replay = sm.set_routing(preset("low", tokens=8, n_layers=1, n_experts=8, top_k=6, seed=3))
    assert replay is not None and replay.n_experts == config["moe_num_experts"]
