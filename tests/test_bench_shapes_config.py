"""A user's model shape from a Hugging Face config.json (asyncside.bench.shapes): every naming scheme of
the MoE dimensions, the refusals (naming the file and the field), the notes on what a qwen3_moe does
not represent, the presets' real dimensions, the cache tag per config, ``--shapes PATH:LAYERS``, and
tiny builds that ``bench generate --shape PATH``, ``bench offload --shapes PATH:N`` and
tools/device/three_tier.py load and decode.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import types
from typing import Any

import pytest
from _cli_support import offload_args

from asyncside.bench import shapes
from asyncside.cli import main
from asyncside.memory import MemoryBudget

ROOT = pathlib.Path(__file__).resolve().parents[1]

#: a tiny DeepSeek-style config: 3 layers, the first dense, 8 routed experts top-2 and a shared one
TINY_DEEPSEEK: dict[str, Any] = {
    "model_type": "deepseek_v2", "hidden_size": 128, "intermediate_size": 512, "moe_intermediate_size": 64,
    "num_hidden_layers": 3, "first_k_dense_replace": 1, "moe_layer_freq": 1, "n_routed_experts": 8,
    "n_shared_experts": 1, "num_experts_per_tok": 2, "num_attention_heads": 4, "vocab_size": 1000,
    "rope_theta": 10000, "rms_norm_eps": 1e-6, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
    "n_group": 2, "topk_group": 1, "kv_lora_rank": 32,
}
#: a tiny Mixtral-style config: the experts' width is ``intermediate_size``
TINY_MIXTRAL: dict[str, Any] = {
    "model_type": "mixtral", "hidden_size": 128, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 8, "num_experts_per_tok": 2,
    "vocab_size": 32000, "rope_theta": 1000000.0, "rms_norm_eps": 1e-5,
}


def _write(directory: pathlib.Path, config: dict[str, Any]) -> pathlib.Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "config.json"
    path.write_text(json.dumps(config))
    return path


def _dims(config: dict[str, Any]) -> tuple[Any, ...]:
    return (config["num_hidden_layers"], config["num_experts"], config["num_experts_per_tok"], config["hidden_size"],
            config["moe_intermediate_size"], config["num_attention_heads"], config["num_key_value_heads"],
            config["head_dim"], config["vocab_size"])


@pytest.mark.parametrize(("raw", "dims", "norm_topk", "notes"), [
    # Qwen2-MoE: num_experts, moe_intermediate_size, a shared expert; no KV-head field means no GQA.
    ({"model_type": "qwen2_moe", "hidden_size": 256, "intermediate_size": 1024, "moe_intermediate_size": 64,
      "shared_expert_intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 8,
      "sliding_window": 32768, "use_sliding_window": False,
      "num_experts": 60, "num_experts_per_tok": 4, "decoder_sparse_step": 2, "vocab_size": 512,
      "rope_theta": 1e6, "rms_norm_eps": 1e-6, "norm_topk_prob": False},
     (2, 60, 4, 256, 64, 8, 8, 32, 512), False,
     ["not as model_type 'qwen2_moe'", "2 dense decoder layer(s) of the 4 not represented: 2 MoE layers built",
      "shared expert(s) not represented (shared_expert_intermediate_size 512)", "biases not represented"]),
    # Mixtral: num_local_experts, intermediate_size for the experts, renormalised top-k without a field.
    (TINY_MIXTRAL, (2, 8, 2, 128, 128, 4, 2, 32, 32000), True,
     ["expert intermediate size from intermediate_size"]),
    # DeepSeek: n_routed_experts, first_k_dense_replace, shared experts, sigmoid group-limited routing, MLA.
    (TINY_DEEPSEEK, (2, 8, 2, 128, 64, 4, 4, 32, 1000), False,
     ["1 dense decoder layer(s) of the 3 not represented", "shared expert(s) not represented (n_shared_experts 1)",
      "scoring_func sigmoid, topk_method noaux_tc, n_group 2", "multi-head latent attention (kv_lora_rank 32)"]),
    # gpt-oss: experts_per_token alone, head_dim apart from hidden / heads, sinks, sliding windows, MXFP4.
    ({"model_type": "gpt_oss", "hidden_size": 192, "intermediate_size": 192, "num_hidden_layers": 2,
      "num_local_experts": 4, "experts_per_token": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
      "head_dim": 64, "vocab_size": 600, "rope_theta": 150000, "rms_norm_eps": 1e-5, "sliding_window": 128,
      "attention_bias": True, "quantization_config": {"quant_method": "mxfp4"},
      "rope_scaling": {"rope_type": "yarn", "factor": 32.0}, "tie_word_embeddings": True},
     (2, 4, 2, 192, 192, 8, 2, 64, 600), True,
     ["attention sinks", "sliding-window attention (sliding_window 128)", "biases not represented (attention_bias)",
      "mxfp4", "rope_scaling", "tied embeddings built untied"]),
    # DBRX: the MoE fields nested in ffn_config, the KV heads in attn_config, d_model / n_heads / n_layers.
    ({"model_type": "dbrx", "d_model": 128, "n_heads": 4, "n_layers": 2, "vocab_size": 400,
      "ffn_config": {"moe_num_experts": 4, "moe_top_k": 2, "ffn_hidden_size": 64},
      "attn_config": {"kv_n_heads": 2, "rope_theta": 500000}},
     (2, 4, 2, 128, 64, 4, 2, 32, 400), False,
     ["read from the config's ffn_config", "expert intermediate size from ffn_hidden_size"]),
    # Llama 4: text_config, every second layer MoE (interleave_moe_layer_step).
    ({"model_type": "llama4", "text_config": {
        "model_type": "llama4_text", "hidden_size": 128, "intermediate_size": 64, "intermediate_size_mlp": 256,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "num_local_experts": 16, "num_experts_per_tok": 1, "interleave_moe_layer_step": 2, "vocab_size": 500}},
     (2, 16, 1, 128, 64, 4, 2, 32, 500), False,
     ["read from the config's text_config", "2 dense decoder layer(s) of the 4", "rope_theta absent"]),
    # Jamba: experts every expert_layer_period layers from expert_layer_offset; no eps field.
    ({"model_type": "jamba", "hidden_size": 128, "intermediate_size": 64, "num_hidden_layers": 8,
      "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 4, "num_experts_per_tok": 2,
      "expert_layer_period": 2, "expert_layer_offset": 1, "vocab_size": 400},
     (4, 4, 2, 128, 64, 4, 2, 32, 400), False,
     ["4 dense decoder layer(s) of the 8", "norm eps absent (rms_norm_eps / layer_norm_eps"]),
    # Hunyuan: per-layer lists of top-k and expert width (the largest built), moe_topk; rope_theta only in
    # rope_parameters (newer configs), with its scaling type; mixed attention layer types.
    ({"model_type": "hunyuan_v1_moe", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
      "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 8, "moe_topk": [2, 2],
      "moe_intermediate_size": [64, 96], "vocab_size": 400, "rms_norm_eps": 1e-5,
      "rope_parameters": {"rope_theta": 500000.0, "rope_type": "dynamic", "factor": 2.0},
      "layer_types": ["full_attention", "linear_attention"]},
     (2, 8, 2, 128, 96, 4, 2, 32, 400), False,
     ["moe_intermediate_size varies per layer (64 to 96): built with 96 in every layer", '"rope_type": "dynamic"',
      "per-layer attention types (full_attention, linear_attention) not represented"]),
    # An explicit moe_layers list.
    ({**TINY_MIXTRAL, "num_hidden_layers": 4, "moe_layers": [0, 2]}, (2, 8, 2, 128, 128, 4, 2, 32, 32000), True,
     ["2 dense decoder layer(s) of the 4"]),
    # A multimodal wrapper: the MoE dimensions are in text_config.
    ({"model_type": "some_vl", "text_config": {**TINY_MIXTRAL, "model_type": "qwen3_moe",
                                               "moe_intermediate_size": 64, "norm_topk_prob": True}},
     (2, 8, 2, 128, 64, 4, 2, 32, 32000), True, ["read from the config's text_config"]),
])
def test_naming_schemes(tmp_path: pathlib.Path, raw: dict[str, Any], dims: tuple[Any, ...], norm_topk: bool,
                        notes: list[str]) -> None:
    path = _write(tmp_path / "My Model v1", raw)
    src = shapes.describe_shape(str(path))
    assert src.name == "My-Model-v1" and src.source == str(path.resolve())
    assert src.config["model_type"] == "qwen3_moe" and src.config["tie_word_embeddings"] is False
    assert _dims(src.config) == dims and src.config["norm_topk_prob"] is norm_topk
    joined = "; ".join(src.notes)
    for note in notes:
        assert note in joined, (note, src.notes)
    assert ("sliding-window" in joined) == bool(raw.get("sliding_window") and raw.get("use_sliding_window") is not False)
    # rope_theta wherever the config holds it (top level, attn_config, rope_parameters), else noted.
    assert ("rope_theta absent" in joined) == ("rope_theta" not in json.dumps(raw)), src.notes
    # The directory names the same config; the spec is what the build uses.
    assert shapes.describe_shape(str(path.parent)) == src
    spec = shapes.shape_spec(str(path), layers=1, vocab=300)
    assert spec.config["num_hidden_layers"] == 1 and spec.config["vocab_size"] == 300


def test_the_qwen3_moe_scheme_has_no_notes(tmp_path: pathlib.Path) -> None:
    """The construction's own architecture read back from its config: nothing left out, same spec key."""
    raw = {**shapes.SHAPES["qwen3-30b-a3b"], "bos_token_id": 151643, "eos_token_id": 151645, "torch_dtype": "bfloat16"}
    src = shapes.describe_shape(str(_write(tmp_path / "qwen3", raw)))
    assert src.notes == () and src.config == shapes.SHAPES["qwen3-30b-a3b"]
    # An mlx-lm conversion of it (its "quantization"): the same dimensions, the quantization noted.
    mlx = shapes.describe_shape(str(_write(tmp_path / "qwen3-4bit", {**raw, "quantization": {"group_size": 64,
                                                                                               "bits": 4}})))
    assert mlx.config == src.config
    assert mlx.notes == ("the model's own quantization (4-bit, group 64) replaced by the bench's 4-bit affine",)
    assert shapes.shape_spec(str(tmp_path / "qwen3"), layers=2).key() == shapes.shape_spec("qwen3-30b-a3b", layers=2).key()


@pytest.mark.parametrize(("name", "dims", "note"), [
    ("olmoe-1b-7b", (16, 64, 8, 2048, 1024, 16, 16, 128, 50304), "intermediate_size"),
    ("qwen2-moe-a2.7b", (24, 60, 4, 2048, 1408, 16, 16, 128, 151936), "shared expert(s) not represented"),
    ("deepseek-v2-lite", (26, 64, 6, 2048, 1408, 16, 16, 128, 102400), "1 dense decoder layer(s) of the 27"),
    ("gpt-oss-20b", (24, 32, 4, 2880, 2880, 64, 8, 64, 201088), "per-layer attention types (full_attention, "
                                                                 "sliding_attention)"),
    ("mixtral-8x7b", (32, 8, 2, 4096, 14336, 32, 8, 128, 32000), "not as model_type 'mixtral'"),
])
def test_presets_have_their_models_dimensions(name: str, dims: tuple[Any, ...], note: str) -> None:
    src = shapes.describe_shape(name)
    assert _dims(src.config) == dims and shapes.shape_spec(name).config == src.config
    assert any(note in n for n in src.notes), src.notes
    assert shapes.shape_spec(name).group_size == 64


def test_existing_presets_keep_their_cache_keys() -> None:
    """The two first presets' stores already built stay valid: their spec (and so their tag) is unchanged."""
    assert shapes.shape_spec("qwen3-30b-a3b", layers=8, vocab=512).key() == "a02a740e79970cee"
    assert shapes.shape_spec("deepseek-v3-like", layers=4, vocab=512).key() == "b6ae9b093c714947"


def test_a_full_mixtral_is_refused_before_building(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Mixtral-8x7B's 256 records of about 110 MB: more than a small machine's disk or memory; each
    refusal names what is short, and nothing is left behind."""
    est = shapes.estimate_bytes(shapes.shape_spec("mixtral-8x7b"))
    # 3 matrices of 14336 x 4096 at 4 bits, float32 scales and biases per group of 64.
    assert est["record"] == 3 * (14336 * 4096 // 2 + 2 * 14336 * 64 * 4)
    assert est["experts"] == 32 * 8 * est["record"] and est["build_memory"] > est["experts"]
    monkeypatch.setattr(shapes.shutil, "disk_usage", lambda path: types.SimpleNamespace(free=50 * 10**9))
    with pytest.raises(shapes.ShapeTooLargeError, match=r"mixtral-8x7b with 32 layers needs about 6\d\.\d GB free "
                                                        r"while it builds, 50\.0 GB are free"):
        shapes.ensure_shape("mixtral-8x7b", cache_dir=tmp_path, progress=False)
    monkeypatch.setattr(shapes.shutil, "disk_usage", lambda path: types.SimpleNamespace(free=10**12))
    import asyncside.memory
    monkeypatch.setattr(asyncside.memory, "available_memory", lambda: MemoryBudget(24 * 2**30, "MemAvailable"))
    with pytest.raises(shapes.ShapeTooLargeError, match=r"holds about 3\d\.\d GB in memory, 25\.8 GB are available "
                                                        r"\(MemAvailable\) \(fewer layers: --layers \d+ or fewer\)"):
        shapes.ensure_shape("mixtral-8x7b", cache_dir=tmp_path, progress=False)
    assert not any(p.name.startswith("shape-") for p in tmp_path.iterdir())


def _no_moe_field(raw: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in raw.items() if k not in ("num_local_experts", "num_experts_per_tok")}


@pytest.mark.parametrize(("raw", "message"), [
    # A dense model: Llama's config.
    ({"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
      "num_attention_heads": 32, "vocab_size": 32000},
     "not a mixture-of-experts config: no num_experts / num_local_experts / n_routed_experts"),
    ({**TINY_MIXTRAL, "num_local_experts": 0}, "not a mixture-of-experts config: num_local_experts is 0"),
    ({**_no_moe_field(TINY_MIXTRAL), "num_local_experts": 8}, "no experts per token (looked for num_experts_per_tok"),
    ({k: v for k, v in TINY_MIXTRAL.items() if k != "intermediate_size"},
     "no expert intermediate size (looked for intermediate_size / ffn_hidden_size)"),
    ({k: v for k, v in TINY_MIXTRAL.items() if k != "hidden_size"}, "no hidden size (looked for hidden_size"),
    ({k: v for k, v in TINY_MIXTRAL.items() if k != "vocab_size"}, "no vocabulary size"),
    ({**TINY_MIXTRAL, "num_experts_per_tok": 9}, "num_experts_per_tok 9 exceeds num_local_experts 8"),
    ({**TINY_MIXTRAL, "num_local_experts": "8"}, "num_local_experts must be a positive integer, got '8'"),
    ({**TINY_MIXTRAL, "hidden_size": True}, "hidden_size must be a positive integer, got True"),
    ({**TINY_MIXTRAL, "num_key_value_heads": 3}, "num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
    ({**TINY_MIXTRAL, "hidden_size": 130}, "no head_dim, and hidden size 130 is not a multiple of num_attention_heads"),
    ({**TINY_MIXTRAL, "intermediate_size": 100},
     "4-bit quantization needs widths that are multiples of 32: moe_intermediate_size 100"),
    ({**TINY_MIXTRAL, "rope_theta": -1}, "rope_theta must be a positive number, got -1"),
    ({**TINY_MIXTRAL, "norm_topk_prob": "yes"}, "norm_topk_prob must be true or false"),
    ({**TINY_DEEPSEEK, "first_k_dense_replace": 3}, "no MoE layer among the 3 of num_hidden_layers"),
    ([1, 2], "a model config is a JSON object, got list"),
    ({**TINY_MIXTRAL, "moe_layers": "all"}, "moe_layers must be a list of layer indices, got 'all'"),
    # Indices past the last layer were dropped without a word (mlp_only_layers' are refused).
    ({**TINY_MIXTRAL, "num_hidden_layers": 4, "moe_layers": [0, 2, 9]},
     "moe_layers [9] fall outside the model's 4 decoder layers; expected layer indices from 0 to 3"),
    ({**TINY_MIXTRAL, "decoder_sparse_step": -1}, "decoder_sparse_step must be a positive integer (a MoE layer "
                                                   "every that many layers), got -1"),
    ({**TINY_DEEPSEEK, "first_k_dense_replace": -1}, "first_k_dense_replace must be a non-negative integer, got -1"),
    # A period of 0 was read as absent (every layer MoE); the model's own code divides by it.
    ({**TINY_MIXTRAL, "decoder_sparse_step": 0}, "decoder_sparse_step must be a positive integer (a MoE layer "
                                                  "every that many layers), got 0"),
    ({**TINY_DEEPSEEK, "moe_layer_freq": 0}, "moe_layer_freq must be a positive integer"),
    ({**TINY_MIXTRAL, "interleave_moe_layer_step": 0}, "interleave_moe_layer_step must be a positive integer"),
    ({**TINY_MIXTRAL, "expert_layer_period": 0}, "expert_layer_period must be a positive integer"),
    # mlp_only_layers past the last layer (or negative) were ignored: every layer stayed MoE.
    ({**TINY_MIXTRAL, "mlp_only_layers": [1, 2]},
     "mlp_only_layers [2] fall outside the model's 2 decoder layers; expected layer indices from 0 to 1"),
    ({**TINY_MIXTRAL, "mlp_only_layers": [-1, 5]}, "mlp_only_layers [-1, 5] fall outside the model's 2 decoder layers"),
])
def test_bad_configs_name_the_file_and_the_field(tmp_path: pathlib.Path, raw: Any, message: str) -> None:
    path = _write(tmp_path / "m", raw)
    with pytest.raises(shapes.ShapeError) as err:
        shapes.shape_spec(str(path))
    assert str(err.value).startswith(str(path)) and message in str(err.value), str(err.value)


def test_bad_paths_names_and_sizes(tmp_path: pathlib.Path) -> None:
    with pytest.raises(shapes.ShapeError, match=r"no such config file \(a shape is one of \[.*'olmoe-1b-7b'.*repo id org/name"):
        shapes.shape_spec(str(tmp_path / "missing" / "config.json"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(shapes.ShapeError, match=r"empty/config\.json: no such config file"):
        shapes.shape_spec(str(tmp_path / "empty"))
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(shapes.ShapeError, match=r"bad\.json: not a JSON config: Expecting property name"):
        shapes.shape_spec(str(tmp_path / "bad.json"))
    locked = _write(tmp_path / "locked", TINY_MIXTRAL)

    def refuse(self: pathlib.Path, *args: Any, **kwargs: Any) -> str:
        raise PermissionError(13, "Permission denied", str(self))

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pathlib.Path, "read_text", refuse)
        with pytest.raises(shapes.ShapeError, match=r"locked/config\.json: cannot be read \(Permission denied\)"):
            shapes.shape_spec(str(locked))
    with pytest.raises(shapes.ShapeError, match=r"unknown shape 'llama'; known shapes: \[.*\], or the path of"):
        shapes.shape_spec("llama")
    path = _write(tmp_path / "ds", TINY_DEEPSEEK)
    with pytest.raises(shapes.ShapeError, match=r"--layers must be an integer in \[1, 2\] for ds \(its MoE layers; SHAPE:N"):
        shapes.shape_spec(str(path), layers=3)
    small = _write(tmp_path / "small", {**TINY_MIXTRAL, "vocab_size": 100})
    with pytest.raises(shapes.ShapeError, match=r"vocab_size 100 is below the byte tokenizer's 258 tokens"):
        shapes.shape_spec(str(small))
    assert shapes.shape_spec(str(small), vocab=300).config["vocab_size"] == 300


def test_a_repo_id_reads_its_config_from_the_hub_cache(tmp_path: pathlib.Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """`--shape org/name` (not a local path): the repo's config.json alone, from the local Hugging Face
    cache here (offline); the shape is named after the repo. Not cached and offline: one clear error."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)  # no local path acme/tiny-moe
    repo = tmp_path / "hub" / "models--acme--tiny-moe"
    _write(repo / "snapshots" / "0123abcd", TINY_MIXTRAL)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    src = shapes.describe_shape("acme/tiny-moe")
    assert src.name == "tiny-moe" and src.source is not None and src.source.startswith("acme/tiny-moe (")
    assert _dims(src.config) == (2, 8, 2, 128, 128, 4, 2, 32, 32000)
    with pytest.raises(shapes.ShapeError, match=r"acme/other: not a local path, and its config\.json is not in the "
                                                r"local Hugging Face cache"):
        shapes.describe_shape("acme/other")


def test_shape_lists(tmp_path: pathlib.Path) -> None:
    odd = _write(tmp_path / "a:b", TINY_MIXTRAL).parent  # a path holding ':'
    assert shapes.parse_shape_list(f"qwen3-30b-a3b:6, {tmp_path}/x/config.json:2,olmoe-1b-7b,{odd},{odd}:1") == [
        ("qwen3-30b-a3b", 6), (f"{tmp_path}/x/config.json", 2), ("olmoe-1b-7b", None), (str(odd), None),
        (str(odd), 1)]
    for bad, message in (("qwen3-30b-a3b:x", "LAYERS must be a positive integer, got 'x'"),
                         ("qwen3-30b-a3b:0", "LAYERS must be a positive integer, got '0'"),
                         ("qwen3-30b-a3b,", "empty shape"), (":4", "empty shape")):
        with pytest.raises(shapes.ShapeError, match=message):
            shapes.parse_shape_list(bad)


def test_the_cache_tag_differs_per_config(tmp_path: pathlib.Path) -> None:
    """Two configs that differ in one dimension never share a store; the tag carries the label and the
    effective config's hash; a second call reuses the build and says what it was built as."""
    a = _write(tmp_path / "cfg" / "a", TINY_MIXTRAL)
    b = _write(tmp_path / "cfg" / "b", {**TINY_MIXTRAL, "rope_theta": 10000.0})
    sa, sb = shapes.shape_spec(str(a), vocab=300), shapes.shape_spec(str(b), vocab=300)
    assert sa.key() != sb.key()
    cache = tmp_path / "cache"
    ba = shapes.ensure_shape(str(a), vocab=300, cache_dir=cache, progress=False)
    bb = shapes.ensure_shape(str(b), vocab=300, cache_dir=cache, progress=False)
    assert ba["built"] and bb["built"] and ba["store"] != bb["store"]
    assert ba["store"].parent.name == f"shape-a-L2-V300-{sa.key()}"
    assert bb["store"].parent.name == f"shape-b-L2-V300-{sb.key()}"
    again = shapes.ensure_shape(str(a.parent), vocab=300, cache_dir=cache, progress=False)
    assert not again["built"] and again["store"] == ba["store"] and again["store_bytes"] == ba["store_bytes"]
    assert again["shape"] == "a" and again["source"] == str(a.resolve())
    assert again["built_as"].startswith("qwen3_moe (2 MoE layers x 8 experts top-2, hidden 128")
    assert "not as model_type 'mixtral'" in again["note"]


def test_generate_builds_and_decodes_a_config(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`bench generate --shape PATH`: the DeepSeek-style config's 2 MoE layers of 8 experts, built and
    decoded, the tokens identical in every system; the note travels into the JSON and the table title."""
    path = _write(tmp_path / "tiny-ds", TINY_DEEPSEEK)
    argv = ["bench", "generate", "--shape", str(path), "--vocab", "300", "--cache-dir", str(tmp_path / "cache"),
            "--tokens", "3", "--repeats", "1", "--residency", "0.25", "--no-cold", "--plot", "none"]
    capsys.readouterr()
    assert main([*argv, "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["tokens_identical"] is True and all(r["tokens_identical"] for r in res["rows"])
    assert res["moe_layers"] == 2 and res["experts_per_layer"] == 8
    info = res["model_info"]
    assert info["kind"] == "shape" and info["shape"] == "tiny-ds" and info["built_now"] is True
    assert info["source"] == str(path.resolve()) and info["layers"] == 2 and info["vocab"] == 300
    assert "shared expert(s) not represented" in info["note"]
    assert main(argv) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "shape tiny-ds: qwen3_moe (2 MoE layers x 8 experts top-2" in out and "not represented:" in out


def test_cli_says_a_bad_shape_in_one_line(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path / "dense", {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
                                       "num_attention_heads": 2, "vocab_size": 300, "intermediate_size": 128})
    capsys.readouterr()
    assert main(["bench", "generate", "--shape", str(path), "--plot", "none"]) == 2  # bad input: a usage error
    err = capsys.readouterr().err
    assert err.strip() == (f"asyncside bench generate: {path}: not a mixture-of-experts config: no num_experts / "
                           f"num_local_experts / n_routed_experts")


def test_offload_takes_a_config_path(tmp_path: pathlib.Path) -> None:
    """`bench offload --shapes PATH:1`: the config's store built and run under a cgroup budget."""
    from _offload_support import offload_budget

    from asyncside.bench import offload

    budget = offload_budget(700 * 2**20)
    ok, why = offload.check_cgroups(budget)
    if not ok:
        pytest.skip(f"no memory cgroup can be made here: {why}")
    path = _write(tmp_path / "tiny-mixtral", TINY_MIXTRAL)
    args = offload_args("--shapes", f"{path}:1", "--vocab", "300", "--cache-dir", str(tmp_path / "cache"),
                        "--memory", str(budget), "--store-ratio", "0.0001", "--seconds", "2", "--tokens", "6",
                        "--localities", "high", "--systems", "asyncside", "--quiet")
    res = offload.run_offload_bench(args)
    (shape,) = res["shapes"]
    assert shape["shape"] == "tiny-mixtral" and shape["moe_layers"] == 1 and shape["experts_per_layer"] == 8
    assert shape["top_k"] == 2 and shape["source"] == str(path.resolve()) and "mixtral" in shape["note"]
    (run,) = res["runs"]
    assert run["status"] == "ok" and run["shape"] == "tiny-mixtral", run
    assert "tiny-mixtral 1 layer x 8 experts top-2" in offload.render_markdown(res)
    assert "(not represented: built as a qwen3_moe" in offload.render_markdown(res)


def test_three_tier_builds_a_config(tmp_path: pathlib.Path) -> None:
    """tools/device/three_tier.py --shape PATH --build-only: the config's store, its dimensions, the note."""
    spec = importlib.util.spec_from_file_location("three_tier", ROOT / "tools" / "device" / "three_tier.py")
    assert spec is not None and spec.loader is not None
    tt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tt)
    path = _write(tmp_path / "tiny-ds", TINY_DEEPSEEK)
    out = tmp_path / "out.json"
    assert tt.main(["--shape", str(path), "--vocab", "300", "--cache-dir", str(tmp_path / "cache"),
                    "--memory-max", "100M", "--build-only", "--disk-bytes", "1M", "--disk-depths", "1",
                    "--disk-passes", "1", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["shape"]["moe_layers"] == 2 and res["shape"]["experts_per_layer"] == 8 and res["shape"]["top_k"] == 2
    assert res["build"]["shape"] == "tiny-ds" and "n_shared_experts 1" in res["build"]["note"]
