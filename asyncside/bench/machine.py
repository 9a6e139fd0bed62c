"""What a benchmark ran on: one description shared by every ``asyncside bench`` JSON."""

from __future__ import annotations

import os
import platform
import subprocess
from typing import Any

__all__ = ["machine_info"]


def _run(argv: list[str]) -> str:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _disk_of(path: str) -> tuple[str, str]:
    """(block device description, filesystem type) of the filesystem holding ``path``."""
    dev = _run(["findmnt", "-n", "-o", "SOURCE", "-T", path])
    disk = ""
    if dev:
        parent = _run(["lsblk", "-n", "-d", "-o", "PKNAME", dev]) or os.path.basename(dev)
        disk = _run(["lsblk", "-n", "-d", "-o", "NAME,MODEL,SIZE,ROTA,TRAN", "/dev/" + parent.strip()])
    return disk or "unknown", _run(["findmnt", "-n", "-o", "FSTYPE", "-T", path])


def machine_info(path: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """CPUs, kernel, Python, MLX, memory, root, load at start, and the disk.

    With ``path``: the disk and filesystem holding it (what a read benchmark reads from); without:
    every block device (``lsblk -d``).
    """
    import mlx.core as mx

    try:
        load: list[float] | None = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = None
    info: dict[str, Any] = {
        "nproc": os.cpu_count(),
        "kernel": platform.release(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "mlx": getattr(mx, "__version__", "?"),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "root": os.geteuid() == 0,
        "loadavg_at_start": load,
    }
    if path is None:
        info["disk"] = _run(["lsblk", "-d", "-o", "NAME,SIZE,ROTA,TYPE,MODEL"])
    else:
        info["disk"], info["filesystem"] = _disk_of(os.fspath(path))
    return info
