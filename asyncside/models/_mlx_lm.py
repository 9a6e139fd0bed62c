"""mlx-lm imported without its change to the open files limit (imported first by this package).

mlx-lm's ``utils`` sets ``RLIMIT_NOFILE`` to (2048, 4096) when it is imported, for models of many
files. Where the hard limit is below 4096 (``ulimit -n 1024``, some containers and clusters) that
is a ValueError, "not allowed to raise maximum limit", raised by every import of mlx-lm: no
command ran, and ``import asyncside.models`` failed. Where the limits were higher, it lowered them
for the whole process. While it is imported here the limit is only ever raised, never past the
hard limit, and the hard limit is kept.

An mlx-lm older than the one the model code needs (a floor pip honours, but not an environment
installed with ``--no-deps`` or another package manager) is refused here, in one line naming both
releases, not by an ImportError of whichever mlx-lm name the first module to miss it imports.
"""

from __future__ import annotations

import os
import sys

from ..errors import AsyncsideError

#: the oldest mlx-lm the model code runs with: pyproject.toml's floor (tests/test_packaging_15.py
#: records why it is that release)
MLX_LM_FLOOR = (0, 32, 1)


class MlxLmVersionError(AsyncsideError, ImportError):
    """The installed mlx-lm is older than :data:`MLX_LM_FLOOR`."""


def _release(version: str) -> tuple[int, ...]:
    """The leading release numbers of a version string (``0.32.1.dev3`` -> ``(0, 32, 1)``)."""
    out = []
    for piece in version.split(".")[:3]:
        digits = piece[:len(piece) - len(piece.lstrip("0123456789"))]
        if not digits:
            break
        out.append(int(digits))
    return tuple(out)


def check_mlx_lm_version(version: str) -> None:
    """MlxLmVersionError if mlx-lm ``version`` is older than :data:`MLX_LM_FLOOR`."""
    if _release(version) < MLX_LM_FLOOR:
        need = ".".join(map(str, MLX_LM_FLOOR))
        raise MlxLmVersionError(f"mlx-lm {version} is older than asyncside needs ({need} or newer): "
                                f"pip install -U 'mlx-lm>={need}'")


def import_mlx_lm() -> None:
    """Import ``mlx_lm.utils`` (and so mlx-lm) once, keeping the process's open files limits."""
    if "mlx_lm.utils" in sys.modules:
        return
    try:
        import resource
    except ImportError:  # not POSIX: mlx-lm's own import decides
        import mlx_lm.utils
        return
    real = resource.setrlimit

    def keeping(which: int, limits: tuple[int, int]) -> None:
        if which != resource.RLIMIT_NOFILE:
            real(which, limits)
            return
        soft, hard = resource.getrlimit(which)
        wanted = limits[0] if hard == resource.RLIM_INFINITY else min(limits[0], hard)
        if soft != resource.RLIM_INFINITY and wanted > soft:
            real(which, (wanted, hard))

    resource.setrlimit = keeping
    gone = _deleted_cwd()
    try:
        import mlx_lm.utils  # noqa: F401
    finally:
        resource.setrlimit = real
        if gone is not None:
            os.fchdir(gone)
            os.close(gone)


def _deleted_cwd() -> int | None:
    """Where the working directory was deleted under the process (a build tree removed, a
    temporary directory cleaned): a descriptor of it, having moved to the root for the import.
    transformers, which mlx-lm imports, resolves a relative path at import, and its
    FileNotFoundError (no file named) ended every command and ``import asyncside.models``; nothing
    else of the import reads the directory. None where it exists."""
    try:
        os.getcwd()
        return None
    except FileNotFoundError:
        pass
    here = os.open(".", os.O_RDONLY | os.O_DIRECTORY)
    os.chdir("/")
    return here


import_mlx_lm()
check_mlx_lm_version(str(getattr(sys.modules["mlx_lm"], "__version__", "0")))
