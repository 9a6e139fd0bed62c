"""The walk's other users follow every architecture as asyncside's forward does: the bench's slot
cache (slot_forward) and pipeline stages (each rank's model, its first stage's embedding), with
bailing_moe's word_embeddings and ``attention`` sub-layer, hunyuan's attention returning its keys
and values too, granitemoe's multipliers and llama4's nested text model."""

from __future__ import annotations

import pathlib

import anyio
import numpy as np
import pytest
from test_archs_16 import _store
from test_distributed import _stages

from asyncside.bridge import completed
from asyncside.models import load_streaming_model, reference_generate

NEW_TOKENS = 6


@pytest.mark.parametrize("model_type", ["bailing_moe", "granitemoe", "hunyuan", "llama4", "qwen2_moe"])
def test_slot_cache_and_pipeline_stages_give_the_reference_tokens(tmp_path: pathlib.Path, model_type: str) -> None:
    from asyncside.bench.slot_cache import SlotCache, slot_generate
    from asyncside.store import ExpertStore

    store_dir, model, config = _store(tmp_path, model_type)
    prompt = [int(t) for t in np.random.default_rng(5).integers(0, config["vocab_size"], 20)]
    ref = reference_generate(model, prompt, max_tokens=NEW_TOKENS)
    sm = load_streaming_model(store_dir, completed=completed)
    with SlotCache(ExpertStore.open(store_dir), 0.25) as sc:
        assert list(slot_generate(sm, sc, prompt, max_tokens=NEW_TOKENS)) == ref
        assert sc.stats()["misses"] > 0
    n_layers = len(model.layers)
    tokens, _logits = anyio.run(_stages, store_dir, prompt, NEW_TOKENS, [1, n_layers - 1])
    assert tokens == ref
