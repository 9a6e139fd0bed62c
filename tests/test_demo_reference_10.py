"""The demo's reference figures under the name of the run that made them, and the limit its
"decode tokens/s of ..." row (and bench offload's "of limit" column) is held to."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest
from _cli_support import run_cli

from asyncside.cli import main


def _demo(capsys: pytest.CaptureFixture[str], store: pathlib.Path, *argv: str) -> dict[str, Any]:
    capsys.readouterr()
    assert main(["demo", "--model", str(store), "--tokens", "4", "--resident", "0.25", "--json", *argv]) == 0
    res: dict[str, Any] = json.loads(capsys.readouterr().out)
    assert res["tokens_identical"] in (True, None) and res["audit_clean"] is True
    return res


def _table_text(res: dict[str, Any], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> str:
    from asyncside import demo

    monkeypatch.setenv("COLUMNS", "400")  # one line a row: a row's label is not wrapped
    demo._table(res)
    return capsys.readouterr().out


def test_slot_cache_figures_are_not_called_all_resident(quick_store: pathlib.Path, capsys: pytest.CaptureFixture[str],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Under --memory with the slot cache as the reference, ``all_resident`` held the slot cache's
    figures; and the row held to the I/O limit alone was labelled min(compute, I/O limit)."""
    res = _demo(capsys, quick_store, "--memory", "400M", "--reference", "slot-cache")
    assert res["reference"] == "slot-cache" and res["all_resident"] is None
    assert res["slot_cache"]["tokens"] == res["streaming"]["tokens"] == 4
    assert res["reference_reads"]["bytes_read"] > 0  # the slot cache read its misses
    lim = res["limits"]
    assert lim["compute_limit_tokens_per_s"] is None and lim["io_limit_tokens_per_s"] > 0
    assert lim["of_limit_against"] == "I/O limit"
    assert lim["of_limit"] == pytest.approx(res["streaming"]["decode_tokens_per_s"] / lim["io_limit_tokens_per_s"])
    out = _table_text(res, capsys, monkeypatch)
    assert "decode tokens/s of the I/O limit (compute limit not measured: the reference was the slot cache)" in out
    assert "min(compute" not in out and "slot cache (reference)" in out


def test_no_reference_has_no_reference_figures(quick_store: pathlib.Path, capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """--reference none: no figures under either name (they were zeros under ``all_resident``)."""
    res = _demo(capsys, quick_store, "--memory", "400M", "--reference", "none")
    assert res["reference"] == "none" and res["all_resident"] is None and res["slot_cache"] is None
    assert res["tokens_identical"] is None and res["limits"]["of_limit_against"] == "I/O limit"
    out = _table_text(res, capsys, monkeypatch)
    assert "of the I/O limit (compute limit not measured: no reference ran)" in out and "min(compute" not in out


def test_all_resident_figures_keep_their_name_and_the_limits_say_which(
        quick_store: pathlib.Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The all-resident reference's figures stay under ``all_resident``; the row says min(compute,
    I/O limit) only where both were measured (without --memory the disk is not probed: the compute
    limit alone)."""
    res = _demo(capsys, quick_store, "--memory", "400M", "--reference", "all-resident")
    assert res["reference"] == "all-resident" and res["slot_cache"] is None
    assert res["all_resident"]["tokens"] == res["streaming"]["tokens"] == 4
    lim = res["limits"]
    assert lim["of_limit_against"] == "min(compute, I/O limit)"
    bound = min(lim["compute_limit_tokens_per_s"], lim["io_limit_tokens_per_s"])
    assert lim["of_limit"] == pytest.approx(res["streaming"]["decode_tokens_per_s"] / bound)
    assert "decode tokens/s of min(compute, I/O limit)" in _table_text(res, capsys, monkeypatch)
    res = _demo(capsys, quick_store)
    lim = res["limits"]
    assert res["reference"] == "all-resident" and lim["io_limit_tokens_per_s"] is None
    assert lim["of_limit_against"] == "compute limit"
    out = _table_text(res, capsys, monkeypatch)
    assert "of the compute limit (I/O limit not measured: the disk is probed under --memory only)" in out
    assert "min(compute" not in out


def test_tokens_that_differ_name_the_reference_that_ran(monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    from asyncside import demo

    result = {"reference": "slot-cache", "tokens_identical": False, "audit_clean": True, "text": "a b",
              "reference_text": "a c"}
    monkeypatch.setattr(demo, "run_demo", lambda args: result)
    monkeypatch.setattr(demo, "_table", lambda res: None)
    rc, err = run_cli(capsys, "demo", "--tokens", "2")
    assert rc == 1 and "tokens differ from the slot-cache run" in err and "all-resident" not in err, err
    assert "slot-cache:   'a c'" in err, err


def test_offload_of_limit_says_which_limit_it_is_held_to(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the compute limit was not measured (its run failed) or the I/O limit not (no misses),
    the "of limit" cell is of the other alone, and says so."""
    from asyncside.bench import offload

    monkeypatch.setattr(offload, "belady_of_run", lambda *a, **k: {"hit_rate": 0.5})
    mb = offload.MB
    sh = {"record_bytes": mb, "io": {"GBps": 1000 * mb / 1e9}, "store": "store"}  # 1000 records a second

    def run_of(misses: int, compute: float | None) -> dict[str, Any]:
        run: dict[str, Any] = {"status": "ok", "tokens": [1] * 10, "rows_per_layer": 4, "read_bytes": 0,
                               "decode_tokens_per_s": 5.0, "stats": {"hits": 50, "misses": misses},
                               "shape": "s", "locality": "low", "system": "asyncside"}
        offload._figures(run, sh, "trace.npz", {"tokens": [1] * 10, "decode_tokens_per_s": compute})
        return run

    both = run_of(100, 20.0)  # I/O limit 100 tok/s, compute 20
    assert both["of_limit_against"] == "min(compute, I/O limit)" and both["of_limit"] == 0.25
    col = offload.COLUMNS.index("of limit")
    assert offload._row(both)[col] == "0.25x"
    io_only = run_of(100, None)
    assert io_only["of_limit_against"] == "I/O limit" and io_only["of_limit"] == 0.05
    assert offload._row(io_only)[col] == "0.05x (of the I/O limit; the other not measured)"
    compute_only = run_of(0, 20.0)
    assert compute_only["of_limit_against"] == "compute limit"
    assert offload._row(compute_only)[col] == "0.25x (of the compute limit; the other not measured)"
