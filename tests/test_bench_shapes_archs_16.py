"""Bench shapes read every supported architecture's config.json as its model builds it: the MoE
layers mlx-lm makes MoE layers, the experts and the top-k (ERNIE 4.5 names them moe_num_experts,
moe_k and a range of MoE layers)."""

from __future__ import annotations

import pytest
from test_archs_16 import LLAMA4, _tiny

from asyncside.bench.shapes import _moe_layers, qwen3_moe_config
from asyncside.models.arch import arch_for, moe_layers
from asyncside.models.walk import DecoderWalk

from _models_support import BASE

#: architectures whose MoE layers the bench shapes do not read yet (afmoe's num_dense_layers,
#: step3p5's moe_layers_enum): strict, so the case fails once they do and this set is emptied
SHAPES_PENDING = {"afmoe", "step3p5"}


@pytest.mark.parametrize("model_type", [
    pytest.param(t, marks=pytest.mark.xfail(strict=True, reason="bench shapes do not read its MoE layers yet"))
    if t in SHAPES_PENDING else t for t in [*sorted(BASE), "llama4"]])
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
