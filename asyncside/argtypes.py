"""Argparse types shared by the subcommands (kept free of MLX: ``asyncside --help`` imports them)."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def int_at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an integer >= ``low``; a usage error saying so otherwise."""

    def check(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}")
        return value

    check.__name__ = f"integer >= {low}"
    return check
