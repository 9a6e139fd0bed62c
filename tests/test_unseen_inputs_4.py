"""Inputs the repository never made, fourth sweep: memory sizes as people type them (exponents of
either sign, units that overflow), routing traces at their edges (one token, top-k equal to the
experts, written by hand) and user configs for ``bench offload --shapes PATH:LAYERS``. What runs says
what it did; what is refused is one line naming the option, file or field and what is accepted.
"""

from __future__ import annotations


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
