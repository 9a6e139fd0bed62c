"""``convert_model``: mlx-lm model directory -> expert store; loading it back; the embedded model."""

from __future__ import annotations

import gc
import json
import pathlib
import warnings

import anyio
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.utils import load_model, save_config, save_model

from asyncside.bridge import completed
from asyncside.errors import StoreError
from asyncside.models import ForwardOptions, load_reference_model, load_streaming_model, reference_generate
from asyncside.models.arch import UnsupportedModelError
from asyncside.models.convert import (
    convert_model,
    load_profile,
    make_profile,
    profile_routing,
    resident_sets,
)
from asyncside.models.embedded import EmbeddedSpec, cache_root, ensure_embedded_default
from asyncside.models.tokenizer import ByteTokenizer
from asyncside.runtime import Runtime
from asyncside.store import ExpertStore

from _models_support import SMALL_EMBEDDED, ShuffledSource, store_pools, tiny_model

Q4 = {"group_size": 64, "bits": 4}
#: MLX CUDA's quantized matmul of several tokens is wrong, and not reproducible, where a matrix's rows
#: are one quantization group, as every matrix of these tiny 4-bit models is: plain mlx-lm's own
#: reference is wrong there (tools/device/probe_qmm.py; tests/test_models.py skips the same). The
#: quantized tests below check the store there, not the tokens.
QMM_WRONG_HERE = mx.default_device() == mx.gpu and bool(getattr(mx, "cuda", None) and mx.cuda.is_available())
QMM_WRONG_REASON = "MLX CUDA: quantized matmul of several tokens is wrong at one group per row (tools/device/probe_qmm.py)"


def write_model_dir(path: pathlib.Path, model_type: str, quantize=None) -> tuple[pathlib.Path, list[int]]:
    model, config = tiny_model(model_type, quantize=quantize)
    save_model(path, model)
    save_config(dict(config), path / "config.json")
    prompt = [int(t) for t in np.random.default_rng(3).integers(0, config["vocab_size"], 30)]
    return path, prompt


async def stream_tokens(store_dir: pathlib.Path, prompt: list[int], source_kind: str) -> list[int]:
    sm = load_streaming_model(store_dir, completed=completed)
    if source_kind.startswith("runtime"):
        # The real runtime at 25%: "runtime" queues each decode step once, misses faulted in on
        # the stream; "runtime-per-layer" serves each MoE layer from the host (three pinned
        # experts, one dynamic row); "runtime-whole" queues decode steps whole from row snapshots
        # and checks them after, redoing from the first unsound layer.
        mode = {"runtime": "queued", "runtime-per-layer": "per-layer", "runtime-whole": "whole"}[source_kind]
        options = ForwardOptions(mode=mode)
        side_rows = None if mode == "queued" else 1
        async with Runtime(sm.store, resident=0.25, side_rows=side_rows, policy="lfu") as rt:
            out = [t async for t in sm.generate(prompt, max_tokens=8, source=rt, predictor="lookahead",
                                                options=options)]
            await rt.drain()
            assert all(r.ok for r in rt.audit().values())
            stats = rt.stats()
        counters = sm.forward_with(options).counters
        if mode == "whole":
            assert counters["optimistic"] == 8 and counters["optimistic_redone"] > 0
        elif mode == "queued":
            assert counters["queued"] == 8 and counters["fallbacks"] == 0 and stats["faults"] > 0
        else:
            assert counters["per_layer"] == 8
        return out
    if source_kind == "resident":
        src = sm.resident_source()
    else:
        src = ShuffledSource(store_pools(sm.store), resident_fraction=0.0, side_rows=2, completed=completed,
                             resident=resident_sets(sm.store))
    out = [t async for t in sm.generate(prompt, max_tokens=8, source=src, predictor="lookahead")]
    if hasattr(src, "close"):
        await src.close()
    return out


def test_convert_quantized_with_profile(tmp_path: pathlib.Path) -> None:
    model_dir, prompt = write_model_dir(tmp_path / "qwen", "qwen3_moe", Q4)
    model, config = load_model(model_dir)
    ref = reference_generate(model, prompt, max_tokens=8)
    prof = profile_routing(model, config, [prompt, prompt[::-1]], max_tokens=4, source="test")
    assert set(prof["layers"]) == {"0", "2"}
    k = config["num_experts_per_tok"]
    for counts in prof["layers"].values():
        assert sum(counts) == prof["tokens"] * k  # every prompt and generated token was routed once

    store = convert_model(model_dir, tmp_path / "store", profile=prof, resident_fraction=0.25, progress=False)
    assert sorted(store.layers) == [0, 2]
    spec = store.layer(0)
    assert [s.key for s in spec.segments] == [
        "gate_proj.weight", "gate_proj.scales", "gate_proj.biases",
        "up_proj.weight", "up_proj.scales", "up_proj.biases",
        "down_proj.weight", "down_proj.scales", "down_proj.biases",
    ]
    # The records hold exactly the model's expert tensors.
    sw = model.model.layers[2].mlp.switch_mlp
    rec = store.read_expert(2, 5)
    assert mx.array_equal(rec["down_proj.scales"], sw.down_proj.scales[5]).item()
    assert mx.array_equal(rec["gate_proj.weight"], sw.gate_proj.weight[5]).item()
    # Non-expert weights only in model.safetensors.
    non_expert = mx.load(str(store.path / "model.safetensors"))
    assert not any("switch_mlp" in k for k in non_expert)
    assert "model.layers.0.mlp.gate.weight" in non_expert and "lm_head.weight" in non_expert
    # Resident sets: the hottest experts of the profile.
    res = resident_sets(store)
    for l, counts in prof["layers"].items():
        hottest = sorted(range(16), key=lambda e: (-counts[e], e))[:4]
        assert res[int(l)] == hottest
    assert resident_sets(store, 0.5)[0][:4] == res[0]
    summary = json.loads((store.path / "asyncside_summary.json").read_text())
    assert summary["expert_bytes"] == sum(s.nbytes for sp in store.layers.values() for s in sp.segments) * 16

    if QMM_WRONG_HERE:
        pytest.skip(f"the store checked; tokens not compared: {QMM_WRONG_REASON}")
    assert anyio.run(stream_tokens, store.path, prompt, "resident") == ref
    assert anyio.run(stream_tokens, store.path, prompt, "shuffled") == ref
    assert anyio.run(stream_tokens, store.path, prompt, "runtime") == ref
    assert anyio.run(stream_tokens, store.path, prompt, "runtime-per-layer") == ref
    assert anyio.run(stream_tokens, store.path, prompt, "runtime-whole") == ref
    rebuilt, _ = load_reference_model(store.path)
    assert reference_generate(rebuilt, prompt, max_tokens=8) == ref


def test_convert_float_without_profile(tmp_path: pathlib.Path) -> None:
    model_dir, prompt = write_model_dir(tmp_path / "mixtral", "mixtral")
    model, config = load_model(model_dir)
    ref = reference_generate(model, prompt, max_tokens=8)
    store = convert_model(model_dir, tmp_path / "store", resident_fraction=0.5, progress=True)
    assert resident_sets(store) == {0: [0, 1, 2, 3], 1: [0, 1, 2, 3]}  # documented default: id order
    assert store.layer(0).segments[0].dtype == "float32"
    assert anyio.run(stream_tokens, store.path, prompt, "shuffled") == ref
    # overwrite
    with pytest.raises(StoreError, match="already exists"):
        convert_model(model_dir, tmp_path / "store", progress=False)
    store2 = convert_model(model_dir, tmp_path / "store", resident_fraction=0.0, progress=False, overwrite=True)
    assert resident_sets(store2) == {0: [], 1: []}


def test_convert_gpt_oss_biases(tmp_path: pathlib.Path) -> None:
    model_dir, prompt = write_model_dir(tmp_path / "oss", "gpt_oss", Q4)
    model, _ = load_model(model_dir)
    ref = reference_generate(model, prompt, max_tokens=8)
    store = convert_model(model_dir, tmp_path / "store", progress=False)
    keys = [s.key for s in store.layer(0).segments]
    assert "gate_proj.bias" in keys and "down_proj.bias" in keys
    if QMM_WRONG_HERE:
        pytest.skip(f"the store checked; tokens not compared: {QMM_WRONG_REASON}")
    assert anyio.run(stream_tokens, store.path, prompt, "shuffled") == ref


def test_convert_errors(tmp_path: pathlib.Path) -> None:
    with pytest.raises(StoreError, match="config.json is missing"):
        convert_model(tmp_path, tmp_path / "out", progress=False)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    with pytest.raises(StoreError, match="no model\\*.safetensors"):
        convert_model(tmp_path / "empty", tmp_path / "out", progress=False)

    model_dir, _ = write_model_dir(tmp_path / "q", "qwen3_moe", Q4)
    bad = make_profile("qwen3_moe", {0: [1] * 16, 1: [1] * 16}, tokens=4)
    with pytest.raises(StoreError, match="layer 1 is not an MoE layer"):
        convert_model(model_dir, tmp_path / "out", profile=bad, progress=False)
    short = make_profile("qwen3_moe", {0: [1] * 15}, tokens=4)
    with pytest.raises(StoreError, match="15 counts, the model has 16 experts"):
        convert_model(model_dir, tmp_path / "out", profile=short, progress=False)
    other = make_profile("mixtral", {0: [1] * 16}, tokens=4)
    with pytest.raises(StoreError, match="profile is for 'mixtral'"):
        convert_model(model_dir, tmp_path / "out", profile=other, progress=False)
    (tmp_path / "p.json").write_text("{not json")
    with pytest.raises(StoreError, match="not valid JSON"):
        load_profile(tmp_path / "p.json")
    with pytest.raises(StoreError, match="non-negative integers"):
        load_profile({"format": "asyncside-routing-profile", "version": 1, "layers": {"0": [1, -2]}})
    with pytest.raises(ValueError, match="resident_fraction"):
        convert_model(model_dir, tmp_path / "out", resident_fraction=1.5, progress=False)
    assert not (tmp_path / "out").exists()  # nothing half-written
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]

    # A dense model has nothing to stream.
    from mlx_lm.utils import _get_classes

    cfg = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 1, "intermediate_size": 128,
           "num_attention_heads": 4, "rms_norm_eps": 1e-5, "vocab_size": 64, "num_key_value_heads": 4}
    cls, args = _get_classes(cfg)
    save_model(tmp_path / "llama", cls(args.from_dict(cfg)))
    save_config(cfg, tmp_path / "llama" / "config.json")
    with pytest.raises(UnsupportedModelError, match="'llama' is not supported"):
        convert_model(tmp_path / "llama", tmp_path / "out", progress=False)

    # Loading: a model dir is not a store; a store without asyncside metadata is refused.
    with pytest.raises(StoreError, match="convert it first"):
        load_streaming_model(model_dir)
    ExpertStore.create(tmp_path / "bare", {0: {"w": np.zeros((2, 4), np.float32)}})
    with pytest.raises(StoreError, match="not written by the asyncside converter"):
        load_streaming_model(tmp_path / "bare")


def test_embedded_builds_once_and_is_exact(tmp_path: pathlib.Path) -> None:
    model_dir, store_dir = ensure_embedded_default(tmp_path, spec=SMALL_EMBEDDED, progress=False)
    assert (model_dir.parent / "READY").is_file()
    assert model_dir.parent.name == f"embedded-{SMALL_EMBEDDED.key()}"
    ready_mtime = (model_dir.parent / "READY").stat().st_mtime_ns
    again = ensure_embedded_default(tmp_path, spec=SMALL_EMBEDDED, progress=False)
    assert again == (model_dir, store_dir)
    assert (model_dir.parent / "READY").stat().st_mtime_ns == ready_mtime  # not rebuilt
    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_moe"
    assert cfg["quantization"]["group_size"] == 64 and cfg["quantization"]["bits"] == 4
    assert cfg["quantization"]["model.layers.0.mlp.gate"]["bits"] == 8  # router at 8 bits

    summary = json.loads((store_dir / "asyncside_summary.json").read_text())
    assert summary["expert_share"] > 0.9
    # Quiesce first: work other tests left on the stream (a cancelled generation's speculative
    # outputs) may still allocate or free while we measure.
    # And empty MLX's buffer cache: a cached buffer reused for a smaller request counts its whole
    # size as active, so the growth below would depend on what earlier tests left in the cache.
    gc.collect()
    mx.synchronize()
    mx.clear_cache()
    before = mx.get_active_memory()
    sm = load_streaming_model(store_dir, completed=completed)
    grew = mx.get_active_memory() - before
    # Loading allocates the non-expert weights only, never an expert tensor.
    assert grew <= summary["non_expert_bytes"] * 1.05 + 4096, (grew, summary)
    # A standard tokenizer.json (mlx-lm's TokenizerWrapper) with the byte tokenizer's ids.
    assert (model_dir / "tokenizer.json").is_file() and not (model_dir / "asyncside_tokenizer.json").exists()
    assert sm.tokenizer.encode("Hé") == ByteTokenizer().encode("Hé") and sm.tokenizer.eos_token_ids == {ByteTokenizer.EOS}
    prompt = sm.tokenizer.encode("Hello, experts!")
    model, _ = load_reference_model(model_dir)
    ref = reference_generate(model, prompt, max_tokens=8, eos_token_ids=sm.tokenizer.eos_token_ids)

    async def main() -> list[int]:
        return [t async for t in sm.generate(prompt, max_tokens=8, source=sm.resident_source())]

    got = anyio.run(main)
    assert got == ref
    text = sm.tokenizer.decode(got)
    assert isinstance(text, str) and all(c.isprintable() or c == "\n" for c in text)  # LM head scores printable ASCII only
    meta = sm.store.metadata["asyncside_model"]
    assert meta["profile"]["source"] == "embedded prompts"


def test_embedded_default_spec_is_expert_dominated() -> None:
    """Bytes of the default embedded config (computed from its shapes, not built here)."""
    c = EmbeddedSpec().config
    d, e, f, v, layers = c["hidden_size"], c["num_experts"], c["moe_intermediate_size"], c["vocab_size"], c["num_hidden_layers"]
    per_weight = 0.5 + 2 * 4 / 64  # 4-bit codes + float32 scale and bias per group of 64
    experts = layers * e * 3 * d * f * per_weight
    attn = layers * (2 * d * c["num_attention_heads"] * c["head_dim"] + 2 * d * c["num_key_value_heads"] * c["head_dim"])
    other = (attn + 2 * v * d) * per_weight + layers * e * d * (1 + 2 * 4 / 64)
    assert experts / (experts + other) > 0.9
    assert 100e6 < experts + other < 400e6


def test_cache_root(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> None:
    monkeypatch.setenv("ASYNCSIDE_CACHE", str(tmp_path / "a"))
    assert cache_root() == tmp_path / "a"
    monkeypatch.delenv("ASYNCSIDE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert cache_root() == tmp_path / "x" / "asyncside"
    assert cache_root(tmp_path / "c") == tmp_path / "c"


def test_profile_model_dir_and_from_trace(tmp_path: pathlib.Path) -> None:
    from asyncside.models import ResidentSource, RoutingTrace, profile_from_trace, profile_model_dir
    from asyncside.models.embedded import build_model

    spec = SMALL_EMBEDDED
    model, cfg = build_model(spec)
    save_model(tmp_path / "m", model)
    save_config(dict(cfg), tmp_path / "m" / "config.json")
    ByteTokenizer(cfg["vocab_size"]).save(tmp_path / "m")
    prof = profile_model_dir(tmp_path / "m", ["abc", "hello world"], max_tokens=3, out=tmp_path / "p.json")
    assert load_profile(tmp_path / "p.json") == prof
    assert prof["tokens"] == 3 + 11 + 2 * 3

    # The same counts from a streaming run's trace (prefill of prompt[:-1], then one token per step).
    from asyncside.models import streaming_from_model

    sm, pools = streaming_from_model(model, cfg, completed=completed)
    tok = ByteTokenizer(cfg["vocab_size"])

    async def main() -> RoutingTrace:
        tr = RoutingTrace()
        for p in ["abc", "hello world"]:
            async for _ in sm.generate(tok.encode(p), max_tokens=3, source=ResidentSource(pools), trace=tr, stop_at_eos=False):
                pass
        return tr

    tr = anyio.run(main)
    from_trace = profile_from_trace(tr, "qwen3_moe", {0: 32, 1: 32})
    # generate_step also runs the last generated token through the model; the async path does not.
    assert from_trace["tokens"] == prof["tokens"] - 2
    with pytest.raises(StoreError, match="no tokenizer"):
        (tmp_path / "m" / "asyncside_tokenizer.json").unlink()
        profile_model_dir(tmp_path / "m", ["x"])


def test_report_on_a_small_embedded_store(tmp_path: pathlib.Path) -> None:
    from asyncside.models.report import format_table, main, measure

    _, store_dir = ensure_embedded_default(tmp_path, spec=SMALL_EMBEDDED, progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a predictor that named nothing was a NaN mean
        res = measure(store_dir, max_tokens=6, fractions=(0.25,), side_rows=(2,), policies=("lfu",))
    assert all(v is None or 0.0 <= v <= 1.0 for q in res["predictor_decode_quality"].values() for v in q.values())
    assert res["tokens_equal"] and res["generated"] == 6
    assert res["decode_tok_s"]["async_resident"] > 0 and res["decode_tok_s"]["mlx_lm_reference"] > 0
    (row,) = res["hit_rates"]
    assert 0.0 <= row["belady"] <= 1.0 and row["lfu"] <= row["belady"] + 1e-12  # MIN bounds demand-only LFU
    assert "lfu" in format_table(res)
    assert main([str(store_dir), "--max-tokens", "4", "--json", str(tmp_path / "r.json")]) == 0
    assert json.loads((tmp_path / "r.json").read_text())["tokens_equal"] is True
