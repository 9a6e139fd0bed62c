"""mlx-lm imported without its change to the open files limit (imported first by this package).

mlx-lm's ``utils`` sets ``RLIMIT_NOFILE`` to (2048, 4096) when it is imported, for models of many
files. Where the hard limit is below 4096 (``ulimit -n 1024``, some containers and clusters) that
is a ValueError, "not allowed to raise maximum limit", raised by every import of mlx-lm: no
command ran, and ``import asyncside.models`` failed. Where the limits were higher, it lowered them
for the whole process. While it is imported here the limit is only ever raised, never past the
hard limit, and the hard limit is kept.
"""

from __future__ import annotations

import sys


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
    try:
        import mlx_lm.utils  # noqa: F401
    finally:
        resource.setrlimit = real


import_mlx_lm()
