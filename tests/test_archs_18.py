"""The MoE architectures added in session 18: minimax (MiniMax-M2), deepseek (DeepSeek-MoE, v1),
glm4_moe_lite (GLM-4.7-Flash), mistral4 (Mistral-Small-4), Klear, exaone_moe (K-EXAONE), mellum,
laguna and mimo_v2_flash (MiMo-V2-Flash), each exact against mlx-lm with every expert in memory;
and the mlx-lm MoE architectures the decoder walk cannot follow, refused by name with the reason.

Per architecture (a tiny random config of ``tests/_models_support.BASE``), as tests/test_archs_16.py
proves its ten: greedy tokens over a source of fewer rows than experts equal mlx-lm's, in
per-layer steps (ShuffledSource: a real ledger, random physical rows) and in decode steps queued
whole; queued steps over a Runtime on the converted store (rows for one token's experts, so every
MoE layer faults); the converted store loads back with the model's MoE layers; routing replay
forces the same ids on both sides.
"""

from __future__ import annotations

import json
import pathlib

import mlx.core as mx
import mlx.nn as nn
import pytest
from _archs_support import (
    check_forced_routers,
    check_load_generates,
    check_queued_and_replay,
    check_steps_over_fewer_rows,
    converted_store,
    prompt_of,
)

from asyncside.bridge import completed
from asyncside.models import (
    convert_model,
    streaming_from_model,
)
from asyncside.models.arch import REFUSED, UnsupportedModelError, arch_for, moe_layers

from _models_support import BASE, tiny_model

#: model type -> its decoder layers that are dense (not MoE) in the tiny config
NEW = {
    "minimax": [],
    "deepseek": [0],
    "glm4_moe_lite": [0],
    "mistral4": [0],
    "Klear": [1],
    "exaone_moe": [0],
    "mellum": [],
    "laguna": [0],
    "mimo_v2_flash": [0],
}

#: a config's fields changed for decode steps queued whole: a sliding-window cache past its window
#: cannot be trimmed back, so such steps fall back to per-layer ones (asyncside.models.whole); with a
#: window longer than the generation they run whole
WHOLE_FIELDS: dict[str, dict[str, object]] = {
    **{t: {"sliding_window": 64} for t in ("exaone_moe", "mellum", "laguna")},
    "mimo_v2_flash": {"sliding_window_size": 64},
}


def _tiny(model_type: str, **fields: object) -> tuple[nn.Module, dict]:
    """``BASE[model_type]`` as tiny_model builds it, with ``fields`` changed."""
    before = BASE[model_type]
    BASE[model_type] = {**before, **fields}
    try:
        return tiny_model(model_type)
    finally:
        BASE[model_type] = before


@pytest.mark.parametrize("model_type", sorted(NEW))
def test_tiny_model_builds_with_its_moe_layers(model_type: str) -> None:
    model, config = tiny_model(model_type)
    assert config["model_type"] == model_type and model_type in BASE
    moe = moe_layers(model, arch_for(model_type))
    assert sorted(moe) == [i for i in range(len(model.layers)) if i not in NEW[model_type]]


def test_minimax_m2_is_built_as_minimax() -> None:
    """MiniMax-M2's config says minimax_m2, which mlx-lm builds with minimax's classes."""
    assert arch_for("minimax_m2").model_type == "minimax"


@pytest.mark.parametrize("model_type", sorted(NEW))
@pytest.mark.parametrize("mode", ["per-layer", "whole"])
def test_steps_over_fewer_rows_than_experts(model_type: str, mode: str) -> None:
    """Per-layer steps, and decode steps queued whole and checked after (layers redone where rows
    moved under them)."""
    model, config = _tiny(model_type, **(WHOLE_FIELDS.get(model_type, {}) if mode == "whole" else {}))
    check_steps_over_fewer_rows(model, config, prompt_of(config), mode)


@pytest.mark.parametrize("model_type", sorted(NEW))
def test_forced_router_scores_are_the_routers(model_type: str) -> None:
    """Forced to the ids its router picks, each block computes exactly its own output; forced
    elsewhere, another. The lookahead's wider guess holds the router's own ids."""
    model, config = tiny_model(model_type)
    check_forced_routers(model, config, model_type, experts=16)


@pytest.mark.parametrize("model_type", sorted(NEW))
def test_queued_steps_and_replay_over_the_converted_store(tmp_path: pathlib.Path, model_type: str) -> None:
    """The converted store loads back as the model (its MoE layers); queued steps over rows for one
    token's experts fault in every MoE layer and give mlx-lm's tokens; a routing trace replayed
    on both sides routes the trace's ids and still gives equal tokens."""
    model, config = tiny_model(model_type)
    store_dir = converted_store(tmp_path, model, config)
    check_queued_and_replay(tmp_path, model_type, store_dir, model, prompt_of(config, 12, seed=5))


@pytest.mark.parametrize("model_type", sorted(NEW))
def test_the_plans_top_k_is_the_models(model_type: str) -> None:
    from asyncside.runtime._forward_cost import config_top_k

    model, config = tiny_model(model_type)
    sm, _pools = streaming_from_model(model, config, completed=completed)
    assert config_top_k(config) == sm.forward.walk.top_k


@pytest.mark.parametrize("model_type", sorted(NEW))
def test_asyncside_load_generates_mlx_lms_tokens(tmp_path: pathlib.Path, model_type: str) -> None:
    """``asyncside.load`` of the mlx-lm model directory (converted to its cache, the model run on
    the facade's loop thread) generates mlx-lm's tokens through mlx-lm's own generate_step."""
    check_load_generates(tmp_path, *tiny_model(model_type))


#: the mlx-lm MoE architectures the walk cannot follow (hybrid linear attention, Mamba or convolution
#: layers, two attention sub-layers per layer, a router outside the MoE block)
UNFOLLOWABLE = ("bailing_moe_linear", "bailing_moe_v3", "gemma4_text", "granitemoehybrid", "jamba", "kimi_k3",
                "kimi_linear", "lfm2_moe", "longcat_flash", "nemotron_h", "qwen3_5_moe", "qwen3_next")


def test_every_refused_architecture_is_tested() -> None:
    """Each refused architecture has its case here or in tests/test_archs_19.py (those it added)."""
    from test_archs_19 import UNFOLLOWABLE_19

    assert sorted(REFUSED) == sorted((*UNFOLLOWABLE, *UNFOLLOWABLE_19))


@pytest.mark.parametrize("model_type", UNFOLLOWABLE)
def test_an_architecture_the_walk_cannot_follow_is_refused_by_name(tmp_path: pathlib.Path, model_type: str) -> None:
    """Converting (``asyncside convert``, ``asyncside.load``) a model of an mlx-lm MoE architecture
    the decoder walk cannot follow names its config file, the type and the reason, before mlx-lm
    builds anything; the reason is not the bare list of supported types."""
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({"model_type": model_type}))
    mx.save_safetensors(str(model_dir / "model.safetensors"), {"unread": mx.zeros((1,))})
    with pytest.raises(UnsupportedModelError) as info:
        convert_model(model_dir, tmp_path / "store", progress=False)
    message = str(info.value)
    assert str(model_dir / "config.json") in message
    assert f"model_type {model_type!r} is not supported: {REFUSED[model_type]}" in message
    assert "supported: [" not in message and not (tmp_path / "store").exists()


def test_the_cli_refuses_an_unfollowable_architecture_in_one_line(tmp_path: pathlib.Path) -> None:
    """``asyncside convert`` of a qwen3_next (hybrid linear attention) exits with one line naming
    the reason, no traceback."""
    import os
    import subprocess
    import sys

    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({"model_type": "qwen3_next"}))
    mx.save_safetensors(str(model_dir / "model.safetensors"), {"unread": mx.zeros((1,))})
    proc = subprocess.run([sys.executable, "-m", "asyncside", "convert", str(model_dir), str(tmp_path / "store")],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "TMPDIR": str(tmp_path)})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "gated delta net" in proc.stderr and "qwen3_next" in proc.stderr, proc.stderr


def test_the_new_types_are_supported_and_no_refused_one_is() -> None:
    from asyncside.models import SUPPORTED_MODEL_TYPES

    assert not set(REFUSED) & set(SUPPORTED_MODEL_TYPES)
    for model_type in NEW:
        assert model_type in SUPPORTED_MODEL_TYPES


@pytest.mark.parametrize("flags", [[True, False], "all", [1, 0, 1]])
def test_a_bench_shape_refuses_a_bad_is_moe_layer_in_one_line(flags: object) -> None:
    """EXAONE-MoE says which layers are MoE with ``is_moe_layer``, one flag per decoder layer: a
    bench shape read from a config takes those layers (tests/test_bench_shapes_archs_16.py) and
    names the field where the list does not give one flag per layer."""
    from asyncside.bench.shapes import ShapeError, qwen3_moe_config

    raw = {**BASE["exaone_moe"], "is_moe_layer": flags}
    with pytest.raises(ShapeError, match=r"config.json: is_moe_layer must be a list of 3 true/false flags, one "
                                         r"per decoder layer, got "):
        qwen3_moe_config(raw, "config.json")


@pytest.mark.parametrize("kinds", [["dense", "sparse"], ["dense", "moe", "sparse"], "sparse"])
def test_a_bench_shape_refuses_a_bad_mlp_layer_types_in_one_line(kinds: object) -> None:
    """Laguna says which layers are MoE with ``mlp_layer_types``: a list not one ``"dense"`` or
    ``"sparse"`` per decoder layer is refused naming the field."""
    from asyncside.bench.shapes import ShapeError, qwen3_moe_config

    raw = {**BASE["laguna"], "mlp_layer_types": kinds}
    with pytest.raises(ShapeError, match=r'config.json: mlp_layer_types must be a list of 3 "dense" or "sparse", '
                                         r"one per decoder layer, got "):
        qwen3_moe_config(raw, "config.json")


def test_a_laguna_bench_shape_without_mlp_layer_types_has_mlx_lms_dense_first_layer() -> None:
    from asyncside.bench.shapes import _moe_layers

    raw = {k: v for k, v in BASE["laguna"].items() if k != "mlp_layer_types"}
    model, _config = _tiny("laguna", mlp_layer_types=None)
    assert _moe_layers("config.json", raw, 3) == sorted(moe_layers(model, arch_for("laguna"))) == [1, 2]


def test_mimo_v2_flash_kv_layout_is_its_caches_layer_by_layer() -> None:
    """MiMo-V2-Flash's sliding layers have their own heads and head sizes and its values are
    narrower than its keys: the memory plan's KV layout (kv_layout) sized every layer as a
    full-attention one of head_dim keys and values, and never windowed its sliding layers."""
    from mlx_lm.models.cache import make_prompt_cache

    from asyncside.kv_layout import kv_layout

    model, config = tiny_model("mimo_v2_flash")
    cache = make_prompt_cache(model)
    model(mx.array([[1, 2, 3, 4]]), cache=cache)
    layout = kv_layout(config, 4)  # float32 keys and values
    assert layout.windows == (None, 8, 8)
    for i, c in enumerate(cache):
        arrays = [a for a in c.state if isinstance(a, mx.array)]
        assert sum(a.nbytes for a in arrays) == layout.per_token[i] * arrays[0].shape[-2], i


@pytest.mark.parametrize("pattern", [[0, 1], [0, 2, 1], None])
def test_a_bad_hybrid_layer_pattern_is_refused_in_one_line(pattern: object) -> None:
    from asyncside.errors import AsyncsideError
    from asyncside.kv_layout import kv_layout

    with pytest.raises(AsyncsideError, match=r"config.json: expected 'hybrid_layer_pattern' to give 3 flags"):
        kv_layout({**BASE["mimo_v2_flash"], "hybrid_layer_pattern": pattern}, 2)


@pytest.mark.parametrize("flags", [[0, 1], [0, 1, 2], [0.0, 1, 1], [False, True, True]])
def test_a_bench_shape_refuses_bad_moe_layer_freq_flags_in_one_line(flags: object) -> None:
    """MiMo-V2-Flash gives moe_layer_freq as one flag per layer (1: MoE): a bench shape takes those
    layers (tests/test_bench_shapes_archs_16.py) and names the field where the list is not that."""
    from asyncside.bench.shapes import ShapeError, qwen3_moe_config

    raw = {**BASE["mimo_v2_flash"], "moe_layer_freq": flags}
    with pytest.raises(ShapeError, match=r"config.json: moe_layer_freq must be a positive integer or a list of 3 "
                                         r"flags \(1 for an MoE layer, 0 for a dense one\), got "):
        qwen3_moe_config(raw, "config.json")
