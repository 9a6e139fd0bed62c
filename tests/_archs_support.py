"""What tests/test_archs_16.py and test_archs_18.py prove of each architecture they add, once:
greedy tokens over fewer rows than experts, forced routers, queued steps and routing replay over
the converted store, and ``asyncside.load``; each file keeps its architectures and their configs."""

from __future__ import annotations

import pathlib
from typing import Any

import anyio
import mlx.core as mx
import mlx.nn as nn
import numpy as np
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
from asyncside.models.arch import arch_for, moe_layers
from asyncside.models.forcing import force_reference, forced_block_call, rewind_reference
from asyncside.models.pooled import SORT_THRESHOLD, route
from asyncside.routing import preset

from _models_support import ShuffledSource, queued_tokens

NEW_TOKENS = 8


def prompt_of(config: dict[str, Any], n: int = 40, seed: int = 7) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, config["vocab_size"], n)]


def save_model_dir(where: pathlib.Path, model: nn.Module, config: dict[str, Any]) -> pathlib.Path:
    """``model`` and its config saved as an mlx-lm model directory ``where``."""
    save_model(where, model)
    save_config(dict(config), where / "config.json")
    return where


def converted_store(tmp: pathlib.Path, model: nn.Module, config: dict[str, Any]) -> pathlib.Path:
    """``model`` saved under ``tmp/model`` and converted to the store ``tmp/store``."""
    convert_model(save_model_dir(tmp / "model", model, config), tmp / "store", resident_fraction=0.25, progress=False)
    return tmp / "store"


def check_steps_over_fewer_rows(model: nn.Module, config: dict[str, Any], prompt: list[int], mode: str) -> None:
    """Greedy tokens over a ShuffledSource of fewer rows than experts equal mlx-lm's, in per-layer
    steps or decode steps queued whole and checked after (some redone)."""
    ref = reference_generate(model, prompt, max_tokens=NEW_TOKENS)
    options = ForwardOptions(mode=mode)
    sm, pools = streaming_from_model(model, config, completed=completed, options=options)
    assert len(prompt) * sm.forward.walk.top_k >= SORT_THRESHOLD

    async def main() -> ShuffledSource:
        src = ShuffledSource(pools, resident_fraction=0.25, side_rows=3, completed=completed, seed=1,
                             churn=mode == "whole")
        got = [t async for t in sm.generate(prompt, max_tokens=NEW_TOKENS, source=src, predictor="lookahead")]
        await src.close()
        assert got == ref
        return src

    src = anyio.run(main)
    assert src.stats["demand_fills"] > 0 and src.open_leases() == 0 and src.audit() == []
    counters = sm.forward_with(options).counters
    if mode == "whole":
        assert counters["optimistic"] == NEW_TOKENS and counters["optimistic_redone"] > 0
    else:
        assert counters["per_layer"] > 0


def check_forced_routers(model: nn.Module, config: dict[str, Any], model_type: str, *, experts: int,
                         widens: bool = True) -> None:
    """Forced to the ids its router picks, each block computes exactly its own output; forced to
    the next ids (modulo ``experts``), another. The lookahead's two more guesses (none where the
    router does not widen) hold the router's own ids."""
    sm, _pools = streaming_from_model(model, config, completed=completed)
    x = mx.array(np.random.default_rng(1).standard_normal((1, 9, config["hidden_size"])).astype(np.float32))
    for layer, (block, _attr) in moe_layers(model, arch_for(model_type)).items():
        pooled_block, pooled_attr = sm._moe[layer]
        inds = route(pooled_block, pooled_attr, x)[1]
        assert mx.array_equal(block(x), forced_block_call(block, x, inds)).item(), layer
        other = (inds + 1) % experts
        assert not mx.array_equal(block(x), forced_block_call(block, x, other.astype(inds.dtype))).item()
        k = inds.shape[-1]
        wide = sm.forward.walk.route_ids(layer, x, 2)
        assert wide.shape[-1] == (k + 2 if widens else k)
        for a, b in zip(np.asarray(inds).reshape(-1, k), np.asarray(wide).reshape(-1, wide.shape[-1])):
            assert set(a.tolist()) <= set(b.tolist())


def check_queued_and_replay(tmp: pathlib.Path, model_type: str, store_dir: pathlib.Path, model: nn.Module,
                            prompt: list[int]) -> None:
    """The converted store loads back as the model (its MoE layers); queued steps over rows for one
    token's experts fault in every MoE layer and give mlx-lm's tokens; a routing trace replayed on
    both sides routes the trace's ids and still gives equal tokens."""
    ref = reference_generate(model, prompt, max_tokens=NEW_TOKENS)
    sm = load_streaming_model(store_dir, completed=completed, options=ForwardOptions(mode="queued"))
    assert sm.arch.model_type == model_type
    assert sm.moe_layers == sorted(moe_layers(model, arch_for(model_type)))
    k = sm.forward.walk.top_k
    n_experts = sm.store.layer(sm.moe_layers[0]).n_experts

    tokens, misses = anyio.run(queued_tokens, sm, prompt, NEW_TOKENS, k)
    assert tokens == ref
    assert all(n > 0 for n in misses.values()), misses
    assert sm.forward.counters["queued"] > 0 and sm.forward.counters["fallbacks"] == 0

    path = tmp / "trace.npz"
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
    forced, _misses = anyio.run(queued_tokens, sm, prompt, NEW_TOKENS, k, trace)
    assert forced == forced_ref
    for layer in sm.moe_layers:
        got = trace.token_ids(layer)
        assert got.shape[0] >= len(prompt)
        assert np.array_equal(got, replay.host_ids(layer, 0, got.shape[0])), layer


def check_load_generates(tmp: pathlib.Path, model: nn.Module, config: dict[str, Any]) -> None:
    """``asyncside.load`` of the model's mlx-lm directory (converted to its cache, the model run on
    the facade's loop thread) generates mlx-lm's tokens through mlx-lm's own generate_step."""
    from mlx_lm.generate import generate_step

    from asyncside import load
    from asyncside.models.tokenizer import save_byte_level_tokenizer

    save_byte_level_tokenizer(save_model_dir(tmp / "model", model, config))
    prompt = prompt_of(config, 20)
    ref = reference_generate(model, prompt, max_tokens=NEW_TOKENS)
    lm, _tokenizer = load(tmp / "model", cache_dir=tmp / "cache", progress=False)
    try:
        got = [int(y) for y, _ in generate_step(mx.array(prompt), lm, max_tokens=NEW_TOKENS)]
    finally:
        lm.close()
    assert got == ref
