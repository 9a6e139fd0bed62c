"""`asyncside bench offload --routing FILE`: a user's own routing trace, written by hand with
plain numpy in the documented format (docs/routing-traces.md), replayed by every system.

The end-to-end run needs a memory cgroup (skipped, with the reason, where none can be made); the
refusals come before any cgroup is made and run anywhere.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import numpy as np
import pytest
from _cli_support import offload_args
from _offload_support import offload_budget

from asyncside import cli
from asyncside.bench import offload

BUDGET = 700 * 2**20


def write_trace(path: pathlib.Path, *, tokens: tuple[int, ...] = (7, 5), layers: int = 5, experts: int = 64,
                top_k: int = 6, seed: int = 3, **override: Any) -> pathlib.Path:
    """A trace as a person writes one: np.savez of ids (T, L, K) int32, lengths, n_experts (not our save())."""
    rng = np.random.default_rng(seed)
    t = sum(tokens)
    ids = np.stack([np.stack([rng.choice(experts, top_k, replace=False) for _ in range(layers)]) for _ in range(t)])
    arrays: dict[str, Any] = {"ids": ids.astype(np.int32), "lengths": np.array(tokens, dtype=np.int64),
                              "n_experts": np.int64(experts)}
    arrays.update(override)
    np.savez(path, **{k: v for k, v in arrays.items() if v is not None})
    return path


def test_labels_are_stems_made_distinct() -> None:
    assert offload.routing_labels(["a/t.npz", "b/t.npz", "low.npz", "x"], taken=["low"]) == ["t", "t-2", "low-2", "x"]


def test_fitting_a_trace_of_another_shape(tmp_path: pathlib.Path) -> None:
    """64 experts top-6 over 5 layers, 2 sequences, onto 2 layers x 32 experts top-4: sequence 0 mapped
    as RoutingTrace.map_to maps it; its short length wraps, and the record says so."""
    from asyncside.routing import RoutingTrace

    (user,) = offload.load_routings([str(write_trace(tmp_path / "mine.npz"))])
    fitted, info = offload.fit_routing(user, shape="s", moe_layers=2, n_experts=32, top_k=4, positions=11,
                                       predictor="none")
    expect = RoutingTrace.load(tmp_path / "mine.npz").map_to(2, 32, 4).sequence(0)
    assert fitted.ids.shape == (7, 2, 4) and np.array_equal(fitted.ids, expect)
    assert fitted.n_sequences == 1 and fitted.n_experts == 32
    assert info["mapped_from"] == {"n_layers": 5, "n_experts": 64, "top_k": 6} == info["source_shape"]
    assert info["sequences"] == 2 and info["sequence"] == 0 and info["sequence_tokens"] == 7
    assert info["wraps"] is True and "positions wrap" in offload.routing_note(info)
    same, info2 = offload.fit_routing(user, shape="s", moe_layers=5, n_experts=64, top_k=6, positions=4,
                                      predictor="none")
    assert info2["mapped_from"] is None and info2["wraps"] is False
    assert np.array_equal(same.ids, RoutingTrace.load(tmp_path / "mine.npz").sequence(0))


def test_predictor_trace_needs_predictions(tmp_path: pathlib.Path) -> None:
    plain = offload.load_routings([str(write_trace(tmp_path / "plain.npz"))])[0]
    with pytest.raises(ValueError, match=r"plain\.npz.*carries none"):
        offload.fit_routing(plain, shape="s", moe_layers=2, n_experts=32, top_k=4, positions=3, predictor="trace")
    rng = np.random.default_rng(0)
    pred = np.stack([np.stack([rng.choice(64, 7, replace=False) for _ in range(5)]) for _ in range(12)])
    carried = offload.load_routings([str(write_trace(tmp_path / "pred.npz", predicted=pred.astype(np.int32)))])[0]
    fitted, info = offload.fit_routing(carried, shape="s", moe_layers=2, n_experts=32, top_k=4, positions=3,
                                       predictor="trace")
    assert info["predicted"] is True and fitted.predicted is not None and fitted.predicted.shape[:2] == (7, 2)


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    rc = cli.main(["bench", "offload", "--json", "--quiet", *argv])
    return rc, capsys.readouterr().err


@pytest.mark.parametrize(("override", "field"), [
    ({"n_experts": None}, "[n_experts]"),  # a missing array
    ({"ids": np.full((4, 5, 6), 70, dtype=np.int32) + np.arange(6, dtype=np.int32), "lengths": np.array([4])},
     "[ids]"),  # ids out of range of 64 experts
])
def test_a_bad_file_exits_2_naming_file_and_field(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str],
                                                  quick_store: pathlib.Path, override: dict[str, Any],
                                                  field: str) -> None:
    bad = write_trace(tmp_path / "broken.npz", **override)
    rc, err = _cli(capsys, "--stores", str(quick_store), "--routing", str(bad))
    assert rc == 2, err
    assert str(bad) in err and field in err and "Traceback" not in err


def test_a_smaller_top_k_is_refused_by_name(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str],
                                            quick_store: pathlib.Path) -> None:
    small = write_trace(tmp_path / "top2.npz", top_k=2)
    rc, err = _cli(capsys, "--stores", str(quick_store), "--store-ratio", "0.001", "--memory",
                   str(offload_budget(BUDGET)), "--routing", str(small))
    assert rc == 2, err
    assert str(small) in err and "top-2" in err and "top-4" in err and "Traceback" not in err


def test_predictor_trace_with_presets_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="carry none"):
        offload.run_offload_bench(offload_args("--localities", "low", "--predictor", "trace"))
    with pytest.raises(ValueError, match="nothing to replay"):
        offload.run_offload_bench(offload_args("--localities", ""))


def test_a_user_trace_end_to_end(quick_store: pathlib.Path, tmp_path: pathlib.Path) -> None:
    """A 64-expert top-6, 5-layer, 2-sequence trace on the 2-layer 32-expert top-4 store: only the
    file runs (no preset), every system replays the same fitted ids, so all tokens equal the
    all-resident reference's; the JSON says which file, its shape, the mapping and the wrap."""
    budget = offload_budget(BUDGET)
    ok, why = offload.check_cgroups(budget)
    if not ok:
        pytest.skip(f"no memory cgroup can be made here: {why}")
    trace = write_trace(tmp_path / "recorded.npz", tokens=(6, 9))
    res = offload.run_offload_bench(offload_args("--stores", str(quick_store), "--memory", str(budget), "--store-ratio",
                                          "0.001", "--seconds", "2", "--tokens", "10", "--routing", str(trace)))
    (shape,) = res["shapes"]
    assert list(shape["compute"]) == ["recorded"] and shape["compute"]["recorded"]["status"] == "ok"
    assert [(r["locality"], r["system"]) for r in res["runs"]] == [("recorded", s) for s in offload.SYSTEMS]
    ref = shape["compute"]["recorded"]["tokens"]
    for r in res["runs"]:
        assert r["status"] == "ok", r
        assert r["tokens"] == ref and r["n_tokens"] == 10 and r["tokens_match_reference"] is True
        assert r["routing"]["file"] == str(trace.resolve()) and r["routing"]["wraps"] is True
        assert r["routing"]["mapped_from"] == {"n_layers": 5, "n_experts": 64, "top_k": 6}
        if r["system"] != "mlx-lm":
            assert 0 <= r["belady"]["hit_rate"] <= 1 and r["of_min"] is not None
    assert res["tokens_identical"] is True and res["settings"]["localities"] == ""
    json.dumps(res)  # the JSON the CLI prints
    assert "positions wrap" in offload.render_markdown(res)


def test_memory_sizes_a_user_types(capsys: pytest.CaptureFixture[str]) -> None:
    """--memory takes what demo's takes (powers of 1024, with or without B or iB); nonsense is a usage error."""
    for text, want in (("600M", 600 * 2**20), ("1.5G", 3 * 2**29), ("1536MiB", 3 * 2**29), ("2GB", 2 * 2**30)):
        assert offload_args("--memory", text).memory == want
    for bad in ("nan", "lots", "16", "-1G"):
        with pytest.raises(SystemExit):
            offload_args("--memory", bad)
        assert "--memory" in capsys.readouterr().err


@pytest.mark.parametrize(("layers", "experts", "top_k"), [(2, 16, 4), (5, 64, 6), (3, 8, 8), (1, 300, 6)])
def test_fitting_fewer_or_more_layers_and_experts(tmp_path: pathlib.Path, layers: int, experts: int,
                                                  top_k: int) -> None:
    """Onto a 7-layer, 32-expert top-4 shape: layers cycle, experts spread or fold, ids stay distinct
    and in range, exactly as RoutingTrace.map_to gives them."""
    from asyncside.routing import RoutingTrace

    path = write_trace(tmp_path / "t.npz", tokens=(5,), layers=layers, experts=experts, top_k=top_k)
    (user,) = offload.load_routings([str(path)])
    fitted, info = offload.fit_routing(user, shape="s", moe_layers=7, n_experts=32, top_k=4, positions=5,
                                       predictor="none")
    assert fitted.ids.shape == (5, 7, 4) and int(fitted.ids.max()) < 32 and info["wraps"] is False
    assert all(len(set(row)) == 4 for row in fitted.ids.reshape(-1, 4).tolist())
    assert np.array_equal(fitted.ids, RoutingTrace.load(path).map_to(7, 32, 4).ids)
    assert info["mapped_from"] == {"n_layers": layers, "n_experts": experts, "top_k": top_k}
