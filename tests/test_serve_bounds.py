"""tools/serve_bounds.py: the fewest expert reads per token a batch of requests needs (BENCHMARKS.md,
"What eight clients can gain"), checked on traces small enough to count by hand."""

from __future__ import annotations

import importlib.util
import json
import pathlib
from typing import Any

import numpy as np
import pytest

from asyncside.routing import RoutingTrace, preset

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def sb() -> Any:
    spec = importlib.util.spec_from_file_location("serve_bounds", ROOT / "tools" / "serve_bounds.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _trace(seqs: list[list[list[int]]], n_experts: int) -> RoutingTrace:
    """One layer; ``seqs[s][t]`` the experts of token t of sequence s (equal lengths)."""
    ids = np.array([tok for seq in seqs for tok in seq], dtype=np.int32)[:, None, :]
    return RoutingTrace(ids=ids, lengths=np.array([len(s) for s in seqs]), n_experts=n_experts)


def test_a_batch_reads_each_shared_expert_once(sb: Any) -> None:
    # two sequences routing the same experts every token: together they read them once
    same = [[[0, 1]] * 4, [[0, 1]] * 4]
    t = _trace(same, 8)
    assert sb.batch_demands(t, 0, [0, 1]) == [{0, 1}] * 4
    one = sb.reads_per_token(t, rows=2, batch=1)
    two = sb.reads_per_token(t, rows=2, batch=2)
    assert one == {"min": 2 / 4, "lrfu": 2 / 4}  # each sequence reads its two experts once
    assert two == {"min": 2 / 8}  # once for both: half the reads a token


def test_requests_with_their_own_hot_sets_evict_each_other(sb: Any) -> None:
    # each sequence keeps to two experts of its own; two rows hold one set, not both
    apart = [[[0, 1]] * 4, [[2, 3]] * 4]
    t = _trace(apart, 8)
    one = sb.reads_per_token(t, rows=2, batch=1)
    two = sb.reads_per_token(t, rows=2, batch=2)
    assert one["min"] == 2 / 4 and two["min"] == (4 + 2 * 3) / 8  # all four once, then MIN keeps one set and rereads the other
    rows = sb.bound_rows("apart", t, [2], [1, 2])
    assert [r["ceiling_vs_one_request_min"] for r in rows] == [1.0, one["min"] / two["min"]]
    assert rows[1]["ceiling_vs_one_request_min"] < 1.0


def test_the_command_writes_its_table_and_json(sb: Any, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
                                                ) -> None:
    out = tmp_path / "b.json"
    assert sb.main(["--localities", "middle", "--layers", "2", "--experts", "16", "--top-k", "2", "--tokens", "64",
                    "--sequences", "4", "--rows", "4", "--batches", "1,2", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["trace"], r["rows"], r["batch"]) for r in rows] == [("middle", 4, 1), ("middle", 4, 2)]
    assert rows[0]["min_reads_per_token"] <= rows[0]["one_request_lrfu_reads_per_token"]  # MIN is the least
    assert "| middle | 4 | 2 |" in capsys.readouterr().out
    # a batch larger than the trace's sequences, and rows that cannot hold one token, are refused
    assert sb.main(["--localities", "middle", "--layers", "1", "--experts", "16", "--top-k", "2", "--tokens", "8",
                    "--sequences", "2", "--rows", "4", "--batches", "4"]) == 2
    assert sb.main(["--localities", "middle", "--layers", "1", "--experts", "16", "--top-k", "4", "--tokens", "8",
                    "--sequences", "2", "--rows", "2"]) == 2
    trace = preset("low", tokens=32, n_layers=1, n_experts=16, top_k=2, sequences=2)
    path = tmp_path / "mine.npz"
    trace.save(path)
    assert sb.main(["--localities", "", "--routing", str(path), "--rows", "4", "--batches", "1,2"]) == 0
    assert "| mine | 4 | 2 |" in capsys.readouterr().out
