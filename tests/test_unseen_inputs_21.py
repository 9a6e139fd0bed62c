"""Unseen inputs, round 21: model configurations, routing traces and memory limits written by hand,
as a new user would try them. What cannot run is refused in one line naming the file and field."""

from __future__ import annotations

import json
import pathlib

import pytest

from asyncside.errors import StoreError

from _models_support import BASE, tiny_model


def _save(root: pathlib.Path, name: str, **fields: object) -> pathlib.Path:
    """A tiny deepseek_v3 model directory (16 routed experts, top-4) with ``fields`` changed."""
    from mlx_lm.utils import save_config, save_model

    BASE[name] = dict(BASE["deepseek_v3"], **fields)
    try:
        model, config = tiny_model(name)
    finally:
        del BASE[name]
    save_model(root / name, model)
    save_config(dict(config), root / name / "config.json")
    return root / name


@pytest.mark.parametrize(("fields", "expected"), [
    ({"n_group": 3}, "expected n_group to divide the layer's 16 experts, got 3"),
    ({"n_group": 16, "topk_group": 4}, "expected groups of at least 2 experts"),
])
def test_a_grouped_router_that_cannot_route_is_refused_at_convert(tmp_path: pathlib.Path, fields: dict[str, int],
                                                                  expected: str) -> None:
    """A deepseek_v3 config.json whose ``n_group`` does not divide its experts (or leaves one
    expert a group, where the router sums each group's top two) builds in mlx-lm, converted to a
    store, and then ``demo --model`` ended at the first token in a traceback from mlx-lm's
    ``group_expert_select`` (``[Unflatten] Cannot unflatten ...``, ``[topk] Received invalid
    k=2``). ``convert`` runs each router on one token and refuses, naming config.json, n_group
    and what was expected; no store is left."""
    from asyncside.models import convert_model

    src = _save(tmp_path, "ds3_bad_groups", **fields)
    with pytest.raises(StoreError) as err:
        convert_model(src, tmp_path / "store", progress=False)
    assert err.value.path == str(src / "config.json") and err.value.field == "n_group", err.value
    assert expected in str(err.value) and "router cannot route a token" in str(err.value), err.value
    assert not (tmp_path / "store").exists()


@pytest.mark.parametrize(("field", "value"), [("num_experts_per_tok", "4"), ("num_experts_per_tok", 4.0),
                                              ("num_experts_per_tok", True), ("topk_group", "1")])
def test_a_router_count_that_is_not_an_integer_is_refused_at_convert(tmp_path: pathlib.Path, field: str,
                                                                     value: object) -> None:
    """A count written as a string, a float or a boolean in config.json (``"num_experts_per_tok":
    "4"``, ``4.0``, ``true``; ``"topk_group": "1"``) converted, or ended convert in a TypeError
    traceback from mlx-lm's router; the refusal names that field (not ``n_group`` of a grouping
    that fits) and says an integer was expected."""
    from asyncside.models import convert_model

    src = _save(tmp_path, "ds3_counts", n_group=2, topk_group=1)
    cfg = json.loads((src / "config.json").read_text())
    cfg[field] = value
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(StoreError) as err:
        convert_model(src, tmp_path / "store", progress=False)
    assert err.value.field == field, err.value
    assert f"expected {field} to be an integer, got {json.dumps(value)}" in str(err.value), err.value
    assert "groups of at least 2" not in str(err.value)


def test_a_store_whose_config_was_edited_to_bad_groups_is_refused_at_load(tmp_path: pathlib.Path) -> None:
    """The same configuration reached through a store's own config.json (edited after
    converting) loaded, and its first forward was mlx-lm's traceback; ``load_streaming_model``
    (so ``demo``, ``serve`` and ``load``) refuses it naming the store's config.json."""
    from asyncside.models import convert_model, load_streaming_model

    src = _save(tmp_path, "ds3_groups", n_group=2, topk_group=1)
    convert_model(src, tmp_path / "store", progress=False)
    load_streaming_model(tmp_path / "store")  # as converted: loads
    cfg_path = tmp_path / "store" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["n_group"] = 5
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(StoreError) as err:
        load_streaming_model(tmp_path / "store")
    assert err.value.path == str(cfg_path) and err.value.field == "n_group", err.value
    assert "expected n_group to divide the layer's 16 experts, got 5" in str(err.value), err.value


def test_groups_of_one_expert_where_the_router_takes_each_groups_maximum_still_convert(
        tmp_path: pathlib.Path) -> None:
    """deepseek_v2's group_limited_greedy ranks groups by their maximum, so groups of one expert
    route (mlx-lm generates with them): the check refuses only what cannot route, not a shape."""
    from mlx_lm.utils import save_config, save_model

    from asyncside.models import convert_model

    BASE["ds2_groups_of_one"] = dict(BASE["deepseek_v2"], n_group=16, topk_group=2)
    try:
        model, config = tiny_model("ds2_groups_of_one")
    finally:
        del BASE["ds2_groups_of_one"]
    save_model(tmp_path / "m", model)
    save_config(dict(config), tmp_path / "m" / "config.json")
    store = convert_model(tmp_path / "m", tmp_path / "store", progress=False)
    assert store.layers


def _sparse_trace(n_experts: int, used: int, tokens: int = 120, layers: int = 3, top_k: int = 4, seed: int = 0) -> object:
    """A trace of ``n_experts`` per layer that routes to ``used`` of them (spread over the range)."""
    import numpy as np

    from asyncside.routing import RoutingTrace

    rng = np.random.default_rng(seed)
    spread = np.sort(rng.choice(n_experts, used, replace=False))
    ids = np.stack([np.stack([spread[rng.choice(used, top_k, replace=False)] for _ in range(layers)])
                    for _ in range(tokens)])
    return RoutingTrace(ids=ids.astype(np.int32), lengths=np.array([tokens // 2, tokens - tokens // 2]),
                        n_experts=n_experts, meta={})


def test_routing_info_of_a_trace_of_a_million_experts_replays_only_those_it_routes_to(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``asyncside routing info`` of a trace of 2^20 experts a layer (the format's most; 2,000
    tokens of 8 layers top-8) ran past five minutes: the LRU and MIN replays step through arrays
    of every expert per step. It replays each layer over the experts it routes to, renumbered
    in order (the same hits), and a cache that holds all of them hits every access but a first
    use without a replay: the same file takes under a second."""
    from asyncside import policy_replay, routing_cli

    seen: list[int] = []
    for name in ("trace_lru_hits", "trace_min_hits"):
        real = getattr(policy_replay, name)
        monkeypatch.setattr(policy_replay, name,
                            lambda trace, rows, real=real: seen.append(trace.n_experts) or real(trace, rows))
    info = routing_cli.trace_info(_sparse_trace(1 << 20, 40))
    assert all(n <= 40 for n in seen), seen
    assert [c["rows"] for c in info["caches"]] == [1 << 18, 1 << 19]


@pytest.mark.parametrize("used", [150, 100])
def test_routing_info_over_the_routed_experts_gives_the_full_replays_hits(used: int) -> None:
    """The renumbered replay, and the all-fitting shortcut (100 experts routed, 128 rows at 50%),
    give the hits the replays give over every expert of the file."""
    from asyncside import policy_replay, routing_cli

    trace = _sparse_trace(256, used)
    info = routing_cli.trace_info(trace)
    sizes = [c["rows"] for c in info["caches"]]
    assert [c["lru_hits"] for c in info["caches"]] == policy_replay.trace_lru_hits(trace, sizes)
    assert [c["min_hits"] for c in info["caches"]] == policy_replay.trace_min_hits(trace, sizes)
