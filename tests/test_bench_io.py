"""`asyncside bench io --quick --json` runs end to end on a tiny store and reports every field the
BENCHMARKS.md table is built from (a smoke test: no timing assertions)."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest


def _run(args: list[str], tmp_path: Path) -> dict:
    out = subprocess.run([sys.executable, *args, "--quick", "--json", "--dir", str(tmp_path / "bench")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


@pytest.mark.parametrize("entry", [["-m", "asyncside.cli", "bench", "io"], ["-m", "asyncside.bench.io"]],
                         ids=["cli", "module"])
def test_bench_io_quick_json(entry: list[str], tmp_path: Path) -> None:
    r = _run(entry, tmp_path)
    assert r["bench"] == "io"
    for key in ("nproc", "kernel", "disk", "filesystem", "root"):
        assert key in r["machine"]
    assert r["cold_methods"]["cold_direct"].startswith("O_DIRECT")
    if shutil.which("fio") is None:
        assert r["fio"] == "fio not installed"
    else:
        assert r["fio"].startswith("fio")
    (lay,) = r["layouts"]
    assert lay["layout"] == "qwen3-30b-a3b" and lay["segments"] == 9 and lay["record_bytes"] == 2654208
    assert lay["memcpy_1t_GBps"] > 0 and set(lay["side_region_GBps"]) == {"warm", "cold_buffered"}
    cells = {(c["reader"], c["mode"]) for c in lay["runs"]}
    readers = {"threads", "aiofiles"} | ({"io_uring"} if not r["skipped"] else set())
    assert {(rd, m) for rd in readers for m in ("warm", "cold_direct", "cold_buffered")} <= cells
    for c in lay["runs"]:
        assert c["GBps"] > 0 and math.isfinite(c["GBps"]) and c["loop_stall_ms"] >= 0
        assert c["depth"] == 4 and len(c["passes_GBps"]) == 1
    if lay["fio"]:
        assert {f["mode"] for f in lay["fio"]} == {"cold_direct", "cold_buffered"}
        assert all("--ioengine=io_uring" in f["command"] for f in lay["fio"])
    small = {x["reader"]: x["reads_per_s"] for x in r["small_reads_4k_warm"]}
    assert small["threads"] > 0 and (r["skipped"] or small["io_uring registered"] > 0)
    t = r["targets"]["qwen3-30b-a3b"]["threads"]
    assert "warm_best_vs_memcpy_1t" in t and "cold_best_vs_side_region" in t
