"""The MoE architectures added in session 19: deepseek_v32 (DeepSeek-V3.2, its attention's indexer
keeping a cache of its own beside the latent keys; GLM-5's glm_moe_dsa builds it), afmoe (its
layers norm each sub-layer's output and the MoE input apart, its embeddings scaled under muP),
step3p5 (Step-3.5, sliding layers with their own heads, a clamped SwiGLU); solar_open, which
mlx-lm builds with glm4_moe's classes; and the mlx-lm MoE architectures the decoder walk cannot
follow, refused by name with the reason.

Per architecture, a tiny random config, proven as tests/test_archs_18.py proves its nine: greedy
tokens over a source of fewer rows than experts equal mlx-lm's in per-layer steps and in decode
steps queued whole; queued steps over a Runtime on the converted store (rows for one token's
experts, so every MoE layer faults); the converted store loads back with the model's MoE layers;
routing replay forces the same ids on both sides; ``asyncside.load`` generates mlx-lm's tokens.
"""

from __future__ import annotations

import importlib
import json
import pathlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import anyio
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
    save_model_dir,
)

from asyncside.bridge import completed
from asyncside.models import convert_model, streaming_from_model
from asyncside.models.arch import ALIASES, ARCHS, REFUSED, UnsupportedModelError, arch_for, moe_layers

from _models_support import BASE, reference_logits, shuffled_logits, tiny_model

#: model type -> its tiny config: the three architectures' of ``tests/_models_support.BASE`` (so
#: tests/test_models.py, test_queued, test_routing_replay and test_serve_archs_16 run them too), and
#: the two aliases' (deepseek_v32's under GLM-5's name, glm4_moe's under Solar-Open's)
CONFIGS: dict[str, dict[str, Any]] = {t: BASE[t] for t in ("deepseek_v32", "afmoe", "step3p5")}
# Multimodal wrappers of a supported text model (its config under text_config; the width and the
# vocabulary also at the top, where the tests read them): Kimi-VL's and Kimi-K2.5's deepseek_v3,
# Qwen3-VL-MoE's qwen3_moe, Mistral 3's mistral4. Not in BASE, whose tests read a text model's
# fields at the top of its config (tests/test_archs_16.py's _config serves them from here).
CONFIGS["kimi_vl"] = dict(model_type="kimi_vl", vocab_size=128, hidden_size=64,
                          text_config={**BASE["deepseek_v3"], "model_type": "deepseek_v3"})
CONFIGS["kimi_k25"] = dict(model_type="kimi_k25", vocab_size=128, hidden_size=64,
                           text_config={**BASE["deepseek_v3"], "model_type": "deepseek_v3"})
CONFIGS["qwen3_vl_moe"] = dict(model_type="qwen3_vl_moe", vocab_size=128, hidden_size=64,
                               text_config={**BASE["qwen3_moe"], "model_type": "qwen3_vl_moe_text"})
CONFIGS["mistral3"] = dict(model_type="mistral3", vocab_size=128, hidden_size=64, text_config=dict(BASE["mistral4"]))
CONFIGS["glm_moe_dsa"] = {
    **BASE["deepseek_v32"],
    "model_type": "glm_moe_dsa", "topk_method": "noaux_tc", "scoring_func": "sigmoid", "moe_layer_freq": 1,
    "rms_norm_eps": 1e-6, "attention_bias": False, "rope_parameters": {"rope_theta": 10000.0, "type": "default"},
}
CONFIGS["solar_open"] = {**BASE["glm4_moe"], "model_type": "solar_open"}

#: model type -> its decoder layers that are dense (not MoE) in the tiny config
DENSE = {"deepseek_v32": [0], "afmoe": [0], "step3p5": [0], "glm_moe_dsa": [0], "solar_open": [0], "kimi_vl": [0],
         "kimi_k25": [0], "qwen3_vl_moe": [1], "mistral3": [0]}

#: a config's fields changed for decode steps queued whole: a sliding-window cache past its window
#: cannot be trimmed back, so such steps fall back to per-layer ones; with a window longer than the
#: generation they run whole
WHOLE_FIELDS: dict[str, dict[str, object]] = {t: {"sliding_window": 64} for t in ("afmoe", "step3p5")}


@contextmanager
def _in_base(model_type: str, **fields: object) -> Iterator[None]:
    """``CONFIGS[model_type]`` (with ``fields`` changed) as ``BASE[model_type]`` while it lasts (the
    aliases' configs are not in BASE: other tests take BASE's types as supported ones)."""
    before = BASE.get(model_type)
    BASE[model_type] = {**CONFIGS[model_type], **fields}
    try:
        yield
    finally:
        if before is None:
            del BASE[model_type]
        else:
            BASE[model_type] = before


def _tiny(model_type: str, **fields: object) -> tuple[nn.Module, dict[str, Any]]:
    with _in_base(model_type, **fields):
        return tiny_model(model_type)


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_tiny_model_builds_with_its_moe_layers(model_type: str) -> None:
    model, config = _tiny(model_type)
    assert config["model_type"] == model_type
    moe = moe_layers(model, arch_for(model_type))
    assert sorted(moe) == [i for i in range(len(model.layers)) if i not in DENSE[model_type]]


def test_the_aliases_are_built_with_the_classes_of_the_architecture_they_name() -> None:
    """solar_open's mlx-lm module builds glm4_moe's Model, glm_moe_dsa's a subclass of
    deepseek_v32's adding nothing the walk sees: each is walked as that one."""
    for alias, target in ALIASES.items():
        assert target in ARCHS and alias not in ARCHS and alias not in REFUSED
        built = importlib.import_module(f"mlx_lm.models.{alias}").Model
        assert issubclass(built, importlib.import_module(f"mlx_lm.models.{target}").Model), alias
        assert arch_for(alias) is ARCHS[target]


def test_every_mlx_lm_module_building_a_supported_model_is_an_alias() -> None:
    """Any mlx-lm model module whose Model is, or subclasses, a supported architecture's Model under
    another name is in ALIASES (or is itself supported or refused)."""
    import pkgutil

    import mlx_lm.models

    supported = {t: importlib.import_module(f"mlx_lm.models.{t}").Model for t in ARCHS}
    found = set()
    for info in pkgutil.iter_modules(mlx_lm.models.__path__):
        if info.name in ARCHS or info.name in REFUSED:
            continue
        try:
            module = importlib.import_module(f"mlx_lm.models.{info.name}")
        except (Exception, SystemExit):  # a module needing what this environment lacks (olmo exits)
            continue
        built = getattr(module, "Model", None)
        if isinstance(built, type) and any(issubclass(built, m) for m in supported.values()):
            found.add(info.name)
    assert found == set(ALIASES)


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
@pytest.mark.parametrize("mode", ["per-layer", "whole"])
def test_steps_over_fewer_rows_than_experts(model_type: str, mode: str) -> None:
    """Per-layer steps, and decode steps queued whole and checked after (layers redone where rows
    moved under them)."""
    model, config = _tiny(model_type, **(WHOLE_FIELDS.get(model_type, {}) if mode == "whole" else {}))
    check_steps_over_fewer_rows(model, config, prompt_of(config), mode)


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_a_prompt_fed_in_chunks_gives_mlx_lms_logits(model_type: str) -> None:
    """A cache continued by a second prompt chunk, then decoded: each layer's mask is built from a
    cache already holding keys (deepseek_v32's from the latent cache inside its CacheList, mlx-lm's
    own choice; the sliding layers' from their windows), and the logits equal mlx-lm's bit for bit."""
    model, config = _tiny(model_type)
    prompt = prompt_of(config, 30, seed=4)
    steps = [prompt[:12], prompt[12:], [3], [5]]
    ref = reference_logits(model, steps)
    sm, pools = streaming_from_model(model, config, completed=completed)
    got = anyio.run(shuffled_logits, sm, pools, steps, "per-layer")
    for i, (want, have) in enumerate(zip(ref, got)):
        assert mx.array_equal(want, have).item(), (model_type, i)


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_forced_router_scores_are_the_routers(model_type: str) -> None:
    """Forced to the ids its router picks, each block computes exactly its own output; forced
    elsewhere, another. The lookahead's wider guess holds the router's own ids."""
    model, config = _tiny(model_type)
    check_forced_routers(model, config, model_type, experts=16)


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_a_lookahead_past_the_experts_names_every_expert(model_type: str) -> None:
    """A wider lookahead asked for more experts than a layer has names all of them (Mistral 3's
    count is in its text model's configuration: the router's partition failed, "invalid kth")."""
    model, config = _tiny(model_type)
    sm, pools = streaming_from_model(model, config, completed=completed)
    x = mx.random.normal((1, 3, config["hidden_size"]), key=mx.random.key(0))
    for layer in sm.moe_layers:
        experts = next(iter(pools[layer].values())).shape[0]
        assert sm.forward.walk.route_ids(layer, x, 10_000).shape[-1] == experts, layer


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_queued_steps_and_replay_over_the_converted_store(tmp_path: pathlib.Path, model_type: str) -> None:
    """The converted store loads back as the model (its MoE layers); queued steps over rows for one
    token's experts fault in every MoE layer and give mlx-lm's tokens; a routing trace replayed
    on both sides routes the trace's ids and still gives equal tokens."""
    model, config = _tiny(model_type)
    store_dir = converted_store(tmp_path, model, config)
    check_queued_and_replay(tmp_path, arch_for(model_type).model_type, store_dir, model, prompt_of(config, 12, seed=5))


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_asyncside_load_generates_mlx_lms_tokens(tmp_path: pathlib.Path, model_type: str) -> None:
    """``asyncside.load`` of the mlx-lm model directory (converted to its cache, the model run on
    the facade's loop thread) generates mlx-lm's tokens through mlx-lm's own generate_step."""
    check_load_generates(tmp_path, *_tiny(model_type))


#: the mlx-lm MoE architectures the walk cannot follow, added to arch.REFUSED in this session
UNFOLLOWABLE_19 = ("bailing_hybrid", "dbrx", "deepseek_v41", "gemma4", "longcat_flash_ngram", "muse_spark",
                   "phixtral", "prism_hadamard_qwen35", "qwen3_5")


@pytest.mark.parametrize("model_type", UNFOLLOWABLE_19)
def test_an_architecture_the_walk_cannot_follow_is_refused_by_name(tmp_path: pathlib.Path, model_type: str) -> None:
    """Converting a model of an mlx-lm architecture the decoder walk cannot follow names its config
    file, the type and the reason, before mlx-lm builds anything."""
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


def test_a_mistral3_of_a_dense_text_model_is_refused_naming_it() -> None:
    """Mistral 3's wrapper routes experts only with a mistral4 text model; with a dense one the
    walk refuses it naming the text model's type."""
    dense = dict(model_type="llama", vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5)
    model, _config = _tiny("mistral3", text_config=dense)
    with pytest.raises(UnsupportedModelError, match=r"^mistral3: its text model \('llama' in text_config\) is a "
                                                     r"dense model; only a mistral4 text model routes experts$"):
        moe_layers(model, arch_for("mistral3"))


def test_converting_a_mistral3_of_a_dense_text_model_names_its_layers(tmp_path: pathlib.Path) -> None:
    """``asyncside convert`` of such a model says it has no MoE layer among its text model's layers
    (it said 'among its num_hidden_layers None', reading the wrapper's top level)."""
    from asyncside.errors import StoreError

    dense = dict(model_type="llama", vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5)
    model, config = _tiny("mistral3", text_config=dense)
    model_dir = save_model_dir(tmp_path / "model", model, config)
    with pytest.raises(StoreError, match=r"config.json: no MoE layer among its num_hidden_layers 2: asyncside "
                                         r"streams the experts of MoE layers, a dense model has none$"):
        convert_model(model_dir, tmp_path / "store", progress=False)
    assert not (tmp_path / "store").exists()


def test_the_new_types_are_supported_and_listed() -> None:
    from asyncside.models import SUPPORTED_MODEL_TYPES
    from asyncside.models.arch import remapped_model_types

    for model_type in ("deepseek_v32", "afmoe", "step3p5", "kimi_vl", "kimi_k25", "qwen3_vl_moe", "mistral3"):
        assert model_type in SUPPORTED_MODEL_TYPES
    assert {"solar_open", "glm_moe_dsa"} <= set(remapped_model_types())
    assert not set(UNFOLLOWABLE_19) & set(SUPPORTED_MODEL_TYPES)
    with pytest.raises(UnsupportedModelError, match="solar_open"):
        arch_for("dense_llama_like")  # the list of what is supported names the aliases too


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_the_plans_top_k_is_the_models(model_type: str) -> None:
    """The memory plan's top-k, read from the config, is the one the walk routes (step3p5 names it
    moe_top_k: the plan took its default for it)."""
    from asyncside.runtime._forward_cost import config_top_k

    model, config = _tiny(model_type)
    sm, _pools = streaming_from_model(model, config, completed=completed)
    assert config_top_k(config) == sm.forward.walk.top_k


@pytest.mark.parametrize("layer_types", [["full_attention", "sliding_attention", "full_attention"], None])
def test_step3p5_kv_layout_is_its_caches_layer_by_layer(layer_types: object) -> None:
    """Step-3.5 names its key-value heads num_attention_groups, and its sliding layers (by
    layer_types, or without them every even layer) take theirs from attention_other_setting: the
    memory plan's KV layout sized every layer by num_attention_heads and windowed none without
    layer_types."""
    from mlx_lm.models.cache import make_prompt_cache

    from asyncside.kv_layout import kv_layout

    fields = {} if layer_types is not None else {"layer_types": None}
    model, config = _tiny("step3p5", **fields)
    config = {k: v for k, v in config.items() if v is not None}
    cache = make_prompt_cache(model)
    model(mx.array([[1, 2, 3, 4]]), cache=cache)
    layout = kv_layout(config, 4)  # float32 keys and values
    sliding = [layer.is_sliding for layer in model.layers]
    assert layout.windows == tuple(8 if s else None for s in sliding)
    assert sliding == ([False, True, False] if layer_types is not None else [True, False, True])
    for i, c in enumerate(cache):
        arrays = [a for a in c.state if isinstance(a, mx.array)]
        assert sum(a.nbytes for a in arrays) == layout.per_token[i] * arrays[0].shape[-2], i


@pytest.mark.parametrize(("field", "value"), [("attention_other_setting", [2, 1]),
                                              ("attention_other_setting", {"num_attention_groups": 0}),
                                              ("layer_types", ["full_attention"]), ("num_attention_groups", None)])
def test_a_bad_step3p5_kv_field_is_refused_in_one_line(field: str, value: object) -> None:
    from asyncside.errors import AsyncsideError
    from asyncside.kv_layout import kv_layout

    with pytest.raises(AsyncsideError, match=r"^config.json(: attention_other_setting)?: expected '"):
        kv_layout({**BASE["step3p5"], field: value}, 2)
