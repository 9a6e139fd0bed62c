"""Routing trace files a user writes by hand with NumPy (not ``RoutingTrace.save``): what loads, what
is refused (the file and the field named), and how the command line reports them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from asyncside.cli import main
from asyncside.errors import TraceError
from asyncside.policy_replay import compare_policies
from asyncside.routing import MAX_EXPERTS, RoutingTrace, preset

META = json.dumps({"format": "asyncside-routing-trace-npz", "version": 1, "source": "recorded"})


def source() -> RoutingTrace:
    return preset("middle", tokens=12, n_layers=3, n_experts=32, top_k=4, sequences=2)


def write(path: Path, compressed: bool = False, **arrays: Any) -> Path:
    with open(path, "wb") as fh:
        if compressed:
            np.savez_compressed(fh, **arrays)
        else:
            np.savez(fh, **arrays)
    return path


@pytest.mark.parametrize("dtype", [np.int64, np.uint8, np.int16, np.uint64])
def test_any_integer_dtype_loads(tmp_path: Path, dtype: type) -> None:
    tr = source()
    path = write(tmp_path / "t.npz", ids=tr.ids.astype(dtype), lengths=tr.lengths.astype(np.int32),
                 n_experts=np.int64(32), meta=np.array(META))
    back = RoutingTrace.load(path)
    assert back.ids.dtype == np.int32
    np.testing.assert_array_equal(back.ids, tr.ids)
    assert back.lengths.tolist() == tr.lengths.tolist() and back.meta == {"source": "recorded"}


def test_meta_and_lengths_may_be_left_out(tmp_path: Path) -> None:
    tr = source()
    back = RoutingTrace.load(write(tmp_path / "bare.npz", compressed=True, ids=tr.ids, n_experts=32))
    assert back.meta == {} and back.lengths.tolist() == [12] and back.n_sequences == 1
    np.testing.assert_array_equal(back.ids, tr.ids)
    # It replays like any trace: mapped onto a model of another shape.
    assert back.map_to(5, 64, 2).ids.shape == (12, 5, 2)


def test_meta_without_format_with_extra_keys_or_as_bytes(tmp_path: Path) -> None:
    tr = source()
    back = RoutingTrace.load(write(tmp_path / "m.npz", ids=tr.ids, n_experts=32,
                                   meta=np.array(json.dumps({"model": "mine", "tokens": [1, 2]})), extra=np.zeros(3)))
    assert back.meta == {"model": "mine", "tokens": [1, 2]}
    back = RoutingTrace.load(write(tmp_path / "b.npz", ids=tr.ids, n_experts=32, meta=np.array(META.encode())))
    assert back.meta == {"source": "recorded"}


def test_n_experts_as_a_one_element_array(tmp_path: Path) -> None:
    tr = source()
    assert RoutingTrace.load(write(tmp_path / "n.npz", ids=tr.ids, n_experts=np.array([32]))).n_experts == 32
    with pytest.raises(TraceError, match=r"integer scalar, got shape \(2,\)") as info:
        RoutingTrace.load(write(tmp_path / "n2.npz", ids=tr.ids, n_experts=np.array([32, 32])))
    assert info.value.field == "n_experts"


def test_an_npz_under_another_name_loads(tmp_path: Path) -> None:
    tr = source()
    write(tmp_path / "t.npz", ids=tr.ids, n_experts=32)
    (tmp_path / "t.npy").write_bytes((tmp_path / "t.npz").read_bytes())
    np.testing.assert_array_equal(RoutingTrace.load(tmp_path / "t.npy").ids, tr.ids)


def test_wrong_kinds_of_file_are_named(tmp_path: Path) -> None:
    np.save(tmp_path / "single.npy", np.zeros((4, 2, 2), dtype=np.int64))
    (tmp_path / "trace.json").write_text(json.dumps({"ids": [[[0, 1]]], "n_experts": 8}))
    (tmp_path / "dir").mkdir()
    cases = [(tmp_path / "single.npy", "this is a .npy array"), (tmp_path / "trace.json", "this is JSON text"),
             (tmp_path / "dir", "is a directory"), (tmp_path / "no" / "such" / "t.npz", "no such file")]
    for path, message in cases:
        with pytest.raises(TraceError, match=message) as info:
            RoutingTrace.load(path)
        assert info.value.path == str(path) and str(path) in str(info.value)


def test_refusals_name_the_field(tmp_path: Path) -> None:
    tr = source()
    cases: list[tuple[dict[str, Any], str, str]] = [
        ({"ids": tr.ids[:, 0, :], "n_experts": 32}, "ids", r"ids\[:, None, :\]"),
        ({"ids": tr.ids, "n_experts": 32, "meta": np.array({"a": 1}, dtype=object)}, "meta", "object array"),
        ({"ids": tr.ids, "n_experts": 32, "meta": np.frombuffer(META.encode(), dtype=np.uint8)}, "meta",
         "0-d string of JSON text"),
        ({"ids": tr.ids, "n_experts": 32, "meta": np.array(json.dumps({"version": 2}))}, "meta.version",
         "expected version 1"),
        ({"ids": tr.ids, "n_experts": np.int64(MAX_EXPERTS + 1)}, "n_experts", f"at most {MAX_EXPERTS}"),
        ({"ids": tr.ids}, "n_experts", "missing"),
        ({"ids": tr.ids, "n_experts": 32, "lengths": np.int64(12)}, "lengths", "1-d integer array"),
    ]
    for i, (arrays, field, message) in enumerate(cases):
        path = write(tmp_path / f"bad{i}.npz", **arrays)
        with pytest.raises(TraceError, match=message) as info:
            RoutingTrace.load(path)
        assert info.value.field == field and str(path) in str(info.value)


def test_huge_expert_count_maps_onto_a_small_model(tmp_path: Path) -> None:
    tr = preset("middle", tokens=40, n_layers=2, n_experts=4096, top_k=8, sequences=20)
    tr.save(tmp_path / "big.npz")
    mapped = RoutingTrace.load(tmp_path / "big.npz").map_to(4, 64, 8)
    assert mapped.ids.shape == (40, 4, 8) and int(mapped.ids.max()) < 64
    assert all(len(set(row)) == 8 for row in mapped.ids.reshape(-1, 8).tolist())


def test_policy_comparison_of_a_one_token_trace() -> None:
    tr = preset("low", tokens=1, n_layers=2, n_experts=16, top_k=2)
    row = compare_policies({"one": tr}, (0.25,), ["lru"])[0]
    assert row["min"] == 0.0 and np.isnan(row["lru/min"])


def test_cli_refuses_a_bad_trace_with_status_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    np.save(tmp_path / "single.npy", np.zeros((4, 2, 2), dtype=np.int64))
    assert main(["bench", "policy", "--presets", "", "--trace", str(tmp_path / "single.npy")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "single.npy" in err and ".npy array" in err


def test_cli_reports_a_one_token_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    preset("low", tokens=1, n_layers=2, n_experts=16, top_k=2).save(tmp_path / "one.npz")
    assert main(["bench", "policy", "--presets", "", "--fractions", "0.5", "--trace", str(tmp_path / "one.npz")]) == 0
    assert "| one 16x2 | 50% (8/16) | 0.000 |" in capsys.readouterr().out
    assert main(["bench", "policy", "--presets", "", "--split", "--trace", str(tmp_path / "one.npz")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("asyncside bench policy: error: --split:") and "needs at least two tokens" in err


@pytest.mark.parametrize("argv", [["serve", "--port", "0"],
                                  ["bench", "serve", "--duration", "1", "--warmup", "0", "--no-mlx-lm"]])
def test_serving_refuses_a_bad_trace_before_starting(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                     argv: list[str]) -> None:
    np.save(tmp_path / "single.npy", np.zeros((4, 2, 2), dtype=np.int64))
    assert main([*argv, "--routing", str(tmp_path / "single.npy")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "single.npy" in err and ".npy array" in err


def test_a_trace_the_model_cannot_replay_is_a_usage_error() -> None:
    """A trace with fewer slots than the model's top-k (RoutingReplayError) exits 2 like an unreadable one;
    other errors keep status 1."""
    from asyncside.cli import _bad_input
    from asyncside.errors import AsyncsideError
    from asyncside.models.forcing import RoutingReplayError

    assert _bad_input(RoutingReplayError("t.npz: cannot map the trace")) and _bad_input(TraceError("t.npz", "x"))
    assert not _bad_input(AsyncsideError("the pools need more"))


def test_serve_names_a_directory_given_as_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from asyncside.cli import build_parser

    with pytest.raises(SystemExit) as info:
        build_parser(["serve"]).parse_args(["serve", "--routing", str(tmp_path)])
    assert info.value.code == 2 and f"{tmp_path}: is a directory" in capsys.readouterr().err
