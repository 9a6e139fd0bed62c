"""Argparse types shared by the subcommands (kept free of MLX: ``asyncside --help`` imports them)."""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from collections.abc import Callable, Iterable
from typing import Any


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


def positive_ints(text: str) -> list[int]:
    """An argparse type: integers >= 1 separated by commas (client counts, rows, batch sizes); a
    usage error saying so otherwise."""
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return counts


def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0 (seconds, a ratio); a usage error saying so otherwise
    (0, a negative number, NaN and infinity are refused, not carried into a run)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
    return value


positive_float.__name__ = "number > 0"


def nonnegative_float(text: str) -> float:
    """An argparse type: a finite number >= 0 (seconds where 0 means none); a usage error saying so
    otherwise (a negative number, NaN and infinity are refused, not carried into a run)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return value


nonnegative_float.__name__ = "number >= 0"


#: ``--vocab small``: the embedded model's vocabulary; below 258 the byte tokenizer's tokens do not fit
SMALL_VOCAB, LEAST_VOCAB = 512, 258


def vocab_size(text: str) -> int | None:
    """An argparse type for a bench shape's ``--vocab``: ``full`` (None: the shape's own), ``small``
    (:data:`SMALL_VOCAB`) or an integer >= 258 (the byte tokenizer's tokens)."""
    t = text.strip().lower()
    if t == "full":
        return None
    if t == "small":
        return SMALL_VOCAB
    try:
        value = int(t)
    except ValueError:
        value = 0
    if value < LEAST_VOCAB:
        raise argparse.ArgumentTypeError(f"expected an integer >= {LEAST_VOCAB} (the byte tokenizer's tokens), "
                                         f"'small' ({SMALL_VOCAB}) or 'full' (the shape's own), got {text!r}")
    return value


vocab_size.__name__ = "vocabulary size"


def parse_resident(text: str, *, allow_auto: bool = True) -> float | str:
    """The pools' size as ``--resident`` writes it: a fraction of each layer's experts in [0, 1]
    (``0.25``), a percentage (``25%``), and with ``allow_auto`` the word ``auto``, in any case and
    with spaces around it. A ValueError saying what was expected otherwise. One parser for the
    command line and ``Runtime(resident=...)``, so the Python API takes what the CLI takes."""
    expected = "a fraction such as 0.25, a percentage such as 25%" + (", or 'auto'" if allow_auto else "")
    t = text.strip().lower()
    if allow_auto and t == "auto":
        return "auto"
    try:
        value = float(t[:-1]) / 100 if t.endswith("%") else float(t)
    except ValueError:
        value = math.nan
    if not 0.0 <= value <= 1.0:  # NaN fails this too
        raise ValueError(f"expected a fraction in [0, 1], got {text}; {expected}")
    return value + 0.0  # a negative zero loses its sign, which the titles showed


def resident_fraction(*, allow_auto: bool = True) -> Callable[[str], float | str]:
    """An argparse type for ``--resident``, shared by ``demo``, ``serve`` and ``convert``: what
    :func:`parse_resident` takes; a usage error saying so otherwise.

    0 is a setting, not a mistake: nothing resident, every expert streamed through the least rows the
    runtime plans (``Runtime(resident=0.0)``), or for ``convert`` an empty recorded resident set.
    """

    def check(text: str) -> float | str:
        try:
            return parse_resident(text, allow_auto=allow_auto)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    check.__name__ = "fraction in [0, 1]" + (" or 'auto'" if allow_auto else "")
    return check


def file_name(text: str) -> str:
    """An argparse type: a file path that is not empty (``--routing "$TRACE"`` of an unset variable
    ran without the file, as if the option were left out); the file is read and checked later."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"expected a file name, got {text!r}")
    return os.path.expanduser(text)  # a quoted "~/t.npz" (a variable's) as --model reads "~"


def writable_file(text: str) -> str:
    """An argparse type: a file path whose directory exists and is writable (checked before a run
    whose end writes it)."""
    text = file_name(text)
    parent = os.path.dirname(os.path.abspath(text)) or "."
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text}: is a directory; expected a file name")
    if not os.path.isdir(parent):
        raise argparse.ArgumentTypeError(f"{text}: no such directory {parent}")
    if not os.access(parent, os.W_OK):
        raise argparse.ArgumentTypeError(f"{text}: directory {parent} is not writable")
    return text


def file_in_the_way(path: str | os.PathLike[str]) -> str | None:
    """The nearest of ``path`` and its parents that exists, where it is no directory (so no
    directory can be made at ``path``); None where it is one, or nothing of the path exists."""
    at = os.path.abspath(path)
    while not os.path.lexists(at):
        up = os.path.dirname(at)
        if up == at:
            return None
        at = up
    return None if os.path.isdir(at) else at


def directory_problem(text: str) -> str | None:
    """Why no directory can be at ``text`` (None where it is one, or can be made): it, or the
    nearest of its parents that exists, is a file, or its name is no UTF-8. Said before a run that
    builds or converts there (pathlib's FileExistsError / NotADirectoryError, or MLX's
    "std::bad_cast", traceback otherwise)."""
    from .store import path_not_utf8, printable_path

    if path_not_utf8(text) is not None:  # MLX writes through UTF-8 paths only ("std::bad_cast" from save_safetensors)
        return f"{printable_path(text)} is not valid UTF-8 (a name in another encoding): MLX writes UTF-8 paths only"
    at = file_in_the_way(text)
    if at is None:
        return None
    return f"{at} is a file" if at == os.path.abspath(text) else f"{at} is a file, not a directory to make it in"


def directory(text: str) -> str:
    """An argparse type: a directory, existing or made on first use (``--cache-dir``, convert's
    STORE_DIR); not an empty name (an unset variable's, which would be the current directory).
    A leading ``~`` is the home directory, as ``--model`` reads it: a quoted ``"~/stores/q"`` (a
    variable's) made a directory named ``~`` in the working directory, where ``--model`` then
    looked in the home directory."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"expected a directory, got {text!r}")
    text = os.path.expanduser(text)
    problem = directory_problem(text)
    if problem is not None:
        from .store import printable_path  # a stream writes it, whatever its bytes

        raise argparse.ArgumentTypeError(f"{printable_path(text)}: expected a directory; {problem}")
    return text


def policy_name(text: str) -> str:
    """An eviction policy's name (:data:`asyncside.policies.POLICIES`, aliases included), checked when
    parsed so a misspelt one is a usage error before any model loads."""
    from .policies import POLICIES, POLICY_NAMES

    if text.lower() not in POLICIES:
        raise argparse.ArgumentTypeError(f"unknown policy {text!r}; choose from {', '.join(POLICY_NAMES)}")
    return text


#: Where a word starts as a negative number (``-1G``, ``-.5G``): argparse takes it for an option unless it
#: is a plain number (``-1``, ``-.5``), and says the option before it "expected one argument".
_NEGATIVE_VALUE = re.compile(r"-[0-9.]")


class Once(argparse.Action):
    """An option that takes one value and may be given once: a second ``--routing B`` after
    ``--routing A`` is refused (argparse would keep B and drop A without a word)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        seen = f"_given_{self.dest}"
        if getattr(namespace, seen, None) is not None:
            raise argparse.ArgumentError(self, f"given twice ({getattr(namespace, seen)} and {values}): "
                                               f"it takes one file; give it once")
        setattr(namespace, seen, values)
        setattr(namespace, self.dest, values)


class CommandParser(argparse.ArgumentParser):
    """The parser of every ``asyncside`` command (its subcommands' parsers are of this class too).

    A size option (shown as ``SIZE`` in ``--help``) followed by a value starting as a negative number
    (``--memory -1G``) is read as ``--memory=-1G``: the option's own type refuses it, saying what a
    size is, instead of argparse's "expected one argument". An option as the next word
    (``--memory --tokens 4``) is still a missing value.
    """

    def parse_known_args(self, args: Iterable[str] | None = None,
                         namespace: Any = None) -> tuple[Any, list[str]]:
        words = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(self._join_negative_sizes(words), namespace)

    def _join_negative_sizes(self, words: list[str]) -> list[str]:
        sized = {o for a in self._actions if a.metavar == "SIZE" and a.nargs is None for o in a.option_strings}
        every = [o for a in self._actions for o in a.option_strings]
        out: list[str] = []
        i = 0
        while i < len(words):
            word = words[i]
            if word == "--":  # what follows is positional
                return out + words[i:]
            if i + 1 < len(words) and _NEGATIVE_VALUE.match(words[i + 1]) and self._names(word, sized, every):
                out.append(f"{word}={words[i + 1]}")
                i += 2
            else:
                out.append(word)
                i += 1
        return out

    def _names(self, word: str, sized: set[str], every: list[str]) -> bool:
        """Whether ``word`` names one of the options ``sized``, in full or, as argparse takes it, by
        an unambiguous abbreviation (``--mem``)."""
        if word in every or not (self.allow_abbrev and word.startswith("--")):
            return word in sized
        matches = [o for o in every if o.startswith(word)]
        return len(matches) == 1 and matches[0] in sized
