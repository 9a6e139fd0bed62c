"""The pools' least rows per layer follow the model's top-k, so a model that routes few of few
experts (top-2 of 8, as Mixtral) streams instead of holding every expert."""

from __future__ import annotations

import json
import pathlib

import anyio
from _fault_helpers import model_store

from asyncside import ExpertStore
from asyncside.bridge import completed
from asyncside.models import load_streaming_model, reference_generate
from asyncside.runtime import Runtime
from asyncside.runtime._plan import DEFAULT_MIN_ROWS, min_rows, plan_layer, store_top_k


def test_a_top_2_model_streams_with_two_rows_a_layer(tmp_path: pathlib.Path) -> None:
    """Converted from a top-2-of-8 model, the store records its top-k; the runtime's default plan
    at resident=0 gives each layer 2 rows (the old fixed floor of 8 was every expert: nothing
    streamed), the slot cache's sizing agrees, and the tokens equal mlx-lm's with misses."""
    store_dir, model, prompt = model_store(tmp_path, "mixtral", None)
    store = ExpertStore.open(store_dir)
    assert store.metadata["asyncside_model"]["top_k"] == {str(layer): 2 for layer in store.layers}
    assert min_rows(store) == 2
    assert all(plan_layer(store, layer, 0.0) == ([], 2) for layer in store.layers)
    ref = reference_generate(model, prompt, max_tokens=8)
    sm = load_streaming_model(store_dir, completed=completed)

    async def main() -> tuple[list[int], dict, dict]:
        async with Runtime(sm.store, resident=0.0) as rt:
            tokens = [t async for t in sm.generate(prompt, max_tokens=8, source=rt)]
            await rt.quiesce()
            assert all(r.ok for r in rt.audit().values())
            return tokens, dict(rt.memory["rows"]), dict(rt.stats())

    tokens, rows, stats = anyio.run(main)
    assert set(rows.values()) == {2}, rows
    assert tokens == ref
    assert stats["misses"] > 0  # two rows of eight: the run streamed


def test_top_k_from_the_config_beside_the_manifest_else_the_default(tmp_path: pathlib.Path) -> None:
    """A store converted before the top-k was recorded reads it from its model's config.json;
    a store that says nothing keeps the default floor."""
    store_dir, _model, _prompt = model_store(tmp_path, "mixtral", None)
    store = ExpertStore.open(store_dir)
    model_meta = {k: v for k, v in store.metadata["asyncside_model"].items() if k != "top_k"}
    older = ExpertStore(store.path, store.layers, {**store.metadata, "asyncside_model": model_meta})
    assert store_top_k(older) == 2 and min_rows(older) == 2
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text(json.dumps({"model_type": "olmoe", "num_experts": 64}))  # no top-k field
    assert store_top_k(ExpertStore(bare, store.layers, {})) is None
    assert min_rows(ExpertStore(bare, store.layers, {})) == DEFAULT_MIN_ROWS
    (bare / "config.json").write_text(json.dumps({"text_config": {"num_experts_per_tok": 6}}))
    assert min_rows(ExpertStore(bare, store.layers, {})) == 6
    (bare / "config.json").write_text("{not json")
    assert min_rows(ExpertStore(bare, store.layers, {})) == DEFAULT_MIN_ROWS
