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
