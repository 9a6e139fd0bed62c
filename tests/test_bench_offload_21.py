"""bench offload's verdict on tokens: a run of asyncside that compared no token is not 'identical'."""

from __future__ import annotations

import pathlib

from asyncside.bench.offload import tokens_identical


def run(system: str, match: bool | None) -> dict[str, object]:
    return {"system": system, "tokens_match_reference": match}


def test_asyncside_runs_that_ended_before_a_token_are_not_identical() -> None:
    # Every asyncside run crashed (a native error, a timeout before decoding): the verdict was
    # "identical" and the exit status 0, since a run with no tokens was "not different".
    assert not tokens_identical([run("asyncside", None), run("slot-cache", True), run("mlx-lm", True)])
    assert not tokens_identical([run("asyncside", None)])


def test_a_baseline_killed_by_the_budget_does_not_spoil_the_verdict() -> None:
    assert tokens_identical([run("asyncside", True), run("mlx-lm", None), run("slot-cache", True)])
    assert not tokens_identical([run("asyncside", True), run("slot-cache", False)])
    assert not tokens_identical([run("asyncside", False), run("mlx-lm", True)])


def test_the_least_budget_of_a_built_store_counts_the_plans_headroom(quick_store: pathlib.Path) -> None:
    # The plan's headroom is estimated from the store's model (runtime._plan.estimate_headroom):
    # the least budget offered still counted the fixed MIN_HEADROOM, a figure the plan no longer keeps.
    from asyncside import ExpertStore, memory
    from asyncside.bench.offload import least_budget
    from asyncside.runtime._plan import plan_headroom

    store = ExpertStore.open(quick_store)
    shape = {"moe_layers": 2, "top_k": 4, "record_bytes": 1 << 20, "store_bytes": 10 << 20,
             "expert_bytes": 8 << 20, "process_bytes": 0}
    unbuilt = least_budget(shape)
    built = least_budget({**shape, "store": str(quick_store)})
    assert built - unbuilt == plan_headroom(store) - memory.MIN_HEADROOM
