"""`asyncside bench offload`: sizes, memory cgroups, and a tiny run of every system in one.

The cgroup tests need a memory cgroup this process can create (root, v1 or v2); they are skipped,
with the reason, where none can be made.
"""

from __future__ import annotations

import pathlib
from typing import Any

import pytest
from _cli_support import offload_args
from _offload_support import offload_budget

from asyncside.bench import offload

BUDGET = 700 * 2**20


@pytest.fixture(scope="module")
def cgroups() -> None:
    ok, why = offload.check_cgroups(BUDGET)
    if not ok:
        pytest.skip(f"no memory cgroup can be made here: {why}")


def test_sizes() -> None:
    assert offload.parse_size("800M") == 800 * 2**20
    assert offload.parse_size("1.5G") == int(1.5 * 2**30)
    assert offload.parse_size("2gib") == 2 * 2**30
    assert offload.parse_size(4096) == 4096
    for bad in ("lots", "-1G", "0"):
        with pytest.raises(ValueError, match="size"):
            offload.parse_size(bad)


def test_the_title_gives_the_budget_as_memory_reads_it() -> None:
    """--memory 700M is 700 MiB (what asyncside's plan and refusals say); the title said "734 MB"
    alone, the decimal figure of the tables, which read as another budget."""
    title = offload._title({"budget_bytes": BUDGET, "cgroup": "cgroup v2", "shapes": []})
    assert "budget 700 MiB (734 MB)" in title


def test_no_cgroup_hierarchy_is_said_clearly(tmp_path: pathlib.Path) -> None:
    with pytest.raises(offload.CgroupError, match="no memory cgroup hierarchy"):
        offload.cgroup_version(tmp_path)


def test_a_process_over_the_limit_is_reported_killed(cgroups: None, quick_store: pathlib.Path) -> None:
    """mlx-lm in a cgroup far below what it needs: the run says the OOM killer ended it, and at what
    peak; the cgroup is gone afterwards."""
    spec = {"system": "mlx-lm", "store": str(quick_store), "prompt": [84], "seconds": 1, "tokens": 2,
            "routing": None, "budget": 0, "fraction": 0.25, "policy": "lru", "predictor": "none"}
    with offload.MemoryCgroup(48 * 2**20) as cg:
        run = offload._child(spec, cg, timeout=120)
        path = cg.path
    assert not path.exists()
    assert run["oom_kills"] >= 1, run
    assert run["status"].startswith("killed by the cgroup's OOM killer"), run["status"]
    # The kernel charges a few pages past the limit before its OOM killer acts (cgroup v1's
    # max_usage_in_bytes shows them): a peak within 1 MiB of the limit is the limit held.
    assert 0 < run["peak_bytes"] <= 49 * 2**20


def test_tiny_offload_run(cgroups: None, quick_store: pathlib.Path) -> None:
    """Every system runs in its own cgroup under the budget, never above it, with every column, and
    the tokens of every system equal the all-resident reference's under the same replayed routing."""
    budget = offload_budget(BUDGET)
    args = offload_args("--stores", str(quick_store), "--memory", str(budget), "--store-ratio", "0.001",
                        "--seconds", "2", "--tokens", "10", "--localities", "low,high")
    res = offload.run_offload_bench(args)
    assert res["budget_bytes"] == budget and res["cgroup"].startswith("cgroup v")
    (shape,) = res["shapes"]
    assert shape["io"]["GBps"] > 0 and shape["io"]["queue_depth"] >= 1
    for loc in ("low", "high"):
        assert shape["compute"][loc]["status"] == "ok" and shape["compute"][loc]["decode_tokens_per_s"] > 0
    assert [(r["locality"], r["system"]) for r in res["runs"]] == [
        (loc, s) for loc in ("low", "high") for s in offload.SYSTEMS]
    for r in res["runs"]:
        assert r["status"] == "ok", r
        assert 0 < r["peak_bytes"] <= budget  # the budget is never exceeded
        assert r["tokens_match_reference"] is True and r["n_tokens"] == 10
        assert r["decode_tokens_per_s"] > 0 and r["disk_mb_per_token"] >= 0 and r["of_limit"] > 0
        if r["system"] != "mlx-lm":
            assert 0 <= r["hit_rate"] <= 1 and 0 <= r["belady"]["hit_rate"] <= 1
            assert r["of_min"] is not None and r["miss_mb_per_token"] >= 0
            assert r["rows_per_layer"] and all(n > 0 for n in r["rows_per_layer"].values())
        if r["system"] == "asyncside":  # a plan that reads past the page cache states its read window
            window = r["read_window"]
            assert (window is not None) == r["memory_plan"]["direct"], (window, r["memory_plan"])
            if window is not None:
                assert window["source"] in ("measured", "default", "process") and window["why"], window
    assert res["tokens_identical"] is True
    md = offload.render_markdown(res)
    assert md.count("\n| store") == len(res["runs"]) and "of MIN" in md


def test_the_bench_fails_when_a_run_of_asyncsides_did_not_finish() -> None:
    # mlx-lm killed under the limit is a finding; asyncside refused (a generation whose KV cache
    # passes the budget, pools that do not fit) is the bench not measuring what it is for
    from asyncside.bench import BENCHES

    ok = BENCHES["offload"].ok
    fine = {"system": "asyncside", "status": "ok"}
    slot = {"system": "slot-cache", "status": "ok"}
    killed = {"system": "mlx-lm", "status": "killed by the cgroup's OOM killer while loading"}
    refused = {"system": "asyncside", "status": "exit status 2 while starting: AsyncsideError: max_tokens=..."}
    assert ok({"tokens_identical": True, "runs": [fine, slot, killed]})
    assert not ok({"tokens_identical": True, "runs": [refused, slot, killed]})
    assert not ok({"tokens_identical": True, "runs": [fine, refused]})
    assert not ok({"tokens_identical": False, "runs": [fine, slot]})
    assert not ok({"tokens_identical": True, "runs": [killed]})


def test_the_io_limit_counts_the_prefetches_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under a predictor, queued steps also read predicted records (right or wrong): the I/O limit
    divides the disk's rate by the misses' and the prefetches' bytes, not the misses' alone."""
    monkeypatch.setattr(offload, "belady_of_run", lambda *a, **k: {"hit_rate": 0.5})
    mb = offload.MB
    sh = {"record_bytes": mb, "io": {"GBps": 1000 * mb / 1e9}, "store": "store"}  # 1000 records a second
    run: dict[str, Any] = {"status": "ok", "tokens": [1] * 10, "rows_per_layer": 4, "read_bytes": 0,
                           "decode_tokens_per_s": 5.0,
                           "stats": {"hits": 50, "misses": 100, "prefetch_reads": 100, "prefetch_hits": 40}}
    offload._figures(run, sh, "trace.npz", {"tokens": [1] * 10, "decode_tokens_per_s": 1000.0})
    assert run["miss_mb_per_token"] == 10.0 and run["prefetch_mb_per_token"] == 10.0
    assert run["io_limit_tokens_per_s"] == 50.0  # 1000 records / s over 20 a token
    del run["stats"]["prefetch_reads"]  # no predictor: the misses alone
    offload._figures(run, sh, "trace.npz", {"tokens": [1] * 10, "decode_tokens_per_s": 1000.0})
    assert run["io_limit_tokens_per_s"] == 100.0
