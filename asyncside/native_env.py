"""The ``ASYNCSIDE_*`` environment variables the native extension reads itself, checked from Python.

The extension reads these with ``getenv`` and quietly falls back to its default on a value it cannot
parse (``ASYNCSIDE_FAULT_READ_THREADS=abc``), or caps one out of range; :func:`check_native_env`
refuses such a value before a :class:`~asyncside.runtime.Runtime` starts, naming the variable, the
value and what is accepted (docs/api.md, "Environment variables"). No MLX and no native import.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

from .errors import EnvVarError

#: The largest thread count the native pools take (larger values were capped there, not honoured).
MAX_THREADS = 64
#: ASYNCSIDE_FAULT_READ_CHUNK: a multiple of this many bytes (O_DIRECT alignment) ...
CHUNK_ALIGN = 4096
#: ... up to this many.
MAX_CHUNK = 1 << 30
#: ASYNCSIDE_FAULT_READ_WINDOW: pieces in flight at most (the size of a reading thread's ring).
MAX_WINDOW = 32


def _count(low: int, high: int) -> Callable[[str], bool]:
    def ok(value: str) -> bool:
        return re.fullmatch(r"[0-9]+", value) is not None and low <= int(value) <= high

    return ok


def _chunk(value: str) -> bool:
    if re.fullmatch(r"[0-9]+", value) is None:
        return False
    n = int(value)
    return n == 0 or (n % CHUNK_ALIGN == 0 and n <= MAX_CHUNK)


def _one_of(*words: str) -> Callable[[str], bool]:
    return lambda value: value in words


@dataclass(frozen=True)
class NativeVariable:
    """One variable the extension reads: what it sets, what it accepts (in words), its default."""

    name: str
    sets: str
    expected: str
    default: str
    accepts: Callable[[str], bool]
    empty_is_default: bool = True  # the extension reads an empty value as unset


#: Every ``ASYNCSIDE_*`` variable the native extension reads (``getenv`` in native/), by name.
NATIVE_VARIABLES: dict[str, NativeVariable] = {v.name: v for v in (
    NativeVariable("ASYNCSIDE_FAULT_READ_THREADS", "worker threads of the parallel fault reads",
                   f"an integer from 0 to {MAX_THREADS} (0: every read on the calling thread)",
                   "min(7, cores / 2 - 1), 0 below 4 cores", _count(0, MAX_THREADS)),
    NativeVariable("ASYNCSIDE_FAULT_BACKGROUND_THREADS", "threads of the background (prefetch) fault reads",
                   f"an integer from 1 to {MAX_THREADS}", "max(2, the fault read threads)", _count(1, MAX_THREADS)),
    NativeVariable("ASYNCSIDE_FAULT_READ_CHUNK", "bytes an O_DIRECT fault read of a record is split into",
                   f"0 (whole records) or a multiple of {CHUNK_ALIGN} bytes up to {MAX_CHUNK}", "1 MiB", _chunk,
                   empty_is_default=False),  # the extension refuses an empty one when it loads
    NativeVariable("ASYNCSIDE_FAULT_READ_WINDOW",
                   "pieces a streamed resolve keeps in flight while it reads its O_DIRECT records in order",
                   f"an integer from 0 to {MAX_WINDOW} (0: a background job per record, side by side)",
                   "each runtime's, measured on its store's disk; else 4",
                   _count(0, MAX_WINDOW), empty_is_default=False),
    NativeVariable("ASYNCSIDE_GRAPH_RELEASE", "which thread drops a step's finished arrays",
                   "'caller' (every release on the calling thread, a diagnostic switch) or 'thread'",
                   "thread (the release thread)", _one_of("caller", "thread")),
    NativeVariable("ASYNCSIDE_CUDA_FAULT_NODE", "how MLX CUDA encodes a fault node",
                   "'device', 'host' or 'child'", "device", _one_of("device", "host", "child")),
)}


def check_native_env(environ: Mapping[str, str] | None = None) -> None:
    """Refuse a bad value of any variable in :data:`NATIVE_VARIABLES` (``environ``: default
    ``os.environ``) with an :class:`~asyncside.errors.EnvVarError` naming the variable, the value and
    what is accepted. Unset is the default, and so is empty where the extension reads it so."""
    env = os.environ if environ is None else environ
    for var in NATIVE_VARIABLES.values():
        value = env.get(var.name)
        if value is None or (value == "" and var.empty_is_default):
            continue
        if not var.accepts(value):
            raise EnvVarError(var.name, value, var.expected)


#: The read backends, by name (``reader=`` and ``$ASYNCSIDE_READER`` name one; asyncside.readers).
READERS = ("io_uring", "threads", "aiofiles")
ENV_READER = "ASYNCSIDE_READER"
ENV_DIRECT = "ASYNCSIDE_DIRECT"
ENV_DIRECT_DECODE_TOKENS = "ASYNCSIDE_DIRECT_DECODE_TOKENS"
ENV_ROWS_CONCURRENCY = "ASYNCSIDE_ROWS_CONCURRENCY"
ENV_CACHE = "ASYNCSIDE_CACHE"
ENV_MEASURED_DISKS = "ASYNCSIDE_MEASURED_DISKS"
_SWITCH = {"": False, "0": False, "false": False, "no": False, "1": True, "true": True, "yes": True}


def env_reader(value: str) -> str | None:
    """A value of ``$ASYNCSIDE_READER``: the backend it names, None where it is blank (the choice is
    automatic). An :class:`~asyncside.errors.EnvVarError` where it names no backend."""
    name = value.strip()
    if name and name not in READERS:
        raise EnvVarError(ENV_READER, value, f"one of {list(READERS)}")
    return name or None


def env_direct(value: str) -> bool:
    """A value of ``$ASYNCSIDE_DIRECT``: True for 1/true/yes, False for 0/false/no or blank (any
    case, spaces around ignored). An :class:`~asyncside.errors.EnvVarError` for anything else."""
    switch = _SWITCH.get(value.strip().lower())
    if switch is None:
        raise EnvVarError(ENV_DIRECT, value, "1/true/yes or 0/false/no")
    return switch


def env_direct_decode_tokens(value: str) -> int | None:
    """A value of ``$ASYNCSIDE_DIRECT_DECODE_TOKENS``: the token count, None where it is empty (the
    default). An :class:`~asyncside.errors.EnvVarError` for anything but a count >= 0."""
    if value == "":
        return None
    try:
        count = int(value)
    except ValueError:
        count = -1
    if count < 0:
        raise EnvVarError(ENV_DIRECT_DECODE_TOKENS, value, "a token count >= 0")
    return count


def env_rows_concurrency(value: str) -> int | Literal["auto", "off"]:
    """A value of ``$ASYNCSIDE_ROWS_CONCURRENCY``: ``"auto"`` (also blank), ``"off"`` (any case) or
    a count >= 1. An :class:`~asyncside.errors.EnvVarError` for anything else."""
    raw = value.strip().lower()
    if raw in ("", "auto"):
        return "auto"
    if raw == "off":
        return "off"
    # fullmatch on ASCII digits: str.isdigit takes a superscript digit, which int() refuses
    if re.fullmatch(r"[0-9]+", raw) is None or int(raw) < 1:
        raise EnvVarError(ENV_ROWS_CONCURRENCY, value, "off, auto or a count >= 1")
    return int(raw)


def env_cache(value: str) -> str | None:
    """A value of ``$ASYNCSIDE_CACHE``: the directory it names, None where it is empty (the user
    cache). An :class:`~asyncside.errors.EnvVarError` where no directory can be there (it, or the
    nearest of its parents that exists, is a file)."""
    from .argtypes import directory_problem

    if value == "":
        return None
    problem = directory_problem(value)
    if problem is not None:
        raise EnvVarError(ENV_CACHE, value, f"a directory ({problem})")
    return value


def env_measured_disks(value: str) -> str | None:
    """A value of ``$ASYNCSIDE_MEASURED_DISKS``: the file that keeps each disk's measured read window
    for later processes (``~`` is the home directory), ``""`` where it is blank (the default file
    in the user cache), None for ``off`` (every process measures its disks). An
    :class:`~asyncside.errors.EnvVarError` where no file can be there (it is a directory, or the
    nearest of its parents that exists is a file)."""
    from .argtypes import directory_problem

    raw = value.strip()
    if raw == "":
        return ""
    if raw.lower() == "off":
        return None
    path = os.path.expanduser(raw)
    if os.path.isdir(path):
        raise EnvVarError(ENV_MEASURED_DISKS, value, "off, or a file (this is a directory)")
    problem = directory_problem(os.path.dirname(os.path.abspath(path)))
    if problem is not None:
        raise EnvVarError(ENV_MEASURED_DISKS, value, f"off, or a file ({problem})")
    return path


#: The ``ASYNCSIDE_*`` variables read from Python that take a fixed set of values, each with the
#: parse its reader uses (an EnvVarError for a value outside them); read where they are used, so a bad
#: value would otherwise surface only once a model has loaded (or, for a serve-only one, never in demo).
PYTHON_VARIABLES: dict[str, Callable[[str], object]] = {
    ENV_READER: env_reader,
    ENV_DIRECT: env_direct,
    ENV_DIRECT_DECODE_TOKENS: env_direct_decode_tokens,
    ENV_ROWS_CONCURRENCY: env_rows_concurrency,
    ENV_CACHE: env_cache,
    ENV_MEASURED_DISKS: env_measured_disks,
}


def check_env(environ: Mapping[str, str] | None = None) -> None:
    """:func:`check_native_env`, then the variables of :data:`PYTHON_VARIABLES`: an
    :class:`~asyncside.errors.EnvVarError` for the first bad value. The command line calls it before
    anything loads, a :class:`~asyncside.runtime.Runtime` when it is entered."""
    env = os.environ if environ is None else environ
    check_native_env(env)
    for name, parse in PYTHON_VARIABLES.items():
        value = env.get(name)
        if value is not None:
            parse(value)
