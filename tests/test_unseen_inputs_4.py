"""Inputs the repository never made, fourth sweep: memory sizes as people type them (exponents of
either sign, units that overflow), routing traces at their edges (one token, top-k equal to the
experts, written by hand) and user configs for ``bench offload --shapes PATH:LAYERS``. What runs says
what it did; what is refused is one line naming the option, file or field and what is accepted.
"""

from __future__ import annotations

import pathlib

import numpy as np
import pytest
from _cli_support import run_cli

from asyncside.memory import memory_arg, parse_size


@pytest.mark.parametrize(("text", "size"), [
    ("1e-3G", 1073741), ("1e3M", 1000 << 20), ("1e+3K", 1000 << 10), ("  2G ", 2 << 30), ("2g", 2 << 30),
    ("2GiB", 2 << 30), ("2GB", 2 << 30), ("1.5G", 3 << 29), ("+1G", 1 << 30), (".5G", 1 << 29),
])
def test_a_size_takes_an_exponent_of_either_sign(text: str, size: int) -> None:
    """``--memory 1e-3G`` (about 1 MiB) was "expected a size such as 800M, 1.5G or 4096" while
    ``1e3M`` was taken: the number's pattern had no minus sign for the exponent."""
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["1e300T", "1e308G", "1e400"])
def test_a_size_that_overflows_in_its_unit_is_one_line(text: str, capsys: pytest.CaptureFixture[str]) -> None:
    """``--memory 1e300T`` ended in OverflowError (cannot convert float infinity to integer): the
    number was finite, the number in its unit was not."""
    with pytest.raises(ValueError, match="expected a finite size"):
        parse_size(text, what="memory")
    rc, err = run_cli(capsys, "bench", "offload", "--memory", text)
    assert rc == 2 and "argument --memory" in err and "finite size" in err and "Traceback" not in err, err


def test_a_budget_of_one_byte_is_one_byte() -> None:
    import argparse

    with pytest.raises(argparse.ArgumentTypeError, match=r"memory '1' is 1 byte; expected at least 4K"):
        memory_arg("1")
    with pytest.raises(argparse.ArgumentTypeError, match=r"memory '1K' is 1024 bytes; expected at least 4K"):
        memory_arg("1K")


def _trace(path: pathlib.Path, ids: np.ndarray, n_experts: int, **arrays: object) -> str:
    np.savez(path, ids=ids, n_experts=n_experts, **arrays)
    return str(path)


def test_routing_info_gives_min_where_no_access_hits(tmp_path: pathlib.Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """A trace of one token: LRU said 0.0% and Belady's MIN was left out without a word (its ratio
    to LRU divides by it). "predictions: none per token" is "predictions: none"."""
    from asyncside import cli

    path = _trace(tmp_path / "one.npz", np.array([[[0, 1]]]), 8)
    assert cli.main(["routing", "info", path]) == 0
    out = capsys.readouterr().out
    assert "predictions: none\n" in out and "none per token" not in out, out
    assert out.count("LRU 0.0% hits, Belady's MIN 0.0%") == 2, out
    _trace(tmp_path / "pred.npz", np.array([[[0, 1]]]), 8, predicted=np.array([[[0, 1, 2]]]))
    assert cli.main(["routing", "info", str(tmp_path / "pred.npz"), "--no-min"]) == 0
    assert "predictions: 3 ids per token" in capsys.readouterr().out


def test_widening_a_trace_that_routes_every_expert_says_so(tmp_path: pathlib.Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """A top-16 trace of 16 experts: ``routing widen --top-k 17`` said "top_k must be an int in (16,
    16]", an empty range."""
    ids = np.tile(np.arange(16), (3, 1, 1))
    path = _trace(tmp_path / "all.npz", ids, 16)
    rc, err = run_cli(capsys, "routing", "widen", path, str(tmp_path / "out.npz"), "--top-k", "17")
    assert rc == 2 and "routes every one of its 16 experts per token already" in err, err
    assert "(16, 16]" not in err and len(err.strip().splitlines()) == 1, err
