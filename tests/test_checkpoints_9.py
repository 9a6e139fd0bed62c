"""Checkpoints' variety: sharded checkpoints whose weight files do not match their index, or are
cut short, are refused by ``asyncside convert`` in one line naming the weight file (status 2)."""

from __future__ import annotations

import json
import pathlib
import shutil
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.utils import save_config, save_model

from asyncside.cli import main

from _models_support import tiny_model

INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A tiny 4-bit qwen3_moe in three shards with the index mlx-lm conversions write."""
    d = tmp_path_factory.mktemp("sharded")
    model, config = tiny_model("qwen3_moe", quantize={"group_size": 64, "bits": 4})
    save_model(d, model)
    save_config(dict(config), d / "config.json")
    weights = mx.load(str(d / "model.safetensors"))
    (d / "model.safetensors").unlink()
    (d / INDEX).unlink(missing_ok=True)
    keys = sorted(weights)
    per = -(-len(keys) // 3)
    weight_map = {}
    for i in range(3):
        name = f"model-{i + 1:05d}-of-00003.safetensors"
        part = {k: weights[k] for k in keys[i * per:(i + 1) * per]}
        mx.save_safetensors(str(d / name), part, metadata={"format": "mlx"})
        weight_map.update(dict.fromkeys(part, name))
    (d / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return d


def _copy(src: pathlib.Path, tmp_path: pathlib.Path) -> pathlib.Path:
    d = tmp_path / "model"
    shutil.copytree(src, d)
    return d


def _convert(d: pathlib.Path, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(["convert", str(d), str(tmp_path / "store"), "--json"])
    err = capsys.readouterr().err.strip()
    return code, err


def test_sharded_with_unrelated_files_converts(sharded: pathlib.Path, tmp_path: pathlib.Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    d = _copy(sharded, tmp_path)
    (d / "README.md").write_text("notes\n")
    shutil.copy(d / "model-00001-of-00003.safetensors", d / "consolidated.safetensors")
    assert _convert(d, tmp_path, capsys)[0] == 0


def _drop_a_tensor(shard: pathlib.Path) -> str:
    """Rewrite ``shard`` without its first tensor (by name); returns that name."""
    weights = mx.load(str(shard))
    gone = sorted(weights)[0]
    del weights[gone]
    mx.save_safetensors(str(shard), weights, metadata={"format": "mlx"})
    return gone


def test_missing_shard_is_named(sharded: pathlib.Path, tmp_path: pathlib.Path,
                                capsys: pytest.CaptureFixture[str]) -> None:
    d = _copy(sharded, tmp_path)
    (d / "model-00002-of-00003.safetensors").unlink()
    code, err = _convert(d, tmp_path, capsys)
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "model-00002-of-00003.safetensors" in err and INDEX in err and "/config.json:" not in err


def test_shard_missing_a_tensor_is_named(sharded: pathlib.Path, tmp_path: pathlib.Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    d = _copy(sharded, tmp_path)
    shard = d / "model-00002-of-00003.safetensors"
    gone = _drop_a_tensor(shard)
    code, err = _convert(d, tmp_path, capsys)
    assert code == 2 and len(err.splitlines()) == 1, err
    assert shard.name in err and gone in err and "/config.json:" not in err


def test_missing_tensor_without_index_blames_the_weights(sharded: pathlib.Path, tmp_path: pathlib.Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    d = _copy(sharded, tmp_path)
    (d / INDEX).unlink()
    shard = d / "model-00002-of-00003.safetensors"
    gone = _drop_a_tensor(shard)
    code, err = _convert(d, tmp_path, capsys)
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "model*.safetensors" in err and gone in err and "/config.json:" not in err


def test_shard_with_an_extra_tensor_blames_the_weights(sharded: pathlib.Path, tmp_path: pathlib.Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    d = _copy(sharded, tmp_path)
    shard = d / "model-00002-of-00003.safetensors"
    weights = mx.load(str(shard))
    weights["model.layers.0.foo.weight"] = mx.zeros((4, 4))
    mx.save_safetensors(str(shard), weights, metadata={"format": "mlx"})
    code, err = _convert(d, tmp_path, capsys)
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "model*.safetensors" in err and "model.layers.0.foo.weight" in err and "/config.json:" not in err


@pytest.mark.parametrize("damage", ["truncated", "not-safetensors", "lfs-pointer"])
def test_damaged_weight_file_is_named(sharded: pathlib.Path, tmp_path: pathlib.Path,
                                      capsys: pytest.CaptureFixture[str], damage: str) -> None:
    d = _copy(sharded, tmp_path)
    if damage == "truncated":
        bad = d / "model-00002-of-00003.safetensors"
        with open(bad, "r+b") as fh:
            fh.truncate(bad.stat().st_size // 2)
    elif damage == "lfs-pointer":
        bad = d / "model-00003-of-00003.safetensors"
        bad.write_text("version https://git-lfs.github.com/spec/v1\noid sha256:0123\nsize 4096\n")
    else:
        bad = d / "model-notes.safetensors"
        bad.write_text("not a safetensors file\n")
    code, err = _convert(d, tmp_path, capsys)
    assert code == 2 and len(err.splitlines()) == 1, err
    assert bad.name in err
    assert ("git lfs pull" in err) == (damage == "lfs-pointer")


def _convert_and_demo(tmp_path: pathlib.Path, model: Any, config: Any,
                      capsys: pytest.CaptureFixture[str]) -> tuple[pathlib.Path, int, str, str]:
    """Save ``model`` as a checkpoint (byte-level tokenizer), convert it, run a two-token demo on
    the store: the store, the demo's exit status, its stdout and stderr."""
    from asyncside.models.tokenizer import save_byte_level_tokenizer

    d = tmp_path / "model"
    save_model(d, model)
    save_config(dict(config), d / "config.json")
    save_byte_level_tokenizer(d)
    store = tmp_path / "store"
    assert _convert(d, tmp_path, capsys)[0] == 0
    capsys.readouterr()
    code = main(["demo", "--model", str(store), "--tokens", "2", "--prompt", "ab", "--json", "--quiet"])
    out, err = capsys.readouterr()
    return store, code, out, err


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_unquantized_experts(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str],
                                            dtype: str) -> None:
    """Unquantized half-precision experts convert; where MLX's device cannot multiply them gathered
    (the CPU backend's gather_mm takes float32 only) the demo refuses in one line naming the store's
    dtype field (status 2), else its tokens match mlx-lm's."""
    from asyncside.models.loading import _gather_mm_takes

    model, config = tiny_model("mixtral", dtype=getattr(mx, dtype))
    _store, code, out, err = _convert_and_demo(tmp_path, model, config, capsys)
    if _gather_mm_takes(getattr(mx, dtype)):
        assert code == 0 and json.loads(out)["tokens_identical"], err
    else:
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert "manifest.json" in err and "segments[0].dtype" in err and dtype in err


def test_config_transformers_rejects_is_named(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A deepseek_v3 config with ``n_shared_experts: null`` builds in mlx-lm and converts, but
    transformers' config class (read to load the tokenizer) rejects it: the demo refuses in one
    line naming config.json and the field (status 2), not with huggingface_hub's traceback."""
    import _models_support as ms

    base = dict(ms.BASE["deepseek_v3"])
    try:
        ms.BASE["deepseek_v3"] = {**base, "n_shared_experts": None}
        model, config = tiny_model("deepseek_v3")
    finally:
        ms.BASE["deepseek_v3"] = base
    store, code, _out, err = _convert_and_demo(tmp_path, model, config, capsys)
    err = err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert str(store / "config.json") in err and "n_shared_experts" in err


def test_stale_index_beside_complete_files_converts(sharded: pathlib.Path, tmp_path: pathlib.Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """mlx-lm's loader reads every model*.safetensors and ignores the index: an index whose
    weight_map is stale (here: one tensor moved to another shard) does not stop a conversion."""
    d = _copy(sharded, tmp_path)
    a, b = d / "model-00001-of-00003.safetensors", d / "model-00002-of-00003.safetensors"
    wa, wb = mx.load(str(a)), mx.load(str(b))
    moved = sorted(wb)[0]
    wa[moved] = wb.pop(moved)
    mx.save_safetensors(str(a), wa, metadata={"format": "mlx"})
    mx.save_safetensors(str(b), wb, metadata={"format": "mlx"})
    assert _convert(d, tmp_path, capsys)[0] == 0


@pytest.mark.parametrize(("model_type", "fields"), [
    ("qwen3_moe", {"mlp_only_layers": [0, 1, 2]}),
    ("deepseek_v3", {"first_k_dense_replace": 3}),
])
def test_no_moe_layer_names_config_fields(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str],
                                          model_type: str, fields: dict) -> None:
    """A config whose layer fields leave no MoE layer is refused naming config.json and those fields."""
    import _models_support as ms

    d = tmp_path / "model"
    base = dict(ms.BASE[model_type])
    try:
        ms.BASE[model_type] = {**base, **fields}
        model, config = tiny_model(model_type)
    finally:
        ms.BASE[model_type] = base
    save_model(d, model)
    save_config(dict(config), d / "config.json")
    code, err = _convert(d, tmp_path, capsys)
    assert code == 2 and len(err.splitlines()) == 1, err
    assert str(d / "config.json") in err and "no MoE layer" in err
    for name, value in fields.items():
        assert f"{name} {json.dumps(value)}" in err


def test_quantized_weights_without_quantization_config(sharded: pathlib.Path, tmp_path: pathlib.Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """Quantized weight files beside a config.json without its quantization: one line naming
    config.json's quantization field, not mlx-lm's list of every unexpected parameter."""
    d = _copy(sharded, tmp_path)
    config = json.loads((d / "config.json").read_text())
    config.pop("quantization")
    config.pop("quantization_config", None)
    (d / "config.json").write_text(json.dumps(config))
    code, err = _convert(d, tmp_path, capsys)
    assert code == 2 and len(err.splitlines()) == 1, err
    assert f"{d / 'config.json'} [quantization]: has no quantization" in err and ".scales'" in err
