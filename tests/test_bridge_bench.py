"""`asyncside bench bridge --quick --json` runs end to end and reports every field (no timings asserted)."""

from __future__ import annotations

import json

import pytest

from asyncside.bench import bridge as bench


def test_quick_bench_reports_every_cell(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["--quick", "--json", "--size", "1024"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["bench"] == "bridge"
    cells = {(r["backend"], r["method"]) for r in result["results"]}
    assert cells == {(b, m) for b in ("asyncio", "uvloop", "trio") for m in ("bridge", "executor", "polling")}
    n = result["settings"]["n"] * result["settings"]["rounds"]
    for r in result["results"]:
        lat = r["latency_us"]
        assert lat["n"] == n
        assert 0 < lat["min"] <= lat["median"] <= lat["p99"] <= lat["max"]
        assert r["completions_per_s"] > 0
        assert isinstance(r["meets_target"], bool)
    assert result["floor_eventfd_wakeup_us"]["n"] == result["settings"]["floor_n"] * result["settings"]["rounds"]
    assert result["loop_thread_issue_cost_us"]["n"] == n
    assert result["targets_us"] == {"median": 30.0, "p99": 100.0}


def test_bench_refuses_bad_settings(capsys: pytest.CaptureFixture[str]) -> None:
    """A usage error in one line, status 2 (python -m asyncside.bench.bridge as the asyncside command)."""
    assert bench.main(["--quick", "--n", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "error: --n must be > 0" in err[0], err


def test_table_renders(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["--quick", "--size", "64", "--n", "5", "--throughput-n", "8"]) == 0
    out = capsys.readouterr().out
    assert "floor" in out and "uvloop" in out and "compl/s" in out
