"""The MoE architectures added in session 16: qwen2_moe, deepseek_v2, glm4_moe, phimoe, ernie4_5_moe,
dots1, hunyuan and bailing_moe, each exact against mlx-lm with every expert in memory.

Per architecture (a tiny random config of ``tests/_models_support.BASE``): greedy tokens over a
source of fewer rows than experts equal mlx-lm's, in per-layer steps (ShuffledSource: a real
ledger, random physical rows) and in queued steps (a Runtime over the converted store, rows for
one token's experts, so every MoE layer faults); the converted store loads back with the model's
MoE layers; routing replay forces the same ids on both sides. The architectures mlx-lm has that
the walk cannot follow exactly are refused naming the reason.
"""

from __future__ import annotations

import pathlib

import anyio
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.utils import save_config, save_model

from asyncside.bridge import completed
from asyncside.models import (
    ForwardOptions,
    RoutingTrace,
    convert_model,
    load_streaming_model,
    reference_generate,
    streaming_from_model,
)
from asyncside.models.arch import UnsupportedModelError, arch_for, moe_layers
from asyncside.models.forcing import force_reference, rewind_reference
from asyncside.routing import preset
from asyncside.runtime import Runtime

import _models_support as support
from _models_support import BASE, ShuffledSource, tiny_model

#: model type -> its decoder layers that are dense (not MoE) in the tiny config
NEW = {
    "qwen2_moe": [],
    "deepseek_v2": [0],
    "glm4_moe": [0],
    "phimoe": [],
    "ernie4_5_moe": [0],
    "dots1": [0],
    "hunyuan": [],
    "bailing_moe": [0],
}
PROMPT = 40  # 40 tokens x top-k >= 64 routed pairs: the prefill takes mlx-lm's sorted gather path
NEW_TOKENS = 8


def _prompt(config: dict, n: int = PROMPT, seed: int = 7) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, config["vocab_size"], n)]


def _store(tmp: pathlib.Path, model_type: str) -> tuple[pathlib.Path, object, dict]:
    model, config = tiny_model(model_type)
    save_model(tmp / "model", model)
    save_config(dict(config), tmp / "model" / "config.json")
    convert_model(tmp / "model", tmp / "store", resident_fraction=0.25, progress=False)
    return tmp / "store", model, config


@pytest.mark.parametrize("model_type", sorted(NEW))
def test_tiny_model_builds_with_its_moe_layers(model_type: str) -> None:
    model, config = tiny_model(model_type)
    assert config["model_type"] == model_type and model_type in BASE
    moe = moe_layers(model, arch_for(model_type))
    assert sorted(moe) == [i for i in range(len(model.layers)) if i not in NEW[model_type]]


@pytest.mark.parametrize("model_type", sorted(NEW))
def test_per_layer_steps_over_fewer_rows_than_experts(model_type: str) -> None:
    model, config = tiny_model(model_type)
    prompt = _prompt(config)
    ref = reference_generate(model, prompt, max_tokens=NEW_TOKENS)
    sm, pools = streaming_from_model(model, config, completed=completed,
                                     options=ForwardOptions(mode="per-layer"))

    async def main() -> ShuffledSource:
        src = ShuffledSource(pools, resident_fraction=0.25, side_rows=3, completed=completed, seed=1)
        got = [t async for t in sm.generate(prompt, max_tokens=NEW_TOKENS, source=src, predictor="lookahead")]
        await src.close()
        assert got == ref
        return src

    src = anyio.run(main)
    assert src.stats["demand_fills"] > 0 and src.open_leases() == 0 and src.audit() == []
    assert sm.forward.counters["per_layer"] > 0


@pytest.mark.parametrize("model_type", sorted(NEW))
def test_queued_steps_and_replay_over_the_converted_store(tmp_path: pathlib.Path, model_type: str) -> None:
    """The converted store loads back as the model (its MoE layers); queued steps over rows for one
    token's experts fault in every MoE layer and give mlx-lm's tokens; a routing trace replayed
    on both sides routes the trace's ids and still gives equal tokens."""
    store_dir, model, config = _store(tmp_path, model_type)
    prompt = _prompt(config, 12, seed=5)
    ref = reference_generate(model, prompt, max_tokens=NEW_TOKENS)
    sm = load_streaming_model(store_dir, completed=completed, options=ForwardOptions(mode="queued"))
    assert sm.arch.model_type == model_type
    assert sm.moe_layers == sorted(moe_layers(model, arch_for(model_type)))
    k = sm.forward.walk.top_k
    n_experts = sm.store.layer(sm.moe_layers[0]).n_experts

    async def run(trace: RoutingTrace | None = None) -> tuple[list[int], dict[int, int]]:
        async with Runtime(sm.store, resident=0.0, min_side_rows=k) as rt:
            tokens = [t async for t in sm.generate(prompt, max_tokens=NEW_TOKENS, source=rt, predictor="none",
                                                   trace=trace)]
            await rt.quiesce()
            assert all(r.ok for r in rt.audit().values())
            return tokens, {layer: rt.ledger(layer).stats["misses"] for layer in sm.moe_layers}

    tokens, misses = anyio.run(run)
    assert tokens == ref
    assert all(n > 0 for n in misses.values()), misses
    assert sm.forward.counters["queued"] > 0 and sm.forward.counters["fallbacks"] == 0

    path = tmp_path / "trace.npz"
    preset("low", tokens=len(prompt) + NEW_TOKENS - 3, n_layers=1, n_experts=n_experts + 3, top_k=k + 2,
           seed=3).save(path)
    replay = sm.set_routing(path)
    assert replay is not None
    free = model(mx.array(prompt)[None])
    force_reference(model, sm.arch.block_attr, replay)
    assert not mx.array_equal(model(mx.array(prompt)[None]), free).item()  # the replay changed the routing
    rewind_reference(model)
    forced_ref = reference_generate(model, prompt, max_tokens=NEW_TOKENS)
    trace = RoutingTrace()
    forced, _misses = anyio.run(run, trace)
    assert forced == forced_ref
    for layer in sm.moe_layers:
        got = trace.token_ids(layer)
        assert got.shape[0] >= len(prompt)
        assert np.array_equal(got, replay.host_ids(layer, 0, got.shape[0])), layer


@pytest.mark.parametrize(("model_type", "reason"), [
    ("llama4", "llama4: chunked attention masks are not supported"),
    ("granitemoe", "granitemoe: its residual_multiplier scales each MoE block's output"),
])
def test_architectures_the_walk_cannot_follow_are_refused(model_type: str, reason: str) -> None:
    with pytest.raises(UnsupportedModelError, match=reason):
        arch_for(model_type)


def test_hunyuan_cross_layer_attention_is_refused() -> None:
    base = BASE["hunyuan"]
    support.BASE["hunyuan"] = {**base, "use_cla": True}
    try:
        model, config = tiny_model("hunyuan")
    finally:
        support.BASE["hunyuan"] = base
    with pytest.raises(UnsupportedModelError, match=r"hunyuan: cross-layer attention \(use_cla\) is not supported"):
        streaming_from_model(model, config, completed=completed)


def test_hunyuan_routes_a_top_k_per_layer() -> None:
    """hunyuan's ``moe_topk`` may be a list, one top-k per layer: each block routes its own."""
    base = BASE["hunyuan"]
    support.BASE["hunyuan"] = {**base, "moe_topk": [2, 4]}
    try:
        model, config = tiny_model("hunyuan")
    finally:
        support.BASE["hunyuan"] = base
    assert [layer.mlp.top_k for layer in model.layers] == [2, 4]
    prompt = _prompt(config)
    ref = reference_generate(model, prompt, max_tokens=NEW_TOKENS)
    sm, pools = streaming_from_model(model, config, completed=completed, options=ForwardOptions(mode="per-layer"))
    assert sm.forward.walk.top_k == 4

    async def main() -> list[int]:
        src = ShuffledSource(pools, resident_fraction=0.25, side_rows=3, completed=completed, seed=2)
        got = [t async for t in sm.generate(prompt, max_tokens=NEW_TOKENS, source=src)]
        await src.close()
        return got

    assert anyio.run(main) == ref
