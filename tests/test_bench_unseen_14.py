"""A reviewer reruns our benchmarks, round 14: ``asyncside bench`` and tools/ on shapes, traces and
settings not in the repo, each figure recomputed by hand from the raw numbers the JSON carries
(no timing asserted)."""

from __future__ import annotations

import argparse
import pathlib

import pytest

from asyncside.bench import generate as bench
from tests._cli_support import run_cli


def test_per_token_bytes_are_over_the_steps_the_counters_cover() -> None:
    """Queued steps queue the next step before its token is awaited, so the first decode step's
    demands were counted before the first token arrived, where the counters' window starts: the
    window held ten steps of a twelve-token run (80 demands of two layers x top-4), while bytes per
    token were divided by eleven, understating asyncside's read bytes beside the slot cache's."""
    record = 1000
    run = bench.BenchRun(tokens=list(range(12)), demands_per_step=8,
                         stats_first={"hits": 10, "misses": 6, "bytes_read": 6 * record},
                         stats={"hits": 60, "misses": 36, "bytes_read": 36 * record})
    figures = run.decode_figures(record)
    assert run.counted_steps() == 10.0
    assert figures["miss_bytes_per_token"] == 30 * record / 10
    assert figures["bytes_read_per_token"] == 30 * record / 10
    assert figures["hit_rate"] == 50 / 80
    # Without a known step's demands, the decode steps as before.
    assert bench.BenchRun(tokens=list(range(12)), stats=run.stats, stats_first=run.stats_first).counted_steps() == 11


def test_generate_json_per_token_bytes_recompute_from_its_counters(quick_store: pathlib.Path) -> None:
    """Every row with counters: its per-token bytes are its counters over the steps they cover, and
    those steps are its demands over a step's (MoE layers x top-k), the slot cache's all the decode
    steps of the run."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", action="store_true")
    bench.add_generate_arguments(parser)
    args = parser.parse_args(["--quick", "--json", "--model", str(quick_store), "--tokens", "8", "--residency", "0",
                              "--no-cold", "--plot", "none"])
    res = bench.run_generate_bench(args)
    per_step = res["moe_layers"] * 4  # the quick model routes top-4
    checked = 0
    for row in res["rows"]:
        d = row.get("decode_counters")
        if not d:
            continue
        assert d["steps"] == (d["hits"] + d["misses"]) / per_step
        assert row["miss_bytes_per_token"] == d["misses"] * res["record_bytes"] / d["steps"]
        assert row["bytes_read_per_token"] == d["bytes_read"] / d["steps"]
        if row["system"] == "slot-cache":
            assert d["steps"] == row["tokens"] - 1
        checked += 1
    assert checked == 2


def test_offload_stores_under_a_memory_no_run_holds_is_refused_before_any_run(
        quick_store: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``bench offload --stores DIR --memory 1M``: a budget below a run's process alone was refused
    for a built shape before building, but a converted store went on to measure the disk and run
    every locality and system, each killed by the OOM killer (minutes, a table of nothing, and no
    cgroup at all on a machine without one); now one usage line names --memory and what a run of
    that store holds, before anything runs."""
    rc, err = run_cli(capsys, "bench", "offload", "--stores", str(quick_store), "--memory", "1M",
                      "--store-ratio", "0.001", "--seconds", "1", "--tokens", "2", "--json")
    assert rc == 2
    lines = [line for line in err.splitlines() if "error" in line]
    assert len(lines) == 1 and "Traceback" not in err
    assert lines[0].startswith(f"asyncside bench offload: error: --memory 1 MiB (1 MB) holds no run of the store "
                               f"{quick_store}: its 2 MoE layers' top-4 experts alone are")
    assert lines[0].endswith("(nothing was run)") and "random-read bandwidth" not in err


def test_generate_json_has_no_nan_where_belady_hits_nothing(quick_store: pathlib.Path, tmp_path: pathlib.Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """A user's routing whose every token routes experts no earlier token did: Belady's MIN hits
    nothing, and each policy's vs_belady was NaN, printed by --json as a bare NaN that strict JSON
    parsers (jq, JavaScript, Go) refuse. A ratio over zero is now null, the JSON strict."""
    import json

    import numpy as np

    from asyncside.cli import main
    from asyncside.routing import RoutingTrace

    ids = np.array([[[(4 * t + j) % 32 for j in range(4)] for _layer in range(2)] for t in range(8)])
    trace = tmp_path / "disjoint.npz"
    RoutingTrace(ids, np.array([8]), 32, {}).save(trace)
    capsys.readouterr()
    assert main(["bench", "generate", "--quick", "--json", "--model", str(quick_store), "--tokens", "2",
                 "--residency", "0", "--no-cold", "--prompt", "a", "--routing", str(trace), "--plot", "none"]) == 0

    def refuse(constant: str) -> None:
        raise AssertionError(f"{constant} in the JSON")

    res = json.loads(capsys.readouterr().out, parse_constant=refuse)
    (row,) = res["policies_vs_belady"]
    assert row["belady"] == 0.0
    assert all(p["vs_belady"] is None for p in row["policies"].values())


@pytest.mark.parametrize(("tool", "argv", "said"), [
    ("ab_streamed.py", ["--model", "STORE", "--tokens", "1"], "argument --tokens: expected an integer >= 2, got '1'"),
    ("ab_decode.py", ["--rounds", "0"], "argument --rounds: expected an integer >= 1, got '0'"),
    ("bench_facade.py", ["--rounds", "0"], "argument --rounds: expected an integer >= 1, got '0'"),
    ("serve_batch_cost.py", ["STORE", "TRACE", "--steps", "1"], "argument --steps: expected an integer >= 2, got '1'"),
    ("streamed_landing.py", ["STORE", "--trials", "4"], "argument --trials: expected an integer >= 5, got '4'"),
    ("policy_bounds.py", ["--tokens", "0"], "argument --tokens: expected an integer >= 1, got '0'"),
])
def test_a_tools_count_too_small_for_a_figure_is_a_usage_error(tool: str, argv: list[str], said: str) -> None:
    """tools/ab_streamed.py --tokens 1 (one arm never timed), --rounds 0 (no round), --steps 1 (the
    first step is dropped as warm-up), --trials 4 (all warm-up): the work ran, then ended in a
    statistics.StatisticsError traceback on an empty median. Now a usage line, status 2."""
    import subprocess
    import sys

    tools = pathlib.Path(__file__).resolve().parent.parent / "tools"
    done = subprocess.run([sys.executable, str(tools / tool), *argv], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines()[-1] == f"{tool}: error: {said}" and "Traceback" not in done.stderr


def test_offload_slot_cache_gets_asyncsides_rows_whatever_the_systems_order(
        quick_store: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--systems slot-cache,asyncside``: the slot cache ran first, on the bench's guess at a cache
    size (half the budget's share of the experts), not on the rows asyncside's plan chose, and its
    row sat beside asyncside's as if the caches were the same size. asyncside now runs first. (The
    children are stood in for: what is checked is what each was asked to run.)"""
    from _offload_support import offload_budget, stand_in_runs

    from asyncside.bench import offload
    from tests._cli_support import offload_args

    specs = stand_in_runs(monkeypatch, 6)
    args = offload_args("--stores", str(quick_store), "--memory", str(offload_budget(700 * 2**20)),
                        "--store-ratio", "0.001", "--localities", "high", "--systems", "slot-cache,asyncside",
                        "--tokens", "3", "--quiet")
    res = offload.run_offload_bench(args)
    asked = [(s["system"], s.get("fraction") if s["system"] == "slot-cache" else None) for s in specs]
    experts = res["shapes"][0]["experts_per_layer"]
    assert [s for s, _f in asked] == ["mlx-lm", "asyncside", "slot-cache"]  # the compute limit, then the arms
    assert asked[-1][1] == 12 / (2 * experts)  # asyncside's 6 rows a layer, of 2 layers
    assert [r["system"] for r in res["runs"]] == ["asyncside", "slot-cache"]


def test_offload_tokens_1_is_a_usage_error(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``bench offload --tokens 1`` ran every system for one token each and reported 0.00 tok/s
    for all of them, status ok, of limit 0.00x: decode speed is timed from the first token to the
    last, so one token times nothing (bench generate refuses it as well)."""
    rc, err = run_cli(capsys, "bench", "offload", "--stores", str(tmp_path), "--tokens", "1")
    assert rc == 2
    assert err.splitlines()[-1] == "asyncside bench offload: error: argument --tokens: expected an integer >= 2, got '1'"


def test_generate_residency_given_twice_runs_once(quick_store: pathlib.Path) -> None:
    """``--residency 0.5 0.5`` ran that residency twice a round into one table cell: each of its
    rows said repeats 2 under settings.repeats 1, and the rows came twice."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", action="store_true")
    bench.add_generate_arguments(parser)
    args = parser.parse_args(["--quick", "--json", "--model", str(quick_store), "--tokens", "3",
                              "--residency", "0.5", "0.5", "--no-cold", "--plot", "none"])
    res = bench.run_generate_bench(args)
    assert res["settings"]["residencies"] == [0.5]
    assert [r["system"] for r in res["rows"]] == ["mlx-lm", "asyncside", "slot-cache"]
    assert all(r["repeats"] == 1 for r in res["rows"])


@pytest.mark.parametrize(("argv", "said"), [
    (["--chunk-kib", "3"], "argument --chunk-kib: expected an integer >= 4, got '3'"),
    (["--iowq-workers", "-5"], "argument --iowq-workers: expected an integer >= -1, got '-5'"),
    (["--repeat", "0"], "argument --repeat: expected an integer >= 1, got '0'"),
])
def test_io_reader_options_out_of_range_are_usage_errors(argv: list[str], said: str,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """``bench io --chunk-kib 3`` (an O_DIRECT op below a page) and ``--iowq-workers -5`` ended in the
    native reader's ValueError traceback, once the store was built; ``--repeat 0`` ran one pass
    and said 1. Each is now a usage error as parsed."""
    rc, err = run_cli(capsys, "bench", "io", "--quick", "--no-fio", *argv)
    assert rc == 2 and "Traceback" not in err
    assert err.splitlines()[-1] == f"asyncside bench io: error: {said}"


@pytest.mark.parametrize("residency", [0.25, 1.0])
def test_the_slot_cache_starts_holding_what_the_runtimes_rows_start_with(quick_store: pathlib.Path,
                                                                        residency: float) -> None:
    """The runtime warms its dynamic rows with the store's next hottest experts before the first
    step; the slot cache, "starting with the same resident set", left its other slots empty, so its
    first steps missed what asyncside's hit (every expert at 100% in pools) and the vs_slot_cache
    figures leaned towards asyncside. Both now start holding the same experts."""
    import anyio
    import numpy as np

    from asyncside.bench.slot_cache import SlotCache
    from asyncside.runtime import Runtime
    from asyncside.store import ExpertStore

    store = ExpertStore.open(quick_store)

    async def runtime_holds() -> dict[int, set[int]]:
        async with Runtime(store, resident=residency) as rt:
            await rt.drain()
            return {layer: {int(e) for e in np.flatnonzero(rt.ledger(layer).lookup() >= 0)} for layer in store.layers}

    held = anyio.run(runtime_holds)
    with SlotCache(store, residency) as sc:
        assert {layer: set(sc.holds(layer)) for layer in store.layers} == held
        assert all(len(h) == sc.layers[layer].slots for layer, h in held.items())  # every slot filled
        assert sc.stats()["misses"] == 0 and sc.stats()["bytes_read"] == 0  # warm reads are not demand reads


def test_a_runs_process_is_measured_apart_from_the_process_that_plans_the_bench() -> None:
    """bench offload's refusal of a budget no run holds counted what *this* process held as a run's
    process: called from a large program (a test suite late in its run, a notebook) it refused
    --memory 700M with "about 2229 MB of process", though every run is a fresh child. A run's
    process is now measured in a fresh child."""
    from asyncside.bench import offload
    from asyncside.memory import proc_self_bytes

    offload.process_baseline.cache_clear()
    ballast = bytearray(512 * 2**20)
    ballast[::4096] = b"x" * len(ballast[::4096])  # touched: resident
    try:
        here = proc_self_bytes("status", "VmRSS")
        child = offload.process_baseline()
        assert 0 < child < here - 400 * 2**20, (child, here)
    finally:
        del ballast
