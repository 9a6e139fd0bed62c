"""The ordered reads' window, chosen from the store's disk (asyncside/read_window.py).

The runtime measures the rate of its store's disk at each window, the way a streamed resolve
reads (``_native.time_ordered_reads``), takes the least window within ``KNEE`` of the best, and
tells its fault tables; a window chosen for the process, or given to the runtime, is kept and not
measured; a store too small to measure keeps the default and says why; a disk is measured once per
process. Bad windows are refused, and a failed measuring read names its file.
"""

from __future__ import annotations

import errno
import os
import pathlib
from collections.abc import Iterator
from typing import Any

import mlx.core as mx
import pytest
from _fault_helpers import direct_decode, direct_file, model_store, native_read_settings_kept

from asyncside import ExpertStore, Runtime, _native
from asyncside import read_window as rw
from asyncside.models import reference_generate

RING = _native.io_uring_available()[0]


@pytest.fixture(autouse=True)
def _fresh() -> Iterator[None]:
    """Each test starts as a process does: no window chosen for it, no disk measured."""
    _native.testing.reset_fault_read_window()
    rw.forget_measured()
    with native_read_settings_kept():
        yield
    rw.forget_measured()


def test_the_knee_is_the_least_window_within_the_share_of_the_best() -> None:
    rates = {1: 0.5e9, 2: 1.0e9, 4: 1.45e9, 8: 1.5e9, 16: 1.55e9}
    assert rw.knee(rates) == 4  # 1.45 >= 0.9 x 1.55; 1.0 is not
    assert rw.knee(rates, share=0.6) == 2
    assert rw.knee(rates, share=1.0) == 16
    assert rw.knee({1: 1.6e9, 2: 1.5e9, 4: 1.2e9}) == 1  # a disk that gains nothing from depth
    with pytest.raises(ValueError, match="at least one window"):
        rw.knee({})


@pytest.mark.skipif(not RING, reason="no io_uring here")
def test_time_ordered_reads_reads_the_disk_and_refuses_bad_arguments(tmp_path: pathlib.Path) -> None:
    path = direct_file(tmp_path, 8 << 20)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        records = [(k << 20, 1 << 20) for k in (3, 0, 5)]
        err, seconds = _native.time_ordered_reads(fd, records, 256 << 10, 4)
        assert err == 0 and seconds > 0
        # A record past the end of the file: its first piece reads nothing (ENODATA).
        err, _ = _native.time_ordered_reads(fd, [(16 << 20, 1 << 20)], 1 << 20, 2)
        assert err == errno.ENODATA
        with pytest.raises(ValueError, match="piece: expected a multiple of 4096 bytes, got 1000"):
            _native.time_ordered_reads(fd, records, 1000, 4)
        with pytest.raises(ValueError, match="window: expected 1 to 32 pieces in flight, got 0"):
            _native.time_ordered_reads(fd, records, 1 << 20, 0)
        with pytest.raises(ValueError, match="got 33"):
            _native.time_ordered_reads(fd, records, 1 << 20, 33)
    finally:
        os.close(fd)
    before = _native.fault_counters()
    rw.measure_rates([(path, k << 20, 1 << 20) for k in range(8)], 1 << 20, pass_bytes=2 << 20, rounds=1)
    after = _native.fault_counters()
    # Measuring is not a streamed resolve's read: the fault counters do not move.
    assert after["ordered_reads"] == before["ordered_reads"] and after["chunk_ops"] == before["chunk_ops"]


@pytest.mark.skipif(not RING, reason="no io_uring here")
def test_measure_rates_gives_every_window_a_rate_and_names_a_failed_file(tmp_path: pathlib.Path) -> None:
    path = direct_file(tmp_path, 4 << 20)
    records = [(path, k * 262144, 262144) for k in range(16)]
    rates = rw.measure_rates(records, 65536, windows=(1, 2, 4), pass_bytes=1 << 20, rounds=2)
    assert set(rates) == {1, 2, 4} and all(r > 0 for r in rates.values())
    with pytest.raises(OSError) as info:  # the file ends before the last record
        rw.measure_rates([(path, 8 << 20, 262144)], 65536, windows=(1,), pass_bytes=1, rounds=1)
    assert info.value.filename == str(path) and info.value.errno == errno.ENODATA
    with pytest.raises(ValueError, match="expected records"):
        rw.measure_rates([], 65536)


def test_a_window_given_or_chosen_for_the_process_is_kept_unmeasured(tmp_path: pathlib.Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(rw, "measure_rates", lambda *a, **k: calls.append(1) or {4: 1.0})
    store = ExpertStore.open(model_store(tmp_path, "qwen3_moe", None)[0])
    specs = [store.layer(i) for i in store.layers]
    given = rw.choose_read_window(specs, 6)
    assert (given.window, given.source, given.table_window) == (6, "argument", 6)
    _native.set_fault_read_window(3)
    process = rw.choose_read_window(specs)
    # The tables follow the process's setting (-1), which a tool may switch while they run.
    assert (process.window, process.source, process.table_window) == (3, "process", -1)
    assert "ASYNCSIDE_FAULT_READ_WINDOW" in process.describe()
    assert calls == []


def test_a_store_too_small_to_measure_keeps_the_default_and_says_why(tmp_path: pathlib.Path) -> None:
    store = ExpertStore.open(model_store(tmp_path, "qwen3_moe", None)[0])
    chosen = rw.choose_read_window([store.layer(i) for i in store.layers])
    assert chosen.source == "default" and chosen.window == _native.fault_read_window()
    assert chosen.table_window == -1  # the tables follow the process's setting
    assert "not measured" in chosen.why and chosen.rates == {}


@pytest.mark.skipif(not RING, reason="no io_uring here")
def test_a_disk_is_measured_once_per_process(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = direct_file(tmp_path, 4 << 20)
    monkeypatch.setattr(rw, "MIN_STORE_BYTES", 0)
    real = rw.measure_rates
    calls: list[int] = []

    def counted(*args: Any, **kwargs: Any) -> dict[int, float]:
        calls.append(1)
        return real(*args, pass_bytes=512 << 10, rounds=1, windows=(2, 4, 8))

    monkeypatch.setattr(rw, "measure_rates", counted)
    _native.set_fault_read_chunk(65536)
    spec = type("Spec", (), {"path": path, "stride": 262144, "n_experts": 16})()
    first = rw.choose_read_window([spec])
    assert first.source == "measured" and set(first.rates) == {2, 4, 8}
    # The least window is MIN_WINDOW, even where the disk is as fast with fewer pieces in flight.
    assert first.window == rw.knee({w: r for w, r in first.rates.items() if w >= rw.MIN_WINDOW})
    assert first.window >= rw.MIN_WINDOW and first.piece_bytes == 65536 and first.seconds > 0
    assert "GB/s at 2 / 4 / 8" in first.describe()
    assert rw.choose_read_window([spec]) is first and calls == [1]
    rw.forget_measured()
    rw.choose_read_window([spec])
    assert calls == [1, 1]


@pytest.mark.parametrize("bad", [-1, 33, 2.0, True, "4"])
def test_the_runtime_refuses_a_bad_read_window(tmp_path: pathlib.Path, bad: Any) -> None:
    store = ExpertStore.open(model_store(tmp_path, "qwen3_moe", None)[0])
    with pytest.raises(ValueError, match="read_window: expected None .* or 0 to 32 pieces in flight"):
        Runtime(store, read_window=bad)


def ordered_reads() -> int:
    return int(_native.fault_counters()["ordered_reads"])


@pytest.mark.skipif(not RING, reason="no io_uring here")
def test_the_runtime_measures_its_disk_and_its_tables_read_with_the_window(tmp_path: pathlib.Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A direct decode with the window measured (the store made large enough to measure by
    lowering the floor), given, and given as 0: tokens equal mlx-lm's; the plan says where its
    window came from; reads go in order exactly where the window is not 0."""
    if mx.default_device() == mx.gpu:
        pytest.skip("the host pools' fault path (CPU stream)")
    monkeypatch.setenv("ASYNCSIDE_DIRECT", "1")
    monkeypatch.setattr(rw, "MIN_STORE_BYTES", 0)
    monkeypatch.setattr(rw, "PASS_BYTES", 256 << 10)
    store_dir, model, prompt = model_store(tmp_path, "qwen3_moe", None)
    ref = reference_generate(model, prompt, max_tokens=5)
    _native.set_fault_read_chunk(4096)
    for given, source in ((None, "measured"), (2, "argument"), (0, "argument")):
        plans: list[Any] = []
        before = ordered_reads()
        tokens = direct_decode(store_dir, prompt, 5, streamed=True, read_window=given, plans=plans)
        assert tokens == ref, (given, tokens, ref)
        chosen = plans[0].read_window
        assert chosen.source == source, chosen
        assert "read window: " in plans[0].describe()
        assert plans[0].as_dict()["read_window"]["source"] == source
        assert (ordered_reads() > before) == (chosen.window > 0), (given, chosen)
        if given is not None:
            assert chosen.window == given


@pytest.mark.skipif(not _native.ordered_reads_possible(), reason="no io_uring here: nothing is measured")
@pytest.mark.parametrize("rates, window", [
    ({4: 0.6e9, 8: 1.1e9, 16: 1.45e9, 32: 1.5e9}, 16),  # a disk that wants depth (a network volume)
    ({4: 1.6e9, 8: 1.6e9, 16: 1.4e9, 32: 1.2e9}, 4),    # flat from the least window: the least
    ({2: 1.7e9, 4: 1.5e9, 8: 1.6e9}, 4),                 # never below MIN_WINDOW, whatever 2 gave
])
def test_the_window_follows_the_disks_rates(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
                                            rates: dict[int, float], window: int) -> None:
    monkeypatch.setattr(rw, "MIN_STORE_BYTES", 0)
    monkeypatch.setattr(rw, "measure_rates", lambda *a, **k: rates)
    store = ExpertStore.open(model_store(tmp_path, "qwen3_moe", None)[0])
    chosen = rw.choose_read_window([store.layer(i) for i in store.layers])
    assert (chosen.window, chosen.source, chosen.table_window) == (window, "measured", window)


def test_a_pass_shrinks_to_fit_the_time_left_on_a_slow_disk() -> None:
    mib = 1 << 20
    # A fast disk: whole passes fit the time left.
    assert rw.pass_budget(0.1, 11, 1.5e9) == rw.PASS_BYTES
    # 20 MB/s with 1.0 s spent: 1.0 s over 10 passes is 2 MB each, below the least pass.
    assert rw.pass_budget(1.0, 10, 20e6) == rw.LEAST_PASS_BYTES
    # 200 MB/s with 0.2 s spent: 1.8 s over 9 passes, 40 MB each.
    assert rw.pass_budget(0.2, 9, 200e6) == 40_000_000
    # The time already spent: still the least pass, never a negative one.
    assert rw.pass_budget(5.0, 3, 1e9) == rw.LEAST_PASS_BYTES
    assert rw.pass_budget(0.0, 2, 1e12, pass_bytes=mib, least_bytes=4 * mib) == mib  # never above a pass
    assert rw.pass_budget(0.0, 0, 1.0) == rw.PASS_BYTES


class _SlowDisk:
    """``time_ordered_reads`` of a disk of ``rate`` bytes/s on a clock of its own (``now``)."""

    def __init__(self, rate: float) -> None:
        self.rate, self.now = rate, 0.0

    def reads(self, fd: int, records: list[tuple[int, int]], piece: int, window: int) -> tuple[int, float]:
        seconds = sum(n for _, n in records) / self.rate
        self.now += seconds
        return 0, seconds


@pytest.mark.parametrize("rate", [20e6, 100e6, 1.5e9])
def test_measuring_a_slow_disk_takes_about_the_time_allowed(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
                                                            rate: float) -> None:
    """A disk of ``rate`` (a stand-in for the reads, on its own clock): the first pass is short, the
    others fit what is left of MEASURE_SECONDS down to the least pass; a fast disk reads whole passes."""
    disk = _SlowDisk(rate)
    monkeypatch.setattr(_native, "time_ordered_reads", disk.reads)
    monkeypatch.setattr(rw.time, "perf_counter", lambda: disk.now)
    path = direct_file(tmp_path, 4096)
    records = [(path, k << 22, 4 << 20) for k in range(64)]  # 256 MiB of records, never read here
    read: list[int] = []
    rates = rw.measure_rates(records, 1 << 20, budget_s=rw.MEASURE_SECONDS, read=read)
    assert set(rates) == set(rw.WINDOWS) and len(read) == rw.ROUNDS * len(rw.WINDOWS)
    assert read[0] == rw.FIRST_PASS_BYTES
    assert all(rw.LEAST_PASS_BYTES <= n <= rw.PASS_BYTES for n in read[1:])
    if rate >= 1e9:
        assert read[1:] == [rw.PASS_BYTES] * (len(read) - 1)
    else:
        # Within the time allowed, but for the first pass and the least passes' floor.
        floor = rw.FIRST_PASS_BYTES / rate + (len(read) - 1) * rw.LEAST_PASS_BYTES / rate
        assert disk.now <= max(rw.MEASURE_SECONDS * 1.05, floor * 1.05), (disk.now, read)
        assert min(read[1:]) < rw.PASS_BYTES
    # Without a budget every pass is whole.
    read.clear()
    rw.measure_rates(records, 1 << 20, read=read, rounds=1)
    assert read == [rw.PASS_BYTES] * len(rw.WINDOWS)


@pytest.mark.skipif(not _native.ordered_reads_possible(), reason="no io_uring here: nothing is measured")
def test_the_plan_says_when_a_slow_disk_was_measured_in_short_passes(tmp_path: pathlib.Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    disk = _SlowDisk(20e6)
    monkeypatch.setattr(_native, "time_ordered_reads", disk.reads)
    monkeypatch.setattr(rw.time, "perf_counter", lambda: disk.now)
    monkeypatch.setattr(rw, "MIN_STORE_BYTES", 0)
    _native.set_fault_read_chunk(1 << 20)
    path = direct_file(tmp_path, 4096)
    spec = type("Spec", (), {"path": path, "stride": 4 << 20, "n_experts": 64})()
    chosen = rw.choose_read_window([spec])
    assert chosen.source == "measured"
    assert "; a slow disk: passes of 8 MiB to measure in about 2 s" in chosen.why, chosen.why
