"""``bench offload``'s bytes read while loading, round 19: on a low-locality trace asyncside read
710 MB "while loading" against the slot cache's 128 MB, one figure for the model, the rows'
warm-up and the passes over the store that measure its disk's read window when a runtime whose
plan reads past the page cache is entered (about 580 MB and 0.6 s there, before the first token).
The run now says which is which."""

from __future__ import annotations

import os
import pathlib
from typing import Any

import pytest

import asyncside.runtime as runtime_mod
from asyncside import read_window
from asyncside.bench import offload
from asyncside.store import ExpertStore


def test_offload_says_what_loading_read_measuring_the_disk_apart_from_the_warm_up(
        quick_store: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if not pathlib.Path("/proc/self/io").is_file() or not hasattr(os, "O_DIRECT"):
        pytest.skip("no /proc/self/io or O_DIRECT here")
    store = ExpertStore.open(quick_store)
    try:
        os.close(os.open(store.layer(sorted(store.layers)[0]).path, os.O_RDONLY | os.O_DIRECT))
    except OSError:
        pytest.skip("this file system refuses O_DIRECT")
    measured: list[int] = []

    def measure(specs: Any, given: int | None = None) -> read_window.ReadWindow:
        # The store is too small for the runtime to measure its disk: passes of a MiB stand in,
        # read the way the runtime's are (O_DIRECT, counted by the process's disk counter).
        piece = 1 << 20
        rates = read_window.measure_rates(read_window.store_records(specs), piece, pass_bytes=1 << 20,
                                          rounds=1, read=measured)
        return read_window.ReadWindow(4, piece, "measured", "a stand-in's passes", rates, 0.01)

    monkeypatch.setattr(runtime_mod, "choose_read_window", measure)
    monkeypatch.setenv("ASYNCSIDE_DIRECT", "1")
    spec = {"store": str(quick_store), "prompt": offload.prompt_for(str(quick_store)), "seconds": 60.0, "tokens": 3,
            "policy": "lru", "predictor": "none", "budget": 1 << 30, "system": "asyncside"}
    out = offload.child_main(spec)
    assert out["read_window"]["source"] == "measured" and sum(measured) >= 4 << 20
    parts = out["read_bytes_loading_parts"]
    assert set(parts) == {"model_and_store", "warm_rows", "measuring_the_disk"}
    assert sum(parts.values()) == out["read_bytes_loading"]
    assert parts["warm_rows"] > 0
    # every byte the passes read, and nothing of the warm-up's
    assert sum(measured) <= parts["measuring_the_disk"] < sum(measured) + (1 << 20)
    run = {**out, "status": "ok"}
    assert "MB of them measuring the disk's read window" in offload._loading_note(run)
    # the slot cache has no disk to measure: its loading is the model and its warm slots
    slot = offload.child_main({**spec, "system": "slot-cache", "fraction": 0.5})
    assert set(slot["read_bytes_loading_parts"]) == {"model_and_store", "warm_rows"}
    assert slot["read_bytes_loading_parts"]["warm_rows"] > 0 and offload._loading_note(slot) == ""
