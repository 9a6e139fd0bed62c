"""How much memory the pools may take: what this process can use, and what a residency needs.

The pools are allocated once, up front; the page cache holds the records the faults read. Under a
memory limit that charges the page cache (a cgroup), pools that leave too little room make every
fault a disk read and the reads evict each other: the runtime says what it needs at start and
refuses clearly when that cannot fit, and ``resident="auto"`` sizes the pools to what is there.
"""

from __future__ import annotations

import math
import os
import pathlib
import re
from dataclasses import dataclass
from typing import Any

__all__ = ["MemoryBudget", "available_memory", "layer_rows", "pool_bytes", "auto_fraction", "TIER_SHARE",
           "parse_size", "describe_bytes", "proc_self_bytes", "parse_host_tier", "host_tier_arg", "memory_arg",
           "check_memory", "SIZE_UNITS", "cached_pages", "drop_ranges", "pages_brought_in", "unmap_ranges"]

#: Share of the available memory ``resident="auto"`` gives the pools; the rest stays for the page
#: cache (the records faults read), the non-expert weights, the KV caches and MLX's own buffers.
AUTO_SHARE = 0.5
#: Share of the available memory ``Runtime(host_tier="auto")`` may pin for the host tier of
#: records (device pools on MLX CUDA: faulted records kept, verified, for copies to the device).
TIER_SHARE = 0.25
#: Pools plus this much headroom must fit what is available, or the runtime refuses to start.
MIN_HEADROOM = 256 << 20


@dataclass(frozen=True)
class MemoryBudget:
    """Bytes this process can still use, and where the figure comes from."""

    available: int
    source: str  # "cgroup v2 memory.max", "cgroup v1 memory.limit_in_bytes" or "MemAvailable"

    def describe(self) -> str:
        return f"{self.available / 2**30:.2f} GiB available ({self.source})"


def _read_int(path: pathlib.Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        return None


#: where this process's cgroups and mounts are read (tests stand in files of a container's view)
PROC_CGROUP = pathlib.Path("/proc/self/cgroup")
PROC_MOUNTINFO = pathlib.Path("/proc/self/mountinfo")


def _cgroup_mounts() -> list[tuple[str, str, pathlib.Path]]:
    """(version, the cgroup path at the mount's root, the mount point) of each memory cgroup
    hierarchy mounted here (``/proc/self/mountinfo``): a container's view mounts its own cgroup
    as the root of ``/sys/fs/cgroup/memory``, where ``/proc/self/cgroup`` still names the host's path."""
    out: list[tuple[str, str, pathlib.Path]] = []
    try:
        lines = PROC_MOUNTINFO.read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or len(tail) < 3:
            continue
        root, point = fields[3].replace("\\040", " "), fields[4].replace("\\040", " ")
        if tail[0] == "cgroup2":
            out.append(("v2", root, pathlib.Path(point)))
        elif tail[0] == "cgroup" and "memory" in tail[2].split(","):
            out.append(("v1", root, pathlib.Path(point)))
    return out


def _cgroup_dirs() -> list[tuple[str, pathlib.Path, pathlib.Path]]:
    """This process's memory cgroup directories (v2 unified, v1 memory controller), each with the
    directory its hierarchy is mounted at: its path in ``/proc/self/cgroup`` under the hierarchy's
    mount, less the part the mount's root already is.
    A container whose ``/proc/self/cgroup`` says ``/docker/ID`` while its memory hierarchy is
    mounted from that very cgroup had its limit skipped (no such directory under the mount), and
    its pools were planned against the host's MemAvailable."""
    out: list[tuple[str, pathlib.Path, pathlib.Path]] = []
    try:
        lines = PROC_CGROUP.read_text().splitlines()
    except OSError:
        return out
    mounts = _cgroup_mounts()
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _hid, controllers, rel = parts
        if controllers == "":
            version, default = "v2", pathlib.Path("/sys/fs/cgroup")
        elif "memory" in controllers.split(","):
            version, default = "v1", pathlib.Path("/sys/fs/cgroup/memory")
        else:
            continue
        found = False
        for v, root, point in mounts:
            if v != version:
                continue
            inner = rel.lstrip("/") if root == "/" else (
                rel[len(root):].lstrip("/") if rel == root or rel.startswith(root.rstrip("/") + "/") else None)
            if inner is not None:
                out.append((version, point / inner, point))
                found = True
        # Where no mount of it matched: the usual mount point, as before (a hierarchy the mount
        # table lists no mount of is not mounted in this view, and has no files to read).
        if not found and (not mounts or any(v == version for v, _root, _point in mounts)):
            out.append((version, default / rel.lstrip("/"), default))
    return out


def _cgroup_room(version: str, d: pathlib.Path) -> MemoryBudget | None:
    """The room the memory cgroup at ``d`` leaves: its limit (on v2 the lower of ``memory.max`` and
    ``memory.high``) less its usage, its page cache counted as room (the cgroup reclaims it); None
    where it sets no limit or has no such files."""
    if version == "v2":
        limit, usage, name = _read_int(d / "memory.max"), _read_int(d / "memory.current"), "cgroup v2 memory.max"
        # memory.high (systemd's MemoryHigh=) kills nothing, but past it the kernel throttles the
        # cgroup and reclaims hard: pools or page cache planned above it would thrash.
        high = _read_int(d / "memory.high")
        if high is not None and (limit is None or high < limit):
            limit, name = high, "cgroup v2 memory.high"
    else:
        limit = _read_int(d / "memory.limit_in_bytes")
        usage = _read_int(d / "memory.usage_in_bytes")
        name = "cgroup v1 memory.limit_in_bytes"
        if limit is not None and limit >= 1 << 60:  # v1 says "no limit" with a huge number
            limit = None
    if limit is None or usage is None:
        return None
    stat: dict[str, int] = {}
    try:
        for line in (d / "memory.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key in ("file", "cache", "total_cache", "shmem", "total_shmem"):
                stat[key] = int(value)
    except (OSError, ValueError):
        pass
    # The page cache the cgroup can reclaim: its file pages less tmpfs and shared memory (counted in
    # them, and never reclaimed without swap). A store or any file on a tmpfs charged to the cgroup
    # was counted as room, and pools planned into it had the process killed by the cgroup.
    cache = max(stat.get("file", 0) - stat.get("shmem", 0), stat.get("cache", 0) - stat.get("shmem", 0),
                stat.get("total_cache", 0) - stat.get("total_shmem", 0), 0)
    return MemoryBudget(max(0, limit - usage + cache), f"{name} = {describe_bytes(limit)}")


def available_memory() -> MemoryBudget:
    """What this process can still use: the tighter of its memory cgroup's room (limit minus
    usage, page cache included, as the cgroup charges it) and the system's MemAvailable."""
    best: MemoryBudget | None = None
    try:
        for line in pathlib.Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                best = MemoryBudget(int(line.split()[1]) * 1024, "MemAvailable")
                break
    except (OSError, ValueError, IndexError):
        pass
    for version, leaf, top in _cgroup_dirs():
        # The cgroup's ancestors up to the mount limit it too: a limit set on a slice (systemd's
        # MemoryMax=) left the process's own cgroup at "max", and the runtime planned past it.
        for d in [leaf, *(p for p in leaf.parents if p == top or top in p.parents)]:
            room = _cgroup_room(version, d)
            if room is not None and d != leaf:
                room = MemoryBudget(room.available, f"{room.source} (of the parent cgroup {d})")
            if room is not None and (best is None or room.available < best.available):
                best = room
    return best or MemoryBudget(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"), "free pages")


def layer_rows(n_experts: int, resident: float, side_rows: int | None = None, min_side_rows: int = 8) -> int:
    """Pool rows of a layer of ``n_experts`` at residency ``resident`` (a fraction of its experts):
    ``ceil(resident * n_experts)``, at least ``min_side_rows`` (and ``side_rows`` when larger), at
    most every expert. The one sizing rule: the runtime's allocation, its budget check,
    ``resident="auto"`` and the benchmark baselines use it. The cap is meant: the default floor
    (the model's top-k, else 8) may pass a small layer's experts; ``Runtime`` refuses a
    ``min_side_rows`` given above them before it sizes anything."""
    if isinstance(resident, bool) or not 0.0 <= float(resident) <= 1.0:
        raise ValueError(f"resident: expected a fraction in [0, 1], got {resident!r}")
    budget = max(1, math.ceil(float(resident) * n_experts))
    rows = max(budget, min_side_rows if side_rows is None else int(side_rows))
    return min(rows, n_experts)


def pool_bytes(store: Any, fraction: float, layers: list[int] | None = None, min_rows: int = 8) -> int:
    """Bytes the pools of ``layers`` (all by default) take at residency ``fraction`` (rows by
    :func:`layer_rows`)."""
    total = 0
    for index in layers if layers is not None else list(store.layers):
        spec = store.layer(index)
        total += layer_rows(spec.n_experts, fraction, None, min_rows) * sum(seg.nbytes for seg in spec.segments)
    return total


def auto_fraction(store: Any, budget: MemoryBudget, layers: list[int] | None = None, min_rows: int = 8) -> float:
    """The largest residency whose pools take at most :data:`AUTO_SHARE` of ``budget`` (at least
    the smallest pools :func:`pool_bytes` allows, at most every expert)."""
    target = budget.available * AUTO_SHARE
    lo, hi = 0.0, 1.0
    if pool_bytes(store, 1.0, layers, min_rows) <= target:
        return 1.0
    for _ in range(30):  # bisect the fraction: pool_bytes is monotone in it
        mid = (lo + hi) / 2
        if pool_bytes(store, mid, layers, min_rows) <= target:
            lo = mid
        else:
            hi = mid
    return lo


#: a number (a decimal, an exponent of either sign allowed), then an optional unit: K, M, G or T,
#: optionally followed by "iB" or "B"
_SIZE = re.compile(r"(\+?[0-9.]+(?:e[+-]?[0-9]+)?)\s*([kmgt]?)(?:ib|i|b)?")
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
#: a number in a unit past T (P, E, Z, Y), which no size option takes (a bare "e" is an exponent's)
_BEYOND = re.compile(r"\+?[0-9.]+(?:e[+-]?[0-9]+)?\s*(?:([pzy])(?:ib|i|b)?|(e)(?:ib|i|b))")


def proc_self_bytes(name: str, key: str) -> int:
    """A byte count of this process from ``/proc/self/<name>``: ``status`` lines in kB (``VmRSS``,
    ``VmHWM``) or ``io`` lines in bytes (``read_bytes``); 0 where /proc does not say."""
    scale = 1024 if name == "status" else 1
    try:
        with open(f"/proc/self/{name}") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * scale
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _libc_function(name: str, argtypes: list[Any], restype: Any) -> Any | None:
    """The C library's function ``name``, typed; None where the C library has none (musl, macOS
    lack glibc's heap calls)."""
    import ctypes

    try:
        fn = getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = argtypes, restype
    return fn


def release_freed_heap() -> bool:
    """Hand the pages of freed C-heap memory back to the system (glibc's ``malloc_trim``); False
    where the C library has no such call (musl, macOS). A model freed in this process (the demo's
    all-resident reference) otherwise stays in its resident size, which a memory budget charges and
    the runtime's plan, made from what the process holds, takes from the pools and page cache."""
    import ctypes

    trim = _libc_function("malloc_trim", [ctypes.c_size_t], ctypes.c_int)
    if trim is None:
        return False
    trim(0)
    return True


#: glibc's mallopt parameter for the size from which an allocation is its own mapping
_M_MMAP_THRESHOLD = -3
#: that size, glibc's default, pinned: see :func:`return_large_frees`
_MMAP_THRESHOLD = 128 << 10


def return_large_frees() -> bool:
    """From now on, have the C heap hand every freed block of 128 KiB or more back to the system at
    once (glibc's ``mallopt(M_MMAP_THRESHOLD)`` pinned at its default); False where the C library
    has no such call (musl, macOS).

    glibc raises that threshold each time a block above it is freed, up to 32 MiB, so MLX's
    buffers of a long prompt's chunks, freed past MLX's own cache, came from the heap instead and
    stayed in the process's resident size: tens of MiB under a budget of a few hundred that the
    plan does not count (BENCHMARKS.md, "A long prompt at the smallest budget: where the memory
    goes"). Pinned, the resident size is what MLX holds and caches. Process-wide; the runtime sets
    it only under a plan that reads past the page cache, where the budget is tight."""
    import ctypes

    mallopt = _libc_function("mallopt", [ctypes.c_int, ctypes.c_int], ctypes.c_int)
    return mallopt is not None and bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD))


def cached_pages(path: str | os.PathLike[str]) -> bytes | None:
    """One byte per page of the file ``path``, 1 where that page is in the page cache now
    (``mincore`` over a read-only mapping of the file: nothing read or populated); None where that
    cannot be told (no such call, the file cannot be opened or mapped)."""
    import ctypes
    import mmap

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        map_, unmap, core = libc.mmap, libc.munmap, libc.mincore
    except (OSError, AttributeError):
        return None
    map_.restype = ctypes.c_void_p
    map_.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    unmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    core.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return b""
        addr = map_(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            return None
        try:
            vec = (ctypes.c_ubyte * (-(-size // mmap.PAGESIZE)))()
            if core(addr, size, vec) != 0:
                return None
            return bytes(v & 1 for v in vec)
        finally:
            unmap(addr, size)
    finally:
        os.close(fd)


def pages_brought_in(before: bytes, after: bytes) -> list[tuple[int, int]]:
    """The (offset, length) byte ranges of the pages cached in ``after`` and not in ``before``
    (:func:`cached_pages` of one file, twice), each run of pages one range."""
    import numpy as np

    page = os.sysconf("SC_PAGE_SIZE")
    now = np.frombuffer(after, dtype=np.uint8) != 0
    was = np.zeros(len(now), dtype=bool)
    was[: min(len(before), len(now))] = np.frombuffer(before, dtype=np.uint8)[: len(now)] != 0
    new = np.concatenate([[False], now & ~was, [False]]).astype(np.int8)
    edges = np.flatnonzero(np.diff(new))  # starts and ends of the runs, alternately
    return [(int(a) * page, int(b - a) * page) for a, b in zip(edges[::2], edges[1::2])]


def unmap_ranges(path: str | os.PathLike[str], ranges: list[tuple[int, int]]) -> int:
    """Let go of this process's mapped pages of the ``(offset, length)`` ranges of the file
    ``path`` (``MADV_DONTNEED`` over each of its mappings of the file, found in
    ``/proc/self/maps`` by device and inode); the bytes advised. A later access of such a mapping
    maps the page again (from the page cache, or read). Why: the page cache keeps a page any
    mapping holds whatever ``POSIX_FADV_DONTNEED`` says, and the native reader copies records whose
    pages are all cached (as readahead leaves them) through a mapping of the whole blob."""
    import ctypes
    import mmap

    try:
        st = os.stat(path)
        lines = pathlib.Path("/proc/self/maps").read_text().splitlines()
        advise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return 0
    advise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    dont_need = getattr(mmap, "MADV_DONTNEED", 4)
    page = mmap.PAGESIZE
    done = 0
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) < 5:
            continue
        span, _perms, offset, dev, inode = fields[:5]
        try:
            major, minor = (int(x, 16) for x in dev.split(":"))
            if int(inode) != st.st_ino or os.makedev(major, minor) != st.st_dev:
                continue
            start, end = (int(x, 16) for x in span.split("-"))
            base = int(offset, 16)
        except ValueError:
            continue
        for off, length in ranges:
            lo = max(off, base) // page * page
            hi = -(-min(off + length, base + end - start) // page) * page
            if lo < hi and advise(start + lo - base, hi - lo, dont_need) == 0:
                done += hi - lo
    return done


def drop_ranges(path: str | os.PathLike[str], ranges: list[tuple[int, int]]) -> int:
    """Evict the ``(offset, length)`` ranges of the file ``path`` from the page cache
    (``POSIX_FADV_DONTNEED``: clean pages no process maps); the bytes advised (0 where the platform
    or file system keeps no such advice, or the file cannot be opened)."""
    advise = getattr(os, "posix_fadvise", None)
    if advise is None or not ranges:
        return 0
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return 0
    done = 0
    try:
        for offset, length in ranges:
            try:
                advise(fd, offset, length, os.POSIX_FADV_DONTNEED)
                done += length
            except OSError:
                return done  # the file system keeps no such advice: nothing more to drop
    finally:
        os.close(fd)
    return done


def describe_bytes(n: int | float) -> str:
    """``n`` bytes for a person: TiB from one TiB up, GiB from one GiB up, else MiB; a size that is
    not zero but would read as ``0.0 MiB`` in KiB, or in bytes below one KiB."""
    if abs(n) >= 1 << 40:  # a budget of many TiB read back as thousands of GiB
        return f"{n / 2**40:.2f} TiB"
    if abs(n) >= 1 << 30:
        return f"{n / 2**30:.2f} GiB"
    if n and abs(n) < 0.05 * 2**20:  # "memory=4K" read "memory=0.0 MiB", as if nothing were given
        return f"{n / 2**10:.1f} KiB" if abs(n) >= 1 << 10 else f"{n:g} {'byte' if n == 1 else 'bytes'}"
    return f"{n / 2**20:.1f} MiB"


#: What every size option takes, for its help and its errors.
SIZE_UNITS = ("units K, M, G, T are powers of 1024, with or without B, i or iB: 2G, 2GB, 2Gi and 2GiB are all "
              "2 GiB")


def _share_hint(value: int | str) -> str:
    """For a memory budget written as a share (``0.5``, ``"50%"``), the option that takes a share of
    the experts, as the end of a refusal; else nothing. A bare ``1`` is no share: a byte, as it says."""
    if isinstance(value, (bool, int)):
        return ""
    text = str(value).strip()
    percent = text.endswith("%")
    try:
        share = float(text[:-1]) / 100 if percent else float(text)
    except ValueError:
        return ""
    if not 0 < share <= 1 or (not percent and text.isdigit()):
        return ""
    # The pools' share of each layer's experts is resident=: a share given as memory was refused as
    # a size with no word of where it belongs.
    written = f"{float(text[:-1]):g}%" if percent else text  # one word, as the command line takes it
    return (f"; memory is a size, and a share of each layer's experts is --resident {written} "
            f"(resident={share!r} in Python)")


def parse_size(value: int | str, *, what: str = "size") -> int:
    """Bytes from an int or a size string with an optional binary unit (``800M``, ``1.5G``,
    ``4096``; :data:`SIZE_UNITS`); ValueError naming ``what`` and what was expected otherwise."""
    if isinstance(value, bool):
        raise ValueError(f"{what}: expected a size such as 800M or 1.5G, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{what}: expected a size >= 0, got {value}")
        return value
    if str(value).strip().startswith("-"):
        raise ValueError(f"{what} {value!r}: expected a size >= 0")
    match = _SIZE.fullmatch(str(value).strip().lower())
    beyond = _BEYOND.fullmatch(str(value).strip().lower())
    if beyond:
        unit = (beyond.group(1) or beyond.group(2)).upper()
        raise ValueError(f"{what} {value!r}: no unit {unit}, the largest is T (1{unit} is "
                         f"{1 << 10 * ('PEZY'.index(unit) + 1)}T); {SIZE_UNITS}")
    number, unit = (match.group(1), match.group(2)) if match else ("", "")
    try:
        size = float(number)
    except ValueError:
        hint = _share_hint(value) if what == "memory" else ""
        raise ValueError(f"{what} {value!r}: expected a size such as 800M, 1.5G or 4096 ({SIZE_UNITS}){hint}") from None
    if not 0 <= size:
        raise ValueError(f"{what} {value!r}: expected a size >= 0")
    if math.isinf(size * _UNITS[unit]):  # the number, or the number in that unit, overflows a float
        raise ValueError(f"{what} {value!r}: expected a finite size (the number overflows)")
    return int(size * _UNITS[unit])


#: The smallest ``--memory`` the command line takes (one page): below it a number was surely meant in a
#: larger unit; above it, a budget the pools cannot fit is refused by the plan, with its figures.
MIN_MEMORY_ARG = 4096


def check_memory(size: int, text: int | str) -> int:
    """``size``, the bytes of a memory budget given as ``text``, where it is at least
    :data:`MIN_MEMORY_ARG` (a bare ``16`` is 16 bytes, never a budget); ValueError otherwise."""
    if size < MIN_MEMORY_ARG:
        bytes_ = "byte" if size == 1 else "bytes"
        raise ValueError(f"memory {text!r} is {size} {bytes_}; expected at least 4K ({SIZE_UNITS}){_share_hint(text)}")
    return size


def memory_arg(text: str) -> int:
    """The argparse type of ``--memory``: :func:`parse_size`, then :func:`check_memory`, its error as
    a usage error."""
    import argparse

    try:
        size = parse_size(text, what="memory")
    except ValueError as exc:
        if text.strip().lower() == "auto":
            raise argparse.ArgumentTypeError(f"{exc}; leave --memory out for the default (what the memory cgroup "
                                             "and MemAvailable allow)") from None
        raise argparse.ArgumentTypeError(str(exc)) from None
    try:
        return check_memory(size, text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_host_tier(text: str) -> int | str:
    """``"auto"``, or a size in bytes with an optional binary unit (``512M``, ``2G``, ``0``), as
    ``Runtime(host_tier=...)`` takes it; ValueError naming what was expected otherwise."""
    if text.strip().lower() == "auto":
        return "auto"
    return parse_size(text, what="host tier")


def host_tier_arg(text: str) -> int | str:
    """The argparse type of ``--host-tier``: :func:`parse_host_tier`, its error as a usage error."""
    import argparse

    try:
        return parse_host_tier(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
