"""``--routing-sequence N``: demo and bench generate replay the N-th sequence of a trace of several
(each sequence routes other experts, so the runs differ), stay exact, and say which sequence; a
sequence the trace lacks, or the option without ``--routing``, is one line and exit 2."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

from asyncside.cli import main
from asyncside.routing import RoutingTrace, preset


def two_sequences(path: pathlib.Path, n_experts: int, top_k: int) -> pathlib.Path:
    """A trace of two sequences routed differently (a low- and a high-locality preset)."""
    a = preset("low", tokens=48, n_layers=2, n_experts=n_experts, top_k=top_k, seed=1)
    b = preset("high", tokens=40, n_layers=2, n_experts=n_experts, top_k=top_k, seed=2)
    RoutingTrace(np.concatenate([a.ids, b.ids]), np.array([48, 40]), n_experts, {"source": "test"}).save(path)
    return path


def test_demo_replays_the_sequence_asked_for(tmp_path: pathlib.Path, quick_store: pathlib.Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    rec = tmp_path / "rec.npz"
    base = ["demo", "--model", str(quick_store), "--tokens", "5", "--json", "--resident", "0.25"]
    capsys.readouterr()
    assert main([*base, "--record-routing", str(rec)]) == 0  # the model's own shape
    shape = RoutingTrace.load(rec)
    trace = two_sequences(tmp_path / "two.npz", shape.n_experts, shape.top_k)
    capsys.readouterr()
    runs = {}
    for seq in (0, 1):
        assert main([*base, "--routing", str(trace), "--routing-sequence", str(seq)]) == 0
        runs[seq] = json.loads(capsys.readouterr().out)
        assert runs[seq]["tokens_identical"] is True and runs[seq]["audit_clean"] is True
        assert runs[seq]["routing"]["sequence"] == seq and runs[seq]["routing"]["sequences"] == 2
    assert runs[0]["routing"]["sequence_tokens"] == 48 and runs[1]["routing"]["sequence_tokens"] == 40
    assert runs[0]["hit_rate"] != runs[1]["hit_rate"]  # other experts were routed
    assert main([*base, "--routing", str(trace), "--routing-sequence", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"asyncside demo: error: --routing-sequence 2 out of range: {trace} has 2 sequences"], err
    assert main([*base, "--routing-sequence", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["asyncside demo: error: --routing-sequence picks a sequence of a --routing trace: "
                   "give --routing FILE"], err


def test_bench_generate_replays_the_sequence_asked_for(tmp_path: pathlib.Path, quick_store: pathlib.Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    trace = two_sequences(tmp_path / "two.npz", 40, 8)
    args = ["bench", "generate", "--quick", "--json", "--model", str(quick_store), "--plot", "none", "--tokens", "3",
            "--residency", "0.25", "--no-drop-caches", "--modes", "default", "--routing", str(trace)]
    capsys.readouterr()
    assert main([*args, "--routing-sequence", "1"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["tokens_identical"] is True and res["routing"]["sequence"] == 1
    assert main([*args, "--routing-sequence", "5"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"asyncside bench generate: error: --routing-sequence 5 out of range: {trace} has 2 sequences"], err
    with pytest.raises(SystemExit) as info:  # argparse's refusal: the usage, then the line that says why
        main([*args, "--routing-sequence", "-1"])
    assert info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
        "argument --routing-sequence: expected an integer >= 0, got '-1'")
