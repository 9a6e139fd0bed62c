"""A model freed in this process leaves its pages in the C heap: the demo hands them back before
its streaming run plans, so a budget is not charged for a reference that has ended."""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import pathlib
import sys
from typing import Any

import pytest

from asyncside.memory import proc_self_bytes, release_freed_heap

CHUNK = 64 << 10  # below glibc's mmap threshold: these come from the heap, not their own mappings
CHUNKS = 1024     # 64 MiB
KEEP = 100 << 10  # also from the heap


@pytest.mark.skipif(sys.platform != "linux" or not ctypes.util.find_library("c"), reason="glibc's heap")
def test_freed_heap_pages_are_given_back() -> None:
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    chunks = [libc.malloc(CHUNK) for _ in range(CHUNKS)]
    # Above the freed chunks (too large for any hole below them), so the heap's top cannot shrink
    # by itself when they are freed: what a model's arrays freed under later allocations leave.
    keep = libc.malloc(KEEP)
    for p in chunks:
        ctypes.memset(p, 1, CHUNK)  # resident
    touched = proc_self_bytes("status", "VmRSS")
    for p in chunks:
        libc.free(p)
    held = proc_self_bytes("status", "VmRSS")
    assert touched - held < CHUNK * CHUNKS // 2, touched - held  # free alone gave little back
    assert release_freed_heap()
    given_back = held - proc_self_bytes("status", "VmRSS")
    libc.free(keep)
    # Most of the freed chunks leave (a few pages of each stay: malloc's own headers).
    assert given_back > CHUNK * CHUNKS // 2, given_back




def test_the_demo_gives_the_reference_back_before_its_streaming_run_plans(
        quick_store: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from asyncside import cli, demo

    seen: list[str] = []
    reference_run, streaming_run = demo.reference_run, demo._streaming_run

    def reference(*a: Any, **k: Any) -> Any:
        seen.append("reference")
        return reference_run(*a, **k)

    async def streaming(*a: Any, **k: Any) -> Any:
        seen.append("streaming")
        return await streaming_run(*a, **k)

    monkeypatch.setattr(demo, "reference_run", reference)
    monkeypatch.setattr(demo, "_streaming_run", streaming)
    def released() -> bool:
        seen.append("released")
        return True

    monkeypatch.setattr(demo, "release_freed_heap", released)
    assert cli.main(["demo", "--model", str(quick_store), "--tokens", "2", "--json",
                     "--reference", "all-resident"]) == 0
    assert seen == ["reference", "reference", "released", "streaming"], seen  # warm-up, timed run
    assert json.loads(capsys.readouterr().out)["tokens_identical"] is True
