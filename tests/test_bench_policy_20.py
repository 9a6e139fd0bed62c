"""``asyncside bench policy`` as a user comparing policies runs it: ``--split`` with ``--policies``,
progress on stderr while a long trace replays (stdout keeps the table or the JSON), and MIN's
vectorised replay giving the hits of the per-step one."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

from asyncside import cli
from asyncside.policies import DEFAULT_POLICY
from asyncside.policy_replay import (
    belady_bypass,
    belady_no_bypass,
    holdout_pair,
    replay_trace,
    total,
    trace_rows,
)
from asyncside.routing import RoutingTrace, preset


def _trace(tmp_path: pathlib.Path) -> pathlib.Path:
    path = tmp_path / "topics.npz"
    preset("middle", tokens=96, n_layers=2, n_experts=16, top_k=2, sequences=2, seed=3).save(path)
    return path


def test_split_replays_each_policy_named(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``bench policy --split --policies lru,adaptive-lrfu`` replayed the default policy (lrfu) alone
    and said nothing of the two named. Each policy named now has its even and split rows, side by
    side, each the hit rate its own replay gives; without --policies the default policy alone."""
    path, out = _trace(tmp_path), tmp_path / "split.json"
    common = ["bench", "policy", "--presets", "", "--trace", str(path), "--fractions", "0.25", "--split", "--quiet"]
    assert cli.main([*common, "--policies", "lru,adaptive-lrfu", "--json", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["policies"] == ["lru", "adaptive-lrfu"]
    assert [r["policy"] for r in result["rows"]] == ["lru", "adaptive-lrfu"]
    _profile, holdout = holdout_pair(RoutingTrace.load(path))
    rows = trace_rows(holdout, 0.25)
    for r in result["rows"]:
        assert r["even"] == total(replay_trace(holdout, rows, r["policy"])).hit_rate
        assert r["split_hit_rate"] == total(replay_trace(holdout, r["split"], r["policy"])).hit_rate
    capsys.readouterr()
    assert cli.main(common) == 0
    table = capsys.readouterr().out
    assert f"| {DEFAULT_POLICY} |" in table and "| lru |" not in table, table


def test_progress_goes_to_stderr_and_json_keeps_stdout(tmp_path: pathlib.Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """A long replay printed nothing until its table (a 58-layer, 8,192-token trace: over a minute of
    silence). Each replay now writes a line to stderr naming the trace, the rows and the policy;
    stdout under --json holds the JSON alone; --quiet writes no line."""
    path = _trace(tmp_path)
    argv = ["bench", "policy", "--presets", "", "--trace", str(path), "--fractions", "0.5", "--policies", "lru"]
    assert cli.main([*argv, "--json"]) == 0
    got = capsys.readouterr()
    assert json.loads(got.out)["policies"] == ["lru"]
    lines = got.err.splitlines()
    assert lines and all(line.startswith("[bench policy] topics 16x2 at 8 rows: ") for line in lines), lines
    assert any(": lru " in line for line in lines) and any(": min " in line for line in lines), lines
    assert cli.main([*argv, "--split", "--json"]) == 0
    assert any(": lru even " in line for line in capsys.readouterr().err.splitlines())
    assert cli.main([*argv, "--quiet"]) == 0
    assert capsys.readouterr().err == ""


def _layers_that_differ() -> RoutingTrace:
    """Two sequences; layer 0 routes over 6 of the 32 experts, layer 1 over all, layer 2 a moving set."""
    rng = np.random.default_rng(7)
    steps = 150
    ids = np.zeros((steps, 3, 4), dtype=np.int32)
    for t in range(steps):
        ids[t, 0] = rng.choice(6, 4, replace=False)
        ids[t, 1] = rng.choice(32, 4, replace=False)
        ids[t, 2] = (rng.choice(8, 4, replace=False) + 4 * (t // 20)) % 32
    return RoutingTrace(ids, np.array([70, 80]), 32, {})


@pytest.mark.parametrize("rows", [4, 5, 9, 16, 32, [4, 12, 7]])
def test_min_replay_counts_what_the_per_step_min_counts(rows: int | list[int]) -> None:
    """MIN with and without bypass now replays every layer at once (numpy) instead of a Python loop
    per step; its hits and accesses per layer are those of belady_bypass / belady_no_bypass."""
    for tr in (_layers_that_differ(), preset("high", tokens=200, n_layers=2, n_experts=24, top_k=4, seed=1)):
        per_layer = [rows] * tr.n_layers if isinstance(rows, int) else rows[:tr.n_layers]
        for method, reference in (("min", belady_bypass), ("min-no-bypass", belady_no_bypass)):
            got = [(c.hits, c.accesses) for c in replay_trace(tr, per_layer, method=method)]
            want = [(c.hits, c.accesses) for c in (reference(tr.layer_steps(layer), [], r)
                                                   for layer, r in enumerate(per_layer))]
            assert got == want, (method, rows)


def test_an_item_given_twice_is_replayed_once(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--policies lru,lru --fractions 0.25,25%`` replayed lru twice into two identical columns and
    each trace twice at 25% into two identical rows. Each is kept once."""
    path, out = _trace(tmp_path), tmp_path / "twice.json"
    argv = ["bench", "policy", "--presets", "", "--trace", str(path), "--quiet", "--fractions", "0.25,25%"]
    assert cli.main([*argv, "--policies", "lru,lru", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["policies"] == ["lru"] and result["fractions"] == [0.25] and len(result["rows"]) == 1
    head = capsys.readouterr().out.splitlines()[0]
    assert [c.strip() for c in head.strip("| ").split("|")].count("lru") == 1, head
    assert cli.main([*argv, "--policies", "lru,lfu,lru", "--split", "--out", str(out)]) == 0
    assert [r["policy"] for r in json.loads(out.read_text())["rows"]] == ["lru", "lfu"]


def test_an_unknown_policy_names_only_what_the_command_line_takes(capsys: pytest.CaptureFixture[str]) -> None:
    """``--policies default`` was refused as "unknown policy 'default'; known: [...] or a Policy
    instance": an instance is the Python API's, no command line can give one. The line lists the
    names alone."""
    from asyncside.policies import POLICIES

    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "policy", "--quick", "--policies", "lru,default"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and err[-1] == (
        "asyncside bench policy: error: argument --policies: unknown policy 'default'; known: "
        + ", ".join(sorted(POLICIES))), err
