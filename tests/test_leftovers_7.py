"""Two leftovers: a ``side_rows`` / ``--side-rows`` larger than a layer's experts is refused (it was
cut down to what fits without a word), and ``bench offload --routing-sequence N`` replays the same
sequence of a multi-sequence trace in every arm."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest
from _cli_support import run_cli

from asyncside import ExpertStore
from asyncside.errors import AsyncsideError
from asyncside.runtime import Runtime, plan_layer
from asyncside.runtime import _plan as plan_mod


def _store(path: pathlib.Path, experts: tuple[int, ...] = (16, 16)) -> ExpertStore:
    rng = np.random.default_rng(0)
    return ExpertStore.create(path, {layer: {"w": rng.integers(0, 255, size=(n, 256), dtype=np.uint8)}
                                     for layer, n in enumerate(experts)})


def test_runtime_refuses_side_rows_past_a_layers_experts_when_made(tmp_path: pathlib.Path) -> None:
    """side_rows=17 on layers of 16 experts was cut to 16 and the plan said the rows were raised
    to "the least rows a layer": now a PlanArgumentError (a ValueError) when the Runtime is made,
    naming the value, the most it can be and why."""
    store = _store(tmp_path / "s")
    with pytest.raises(plan_mod.PlanArgumentError, match=r"^side_rows=17: at most 16 dynamic rows a layer "
                       r"\(this model's layers have 16 experts each; at 16 every row is dynamic"):
        Runtime(store, side_rows=17)
    assert issubclass(plan_mod.PlanArgumentError, ValueError) and issubclass(plan_mod.PlanArgumentError,
                                                                              AsyncsideError)
    with pytest.raises(plan_mod.PlanArgumentError, match=r"^side_rows=17: at most 16"):
        plan_layer(store, 0, 0.25, side_rows=17)
    assert plan_layer(store, 0, 0.25, side_rows=16) == ([], 16)  # the most: every row dynamic
    Runtime(store, side_rows=16)
    with pytest.raises(plan_mod.PlanArgumentError, match=r"^side_rows: expected a number of rows >= 0, got True"):
        Runtime(store, side_rows=True)  # type: ignore[arg-type]


def test_side_rows_beside_pinned_experts_counts_what_is_left_to_stream(tmp_path: pathlib.Path) -> None:
    store = _store(tmp_path / "s")
    with pytest.raises(plan_mod.PlanArgumentError, match=r"^side_rows=15: at most 13 dynamic rows a layer "
                       r"\(layer 0 pins 3 of its 16 experts, which leaves 13 to stream"):
        Runtime(store, pinned={0: [1, 2, 3], 1: []}, side_rows=15)
    Runtime(store, pinned={0: [1, 2, 3], 1: []}, side_rows=13)


def test_side_rows_names_the_layer_with_fewest_experts(tmp_path: pathlib.Path) -> None:
    store = _store(tmp_path / "s", experts=(16, 8))
    with pytest.raises(plan_mod.PlanArgumentError, match=r"^side_rows=9: at most 8 dynamic rows a layer "
                       r"\(layer 1 has 8 experts"):
        Runtime(store, side_rows=9)
    Runtime(store, side_rows=9, layers=[0])  # only the layers the runtime serves count


def test_demo_refuses_side_rows_past_the_experts_before_a_model_loads(tmp_path: pathlib.Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """One line naming --side-rows: said before the model loads or the reference runs (the store
    here is no model at all, which the demo would say next)."""
    store = _store(tmp_path / "s")
    rc, err = run_cli(capsys, "demo", "--model", str(store.path), "--side-rows", "17", "--tokens", "1")
    assert rc == 2 and err.strip().count("\n") == 0 and "Traceback" not in err
    assert err.startswith("asyncside demo: --side-rows 17: at most 16 dynamic rows a layer (this model's layers "
                          "have 16 experts each"), err
    rc, err = run_cli(capsys, "demo", "--model", str(store.path), "--side-rows", "16", "--tokens", "1")
    assert "--side-rows" not in err
    rc, err = run_cli(capsys, "demo", "--model", str(store.path), "--side-rows", "17", "--tokens", "1",
                      "--ranks", "2", "--resident", "0.25")
    assert rc == 2 and err.startswith("asyncside demo: --side-rows 17: at most 16 dynamic rows a layer"), err


def test_a_rank_refuses_side_rows_past_the_experts_before_the_ranks_meet(tmp_path: pathlib.Path) -> None:
    from asyncside.distributed.rank import check_side_rows

    store = _store(tmp_path / "s")
    with pytest.raises(ValueError, match=r"^--side-rows 17: at most 16 dynamic rows a layer"):
        check_side_rows(store.path, 17)
    check_side_rows(store.path, 16)
    check_side_rows(store.path, None)


# ---- bench offload --routing-sequence N --------------------------------------------------------

OFFLOAD_BUDGET = 700 * 2**20


def _two_sequences(path: pathlib.Path, n_layers: int = 2, n_experts: int = 32, top_k: int = 4) -> pathlib.Path:
    """A trace of two sequences routed differently (a low- and a high-locality preset)."""
    from asyncside.routing import RoutingTrace, preset

    a = preset("low", tokens=12, n_layers=n_layers, n_experts=n_experts, top_k=top_k, seed=1)
    b = preset("high", tokens=9, n_layers=n_layers, n_experts=n_experts, top_k=top_k, seed=2)
    RoutingTrace(np.concatenate([a.ids, b.ids]), np.array([12, 9]), n_experts, {"source": "test"}).save(path)
    return path


def test_bench_offload_refuses_a_sequence_the_trace_lacks(tmp_path: pathlib.Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """The demo's one line (the file, the sequence, how many it has), before anything is built; the
    option without --routing, and a negative N, are usage errors naming it."""
    two = _two_sequences(tmp_path / "two.npz")
    base = ("bench", "offload", "--json", "--quiet", "--memory", str(OFFLOAD_BUDGET))
    rc, err = run_cli(capsys, *base, "--routing", str(two), "--routing-sequence", "2")
    assert rc == 2 and err.strip().count("\n") == 0 and "Traceback" not in err, err
    assert err.strip() == f"asyncside bench offload: error: --routing-sequence 2 out of range: {two} has 2 sequences", err
    rc, err = run_cli(capsys, *base, "--routing-sequence", "1")
    assert rc == 2 and err.strip().count("\n") == 0, err
    assert "--routing-sequence picks a sequence of a --routing trace: give --routing FILE" in err, err
    rc, err = run_cli(capsys, *base, "--routing", str(two), "--routing-sequence", "-1")
    assert rc == 2 and "argument --routing-sequence: expected an integer >= 0, got '-1'" in err, err


def test_bench_offload_names_the_file_that_lacks_the_sequence(tmp_path: pathlib.Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    from asyncside.routing import RoutingTrace

    two = _two_sequences(tmp_path / "two.npz")
    whole = RoutingTrace.load(two)
    single = tmp_path / "single.npz"
    RoutingTrace(whole.sequence(0), np.array([12]), whole.n_experts, {"source": "test"}).save(single)
    rc, err = run_cli(capsys, "bench", "offload", "--json", "--quiet", "--routing", str(two), "--routing", str(single),
                      "--routing-sequence", "1")
    assert rc == 2 and f"--routing-sequence 1 out of range: {single} has 1 sequence" in err, err
    assert str(two) not in err


def test_every_arm_of_bench_offload_replays_the_sequence_asked_for(quick_store: pathlib.Path, tmp_path: pathlib.Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Each arm is a child process given a spec (``--child SPEC``) naming the routing file it replays:
    with --routing-sequence 1 the mlx-lm reference, asyncside and the slot cache all replay sequence 1
    of the file (not 0), Belady's MIN reads the same file, and the JSON records the sequence. The
    children and the cgroup are stood in (no benchmark runs)."""
    import contextlib
    import json

    from _cli_support import offload_args
    from _offload_support import offload_budget

    from asyncside.bench import offload
    from asyncside.routing import RoutingTrace

    two = _two_sequences(tmp_path / "two.npz")
    whole = RoutingTrace.load(two)
    assert not np.array_equal(whole.sequence(0)[:9], whole.sequence(1))
    arms: list[tuple[str, np.ndarray, int]] = []

    def child(spec: dict[str, object], cgroup: object, timeout: float, **_kw: object) -> dict[str, object]:
        json.dumps(spec)  # what --child SPEC carries
        replayed = RoutingTrace.load(str(spec["routing"]))  # the file is gone once the bench returns
        arms.append((str(spec["system"]), replayed.sequence(0), replayed.n_sequences))
        return {"system": spec["system"], "status": "stood in"}

    monkeypatch.setattr(offload, "_child", child)
    monkeypatch.setattr(offload, "_runs_cgroup", lambda *a: "a stand-in cgroup")
    monkeypatch.setattr(offload, "_bandwidth", lambda *a, **k: {"GBps": 1.0})
    monkeypatch.setattr(offload, "drop_caches", lambda: True)
    monkeypatch.setattr(offload, "MemoryCgroup", lambda limit: contextlib.nullcontext())
    res = offload.run_offload_bench(offload_args("--stores", str(quick_store), "--memory",
                                                 str(offload_budget(OFFLOAD_BUDGET)),
                                                 "--store-ratio", "0.001", "--routing", str(two),
                                                 "--routing-sequence", "1"))
    assert [system for system, _ids, _n in arms] == ["mlx-lm", *offload.SYSTEMS]
    for system, ids, n in arms:
        assert n == 1 and np.array_equal(ids, whole.sequence(1)), system
    assert res["settings"]["routing_sequence"] == 1
    (shape,) = res["shapes"]
    assert shape["routings"]["two"]["sequence"] == 1 and shape["routings"]["two"]["sequence_tokens"] == 9
    assert all(r["routing"]["sequence"] == 1 for r in res["runs"])
    assert "sequence 1 of 2 replayed (9 tokens)" in offload.routing_note(shape["routings"]["two"])
