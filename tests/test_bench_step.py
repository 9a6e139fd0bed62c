"""`asyncside bench step --quick` runs end to end: every phase reported, every timed step queued
(a step that fell back to the per-layer path would not be the step this bench is about)."""

from __future__ import annotations

import json

import pytest

from asyncside.bench import step as bench


def test_quick_bench_reports_every_phase(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["--quick", "--json", "--batch", "1"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["bench"] == "step" and [r["batch"] for r in result["rows"]] == [1]
    (row,) = result["rows"]
    ours, theirs = row["asyncside_ms"], row["mlx_lm_ms"]
    assert set(ours) == {*bench.PHASES_OURS, "host", "step"}
    assert set(theirs) == {*bench.PHASES_MLX_LM, "host", "step"}
    assert all(v >= 0 for v in (*ours.values(), *theirs.values()))
    assert 0 < ours["build"] <= ours["host"] <= ours["step"]
    assert 0 < theirs["build"] <= theirs["host"] <= theirs["step"]
    assert row["queued_steps"] == result["steps"] * result["reported_rounds"]
    assert row["host_ratio"] == pytest.approx(ours["host"] / theirs["host"])


def test_bench_refuses_bad_settings(capsys: pytest.CaptureFixture[str]) -> None:
    """A usage error in one line, status 2 (python -m asyncside.bench.step as the asyncside command)."""
    assert bench.main(["--steps", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "error: --steps and --rounds must be >= 1" in err[0], err


def test_table_renders(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["--quick", "--batch", "1"]) == 0
    out = capsys.readouterr().out
    assert "host time per decode step" in out and "asyncside" in out and "mlx-lm" in out


def test_quick_prefill_bench_times_queued_chunks(capsys: pytest.CaptureFixture[str]) -> None:
    # --prefill: each timed step is a fresh chunk of L tokens, queued on our side (the CPU's
    # default prefill is per layer; the bench asks for the queued one, the GPU's default).
    assert bench.main(["--quick", "--json", "--batch", "1", "--prefill", "24"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["prefill"] == 24
    (row,) = result["rows"]
    assert row["queued_steps"] == result["steps"] * result["reported_rounds"]
    # 24 tokens x top-4 route more experts than half a layer keeps: faulted into rows, or (MLX
    # CUDA, host tier) copied into the staging arrays
    assert row["faults_per_step"] + row["staged_per_step"] > 0
    assert 0 < row["asyncside_ms"]["build"] <= row["asyncside_ms"]["host"] <= row["asyncside_ms"]["step"]
    assert 0 < row["mlx_lm_ms"]["build"] <= row["mlx_lm_ms"]["step"]
