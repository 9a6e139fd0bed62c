"""The MoE architectures added in session 16: qwen2_moe, deepseek_v2, glm4_moe, phimoe, ernie4_5_moe,
dots1, hunyuan, bailing_moe, llama4 and granitemoe, each exact against mlx-lm with every expert in memory.

Per architecture (a tiny random config of ``tests/_models_support.BASE``; llama4's is :data:`LLAMA4`,
see there): greedy tokens over a
source of fewer rows than experts equal mlx-lm's, in per-layer steps (ShuffledSource: a real
ledger, random physical rows) and in queued steps (a Runtime over the converted store, rows for
one token's experts, so every MoE layer faults); the converted store loads back with the model's
MoE layers; routing replay forces the same ids on both sides. A configuration the walk cannot
follow exactly (hunyuan's cross-layer attention) is refused naming the reason.
"""

from __future__ import annotations

import contextlib
import pathlib
from collections.abc import Iterator

import anyio
import mlx.nn as nn
import pytest
from _archs_support import (
    NEW_TOKENS,
    check_forced_routers,
    check_load_generates,
    check_queued_and_replay,
    check_steps_over_fewer_rows,
    converted_store,
    prompt_of,
)

from asyncside.bridge import completed
from asyncside.models import (
    ForwardOptions,
    reference_generate,
    streaming_from_model,
)
from asyncside.models.arch import UnsupportedModelError, arch_for, moe_layers

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
    "llama4": [0, 2],
    "granitemoe": [],
}

#: llama4's tiny config, kept out of BASE: mlx-lm's llama4 routes top-1, so the 40-token prompts of
#: test_models never reach mlx-lm's sorted gather (64 routed pairs) that those tests assert. Four
#: layers: three chunked-attention layers (chunks of 8 positions) and a global one, MoE every
#: other layer. The top-level vocab_size and hidden_size serve the tests' prompts only.
LLAMA4 = dict(
    model_type="llama4", vocab_size=128, hidden_size=64,
    text_config=dict(
        model_type="llama4_text", attention_bias=False, attention_chunk_size=8, head_dim=16, hidden_size=64,
        interleave_moe_layer_step=2, intermediate_size=64, intermediate_size_mlp=128,
        max_position_embeddings=512, num_attention_heads=4, num_experts_per_tok=1, num_hidden_layers=4,
        num_key_value_heads=2, num_local_experts=8, rms_norm_eps=1e-5, rope_scaling=None, rope_theta=10000.0,
        use_qk_norm=True, vocab_size=128,
    ),
)


def _prompt_len(model_type: str) -> int:
    # top-k x tokens >= 64 routed pairs: the prefill takes mlx-lm's sorted gather path (and a
    # llama4 prompt spans several attention chunks, so its caches drop their front)
    return 70 if model_type == "llama4" else 40


@contextlib.contextmanager
def _config(model_type: str, **fields: object) -> Iterator[None]:
    """BASE[model_type] as tiny_model builds it, with ``fields`` changed (llama4: :data:`LLAMA4`; the
    multimodal wrappers: tests/test_archs_19.py's CONFIGS)."""
    from test_archs_19 import CONFIGS  # the wrappers of tests/test_archs_19.py, not in BASE

    before = support.BASE.get(model_type)
    support.BASE[model_type] = {**(before if before is not None else CONFIGS.get(model_type, LLAMA4)), **fields}
    try:
        yield
    finally:
        if before is None:
            del support.BASE[model_type]
        else:
            support.BASE[model_type] = before


def _tiny(model_type: str, **fields: object) -> tuple[nn.Module, dict]:
    with _config(model_type, **fields):
        return tiny_model(model_type)


def _store(tmp: pathlib.Path, model_type: str) -> tuple[pathlib.Path, nn.Module, dict]:
    """The tiny model of ``model_type`` (llama4: :data:`LLAMA4`), converted under ``tmp``."""
    model, config = _tiny(model_type)
    return converted_store(tmp, model, config), model, config


@pytest.mark.parametrize("model_type", sorted(NEW))
def test_tiny_model_builds_with_its_moe_layers(model_type: str) -> None:
    model, config = _tiny(model_type)
    assert config["model_type"] == model_type and (model_type in BASE) == (model_type != "llama4")
    moe = moe_layers(model, arch_for(model_type))
    assert sorted(moe) == [i for i in range(len(model.layers)) if i not in NEW[model_type]]


@pytest.mark.parametrize("model_type", sorted(NEW))
@pytest.mark.parametrize("mode", ["per-layer", "whole"])
def test_steps_over_fewer_rows_than_experts(model_type: str, mode: str) -> None:
    """Per-layer steps, and decode steps queued whole and checked after (layers redone where rows
    moved under them: the KV caches trimmed back, llama4's chunked ones too)."""
    model, config = _tiny(model_type)
    check_steps_over_fewer_rows(model, config, prompt_of(config, _prompt_len(model_type)), mode)


@pytest.mark.parametrize("model_type", sorted(NEW))
def test_forced_router_scores_are_the_routers(model_type: str) -> None:
    """Forced to the ids its router picks, each block computes exactly its own output; forced
    elsewhere, another. The lookahead's wider guess holds the router's own ids (llama4's router,
    whose top-1 score scales the switch input, is not widened)."""
    model, config = _tiny(model_type)
    # every tiny config routes among 8 experts or more
    check_forced_routers(model, config, model_type, experts=8, widens=model_type != "llama4")


@pytest.mark.parametrize("model_type", sorted(NEW))
def test_queued_steps_and_replay_over_the_converted_store(tmp_path: pathlib.Path, model_type: str) -> None:
    """The converted store loads back as the model (its MoE layers); queued steps over rows for one
    token's experts fault in every MoE layer and give mlx-lm's tokens; a routing trace replayed
    on both sides routes the trace's ids and still gives equal tokens."""
    store_dir, model, config = _store(tmp_path, model_type)
    check_queued_and_replay(tmp_path, model_type, store_dir, model,
                            prompt_of(config, 20 if model_type == "llama4" else 12, seed=5))


def test_hunyuan_cross_layer_attention_is_refused() -> None:
    model, config = _tiny("hunyuan", use_cla=True)
    with pytest.raises(UnsupportedModelError, match=r"hunyuan: cross-layer attention \(use_cla\) is not supported"):
        streaming_from_model(model, config, completed=completed)


def test_hunyuan_routes_a_top_k_per_layer() -> None:
    """hunyuan's ``moe_topk`` may be a list, one top-k per layer: each block routes its own."""
    model, config = _tiny("hunyuan", moe_topk=[2, 4])
    assert [layer.mlp.top_k for layer in model.layers] == [2, 4]
    prompt = prompt_of(config)
    ref = reference_generate(model, prompt, max_tokens=NEW_TOKENS)
    sm, pools = streaming_from_model(model, config, completed=completed, options=ForwardOptions(mode="per-layer"))
    assert sm.forward.walk.top_k == 4

    async def main() -> list[int]:
        src = ShuffledSource(pools, resident_fraction=0.25, side_rows=3, completed=completed, seed=2)
        got = [t async for t in sm.generate(prompt, max_tokens=NEW_TOKENS, source=src)]
        await src.close()
        return got

    assert anyio.run(main) == ref


def test_granitemoe_blocks_are_scaled_once() -> None:
    """A walk handed another walk's blocks (a pipeline stage's, over its model's layers) keeps them
    as they are: each MoE output is multiplied by its layer's residual factor once."""
    from asyncside.models.walk import DecoderWalk

    model, config = _tiny("granitemoe")
    sm, _pools = streaming_from_model(model, config, completed=completed)
    walk = sm.forward.walk
    again = DecoderWalk(model, sm.arch, walk.moe, walk.specs)
    for i, (block, _attr) in walk.moe.items():
        assert again.moe[i][0] is block and block.scale == config["residual_multiplier"]
        assert type(block.block).__name__ == "GraniteMoeMoE"


@pytest.mark.parametrize("model_type", sorted(NEW))
def test_the_plans_top_k_is_the_models(model_type: str) -> None:
    """The memory plan and the serving admission read the router's top-k from the config
    (config_top_k): for ernie4_5_moe (``moe_k``) it fell back to a default, and for a hunyuan that
    lists one top-k per layer it found none; each must be the top-k the model routes."""
    from asyncside.runtime._forward_cost import config_top_k

    fields = {"moe_topk": [2, 4]} if model_type == "hunyuan" else {}
    model, config = _tiny(model_type, **fields)
    sm, _pools = streaming_from_model(model, config, completed=completed)
    assert config_top_k(config) == sm.forward.walk.top_k


@pytest.mark.parametrize("model_type", ["deepseek_v2", "hunyuan", "qwen2_moe"])
def test_asyncside_load_runs_on_its_own_thread(tmp_path: pathlib.Path, model_type: str) -> None:
    """``asyncside.load``'s model runs its forwards on the facade's loop thread. deepseek_v2's and
    hunyuan's rotary frequencies were left lazy by the model's construction on this thread, and
    MLX's streams belong to the thread that made them: mlx-lm's generate over them failed at the
    first token with "There is no Stream(cpu, 0) in current thread"."""
    check_load_generates(tmp_path, *_tiny(model_type))
