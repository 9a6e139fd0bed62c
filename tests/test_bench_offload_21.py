"""bench offload's verdict on tokens: a run of asyncside that compared no token is not 'identical'."""

from __future__ import annotations

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
