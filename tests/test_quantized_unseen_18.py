"""Quantizations a downloaded model has and the repo's other tests do not, converted and streamed.

mlx-community models are made by mlx-lm's ``convert`` with other bits, group sizes and modes
(``--q-bits``, ``--q-group-size``, ``--q-mode``) or per-module recipes (``--quant-predicate``
mixed_*: per-path entries in config.json's "quantization"). Each tiny model here is quantized by
mlx-lm's own ``quantize_model``, saved as mlx-lm saves it, converted with ``convert_model`` and
loaded with ``load_streaming_model``: its greedy tokens equal ``mlx_lm``'s ``load_model`` of the
same directory over fewer rows than experts, served per layer and queued by the real runtime.
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable
from typing import Any

import anyio
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.convert import mixed_quant_predicate_builder
from mlx_lm.utils import load_model, quantize_model, save_config, save_model

from asyncside.bridge import completed
from asyncside.cli import main
from asyncside.models import ForwardOptions, load_streaming_model, reference_generate, streaming_from_model
from asyncside.models.arch import UnsupportedModelError
from asyncside.models.convert import convert_model, resident_sets
from asyncside.runtime import Runtime

from _models_support import ShuffledSource, reference_logits, shuffled_logits, store_pools, tiny_model

#: MLX CUDA's quantized matmul of several tokens is wrong at one group per row (tests/test_convert.py)
QMM_WRONG_HERE = mx.default_device() == mx.gpu and bool(getattr(mx, "cuda", None) and mx.cuda.is_available())

Predicate = Callable[[str, nn.Module], bool | dict[str, Any]]


def _experts_of_layer(layer: int, params: dict[str, Any] | bool) -> Predicate:
    """Experts of ``layer`` quantized with ``params`` (False: left float), everything else default."""
    def pred(path: str, m: nn.Module) -> bool | dict[str, Any]:
        if f".layers.{layer}." in path and ("switch_mlp" in path or ".experts." in path):
            return params
        return True
    return pred


def _router_at_8_bits(path: str, m: nn.Module) -> bool | dict[str, Any]:
    if path.endswith(".gate") or path.endswith(".router"):
        return {"group_size": 64, "bits": 8, "mode": "affine"}
    return True


def _one_switch_mixed(path: str, m: nn.Module) -> bool | dict[str, Any]:
    """Within each switch: up at five bits in groups of 32, gate mxfp4, down left float."""
    if "switch_mlp" in path or ".experts." in path:
        if path.endswith("up_proj"):
            return {"group_size": 32, "bits": 5, "mode": "affine"}
        if path.endswith("gate_proj"):
            return {"group_size": 32, "bits": 4, "mode": "mxfp4"}
        return not path.endswith("down_proj")
    return True


# name -> (group size, bits, mode, predicate or recipe)
CASES: dict[str, tuple[int, int, str, Any]] = {
    "affine-8bit": (64, 8, "affine", None),
    "affine-g32": (32, 4, "affine", None),
    "affine-g128": (128, 4, "affine", None),  # matrices narrower than a group stay float
    "mxfp8": (32, 8, "mxfp8", None),
    "nvfp4": (16, 4, "nvfp4", None),
    "mixed_2_6": (64, 4, "affine", "mixed_2_6"),
    "mixed_3_4": (64, 4, "affine", "mixed_3_4"),
    "mixed_3_6": (64, 4, "affine", "mixed_3_6"),
    "mixed_4_6": (64, 4, "affine", "mixed_4_6"),
    "router-8bit": (64, 4, "affine", _router_at_8_bits),
    "layer1-8bit-g32": (64, 4, "affine", _experts_of_layer(1, {"group_size": 32, "bits": 8, "mode": "affine"})),
    "layer1-mxfp4": (64, 4, "affine", _experts_of_layer(1, {"group_size": 32, "bits": 4, "mode": "mxfp4"})),
    "layer1-float": (64, 4, "affine", _experts_of_layer(1, False)),
    "switch-mixed": (64, 4, "affine", _one_switch_mixed),
    # As older conversions saved them: no per-module entries, mlx-lm infers them from the weights.
    "switch-mixed-unrecorded": (64, 4, "affine", _one_switch_mixed),
    "mixed_3_6-unrecorded": (64, 4, "affine", "mixed_3_6"),
    "dense": (0, 0, "", None),
    # A Hugging Face "quantization_config" naming only its method, as mlx-lm reads those.
    "legacy-mxfp4": (32, 4, "mxfp4", {"quant_method": "mxfp4"}),
    "legacy-modelopt-nvfp4": (16, 4, "nvfp4", {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16}),
}

MATRIX = [
    *[("mixtral", c) for c in CASES],
    ("deepseek_v3", "mixed_3_4"), ("deepseek_v3", "nvfp4"), ("deepseek_v3", "layer1-8bit-g32"),
    ("gpt_oss", "mixed_4_6"), ("gpt_oss", "mxfp8"), ("gpt_oss", "router-8bit"), ("gpt_oss", "layer1-float"),
    ("gpt_oss", "switch-mixed"), ("gpt_oss", "legacy-mxfp4"), ("gpt_oss", "mixed_3_6-unrecorded"),
    ("qwen3_moe", "mixed_2_6"), ("qwen3_moe", "affine-g32"), ("qwen3_moe", "router-8bit"),
]


def write_quantized(path: pathlib.Path, model_type: str, case: str) -> tuple[pathlib.Path, dict[str, Any]]:
    """A tiny ``model_type`` quantized as ``case`` says, saved as an mlx-lm model directory."""
    model, config = tiny_model(model_type)
    group_size, bits, mode, how = CASES[case]
    if bits:
        pred = (mixed_quant_predicate_builder(how, model, group_size) if isinstance(how, str)
                else None if isinstance(how, dict) else how)
        model, config = quantize_model(model, config, group_size, bits, mode=mode, quant_predicate=pred)
        if isinstance(how, dict):
            del config["quantization"]
            config["quantization_config"] = how
        if case.endswith("-unrecorded"):
            config["quantization"] = {k: v for k, v in config["quantization"].items() if not isinstance(v, dict)}
            config["quantization_config"] = config["quantization"]
    save_model(path, model)
    save_config(dict(config), path / "config.json")
    return path, config


async def streamed(store_dir: pathlib.Path, prompt: list[int], mode: str) -> list[int]:
    """Greedy tokens of the converted store, a quarter of each layer's experts resident."""
    sm = load_streaming_model(store_dir, completed=completed)
    if mode == "shuffled":
        src = ShuffledSource(store_pools(sm.store), resident_fraction=0.0, side_rows=2, completed=completed,
                             resident=resident_sets(sm.store))
        out = [t async for t in sm.generate(prompt, max_tokens=8, source=src, predictor="lookahead")]
        await src.close()
        return out
    options = ForwardOptions(mode=mode)
    async with Runtime(sm.store, resident=0.25, side_rows=None if mode == "queued" else 1, policy="lfu") as rt:
        out = [t async for t in sm.generate(prompt, max_tokens=8, source=rt, predictor="lookahead",
                                            options=options)]
        await rt.drain()
        assert all(r.ok for r in rt.audit().values())
    return out


@pytest.mark.skipif(QMM_WRONG_HERE, reason="MLX CUDA: quantized matmul of several tokens is wrong at one group per row")
@pytest.mark.parametrize(("model_type", "case"), MATRIX)
def test_converted_quantization_streams_exact_tokens(model_type: str, case: str, tmp_path: pathlib.Path) -> None:
    model_dir, config = write_quantized(tmp_path / "model", model_type, case)
    prompt = [int(t) for t in np.random.default_rng(3).integers(0, config["vocab_size"], 30)]
    ref = reference_generate(load_model(model_dir)[0], prompt, max_tokens=8)
    store = convert_model(model_dir, tmp_path / "store", progress=False)
    if case.startswith("layer1-"):
        # The store keeps each layer's own quantization of its experts.
        switch = store.metadata["asyncside_model"]["switch"]
        first, second = (switch[str(l)]["linears"]["up_proj"] for l in sorted(store.layers)[:2])
        assert first != second
    for mode in ("shuffled", "per-layer", "queued"):
        assert anyio.run(streamed, store.path, prompt, mode) == ref, mode


@pytest.mark.skipif(QMM_WRONG_HERE, reason="MLX CUDA: quantized matmul of several tokens is wrong at one group per row")
@pytest.mark.parametrize("bits", [4, 8])
def test_experts_in_groups_of_128(bits: int, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A mixtral wide enough that its experts are quantized in groups of 128 (the matrix above's
    are narrower than a group and stay float)."""
    import _models_support

    monkeypatch.setitem(_models_support.BASE, "mixtral", {**_models_support.BASE["mixtral"], "hidden_size": 128,
                                                          "intermediate_size": 128})
    monkeypatch.setitem(CASES, "wide", (128, bits, "affine", None))
    model_dir, config = write_quantized(tmp_path / "model", "mixtral", "wide")
    prompt = [int(t) for t in np.random.default_rng(3).integers(0, config["vocab_size"], 30)]
    ref = reference_generate(load_model(model_dir)[0], prompt, max_tokens=8)
    store = convert_model(model_dir, tmp_path / "store", progress=False)
    up = store.metadata["asyncside_model"]["switch"]["0"]["linears"]["up_proj"]
    assert (up["quantized"], up["group_size"], up["bits"]) == (True, 128, bits)
    for mode in ("per-layer", "queued"):
        assert anyio.run(streamed, store.path, prompt, mode) == ref, mode


@pytest.mark.skipif(QMM_WRONG_HERE, reason="MLX CUDA: quantized matmul of several tokens is wrong at one group per row")
@pytest.mark.parametrize("mode", ["per-layer", "whole"])
def test_mixed_recipe_logits_bitwise(mode: str, tmp_path: pathlib.Path) -> None:
    """A mixed_3_6 recipe's prefill and decode logits equal mlx-lm's bit for bit over shuffled rows."""
    model_dir, config = write_quantized(tmp_path / "model", "qwen3_moe", "mixed_3_6")
    model = load_model(model_dir)[0]
    store = convert_model(model_dir, tmp_path / "store", progress=False)
    steps = [[int(t) for t in np.random.default_rng(5).integers(0, 128, 40)], [5], [17], [99]]
    ref = reference_logits(model, steps)
    sm = load_streaming_model(store.path, completed=completed)
    for i, (a, b) in enumerate(zip(ref, anyio.run(shuffled_logits, sm, store_pools(sm.store), steps, mode))):
        assert mx.array_equal(a, b).item(), f"step {i}"


def test_nvfp4_global_scale_is_refused_naming_the_module(tmp_path: pathlib.Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """Experts quantized nvfp4 with a per-expert global scale (quantize_model(global_scale=True))
    cannot be pooled: refused in one line naming the config, the switch layer and the scale."""
    model, config = tiny_model("mixtral")
    model, config = quantize_model(model, config, 16, 4, mode="nvfp4", global_scale=True)
    save_model(tmp_path / "model", model)
    save_config(dict(config), tmp_path / "model" / "config.json")
    with pytest.raises(UnsupportedModelError) as exc:
        convert_model(tmp_path / "model", tmp_path / "store", progress=False)
    text = str(exc.value)
    assert "config.json" in text and "model.layers.0.block_sparse_moe.switch_mlp" in text
    assert "global scale" in text and "\n" not in text
    capsys.readouterr()
    assert main(["convert", str(tmp_path / "model"), str(tmp_path / "store2")]) == 2
    err = capsys.readouterr().err
    assert "model.layers.0.block_sparse_moe.switch_mlp" in err and "Traceback" not in err
    assert not (tmp_path / "store2").exists()


def test_nvfp4_global_scale_in_memory_is_refused_naming_the_module() -> None:
    """streaming_from_model of such a loaded model: the same refusal, naming the switch's path."""
    model, config = tiny_model("mixtral")
    model, config = quantize_model(model, config, 16, 4, mode="nvfp4", global_scale=True)
    with pytest.raises(UnsupportedModelError, match=r"^model\.layers\.0\.block_sparse_moe\.switch_mlp: .*global scale"):
        streaming_from_model(model, config, completed=completed)
