"""The ordered reads' window, chosen from the disk the store is on.

Past the page cache, a streamed resolve reads a layer's missing records one after another through
one io_uring ring, a window of pieces in flight (``native/chunked_read.h``). Too small a window
leaves a disk that gives more with depth idle between pieces; too large a one lets the next
records share the disk with the first, which the layer's first slot is waiting for. The window a
disk wants is the least depth at which it reaches its rate, and disks differ (a virtio disk, a
local NVMe drive, a network volume): so the runtime measures it, reading records of the store the
way the ordered reads do, and says what it measured (BENCHMARKS.md, "The read window from the
disk").

Measuring reads a few hundred MB before the first token, so a disk is measured once, not once per
process: what it gave is kept in a small file (``$ASYNCSIDE_MEASURED_DISKS``, by default
``disks.json`` in the user cache), keyed by what identifies the disk, and later processes take the
window from there. An entry older than :data:`KEPT_DAYS`, of other windows than :data:`WINDOWS`, or
of a disk that cannot be told apart from the next one to get its device number, is measured again.

A window chosen for the process (``ASYNCSIDE_FAULT_READ_WINDOW``, or
``_native.set_fault_read_window``) is kept as it is, and so is one a runtime is given
(``Runtime(read_window=...)``); neither is measured.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pathlib
import random
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

# the most pieces an ordered read keeps in flight (a reading thread's ring holds no more): defined
# once, beside the check of ASYNCSIDE_FAULT_READ_WINDOW
from .native_env import MAX_WINDOW as MAX_READ_WINDOW

#: the least window chosen. A disk whose rate is flat from one or two pieces in flight still
#: decoded faster at this one: between pieces the disk waits for the reading thread to reap one
#: and submit the next, a gap that measuring (the thread alone on a core) hardly sees and a decode
#: (its compute on every core) does (BENCHMARKS.md, "The read window from the disk")
MIN_WINDOW = 4

#: the windows measured (pieces in flight)
WINDOWS: tuple[int, ...] = (MIN_WINDOW, 8, 16, MAX_READ_WINDOW)

#: the window chosen is the least that reaches this share of the best rate measured: a wider one
#: would buy the rest of the rate with the first record's latency
KNEE = 0.9

#: bytes one measured pass reads (whole records, one after another); each window gets ``ROUNDS``
#: passes, in alternating order, so that a drift of the machine's load meets every window alike
PASS_BYTES = 48 << 20
ROUNDS = 3

#: measuring should take about this long at most (seconds): a runtime waits for it when entered.
#: On a disk slow enough that full passes would take longer, the first pass is
#: :data:`FIRST_PASS_BYTES` and the others shrink to fit what is left, down to :data:`LEAST_PASS_BYTES`
MEASURE_SECONDS = 2.0
FIRST_PASS_BYTES = 16 << 20
LEAST_PASS_BYTES = 8 << 20

#: a store whose records hold fewer bytes than one pass is not measured: re-reading the same
#: records would measure the device's own cache, not the disk
MIN_STORE_BYTES = PASS_BYTES

#: a kept measurement is taken for this many days, then the disk is measured again (a volume
#: replaced under the same name, a firmware update, a drive that filled and slowed)
KEPT_DAYS = 30.0

#: a process waits at most this long (seconds) for another measuring the same kept file's disks,
#: then measures itself: a measurement is held to about MEASURE_SECONDS
LOCK_WAIT_SECONDS = 10.0

#: the kept file's format; a file of another is ignored and rewritten
KEPT_FORMAT = 1

_lock = threading.Lock()
_measured: dict[tuple[int, int], ReadWindow] = {}  # (st_dev, piece bytes) -> what the disk gave


@dataclass(frozen=True)
class ReadWindow:
    """The window a runtime's ordered reads keep in flight, and where it comes from.

    ``source``: ``"measured"`` (this disk's rates, in :attr:`rates`), ``"process"`` (chosen for
    the process: the variable or the setter), ``"argument"`` (``Runtime(read_window=...)``) or
    ``"default"`` (nothing measured; :attr:`why` says why).
    """

    window: int
    piece_bytes: int
    source: str
    why: str
    #: window -> bytes per second, the best of the rounds (measured only)
    rates: Mapping[int, float] = field(default_factory=dict)
    seconds: float = 0.0  # what measuring took in this process (0 where the rates were kept)
    #: the file the rates were taken from (measured by an earlier process), else ""
    kept: str = ""

    @property
    def table_window(self) -> int:
        """What the runtime's fault tables are told: the window measured or given, else -1 (follow
        the process's setting, which may change while they run)."""
        return self.window if self.source in ("measured", "argument") else -1

    def describe(self) -> str:
        """One line for the plan."""
        piece = (f"{self.piece_bytes >> 20} MiB" if self.piece_bytes % (1 << 20) == 0
                 else f"{self.piece_bytes >> 10} KiB")
        what = (f"{self.window} {'piece' if self.window == 1 else 'pieces'} of {piece} in flight"
                if self.window else "none (a background read per record)")
        return f"read window: {what} ({self.why})"

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready figures."""
        return {"window": self.window, "piece_bytes": self.piece_bytes, "source": self.source, "why": self.why,
                "rates": {str(w): r for w, r in self.rates.items()}, "seconds": self.seconds, "kept": self.kept}


def knee(rates: Mapping[int, float], share: float = KNEE) -> int:
    """The least window whose rate reaches ``share`` of the best in ``rates`` (window -> bytes/s).
    The runtime takes it from windows of at least :data:`MIN_WINDOW`."""
    if not rates:
        raise ValueError("knee: expected at least one window's rate")
    best = max(rates.values())
    return min(w for w, r in rates.items() if r >= share * best)


def describe_rates(rates: Mapping[int, float]) -> str:
    """``0.41 / 1.52 GB/s at 1 / 4``: the rates in window order."""
    ws = sorted(rates)
    return f"{' / '.join(f'{rates[w] / 1e9:.2f}' for w in ws)} GB/s at {' / '.join(str(w) for w in ws)}"


def pass_budget(spent_s: float, passes_left: int, rate: float, *, budget_s: float = MEASURE_SECONDS,
                pass_bytes: int = PASS_BYTES, least_bytes: int = LEAST_PASS_BYTES) -> int:
    """Bytes for each of the ``passes_left`` passes still to read, ``spent_s`` seconds into a
    measurement that should take ``budget_s``, on a disk that has given ``rate`` bytes/s (the
    slowest pass so far): ``pass_bytes`` where that fits, else what does, never below
    ``least_bytes`` (a pass of a record or two says little of a window), nor above ``pass_bytes``."""
    if passes_left <= 0:
        return pass_bytes
    fits = (budget_s - spent_s) / passes_left * rate
    return int(min(pass_bytes, max(least_bytes, fits)))


def measure_rates(records: Sequence[tuple[pathlib.Path, int, int]], piece_bytes: int, *,
                  windows: Sequence[int] = WINDOWS, pass_bytes: int = PASS_BYTES, rounds: int = ROUNDS,
                  seed: int = 0, budget_s: float | None = None,
                  read: list[int] | None = None) -> dict[int, float]:
    """The disk's rate at each window (bytes per second, the best of ``rounds`` passes): passes of
    about ``pass_bytes`` of ``records`` (path, offset, bytes; block aligned), read O_DIRECT one
    after another in pieces of ``piece_bytes``, as a streamed resolve reads them. A pass takes
    records of one file in a random order, none read twice while unread ones remain. Blocks the
    calling thread (a worker's). OSError where a file cannot be opened O_DIRECT or a read fails.

    With ``budget_s``, a slow disk is measured in about that long: the first pass reads at most
    :data:`FIRST_PASS_BYTES` and the others what :func:`pass_budget` allows. ``read``, when given,
    gets each pass's bytes, in order."""
    from . import _native

    if not records:
        raise ValueError("measure_rates: expected records to read")
    by_file: dict[pathlib.Path, list[tuple[int, int]]] = {}
    for path, off, n in records:
        by_file.setdefault(pathlib.Path(path), []).append((off, n))
    rng = random.Random(seed)
    unread = {p: rng.sample(rs, len(rs)) for p, rs in by_file.items()}
    files = sorted(by_file)
    fds: dict[pathlib.Path, int] = {}
    best: dict[int, float] = {}
    try:
        for p in files:
            fds[p] = os.open(p, os.O_RDONLY | os.O_CLOEXEC | getattr(os, "O_DIRECT", 0))
        passes, total = 0, rounds * len(windows)
        size = pass_bytes if budget_s is None else min(pass_bytes, FIRST_PASS_BYTES)
        slowest = float("inf")
        t0 = time.perf_counter()
        for r in range(rounds):
            for w in (windows if r % 2 == 0 else list(reversed(windows))):
                path = files[passes % len(files)]
                passes += 1
                picked: list[tuple[int, int]] = []
                nbytes = 0
                while nbytes < size:
                    if not unread[path]:
                        unread[path] = rng.sample(by_file[path], len(by_file[path]))
                    picked.append(unread[path].pop())
                    nbytes += picked[-1][1]
                err, seconds = _native.time_ordered_reads(fds[path], picked, piece_bytes, w)
                if err:
                    raise OSError(err, f"reading records to measure the disk: {os.strerror(err)}", str(path))
                rate = nbytes / max(seconds, 1e-9)
                best[w] = max(best.get(w, 0.0), rate)
                if read is not None:
                    read.append(nbytes)
                if budget_s is not None:
                    slowest = min(slowest, rate)
                    size = pass_budget(time.perf_counter() - t0, total - passes, slowest, budget_s=budget_s,
                                       pass_bytes=pass_bytes)
    finally:
        for fd in fds.values():
            os.close(fd)
    return best


def store_records(specs: Sequence[Any]) -> list[tuple[pathlib.Path, int, int]]:
    """Every record of the layers ``specs`` (:class:`~asyncside.store.LayerSpec`), as
    (blob, offset, bytes): the whole stride, block aligned where the store is."""
    return [(spec.path, e * spec.stride, spec.stride) for spec in specs for e in range(spec.n_experts)]


def choose_read_window(specs: Sequence[Any], given: int | None = None) -> ReadWindow:
    """The window for a runtime reading the layers ``specs`` past the page cache: ``given`` where
    one is, the process's where it was chosen, else what the store's disk measures (once per disk
    and piece size in this process), else the default with the reason. Blocks while it measures
    (call it from a worker thread)."""
    from . import _native

    piece = int(_native.fault_read_chunk())
    if given is not None:
        return ReadWindow(given, piece, "argument", "Runtime(read_window=...)")
    if _native.fault_read_window_chosen():
        return ReadWindow(int(_native.fault_read_window()), piece, "process",
                          "chosen for the process: ASYNCSIDE_FAULT_READ_WINDOW or set_fault_read_window")
    default = int(_native.fault_read_window())
    if not _native.ordered_reads_possible():
        return ReadWindow(default, piece, "default", "not measured: no io_uring here, each record reads on its own")
    if piece == 0:
        return ReadWindow(default, piece, "default", "not measured: fault reads are whole records (a chunk of 0)")
    records = store_records(specs)
    total = sum(n for _, _, n in records)
    if total < MIN_STORE_BYTES or any(n % 4096 for _, _, n in records):
        return ReadWindow(default, piece, "default",
                          f"not measured: the store's records ({total / 1e6:.1f} MB) are too few, or not "
                          f"block aligned, to measure the disk with")
    st_dev = os.stat(records[0][0]).st_dev
    key = (st_dev, piece)
    with _lock:
        if key in _measured:
            return _measured[key]
        disk = disk_identity(st_dev)
        where = kept_file() if disk is not None else None
        if where is None or disk is None:
            chosen = _measure(records, piece, default, None, "")
        else:
            # Processes started together (a server's workers, a pipeline's ranks on one host) would
            # each measure the disk while the others read it, and each see a share of its rate:
            # the first measures, the others wait for it and take what it kept.
            with _kept_lock(where):
                chosen = _take_kept(where, disk, piece) or _measure(records, piece, default, where, disk)
        if chosen.source == "measured":
            _measured[key] = chosen
        return chosen


def _measure(records: Sequence[tuple[pathlib.Path, int, int]], piece: int, default: int,
             where: pathlib.Path | None, disk: str) -> ReadWindow:
    """Measure the disk (the default window with the reason where its records cannot be read
    O_DIRECT) and keep what it gave in ``where`` for ``disk``, where given."""
    t0 = time.perf_counter()
    read: list[int] = []
    try:
        rates = measure_rates(records, piece, budget_s=MEASURE_SECONDS, read=read)
    except OSError as exc:
        return ReadWindow(default, piece, "default", f"not measured: {exc.filename}: {exc.strerror}")
    # A disk too slow for full passes in the time allowed: say how little was read per pass.
    later = read[1:]  # the first pass is short by design
    cut = ""
    if later and min(later) < PASS_BYTES * 0.9:
        least, most = f"{min(later) / 2**20:.0f}", f"{max(later) / 2**20:.0f}"
        cut = (f"; a slow disk: passes of {least if least == most else least + '-' + most} MiB to "
               f"measure in about {MEASURE_SECONDS:g} s")
    seconds = time.perf_counter() - t0
    note = ""
    if where is not None:
        problem = _keep(where, disk, piece, rates, cut, seconds)
        note = f"; not kept for later processes: {problem}" if problem else ""
    return _from_rates(rates, piece, cut + note, seconds)


@contextlib.contextmanager
def _kept_lock(where: pathlib.Path) -> Iterator[None]:
    """Hold ``where``'s lock file (``flock``, released by the kernel if the holder dies) for at most
    :data:`LOCK_WAIT_SECONDS` of waiting; past that, or where no lock file can be made, go on
    without it (two measurements at once cost each other some rate, nothing else)."""
    try:
        where.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(where.with_name(where.name + ".lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError:
        yield
        return
    try:
        deadline = time.monotonic() + LOCK_WAIT_SECONDS
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError:
                if time.monotonic() >= deadline:
                    break
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)  # releases the lock


def _from_rates(rates: Mapping[int, float], piece: int, note: str, seconds: float, kept: str = "") -> ReadWindow:
    window = knee({w: r for w, r in rates.items() if w >= MIN_WINDOW} or rates)
    return ReadWindow(window, piece, "measured",
                      f"the least from {MIN_WINDOW} within {KNEE:.0%} of the disk's best, "
                      f"{describe_rates(rates)}{note}", rates, seconds, kept)


def kept_file() -> pathlib.Path | None:
    """Where measured disks are kept (``$ASYNCSIDE_MEASURED_DISKS``, else ``disks.json`` in the user
    cache), None where nothing is kept: the variable is ``off``, or there is no user cache."""
    from .errors import AsyncsideError
    from .native_env import ENV_MEASURED_DISKS, env_measured_disks

    chosen = env_measured_disks(os.environ.get(ENV_MEASURED_DISKS, ""))
    if chosen is None:
        return None
    if chosen:
        return pathlib.Path(chosen)
    from .models.embedded import cache_root

    try:
        return cache_root() / "disks.json"
    except AsyncsideError:  # no home directory and no cache named: nothing to keep it in
        return None


def _sys_text(path: pathlib.Path) -> str:
    try:
        return path.read_text(errors="replace").strip()
    except OSError:
        return ""


def disk_identity(st_dev: int) -> str | None:
    """What tells the block device ``st_dev`` (a file's ``st_dev``) apart from another that later
    gets its number: its name, size and the serial, WWID, model or device-mapper UUID the kernel
    gives it (a partition's from its disk). Without a block device (overlay, tmpfs, NFS: numbers the
    kernel hands out per mount), its number within this boot. None where neither can be read."""
    major, minor = os.major(st_dev), os.minor(st_dev)
    try:
        dev = pathlib.Path(f"/sys/dev/block/{major}:{minor}").resolve(strict=True)
    except OSError:
        boot = _sys_text(pathlib.Path("/proc/sys/kernel/random/boot_id"))
        return f"{major}:{minor} in boot {boot}" if boot else None
    disk = dev.parent if (dev / "partition").exists() else dev
    parts = [f"{major}:{minor}", dev.name, f"size {_sys_text(dev / 'size')}"]
    for name in ("serial", "wwid", "device/serial", "device/wwid", "device/model", "dm/uuid"):
        text = _sys_text(disk / name)
        if text:
            parts.append(f"{name} {text}")
    return " ".join(parts)


def _read_kept(where: pathlib.Path) -> dict[str, Any]:
    """The kept entries, {} where the file is missing, unreadable or of another format (it is then
    rewritten by the next measurement)."""
    try:
        data = json.loads(where.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("format") != KEPT_FORMAT or not isinstance(data.get("disks"), dict):
        return {}
    return data["disks"]


def _take_kept(where: pathlib.Path, disk: str, piece: int) -> ReadWindow | None:
    """The window from a measurement kept in ``where`` for ``disk`` and ``piece``; None where there
    is none to take (missing, too old, of other windows, damaged)."""
    entry: Any = _read_kept(where).get(f"{disk} | piece {piece}")
    try:
        rates = {int(w): float(r) for w, r in entry["rates"].items()}
        at = float(entry["measured_at"])
        cut = str(entry.get("cut", ""))
    except (TypeError, KeyError, ValueError, AttributeError):
        return None
    age_days = (time.time() - at) / 86400
    if sorted(rates) != sorted(WINDOWS) or not all(r > 0 for r in rates.values()) or not 0 <= age_days <= KEPT_DAYS:
        return None
    hours = age_days * 24
    age = ("under an hour" if hours < 1 else f"{hours:.0f} h" if age_days < 2 else f"{age_days:.0f} days")
    return _from_rates(rates, piece, f"{cut}; measured by an earlier process {age} ago, kept in {where}",
                       0.0, str(where))


def _keep(where: pathlib.Path, disk: str, piece: int, rates: Mapping[int, float], cut: str,
          seconds: float) -> str | None:
    """Keep ``rates`` for ``disk`` and ``piece`` in ``where`` for later processes; why not where it
    cannot be written (a read-only home: the window is still used, only measured again next time).
    The file is replaced whole, so a process reading it meanwhile sees the old or the new one."""
    disks = _read_kept(where)
    disks[f"{disk} | piece {piece}"] = {"rates": {str(w): r for w, r in rates.items()}, "cut": cut,
                                        "measured_at": time.time(), "seconds": seconds}
    tmp = where.with_name(f".{where.name}.{os.getpid()}.{threading.get_ident()}")
    try:
        where.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"format": KEPT_FORMAT, "disks": disks}, indent=1, sort_keys=True))
        os.replace(tmp, where)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        return f"{where}: {exc.strerror or exc}"
    return None


def forget_measured(kept: bool = False) -> None:
    """Measure every disk again at its next runtime (tests; a disk that changed under a long
    process). With ``kept``, the file of disks kept for later processes goes too."""
    with _lock:
        _measured.clear()
        where = kept_file() if kept else None
        if where is not None:
            where.unlink(missing_ok=True)
