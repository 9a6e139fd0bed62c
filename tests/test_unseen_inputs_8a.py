"""Unseen inputs, round 8a: options whose defaults could not be told from a given value, counts
past a layer's experts, impossible bench device combinations, a distributed rank's usage errors,
and bench shapes cached by older code. Each is one line and exit status 2 (or a LedgerError /
PlanArgumentError naming the most), before any work."""

from __future__ import annotations

import pytest
from _cli_support import run_cli


def _never(*_args: object, **_kwargs: object) -> None:
    raise AssertionError("the command went on past its usage error")


# ---- --routing-sequence without --routing ----------------------------------------------------

ROUTING_NEEDED = "--routing-sequence picks a sequence of a --routing trace: give --routing FILE"


@pytest.mark.parametrize("value", ["0", "1"])
def test_demo_refuses_routing_sequence_without_routing(value: str, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """The default was 0, so ``--routing-sequence 0`` alone was taken as not given and ignored."""
    import asyncside.demo as demo

    monkeypatch.setattr(demo, "run_demo", _never)
    rc, err = run_cli(capsys, "demo", "--routing-sequence", value)
    assert rc == 2 and err.strip().splitlines() == [f"asyncside demo: error: {ROUTING_NEEDED}"], err


def test_demo_with_ranks_refuses_routing_sequence_without_routing(monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    import asyncside.distributed.demo as ranks_demo

    monkeypatch.setattr(ranks_demo, "ranks_demo_main", _never)
    rc, err = run_cli(capsys, "demo", "--ranks", "2", "--routing-sequence", "1")
    assert rc == 2 and err.strip().splitlines() == [f"asyncside demo: error: {ROUTING_NEEDED}"], err


def test_bench_generate_refuses_routing_sequence_zero_without_routing(monkeypatch: pytest.MonkeyPatch,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    from asyncside.bench import generate

    monkeypatch.setattr(generate, "_resolve_store", _never)
    rc, err = run_cli(capsys, "bench", "generate", "--quick", "--json", "--plot", "none", "--routing-sequence", "0")
    assert rc == 2 and err.strip().count("\n") == 0 and ROUTING_NEEDED in err, err


def test_bench_offload_refuses_routing_sequence_zero_without_routing(monkeypatch: pytest.MonkeyPatch,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    from asyncside.bench import offload

    monkeypatch.setattr(offload, "process_baseline", _never)
    rc, err = run_cli(capsys, "bench", "offload", "--json", "--quiet", "--routing-sequence", "0")
    assert rc == 2 and err.strip().count("\n") == 0 and ROUTING_NEEDED in err, err


def test_routing_sequence_not_given_is_no_problem() -> None:
    from asyncside.demo import routing_sequence_problem

    assert routing_sequence_problem(None, None) is None
    assert routing_sequence_problem(None, 0) == ROUTING_NEEDED
