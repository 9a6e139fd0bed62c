"""A disk's read window is measured once, not once per process: measuring read a few hundred MB
and took most of a second before every process's first token (a server's restart, each `demo`),
on a disk whose rates had not changed. What it gave is kept in a file (`$ASYNCSIDE_MEASURED_DISKS`,
else ``disks.json`` in the user cache) and later processes take it from there, unless it is old,
of other windows, damaged, or of another disk."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
from _fault_helpers import direct_file, native_read_settings_kept

from asyncside import _native
from asyncside import read_window as rw
from asyncside.errors import EnvVarError
from asyncside.native_env import ENV_MEASURED_DISKS, PYTHON_VARIABLES, env_measured_disks

RING = _native.io_uring_available()[0]
pytestmark = pytest.mark.skipif(not RING, reason="no io_uring here: nothing is measured")

PIECE = 65536


@pytest.fixture(autouse=True)
def _fresh() -> Iterator[None]:
    """Each test starts as a process does: no window chosen for it, no disk measured in it."""
    _native.testing.reset_fault_read_window()
    rw.forget_measured()
    with native_read_settings_kept():
        _native.set_fault_read_chunk(PIECE)
        yield
    rw.forget_measured()


@pytest.fixture
def spec(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """One layer of 16 records of 256 KiB on a file system that takes O_DIRECT."""
    path = direct_file(tmp_path, 4 << 20)
    monkeypatch.setattr(rw, "MIN_STORE_BYTES", 0)
    return type("Spec", (), {"path": path, "stride": 262144, "n_experts": 16})()


@pytest.fixture
def measures(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the measurements (short ones: passes of 512 KiB, one round)."""
    real = rw.measure_rates
    calls: list[int] = []

    def counted(*args: Any, **kwargs: Any) -> dict[int, float]:
        calls.append(1)
        return real(*args, pass_bytes=512 << 10, rounds=1)

    monkeypatch.setattr(rw, "measure_rates", counted)
    return calls


def kept_at(monkeypatch: pytest.MonkeyPatch, path: pathlib.Path) -> pathlib.Path:
    monkeypatch.setenv(ENV_MEASURED_DISKS, str(path))
    return path


def test_a_later_process_takes_the_window_the_first_measured(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, spec: Any, measures: list[int]) -> None:
    kept = kept_at(monkeypatch, tmp_path / "cache" / "disks.json")  # a directory made on first use
    first = rw.choose_read_window([spec])
    assert first.source == "measured" and first.kept == "" and first.seconds > 0 and measures == [1]
    entries = json.loads(kept.read_text())["disks"]
    disk = rw.disk_identity(os.stat(spec.path).st_dev)
    assert disk is not None and list(entries) == [f"{disk} | piece {PIECE}"]

    rw.forget_measured()  # what a new process starts with
    later = rw.choose_read_window([spec])
    assert measures == [1], "measured again though the disk's rates were kept"
    assert later.source == "measured" and later.kept == str(kept) and later.seconds == 0
    assert later.window == first.window and dict(later.rates) == pytest.approx(dict(first.rates))
    assert later.table_window == first.window  # the fault tables are told the kept window
    assert "measured by an earlier process under an hour ago, kept in" in later.describe()
    assert later.as_dict()["kept"] == str(kept)

    # A real second process: it reads nothing to measure the disk.
    code = ("import sys, pathlib; from asyncside import _native, read_window as rw; "
            f"_native.set_fault_read_chunk({PIECE}); rw.MIN_STORE_BYTES = 0; "
            "spec = type('S', (), {'path': pathlib.Path(sys.argv[1]), 'stride': 262144, 'n_experts': 16})(); "
            "rw.measure_rates = None; w = rw.choose_read_window([spec]); print(w.window, w.kept)")
    env = {**os.environ, ENV_MEASURED_DISKS: str(kept)}
    out = subprocess.run([sys.executable, "-c", code, str(spec.path)], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(first.window), str(kept)]


def test_an_old_entry_other_windows_a_damaged_file_or_another_piece_are_measured_again(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, spec: Any, measures: list[int]) -> None:
    kept = kept_at(monkeypatch, tmp_path / "disks.json")
    rw.choose_read_window([spec])
    key = next(iter(json.loads(kept.read_text())["disks"]))

    def rewrite(**change: Any) -> None:
        data = json.loads(kept.read_text())
        data["disks"][key].update(change)
        kept.write_text(json.dumps(data))

    rewrite(measured_at=time.time() - (rw.KEPT_DAYS + 1) * 86400)
    rw.forget_measured()
    rw.choose_read_window([spec])
    assert measures == [1, 1], "a measurement older than KEPT_DAYS was taken"
    # ... and the new one replaced it
    assert time.time() - json.loads(kept.read_text())["disks"][key]["measured_at"] < 3600

    rewrite(rates={"2": 1e9, "4": 1e9})  # windows this version does not measure
    rw.forget_measured()
    rw.choose_read_window([spec])
    assert measures == [1, 1, 1]

    for damage in ("{not json", json.dumps({"format": rw.KEPT_FORMAT + 1, "disks": {}}),
                   json.dumps({"format": rw.KEPT_FORMAT, "disks": {key: {"rates": "fast"}}})):
        kept.write_text(damage)
        rw.forget_measured()
        chosen = rw.choose_read_window([spec])
        assert chosen.source == "measured" and chosen.kept == ""
    assert measures == [1] * 6
    assert json.loads(kept.read_text())["format"] == rw.KEPT_FORMAT  # rewritten whole

    _native.set_fault_read_chunk(2 * PIECE)  # another piece size reads the disk otherwise
    rw.forget_measured()
    rw.choose_read_window([spec])
    assert measures == [1] * 7 and len(json.loads(kept.read_text())["disks"]) == 2


def test_off_keeps_nothing_and_an_unwritable_file_still_measures_and_says_so(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, spec: Any, measures: list[int]) -> None:
    monkeypatch.setenv(ENV_MEASURED_DISKS, "off")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("ASYNCSIDE_CACHE", raising=False)
    assert rw.kept_file() is None
    rw.choose_read_window([spec])
    rw.forget_measured()
    rw.choose_read_window([spec])
    assert measures == [1, 1] and not (tmp_path / "xdg").exists()

    monkeypatch.setenv(ENV_MEASURED_DISKS, "")  # blank: the user cache's file
    assert rw.kept_file() == tmp_path / "xdg" / "asyncside" / "disks.json"

    # A directory no file can be made in, for root too (a read-only home, as a container has).
    monkeypatch.setenv(ENV_MEASURED_DISKS, "/proc/disks.json")
    rw.forget_measured()
    chosen = rw.choose_read_window([spec])
    assert chosen.source == "measured" and chosen.window >= rw.MIN_WINDOW
    assert "not kept for later processes: /proc/disks.json: " in chosen.why


def test_the_variable_is_checked_like_the_others(tmp_path: pathlib.Path) -> None:
    assert PYTHON_VARIABLES[ENV_MEASURED_DISKS] is env_measured_disks
    assert env_measured_disks("") == "" and env_measured_disks(" OFF ") is None
    assert env_measured_disks(str(tmp_path / "d.json")) == str(tmp_path / "d.json")
    assert env_measured_disks("~/d.json") == os.path.expanduser("~/d.json")
    with pytest.raises(EnvVarError, match=r"ASYNCSIDE_MEASURED_DISKS.*off, or a file \(this is a directory\)"):
        env_measured_disks(str(tmp_path))
    (tmp_path / "f").write_text("")
    with pytest.raises(EnvVarError, match="is a file"):
        env_measured_disks(str(tmp_path / "f" / "d.json"))


def test_disks_are_told_apart_by_what_the_kernel_says_of_them(tmp_path: pathlib.Path) -> None:
    here = rw.disk_identity(os.stat(tmp_path).st_dev)
    assert here is not None and here.startswith(f"{os.major(os.stat(tmp_path).st_dev)}:")
    # A number no block device has (an overlay's, a tmpfs's): only within this boot.
    anon = rw.disk_identity(os.makedev(0, 0xFFFFF))
    boot = pathlib.Path("/proc/sys/kernel/random/boot_id")
    if boot.is_file():
        assert anon == f"0:{0xFFFFF} in boot {boot.read_text().strip()}"
    block = pathlib.Path("/sys/dev/block")
    numbers = sorted(p.name for p in block.iterdir()) if block.is_dir() else []
    if len(numbers) >= 2:
        ids = {rw.disk_identity(os.makedev(*map(int, n.split(":")))) for n in numbers}
        assert len(ids) == len(numbers), "two block devices got one identity"


def test_processes_started_together_measure_the_disk_once(tmp_path: pathlib.Path, spec: Any) -> None:
    """Two processes entering at once (a server's workers, ranks on one host): the first measures,
    the second waits for it and takes what it kept, rather than both reading the disk at once and
    each seeing a share of its rate."""
    kept = tmp_path / "disks.json"
    code = ("import sys, time, pathlib; from asyncside import _native, read_window as rw; "
            f"_native.set_fault_read_chunk({PIECE}); rw.MIN_STORE_BYTES = 0; "
            "spec = type('S', (), {'path': pathlib.Path(sys.argv[1]), 'stride': 262144, 'n_experts': 16})(); "
            "rates = {w: 1e9 for w in rw.WINDOWS}; "
            "rw.measure_rates = lambda *a, **k: (time.sleep(1.5), rates)[1]; "
            "w = rw.choose_read_window([spec]); print(w.window, w.kept or 'measured')")
    env = {**os.environ, ENV_MEASURED_DISKS: str(kept)}
    children = [subprocess.Popen([sys.executable, "-c", code, str(spec.path)], env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [c.communicate(timeout=120) for c in children]
    assert [c.returncode for c in children] == [0, 0], [err for _, err in outs]
    said = sorted(out.split()[1] for out, _ in outs)
    assert said == [str(kept), "measured"], said


def test_a_lock_held_too_long_is_waited_for_only_so_long(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, spec: Any, measures: list[int]) -> None:
    import fcntl

    kept = kept_at(monkeypatch, tmp_path / "disks.json")
    monkeypatch.setattr(rw, "LOCK_WAIT_SECONDS", 0.3)
    fd = os.open(tmp_path / "disks.json.lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # another process, stuck while holding it
        chosen = rw.choose_read_window([spec])
    finally:
        os.close(fd)
    assert measures == [1] and chosen.source == "measured" and kept.is_file()
