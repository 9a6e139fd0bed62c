"""Routing replay: every MoE layer routes to a routing trace's ids, in asyncside and in the reference.

Over a real Runtime on converted stores of every architecture, pools holding a top-k of rows per
layer (so every MoE layer misses): the routed ids recorded by asyncside equal the trace's ids
position by position; tokens equal the all-resident mlx-lm model's forced the same way; the
forcing changes the tokens (it is not a no-op); the slot cache replays the same routing.
"""

from __future__ import annotations

import pathlib

import anyio
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.utils import save_config, save_model

from asyncside.bridge import completed
from asyncside.errors import TraceError
from asyncside.models import ForwardOptions, RoutingTrace, convert_model, load_streaming_model, reference_generate
from asyncside.models.forcing import RoutingReplay, RoutingReplayError, force_reference, rewind_reference
from asyncside.routing import RoutingTrace as TraceFile
from asyncside.routing import preset

from _models_support import BASE, queued_tokens, tiny_model

NEW_TOKENS = 8
PROMPT = 12


def _store(tmp: pathlib.Path, model_type: str) -> tuple[pathlib.Path, object, list[int]]:
    model, config = tiny_model(model_type)
    save_model(tmp / "model", model)
    save_config(dict(config), tmp / "model" / "config.json")
    convert_model(tmp / "model", tmp / "store", resident_fraction=0.25, progress=False)
    prompt = [int(t) for t in np.random.default_rng(5).integers(0, config["vocab_size"], PROMPT)]
    return tmp / "store", model, prompt


def _trace(tmp: pathlib.Path, n_experts: int) -> pathlib.Path:
    # Fewer layers and other experts than any test model (mapped: cyclic layers, spread or fold),
    # top-6 truncated to the model's k; shorter than prompt + tokens, so positions wrap too.
    path = tmp / "trace.npz"
    preset("low", tokens=PROMPT + NEW_TOKENS - 3, n_layers=1, n_experts=max(8, n_experts // 2 + 1), top_k=6,
           seed=3).save(path)
    return path


@pytest.mark.parametrize("mode", ["queued", "per-layer"])
@pytest.mark.parametrize("model_type", sorted(BASE))
def test_replay_forces_the_trace_and_stays_exact(tmp_path: pathlib.Path, model_type: str, mode: str) -> None:
    store_dir, model, prompt = _store(tmp_path, model_type)
    free_logits = model(mx.array(prompt)[None])
    sm = load_streaming_model(store_dir, completed=completed, options=ForwardOptions(mode=mode))
    n_experts = sm.store.layer(sm.moe_layers[0]).n_experts
    replay = sm.set_routing(_trace(tmp_path, n_experts))
    assert isinstance(replay, RoutingReplay) and replay.top_k == replay.ids.shape[2]
    force_reference(model, sm.arch.block_attr, replay)
    assert not mx.array_equal(model(mx.array(prompt)[None]), free_logits).item()  # the replay changed the routing
    rewind_reference(model)
    ref = reference_generate(model, prompt, max_tokens=NEW_TOKENS)
    rewind_reference(model)
    assert reference_generate(model, prompt, max_tokens=NEW_TOKENS) == ref  # rewound: the same run again
    rewind_reference(model)
    trace = RoutingTrace()

    tokens, misses = anyio.run(queued_tokens, sm, prompt, NEW_TOKENS, replay.top_k, trace)
    assert tokens == ref
    assert all(n > 0 for n in misses.values()), misses  # misses in every MoE layer
    # Forcing equals the trace: every recorded routed id is the fitted trace's at that position.
    for layer in sm.moe_layers:
        got = trace.token_ids(layer)
        # The last step's last MoE layer may be skipped by a prefill that stops after the last
        # attention; every recorded token is compared, at least the whole prompt.
        assert got.shape[0] >= PROMPT
        assert np.array_equal(got, replay.host_ids(layer, 0, got.shape[0])), layer


def test_slot_cache_replays_the_same_routing(tmp_path: pathlib.Path) -> None:
    from asyncside.bench.slot_cache import SlotCache, slot_generate
    from asyncside.store import ExpertStore

    store_dir, model, prompt = _store(tmp_path, "qwen3_moe")
    sm = load_streaming_model(store_dir, completed=completed)
    replay = sm.set_routing(_trace(tmp_path, 16))
    assert replay is not None
    force_reference(model, sm.arch.block_attr, replay)
    ref = reference_generate(model, prompt, max_tokens=NEW_TOKENS)
    with SlotCache(ExpertStore.open(store_dir), 0.25) as sc:
        got = list(slot_generate(sm, sc, prompt, max_tokens=NEW_TOKENS))
        assert sc.stats()["misses"] > 0
    assert got == ref


def test_bad_traces_are_refused_clearly(tmp_path: pathlib.Path) -> None:
    store_dir, model, _prompt = _store(tmp_path, "mixtral")
    sm = load_streaming_model(store_dir, completed=completed)
    with pytest.raises(TraceError, match="missing.npz"):
        sm.set_routing(tmp_path / "missing.npz")
    # A trace routing fewer experts per token than the model (top-1 vs top-2) cannot be replayed.
    narrow = tmp_path / "narrow.npz"
    TraceFile(np.zeros((4, 1, 1), np.int32), np.array([4]), 8, {"source": "synthetic"}).save(narrow)
    with pytest.raises(RoutingReplayError, match="narrow.npz.*top_k 2 exceeds the trace's top_k 1"):
        sm.set_routing(narrow)
    replay = sm.set_routing(_trace(tmp_path, 8))
    assert replay is not None
    with pytest.raises(RoutingReplayError, match="batch-1"):
        replay.step_ids(sm.moe_layers[0], 0, (2, 3))
    assert sm.set_routing(None) is None and sm.forward.routing is None


def test_demo_records_and_replays_routing(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`demo --record-routing` writes the run's routing; `demo --routing` of that file routes the same
    experts, so both runs give the unforced run's tokens again; a synthetic trace changes them."""
    import json

    from asyncside.bench import generate as bench
    from asyncside.cli import main
    from asyncside.models.embedded import ensure_embedded_default

    store = str(ensure_embedded_default(tmp_path / "embedded", spec=bench._quick_spec(), progress=False)[1])
    rec = tmp_path / "recorded.npz"
    base = ["demo", "--model", store, "--tokens", "6", "--json", "--resident", "0.25"]
    capsys.readouterr()
    assert main([*base, "--record-routing", str(rec)]) == 0
    free = json.loads(capsys.readouterr().out)
    trace = TraceFile.load(rec)
    assert trace.meta["source"] == "recorded" and trace.meta["model"] == free["model"]
    assert trace.n_tokens == free["prompt_tokens"] + 6 - 1  # every step's tokens: the prompt, then 5 decoded
    assert main([*base, "--routing", str(rec)]) == 0
    replayed = json.loads(capsys.readouterr().out)
    assert replayed["tokens_identical"] is True and replayed["routing"]["tokens"] == trace.n_tokens
    assert replayed["text"] == free["text"]
    synth = tmp_path / "low.npz"
    preset("low", tokens=64, n_layers=2, n_experts=trace.n_experts, top_k=trace.top_k).save(synth)
    assert main([*base, "--routing", str(synth)]) == 0
    forced = json.loads(capsys.readouterr().out)
    assert forced["tokens_identical"] is True and forced["audit_clean"] is True
    assert forced["hit_rate"] != free["hit_rate"]  # other experts were routed


@pytest.mark.parametrize("model_type", sorted(BASE))
def test_forced_router_scores_are_the_routers(model_type: str) -> None:
    """Forced to the ids its router picks, every architecture's block computes exactly its own output:
    the gate weights are the router's scores at the forced ids, nothing else changes."""
    from asyncside.models.arch import arch_for, moe_layers
    from asyncside.models.forcing import forced_block_call
    from asyncside.models.loading import streaming_from_model
    from asyncside.models.pooled import route

    model, config = tiny_model(model_type)
    sm, _pools = streaming_from_model(model, config, completed=completed)
    x = mx.array(np.random.default_rng(1).standard_normal((1, 9, config["hidden_size"])).astype(np.float32))
    for layer, (block, _attr) in moe_layers(model, arch_for(model_type)).items():
        pooled_block, pooled_attr = sm._moe[layer]
        inds = route(pooled_block, pooled_attr, x)[1]
        own = block(x)
        forced = forced_block_call(block, x, inds)
        assert mx.array_equal(own, forced).item(), (model_type, layer)
        other = (inds + 1) % int(config.get("num_experts") or config.get("num_local_experts")
                                 or config.get("moe_num_experts") or config["n_routed_experts"])
        assert not mx.array_equal(own, forced_block_call(block, x, other.astype(inds.dtype))).item()


def test_bench_generate_replays_routing_in_every_system(tmp_path: pathlib.Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """`bench generate --routing`: mlx-lm, asyncside in every step mode and the slot cache all route
    the trace's ids, so their tokens are identical; the result names the trace."""
    import json

    from asyncside.bench import generate as bench
    from asyncside.cli import main
    from asyncside.models.embedded import ensure_embedded_default

    store = str(ensure_embedded_default(tmp_path / "embedded", spec=bench._quick_spec(), progress=False)[1])
    synth = tmp_path / "middle.npz"
    preset("middle", tokens=96, n_layers=3, n_experts=40, top_k=8, seed=2).save(synth)
    capsys.readouterr()
    assert main(["bench", "generate", "--quick", "--json", "--model", store, "--plot", "none", "--tokens", "4",
                 "--residency", "0.25", "--no-drop-caches", "--modes", "default", "per-layer", "whole",
                 "--routing", str(synth)]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["tokens_identical"] is True
    assert res["routing"]["file"] == str(synth) and res["routing"]["meta"]["locality"] == "middle"
