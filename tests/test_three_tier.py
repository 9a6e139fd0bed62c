"""tools/device/three_tier.py's pieces that run anywhere (the arguments, each arm's child and
environment, the table) and bench offload's shared pieces it uses (the child command and its
environment, the disk's depth curve). The run itself needs a memory cgroup and a GPU machine
(BENCHMARKS.md, "Three tiers on the H200 (larger than memory)")."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import sys
from types import ModuleType
from typing import Any

import pytest
from _offload_support import stand_in_timed_reads

from asyncside.bench import offload

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tt() -> ModuleType:
    spec = importlib.util.spec_from_file_location("three_tier", ROOT / "tools" / "device" / "three_tier.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_arguments_and_their_refusals(tt: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    args = tt.parse_args(["--memory-max", "4200M", "--json", "x.json"])
    assert args.memory_max_bytes == 4200 * 2**20 and args.disk_bytes_bytes == 2 * 2**30
    assert args.arm_list == ["asyncside", "asyncside-whole", "slot-cache"]
    assert args.locality_list == ["low", "middle", "high"] and args.depth_list == [1, 4, 8, 64]
    assert args.tier_share == 0.0 and args.resident == "0.10" and args.tokens == 24
    assert tt.parse_args(["--memory-max", "1G", "--json", "x", "--resident", "auto"]).resident == "auto"
    for bad, flag in ((["--arms", "asyncside,mystery"], "--arms: unknown arm 'mystery'"),
                      (["--resident", "1.5"], "--resident: expected a fraction"),
                      (["--resident", "lots"], "--resident: expected a fraction"),
                      (["--tier-share", "2"], "--tier-share: expected a share in [0, 1]"),
                      (["--localities", "sideways"], "--localities: unknown preset 'sideways'"),
                      (["--disk-depths", "1,0"], "--disk-depths: expected depths >= 1"),
                      (["--disk-bytes", "much"], "--disk-bytes:")):
        with pytest.raises(SystemExit):
            tt.parse_args(["--memory-max", "1G", "--json", "x", *bad])
        assert flag in capsys.readouterr().err
    with pytest.raises(SystemExit):
        tt.parse_args(["--memory-max", "a lot", "--json", "x"])
    assert "--memory-max:" in capsys.readouterr().err


def test_each_arm_its_child_and_environment(tt: ModuleType) -> None:
    base = {"store": "S", "budget": 1 << 30, "fraction": 0.1}
    spec, env, cmd = tt.arm_spec("asyncside", base, "0.10", 0, 0.2)
    assert env == {} and spec["resident"] == "0.10" and spec["host_tier"] == 0
    assert cmd is not None and cmd[-1].endswith("three_tier.py")
    spec, env, cmd = tt.arm_spec("asyncside-whole", base, "0.10", 5, 0.2)
    assert env == {"ASYNCSIDE_FAULT_READ_CHUNK": "0"} and spec["host_tier"] == 5 and cmd is not None
    spec, env, cmd = tt.arm_spec("slot-cache", base, "0.10", 5, 0.2)
    # bench offload's own slot-cache child, with the rows the asyncside arm's plan chose
    assert cmd is None and env == {} and spec["system"] == "slot-cache" and spec["fraction"] == 0.2
    with pytest.raises(ValueError, match="unknown arm 'other'"):
        tt.arm_spec("other", base, "0.10", 0, 0.2)


def test_the_child_gets_its_command_and_environment() -> None:
    """bench offload's child loop runs another command with extra variables (the arms' knob)."""
    script = ("import json, os, sys; print(json.dumps({'seen': os.environ.get('ASYNCSIDE_FAULT_READ_CHUNK'), "
              "'argv': sys.argv[1:]}))")
    run = offload._child({"system": "probe"}, None, 60, command=[sys.executable, "-c", script],
                         env={"ASYNCSIDE_FAULT_READ_CHUNK": "0"})
    assert run["status"] == "ok", run
    assert run["seen"] == "0" and run["env"] == {"ASYNCSIDE_FAULT_READ_CHUNK": "0"}
    assert run["argv"][0] == "--child" and json.loads(run["argv"][1]) == {"system": "probe"}
    failed = offload._child({"system": "probe"}, None, 60, command=[sys.executable, "-c", "raise SystemExit(3)"])
    assert failed["status"].startswith("exit status 3"), failed


def _run(loc: str, arm: str, tps: float, tokens: list[int], **stats: int) -> dict[str, Any]:
    return {"locality": loc, "arm": arm, "status": "ok", "decode_tokens_per_s": tps, "tokens": tokens,
            "stats": {"hits": 30, "misses": 10, "bytes_read": 8 * 1_000_000, **stats},
            "read_bytes": 8 * 1_000_000, "peak_bytes": 600 * 10**6, "limit_bytes": 800 * 10**6,
            "rows_per_layer": {"0": 13, "1": 13}}


def test_figures_ratios_and_the_table(tt: ModuleType) -> None:
    sh = {"record_bytes": 1_000_000, "io": {"GBps": 2.0, "best_depth": 64, "min_bytes_per_pass": 2e9,
                                            "cells": [{"depth": 1, "GBps": 0.5}, {"depth": 64, "GBps": 2.0}]},
          "shape": "qwen3-30b-a3b", "moe_layers": 2, "experts_per_layer": 128, "top_k": 8,
          "expert_bytes": 256 * 10**6, "host_tier_bytes": 0, "host_tier_layers": 0}
    compute = {"decode_tokens_per_s": 40.0, "tokens": [1, 2, 3, 4]}
    runs = [_run("low", "asyncside", 9.0, [1, 2, 3, 4], tier_faults=2), _run("low", "asyncside-whole", 6.0, [1, 2, 3, 5]),
            _run("low", "slot-cache", 3.0, [1, 2, 3, 4]),
            {"locality": "middle", "arm": "asyncside", "status": "skipped: 10 s left before --deadline"}]
    for r in runs:
        tt._figures(r, sh, compute if r["locality"] == "low" else {})
    tt._vs_slot_cache(runs)
    a, whole, slot, skipped = runs
    assert a["vs_slot_cache"] == pytest.approx(3.0) and whole["vs_slot_cache"] == pytest.approx(2.0)
    assert slot["vs_slot_cache"] == pytest.approx(1.0) and skipped["vs_slot_cache"] is None
    # 4 tokens: 2 MB of store reads a token at 2 GB/s -> 1000 tok/s; the compute limit binds
    assert a["io_limit_tokens_per_s"] == pytest.approx(1000.0) and a["of_limit"] == pytest.approx(9.0 / 40.0)
    assert a["tier_served_share"] == pytest.approx(0.2) and a["disk_miss_mb_per_token"] == pytest.approx(2.0)
    assert a["disk_over_misses"] == pytest.approx(1.0) and a["peak_over_limit"] == pytest.approx(0.75)
    assert a["tokens_match_reference"] is True and whole["tokens_match_reference"] is False
    table = tt.render_markdown({"shape": sh, "runs": runs, "budget_bytes": 800 * 10**6, "cgroup": "cgroup v1",
                                "store_over_budget": 4.2, "settings": {"resident": "0.10"}})
    lines = table.splitlines()
    header = next(line for line in lines if line.startswith("| locality"))
    assert "vs slot cache" in header and header.count("|") == len(tt.COLUMNS) + 1
    rows = [line for line in lines if line.startswith("| low") or line.startswith("| middle")]
    assert len(rows) == 4 and all(row.count("|") == len(tt.COLUMNS) + 1 for row in rows)
    assert "| 3.00x |" in rows[0] and "| 4/4 |" in rows[0] and "differ (of 4)" in rows[1]
    assert rows[0].startswith("| low | asyncside | 13 | 9.00 |") and "| middle | asyncside | — |" in rows[3]
    assert "skipped: 10 s left" in rows[3]
    assert "depth 1 0.50, depth 64 2.00" in table and "4.20x" in table


def test_the_disk_curve(quick_store: pathlib.Path) -> None:
    curve = offload.disk_curve(str(quick_store), (1, 3), min_bytes=1 << 20, passes=2)
    assert [c["depth"] for c in curve["cells"]] == [1, 3]
    for c in curve["cells"]:
        assert len(c["passes"]) >= 1 and c["GBps"] > 0
        assert all(b >= 1 << 20 for b in c["bytes_per_pass"])  # every pass at least min_bytes
    best = max(curve["cells"], key=lambda c: c["GBps"])
    assert curve["GBps"] == best["GBps"] and curve["best_depth"] == best["depth"]
    with pytest.raises(ValueError, match="depths must be integers >= 1"):
        offload.disk_curve(str(quick_store), (0,))


def test_the_disk_curve_of_a_store_whose_records_start_mid_block(tmp_path: pathlib.Path) -> None:
    """A store of a smaller alignment (``alignment=64``; the runtime's readers stage its records)
    has records that start and end inside a disk block: the curve read each one with O_DIRECT at
    its own offset and length, ``OSError: [Errno 22] Invalid argument``. It reads the blocks that
    hold the record, and counts what the disk read: at least the records' bytes."""
    import os

    from asyncside.store import ExpertStore
    from asyncside.testing import random_layers

    if not hasattr(os, "O_DIRECT"):
        pytest.skip("no O_DIRECT on this platform")
    segments = {"w1": ((3, 7), "float32"), "w2": ((5,), "float16"), "s": ((1,), "uint8")}
    store = ExpertStore.create(tmp_path / "store", random_layers(2, 16, segments, seed=3), alignment=64)
    stride = store.layer(0).stride
    assert stride % 512, stride  # records start inside a disk block
    try:
        os.close(os.open(store.layer(0).path, os.O_RDONLY | os.O_DIRECT))
    except OSError as exc:
        pytest.skip(f"the filesystem of {tmp_path} refuses O_DIRECT: {exc}")
    curve = offload.disk_curve(str(tmp_path / "store"), (1, 2), min_bytes=64 * stride, passes=1)
    assert [c["depth"] for c in curve["cells"]] == [1, 2] and curve["GBps"] > 0
    assert all(c["bytes_per_pass"][0] >= 64 * stride for c in curve["cells"])


def test_compute_limits_of_several_localities_in_one_process(tt: ModuleType, quick_store: pathlib.Path,
                                                             tmp_path: pathlib.Path) -> None:
    """One model, re-forced per locality: each locality's tokens are those of a process that ran it
    alone (the previous routing leaves nothing behind)."""
    from asyncside.routing import preset
    from asyncside.store import ExpertStore

    store = ExpertStore.open(str(quick_store))
    layers = sorted(store.layers)
    first = store.layer(layers[0])
    traces = {}
    for loc in ("low", "high"):
        traces[loc] = str(tmp_path / f"{loc}.npz")
        preset(loc, tokens=64, n_layers=len(layers), n_experts=first.n_experts,
               top_k=offload._store_top_k(str(quick_store)), seed=1).save(traces[loc])
    spec = {"system": "compute", "store": str(quick_store), "prompt": [84], "seconds": 60, "tokens": 6}
    both = tt.child_main({**spec, "routings": traces})
    alone = offload._child({**spec, "system": "mlx-lm", "routing": traces["high"], "fraction": 1.0, "budget": 0,
                            "policy": "lru", "predictor": "none"}, None, 120)
    assert alone["status"] == "ok", alone
    assert set(both["localities"]) == {"low", "high"}
    for loc in ("low", "high"):
        assert both["localities"][loc]["status"] == "ok" and len(both["localities"][loc]["tokens"]) == 6
    assert both["localities"]["high"]["tokens"] == alone["tokens"]


def test_user_routing_files(tt: ModuleType, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--routing FILE: loaded at parse time (a bad file is a usage error naming it), no preset unless
    --localities names one, and the file fitted onto the shape by bench offload's own code."""
    import numpy as np

    rng = np.random.default_rng(1)
    ids = np.stack([np.stack([rng.choice(64, 6, replace=False) for _ in range(5)]) for _ in range(9)])
    mine = tmp_path / "mine.npz"
    np.savez(mine, ids=ids.astype(np.int32), lengths=np.array([4, 5]), n_experts=np.int64(64))
    args = tt.parse_args(["--memory-max", "1G", "--json", "x", "--routing", str(mine)])
    assert args.locality_list == [] and [u["label"] for u in args.user_routings] == ["mine"]
    both = tt.parse_args(["--memory-max", "1G", "--json", "x", "--routing", str(mine), "--localities", "low",
                          "--routing", str(mine)])
    assert both.locality_list == ["low"] and [u["label"] for u in both.user_routings] == ["mine", "mine-2"]
    sh = {"shape": "s", "moe_layers": 2, "experts_per_layer": 32, "top_k": 4}
    fitted = offload.fit_routings(both.user_routings, [sh], positions=25, predictor="none")[0]
    traces = tt.write_traces(tmp_path, both.locality_list, fitted, sh)
    assert list(traces) == ["low", "mine", "mine-2"]
    from asyncside.routing import RoutingTrace

    got = RoutingTrace.load(traces["mine"])
    assert got.ids.shape == (4, 2, 4) and got.n_experts == 32
    assert np.array_equal(got.ids, RoutingTrace.load(mine).map_to(2, 32, 4).sequence(0))
    assert sh["routings"]["mine"]["wraps"] is True and sh["routings"]["mine"]["sequences"] == 2  # type: ignore[index]
    assert "routing mine:" in tt.render_markdown({"shape": sh, "runs": []})
    np.savez(tmp_path / "bad.npz", ids=ids.astype(np.int32))  # no n_experts
    for bad, said in ((["--routing", str(tmp_path / "bad.npz")], "bad.npz [n_experts]"),
                      (["--localities", ""], "nothing to replay"),
                      (["--predictor", "trace"], "carry none")):
        with pytest.raises(SystemExit):
            tt.parse_args(["--memory-max", "1G", "--json", "x", *bad])
        assert said in capsys.readouterr().err


def test_belady_of_a_run_bounds_and_counts(quick_store: pathlib.Path, tmp_path: pathlib.Path) -> None:
    """The fraction of MIN each run reports: MIN over the replayed demands, with a row per expert
    only the first use of each expert misses, and fewer rows never hit more."""
    from asyncside.models.forcing import RoutingReplay
    from asyncside.routing import RoutingTrace, preset
    from asyncside.store import ExpertStore

    store = ExpertStore.open(quick_store)
    layers = sorted(store.layers)
    n_experts = store.layer(layers[0]).n_experts
    top_k = offload._store_top_k(str(quick_store))
    trace = tmp_path / "low.npz"
    preset("low", tokens=64, n_layers=len(layers), n_experts=n_experts, top_k=top_k, seed=1).save(trace)
    steps = 12
    replay = RoutingReplay(RoutingTrace.load(trace), moe_layers=layers, n_experts=n_experts, top_k=top_k)
    accesses = sum(len(ids) for layer in layers for ids in replay.host_ids(layer, 0, steps))
    distinct = sum(len({int(e) for ids in replay.host_ids(layer, 0, steps) for e in ids}) for layer in layers)
    every = offload.belady_of_run(str(trace), str(quick_store), steps, {str(layer): n_experts for layer in layers})
    assert every["accesses"] == accesses and every["misses"] == distinct
    few = offload.belady_of_run(str(trace), str(quick_store), steps, {str(layer): top_k for layer in layers})
    assert few["accesses"] == accesses and few["misses"] > distinct


def test_disk_bytes_stop_at_the_last_token_of_a_run_ended_by_time(tt: ModuleType, quick_store: pathlib.Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """As bench offload's: a run ended by ``--seconds`` has a step queued ahead of its last token,
    whose reads go on until the runtime drains, for a token never generated. The disk's bytes
    counted them, one step of records more than the tokens' misses; they now stop at the last
    token."""
    record = 1 << 20
    stand_in_timed_reads(monkeypatch, tt, record)
    spec = {"store": str(quick_store), "prompt": offload.prompt_for(str(quick_store)), "seconds": 0.025,
            "tokens": 1000, "resident": "0.5", "host_tier": 0, "budget": 8 << 30, "policy": "lru",
            "predictor": "none", "routing": None}
    out = tt.child_main(spec)
    assert out["stopped_by"] == "seconds" and 2 <= len(out["tokens"]) < 1000
    assert out["read_bytes"] == 3 * record * len(out["tokens"])
