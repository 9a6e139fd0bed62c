"""Bench shapes read every supported architecture's config.json as its model builds it: the MoE
layers mlx-lm makes MoE layers, the experts and the top-k (ERNIE 4.5 names them moe_num_experts,
moe_k and a range of MoE layers)."""

from __future__ import annotations

from typing import Any

import pytest
from test_archs_16 import LLAMA4, _tiny

from asyncside.bench.shapes import _moe_layers, qwen3_moe_config
from asyncside.models.arch import arch_for, moe_layers
from asyncside.models.walk import DecoderWalk

from _models_support import BASE


@pytest.mark.parametrize("model_type", [*sorted(BASE), "llama4"])
def test_a_shape_has_the_models_moe_layers_experts_and_top_k(model_type: str) -> None:
    raw = dict(LLAMA4 if model_type == "llama4" else BASE[model_type])
    model, _config = _tiny(model_type)
    moe = moe_layers(model, arch_for(model_type))
    scope = raw.get("text_config", raw)
    assert _moe_layers("config.json", scope, len(model.layers)) == sorted(moe)
    cfg, _notes = qwen3_moe_config(raw, "config.json")
    walk = DecoderWalk(model, arch_for(model_type), moe, {})
    assert cfg["num_experts_per_tok"] == walk.top_k
    block, attr = next(iter(moe.values()))
    switch = getattr(block, attr)
    first = switch.gate_proj if "gate_proj" in switch else switch.fc1
    assert cfg["num_experts"] == first.weight.shape[0]


#: four layers of each: the per-layer lists its tiny config gives for three
_FOUR_LAYERS: dict[str, dict[str, object]] = {
    "afmoe": {"layer_types": ["full_attention", "sliding_attention", "full_attention", "full_attention"]},
    "step3p5": {"layer_types": None, "partial_rotary_factors": None, "swiglu_limits": None,
                "swiglu_limits_shared": None},
}


@pytest.mark.parametrize(("model_type", "field"), [("afmoe", "num_dense_layers"), ("step3p5", "moe_layers_enum")])
def test_a_shape_without_its_moe_layer_field_has_mlx_lms_default(model_type: str, field: str) -> None:
    """Without num_dense_layers mlx-lm's afmoe makes its first two layers dense; without
    moe_layers_enum its step3p5 every layer but the first: a bench shape reads them as it builds them."""
    fields = {"num_hidden_layers": 4, **_FOUR_LAYERS[model_type]}
    raw = {k: v for k, v in {**BASE[model_type], **fields}.items() if k != field and v is not None}
    built = _tiny_without(model_type, field, fields)
    assert len(built.layers) == 4
    assert _moe_layers("config.json", raw, 4) == sorted(moe_layers(built, arch_for(model_type)))


def _tiny_without(model_type: str, field: str, fields: dict[str, object]) -> Any:
    """The tiny model of ``model_type`` with ``fields`` changed and ``field`` (and the fields set to
    None) left out of its config, as mlx-lm builds it then."""
    import _models_support as support

    before = support.BASE[model_type]
    support.BASE[model_type] = {k: v for k, v in {**before, **fields}.items() if k != field and v is not None}
    try:
        return support.tiny_model(model_type)[0]
    finally:
        support.BASE[model_type] = before


@pytest.mark.parametrize("enum", ["1,x", "1,7", 3, ["1", "2"]])
def test_a_bad_moe_layers_enum_is_refused_in_one_line(enum: object) -> None:
    from asyncside.bench.shapes import ShapeError

    with pytest.raises(ShapeError, match=r"config.json: moe_layers_enum"):
        _moe_layers("config.json", {**BASE["step3p5"], "moe_layers_enum": enum}, 3)
