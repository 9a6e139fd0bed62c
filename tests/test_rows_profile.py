"""Pool rows split between layers by a routing profile (``Runtime(rows_profile=...)``, the plan's
``profile_rows``): the split keeps the total, respects every layer's minimum, refuses a profile of
another shape naming the file and field, and tokens stay exact with a split plan."""

from __future__ import annotations

import pathlib

import anyio
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.utils import save_config, save_model

from asyncside import ExpertStore, memory
from asyncside.bridge import completed
from asyncside.errors import TraceError
from asyncside.models import ForwardOptions, StepMode, convert_model, load_streaming_model, reference_generate
from asyncside.models.forcing import force_reference, rewind_reference
from asyncside.routing import RoutingTrace, preset
from asyncside.runtime import Runtime
from asyncside.runtime import _plan as plan_mod

from _models_support import tiny_model


@pytest.fixture(autouse=True)
def _big_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(plan_mod, "_resident_now", lambda: 0)
    monkeypatch.setattr(memory, "available_memory", lambda: memory.MemoryBudget(1 << 40, "test"))


def _store(path: pathlib.Path, layers: int = 3) -> ExpertStore:
    rng = np.random.default_rng(0)
    return ExpertStore.create(path, {layer: {"w": rng.integers(0, 255, size=(64, 4096), dtype=np.uint8)}
                                     for layer in range(layers)})


def _skewed_profile(layers: int, tokens: int = 300, top_k: int = 4) -> RoutingTrace:
    """Layer 0 routes the same four experts every token (it needs no more rows than a step's);
    the other layers route uniformly at random (they miss the most)."""
    rng = np.random.default_rng(1)
    ids = np.zeros((tokens, layers, top_k), dtype=np.int32)
    for t in range(tokens):
        ids[t, 0] = np.arange(top_k)
        for layer in range(1, layers):
            ids[t, layer] = rng.choice(64, size=top_k, replace=False)
    return RoutingTrace(ids, np.array([tokens]), 64, {"source": "test"})


def _plan(store: ExpertStore, **kw: object) -> plan_mod.MemoryPlan:
    args: dict[str, object] = dict(resident=0.25, pinned=None, side_rows=None, min_side_rows=8, memory=None,
                                   direct=None, host_tier=0, tier_possible=False)
    args.update(kw)
    return plan_mod.plan_memory(store, list(store.layers), **args)  # type: ignore[arg-type]


def test_split_keeps_the_total_and_the_minimums(tmp_path: pathlib.Path) -> None:
    store = _store(tmp_path / "s")
    even = _plan(store)
    assert even.split is None and dict(even.rows) == {0: 16, 1: 16, 2: 16}
    path = tmp_path / "profile.npz"
    _skewed_profile(3).save(path)
    plan = _plan(store, rows_profile=path)
    assert sum(plan.rows.values()) == sum(even.rows.values()) and plan.pool_bytes == even.pool_bytes
    assert plan.rows[0] == 8  # the floor (min_side_rows), no more: its four experts always hit
    assert plan.rows[1] > 16 and plan.rows[2] > 16
    assert all(r >= 8 for r in plan.rows.values())
    assert "rows split by profile" in plan.describe() and str(path) in plan.describe()
    assert plan.as_dict()["rows"] == {str(i): r for i, r in plan.rows.items()}
    # A larger floor than the even share cannot be met by every layer: none goes below its even rows.
    tight = _plan(store, rows_profile=_skewed_profile(3), resident=0.1, min_side_rows=8)
    assert sum(tight.rows.values()) == 3 * 8 and min(tight.rows.values()) >= 8
    # Top-k above the floor raises every layer's minimum to a step's need.
    wide = _plan(store, rows_profile=_skewed_profile(3, top_k=12), min_side_rows=4)
    assert sum(wide.rows.values()) == 48 and min(wide.rows.values()) >= 12


def test_a_profile_of_another_shape_is_refused_clearly(tmp_path: pathlib.Path) -> None:
    store = _store(tmp_path / "s")
    path = tmp_path / "two-layers.npz"
    _skewed_profile(2).save(path)
    with pytest.raises(TraceError, match=r"two-layers\.npz.*ids.*expected 3 MoE layers") as err:
        _plan(store, rows_profile=path)
    assert err.value.field == "ids"
    other = tmp_path / "32-experts.npz"
    preset("middle", tokens=40, n_layers=3, n_experts=32, top_k=4).save(other)
    with pytest.raises(TraceError, match=r"32-experts\.npz.*n_experts.*expected 64 experts") as err:
        _plan(store, rows_profile=other)
    assert err.value.field == "n_experts"
    with pytest.raises(TraceError, match="no such file"):
        _plan(store, rows_profile=tmp_path / "missing.npz")
    with pytest.raises(TypeError, match="rows_profile"):
        _plan(store, rows_profile=3)
    with pytest.raises(ValueError, match="no pinned experts and no side_rows"):
        _plan(store, rows_profile=path, side_rows=4)


def test_tokens_stay_exact_with_a_split_plan(tmp_path: pathlib.Path) -> None:
    model, config = tiny_model("qwen3_moe")
    save_model(tmp_path / "model", model)
    save_config(dict(config), tmp_path / "model" / "config.json")
    convert_model(tmp_path / "model", tmp_path / "store", resident_fraction=0.25, progress=False)
    prompt = [int(t) for t in np.random.default_rng(5).integers(0, config["vocab_size"], 12)]
    sm = load_streaming_model(tmp_path / "store", completed=completed, options=ForwardOptions(mode=StepMode.QUEUED))
    n_layers, n_experts = len(sm.moe_layers), sm.store.layer(sm.moe_layers[0]).n_experts
    # Replay one sequence, plan from the other (a holdout): layer 0 concentrated, the rest spread.
    both = preset("middle", tokens=80, n_layers=n_layers, n_experts=n_experts, top_k=4, sequences=2, seed=2)
    ids = both.ids.copy()
    ids[:, 0, :] = np.arange(4)
    routing = RoutingTrace(ids[:40], np.array([40]), n_experts, {"source": "test"})
    profile = RoutingTrace(ids[40:], np.array([40]), n_experts, {"source": "test"})
    routing.save(tmp_path / "routing.npz")
    replay = sm.set_routing(tmp_path / "routing.npz")
    assert replay is not None
    force_reference(model, sm.arch.block_attr, replay)
    ref = reference_generate(model, prompt, max_tokens=8)
    rewind_reference(model)

    async def main() -> tuple[list[int], dict[int, int]]:
        async with Runtime(sm.store, resident=0.5, min_side_rows=4, rows_profile=profile) as rt:
            assert rt.plan is not None and rt.plan.split is not None
            tokens = [t async for t in sm.generate(prompt, max_tokens=8, source=rt, predictor="none")]
            await rt.quiesce()
            assert all(r.ok for r in rt.audit().values())
            return tokens, {i: rt.ledger(i).rows for i in sm.moe_layers}

    tokens, rows = anyio.run(main)
    assert tokens == ref
    first, rest = sm.moe_layers[0], sm.moe_layers[1:]
    assert rows[first] == 4 and all(rows[i] > n_experts // 2 for i in rest), rows  # the split reached the pools
    assert sum(rows.values()) == n_layers * (n_experts // 2)
    mx.clear_cache()


def test_split_measured_on_a_holdout() -> None:
    from asyncside.policy_replay import compare_split, holdout_pair

    both = _skewed_profile(3, tokens=400)
    profile, holdout = holdout_pair(both)
    assert profile.n_tokens == holdout.n_tokens == 200
    assert np.array_equal(np.concatenate([profile.ids, holdout.ids]), both.ids)
    (row,) = compare_split({"skewed": (profile, holdout)}, fractions=(0.25,))
    assert sum(row["split"]) == 3 * row["rows"] and min(row["split"]) >= 4
    # Layer 0 needs four rows, so the split gives its spare rows to the random layers, which hit more.
    assert row["split"][0] == 4 and row["split_hit_rate"] > row["even"]
    two = preset("middle", tokens=60, n_layers=2, n_experts=16, top_k=2, sequences=2)
    p2, h2 = holdout_pair(two)
    assert np.array_equal(p2.ids, two.sequence(0)) and np.array_equal(h2.ids, two.sequence(1))


def test_bench_policy_split_quick(capsys: pytest.CaptureFixture[str]) -> None:
    from asyncside.cli import main

    assert main(["bench", "policy", "--split", "--quick", "--presets", "middle"]) in (0, None)
    out = capsys.readouterr().out
    assert "split from profile" in out and "middle 64x6 s0" in out


def test_demo_rows_profile(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`demo --rows-profile` splits the rows (reported per layer) and the tokens stay identical."""
    import json

    from asyncside.bench import generate as bench
    from asyncside.cli import main
    from asyncside.models.embedded import ensure_embedded_default

    store_dir = ensure_embedded_default(tmp_path / "embedded", spec=bench._quick_spec(), progress=False)[1]
    store = ExpertStore.open(store_dir)
    layers, n = len(store.layers), store.layer(next(iter(store.layers))).n_experts
    both = preset("middle", tokens=80, n_layers=layers, n_experts=n, top_k=4, sequences=2)
    ids = both.ids.copy()
    ids[:, 0, :] = np.arange(4)  # layer 0 keeps four experts: the split gives it the floor only
    RoutingTrace(ids[:40], np.array([40]), n, {}).save(tmp_path / "routing.npz")
    RoutingTrace(ids[40:], np.array([40]), n, {}).save(tmp_path / "profile.npz")
    base = ["demo", "--model", str(store_dir), "--tokens", "6", "--json", "--resident", "0.5",
            "--routing", str(tmp_path / "routing.npz")]
    capsys.readouterr()
    assert main([*base, "--rows-profile", str(tmp_path / "profile.npz")]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tokens_identical"] is True and out["audit_clean"] is True
    split = out["pool_rows_split"]
    assert split is not None and len(split) == layers and sum(split) == layers * (n // 2)
    # Layer 0 gets about its floor (the model's top-k, 4: its four experts), far from the even half.
    assert split == [out["memory"]["rows"][str(i)] for i in sorted(store.layers)] and 4 <= split[0] < n // 4
    assert "rows split by profile" in out["memory"]["split"]


def test_bench_generate_rows_profile(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`bench generate --rows-profile` runs asyncside with the split plan, tokens identical."""
    import json

    from asyncside.bench import generate as bench
    from asyncside.cli import main
    from asyncside.models.embedded import ensure_embedded_default

    store_dir = ensure_embedded_default(tmp_path / "embedded", spec=bench._quick_spec(), progress=False)[1]
    store = ExpertStore.open(store_dir)
    layers, n = len(store.layers), store.layer(next(iter(store.layers))).n_experts
    profile = tmp_path / "profile.npz"
    preset("middle", tokens=40, n_layers=layers, n_experts=n, top_k=4).save(profile)
    capsys.readouterr()
    assert main(["bench", "generate", "--quick", "--json", "--model", str(store_dir), "--tokens", "4",
                 "--residency", "0.5", "--no-drop-caches", "--modes", "default",
                 "--rows-profile", str(profile)]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["tokens_identical"] is True and res["settings"]["rows_profile"] == str(profile)
    bad = tmp_path / "bad.npz"
    preset("middle", tokens=40, n_layers=layers, n_experts=n + 1, top_k=4).save(bad)
    assert main(["bench", "generate", "--quick", "--json", "--model", str(store_dir), "--tokens", "4",
                 "--residency", "0.5", "--no-drop-caches", "--modes", "default", "--rows-profile", str(bad)]) != 0
    assert f"{bad} [n_experts]: rows_profile: expected {n} experts" in capsys.readouterr().err
