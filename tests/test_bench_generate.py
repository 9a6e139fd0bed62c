"""`asyncside bench generate --quick --json`: every field, tokens identical everywhere (no timing asserted).

Also: the step-mode switch, the busy-load helper, the bad settings refused, `asyncside demo --json`, and the
qwen3-30b-a3b shape's description (building it is slow: see test_shape_builds_and_runs).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import types

import pytest
from _fault_helpers import direct_budget

from asyncside import memory
from asyncside.bench import generate as bench
from asyncside.bench import shapes
from asyncside.cli import main
from asyncside.models import load_streaming_model
from asyncside.runtime import plan_layer
from asyncside.runtime._plan import min_rows
from asyncside.store import ExpertStore


def _check_row(r: dict, res: dict) -> None:
    """Every figure of one row present and consistent with the others."""
    assert r["tokens_identical"] is True and r["audit_clean"] is True, r
    assert r["decode_tokens_per_s"] > 0 and r["tokens_per_s"] > 0 and r["tokens"] == res["settings"]["tokens"]
    for key in ("vs_all_resident", "vs_slot_cache", "loop_cpu_vs_mlx_lm"):
        per = r[key + "_per_round"]
        assert len(per) == r["repeats"] and all(x > 0 for x in per), (key, r)
        assert min(per) <= r[key] <= max(per)
    assert r["loop_cpu_ms_per_token"] > 0 and r["process_cpu_ms_per_token"] >= r["loop_cpu_ms_per_token"] * 0.9
    if r["system"] == bench.MLX_LM:
        # The reference of its own round: every ratio to it is exactly 1.
        assert r["vs_all_resident"] == 1.0 and r["loop_cpu_vs_mlx_lm"] == 1.0
        assert r["hit_rate"] is None and r["bytes_read_per_token"] is None
        return
    assert 0.0 <= r["hit_rate"] <= 1.0
    assert r["bytes_read_per_token"] >= 0 and r["miss_bytes_per_token"] >= 0
    c = r["decode_counters"]
    # The decode steps the counters cover (queued steps count some of the first before its token).
    steps = c["steps"]
    assert 0 < steps <= r["tokens"] - 1
    # miss bytes are misses x record stride, per decode step counted (of the median run).
    if r["repeats"] == 1:
        assert r["miss_bytes_per_token"] == pytest.approx(c["misses"] * res["record_bytes"] / steps)
        assert r["bytes_read_per_token"] == pytest.approx(c["bytes_read"] / steps)
        assert r["hit_rate"] == pytest.approx(c["hits"] / (c["hits"] + c["misses"]) if c["hits"] + c["misses"] else 1.0)
    if r["system"] == bench.SLOT_CACHE:
        assert r["vs_slot_cache"] == 1.0
        # A slot cache reads exactly its misses: no prefetch; a buffered read stops at the last segment.
        assert c["reads"] == c["misses"] and c["bytes_read"] <= c["misses"] * res["record_bytes"]
        if r["cache"] == "cold" and "O_DIRECT" in res["cold_method"]:
            assert c["bytes_read"] == c["misses"] * res["record_bytes"]
            assert "O_DIRECT" in r["reader"]
    else:
        assert r["predictor"] == "lookahead" and r["step_mode_resolved"] in ("auto", "queued", "per-layer", "whole", "per-layer-nospec")


def test_quick_bench_json(quick_store: pathlib.Path, tmp_path: pathlib.Path,
                          capsys: pytest.CaptureFixture[str]) -> None:
    plot = tmp_path / "gen.png"
    capsys.readouterr()
    assert main(["bench", "generate", "--quick", "--json", "--model", str(quick_store), "--plot", str(plot),
                 "--tokens", "4", "--residency", "0.25", "0.5", "--no-drop-caches",  # no global side effect
                 "--modes", "default", "per-layer", "whole"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["bench"] == "generate" and res["tokens_identical"] is True
    s = res["settings"]
    assert s["tokens"] == 4 and s["residencies"] == [0.25, 0.5] and s["modes"] == ["default", "per-layer", "whole"]
    assert s["predictors"] == ["lookahead"] and s["load"] == 0 and res["model_info"] == {"kind": "store"}
    keys = ["mlx-lm", "asyncside/default/lookahead", "asyncside/per-layer/lookahead", "asyncside/whole/lookahead",
            "slot-cache"]
    assert [c["config"] for c in res["configs"]] == keys
    assert res["all_resident"]["mlx_lm"]["tokens_identical"] and res["all_resident"]["async_resident"]["tokens_identical"]
    assert res["all_resident"]["mlx_lm"]["tokens"] == 4 and res["all_resident"]["async_overhead_ratio"] > 0
    # One row per (cache state, residency, system), in the order the rounds ran them.
    caches = ["warm"] + (["cold"] if s["cold_repeats"] else [])
    assert [(r["cache"], r["residency"], r["config"]) for r in res["rows"]] == [
        (c, f, k) for c in caches for f in (0.25, 0.5) for k in keys]
    for r in res["rows"]:
        _check_row(r, res)
    by = {(r["cache"], r["residency"], r["config"]): r for r in res["rows"]}
    default = by[("warm", 0.25, "asyncside/default/lookahead")]
    assert default["step_mode_resolved"] == "auto" and default["forward_counters"]["queued"] >= 4
    assert by[("warm", 0.25, "asyncside/per-layer/lookahead")]["step_mode_resolved"] == "per-layer"
    whole = by[("warm", 0.25, "asyncside/whole/lookahead")]
    assert whole["step_mode_resolved"] == "whole" and whole["forward_counters"]["optimistic"] >= 4
    assert by[("warm", 0.25, "asyncside/per-layer/lookahead")]["forward_counters"]["optimistic"] == 0
    # The slot cache has as many rows as the runtime at each residency.
    store = ExpertStore.open(quick_store)
    for frac in (0.25, 0.5):
        resident, side = plan_layer(store, next(iter(store.layers)), frac)
        assert res["pool_plan"][str(frac)] == {"resident_per_layer": len(resident), "side_rows": side}
    assert "cold_method" in res and "warm_method" in res
    # Policies vs Belady on one trace: every policy with and without lookahead, ratios consistent;
    # with every row dynamic, MIN bounds LRU.
    assert [p["residency"] for p in res["policies_vs_belady"]] == [0.25, 0.5]
    for p in res["policies_vs_belady"]:
        assert set(p["policies"]) == {n + suffix for n in bench.POLICIES for suffix in ("", "+lookahead")}
        for name, v in p["policies"].items():
            assert v["vs_belady"] == pytest.approx(v["hit_rate"] / p["belady"])
            if "+" not in name:  # MIN bounds every demand-only policy
                assert v["hit_rate"] <= p["belady"] + 1e-12
        dyn = p["all_rows_dynamic"]
        assert dyn["rows"] == p["resident_per_layer"] + p["side_rows"] and dyn["lru"] <= dyn["belady"] + 1e-12
    assert res["trace"]["tokens_identical"] is True
    t = res["targets"]
    assert t["config"] == "asyncside/default/lookahead" and t["loaded"] is False and t["checks"]
    for c in t["checks"]:
        # None only where the figure has no denominator (no decode miss in so short a run).
        assert (c["met"] in (True, False) and isinstance(c["value"], float)) or (
            c["met"] is None and c["value"] is None and c["target"].startswith("bytes read")), c
    assert all(c["value"] is not None for c in t["checks"] if not c["target"].startswith("bytes read"))
    assert res["plot"] == str(plot) and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert res["machine"]["nproc"] >= 1 and res["machine"]["kernel"]


def test_loaded_run_and_markdown(quick_store: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--load N: the busy processes run beside the rounds and are gone after; the targets then
    check the loaded ratio; --markdown prints the same rows as a table."""
    capsys.readouterr()
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", action="store_true")
    bench.add_generate_arguments(parser)
    args = parser.parse_args(["--quick", "--json", "--model", str(quick_store), "--tokens", "3", "--residency", "0.5",
                              "--no-cold", "--plot", "none", "--load", "1"])
    res = bench.run_generate_bench(args)
    assert res["tokens_identical"] is True and res["settings"]["load"] == 1
    (pid,) = res["load"]["pids"]
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # killed and reaped
    assert res["targets"]["loaded"] is True
    assert any(c["target"].startswith("loaded_vs_all_resident") for c in res["targets"]["checks"]) or res["device"] == "gpu"
    md = bench.render_markdown(res)
    assert md.count("| warm | 50% |") == 3 and "slot cache (sync, LRU)" in md and "all rows dynamic" in md
    # Three tokens a run are two decode steps: the figures are flagged, in the JSON and the markdown.
    assert len(res["notes"]) == 1 and "cover 2 step(s)" in res["notes"][0] and "smoke test" in res["notes"][0]
    assert "Note: 3 token(s) a run" in md


def test_only_short_runs_are_flagged_as_a_smoke_test() -> None:
    assert bench.short_run_note(bench.SHORT_RUN_TOKENS) is None
    note = bench.short_run_note(2)
    assert note is not None and "cover 1 step(s)" in note and f"--tokens {bench.SHORT_RUN_TOKENS}" in note


def test_step_modes(quick_store: pathlib.Path) -> None:
    sm = load_streaming_model(quick_store)
    for mode, want in (("queued", "queued"), ("per-layer", "per-layer"), ("whole", "whole"),
                       ("per-layer-nospec", "per-layer-nospec")):
        bench.set_step_mode(sm, mode)
        assert bench.step_mode_of(sm) == want
    bench.set_step_mode(sm, "default")
    assert bench.step_mode_of(sm) == "auto"
    with pytest.raises(ValueError, match="unknown step mode 'psychic'; expected one of"):
        bench.set_step_mode(sm, "psychic")


def test_busy_load_starts_and_stops_processes() -> None:
    with bench.busy_load(2) as pids:
        assert len(pids) == 2
        for pid in pids:
            os.kill(pid, 0)  # alive
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    with bench.busy_load(0) as pids:
        assert pids == []
    with pytest.raises(ValueError, match="--load must be >= 0"):
        with bench.busy_load(-1):
            pass


def test_bad_settings_are_refused(quick_store: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Each is one line naming the option, exit status 2 (a usage error), never a traceback."""
    q = ["bench", "generate", "--quick", "--model", str(quick_store)]
    for argv, message in [
        ([*q, "--tokens", "1"], "--tokens must be >= 2"),
        ([*q, "--policy", "fifo"], "--policy must be one of"),
        ([*q, "--load", "-1"], "--load must be >= 0"),
        ([*q, "--layers", "2"], "--layers and --vocab apply to --shape only"),
        (["bench", "generate", "--model", str(quick_store), "--shape", "qwen3-30b-a3b"],
         "--model and --shape are exclusive"),
        (["bench", "generate", "--shape", "qwen3-30b-a3b", "--layers", "1", "--vocab", "tiny"],
         "--vocab must be 'full', 'small' or an integer, got 'tiny'"),
    ]:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, (argv, err)
    for argv in ([*q, "--modes", "fastest"], [*q, "--residency", "1.5"]):  # argparse: not a step mode, a fraction
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2


def test_shape_description(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = shapes.shape_spec("qwen3-30b-a3b")
    c = spec.config
    assert (c["num_hidden_layers"], c["num_experts"], c["num_experts_per_tok"], c["hidden_size"],
            c["moe_intermediate_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"],
            c["vocab_size"], c["rope_theta"], c["decoder_sparse_step"], c["mlp_only_layers"]) == (
        48, 128, 8, 2048, 768, 32, 4, 128, 151936, 1e6, 1, [])
    assert spec.bits == 4 and spec.group_size == 64
    est = shapes.estimate_bytes(spec)
    # 3 matrices of 768 x 2048 at 4 bits, float32 scales and biases per group of 64.
    assert est["record"] == 3 * (768 * 2048 // 2 + 2 * 768 * 32 * 4) == 2949120
    assert 17e9 < est["experts"] < 19e9
    small = shapes.shape_spec("qwen3-30b-a3b", layers=2, vocab=shapes.SMALL_VOCAB)
    assert small.config["num_hidden_layers"] == 2 and small.config["vocab_size"] == 512 and small.key() != spec.key()
    with pytest.raises(ValueError, match=r"--layers must be an integer in \[1, 48\]"):
        shapes.shape_spec("qwen3-30b-a3b", layers=49)
    with pytest.raises(ValueError, match="unknown shape 'llama'"):
        shapes.shape_spec("llama")
    # Not enough disk: refused before anything is built, naming the directory and the sizes.
    monkeypatch.setattr(shapes.shutil, "disk_usage", lambda path: types.SimpleNamespace(free=10**6))
    with pytest.raises(OSError, match=r"needs about 1\.6 GB free while it builds, 0\.0 GB are free"):
        shapes.ensure_shape("qwen3-30b-a3b", layers=2, vocab=512, cache_dir=tmp_path, progress=False)
    assert not any(p.name.startswith("shape-") for p in tmp_path.iterdir())


def test_demo_command_json_and_table(quick_store: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`asyncside demo --json` on a converted store: identical tokens, every figure, a clean audit;
    the table form prints the same run's rows. (The embedded default is the same model, larger.)"""
    capsys.readouterr()
    assert main(["demo", "--model", str(quick_store), "--tokens", "6", "--resident", "0.25", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["tokens_identical"] is True and res["audit_clean"] is True
    assert res["streaming"]["tokens"] == res["all_resident"]["tokens"] == 6
    assert res["text"] == res["reference_text"]
    assert 0.0 < res["hit_rate"] <= 1.0 and res["bytes_read"] > 0 and res["stall_time_s"] >= 0.0
    lag = res["loop_lag"]
    assert lag["ticks"] > 0 and 0.0 <= lag["median_ms"] <= lag["p99_ms"] <= lag["max_ms"]
    assert res["runtime"]["fills"] >= 1 and res["pool_rows_per_layer"] < res["experts_per_layer"]
    # Queued steps by default: every decode step queued once, misses faulted in on the stream.
    fwd = res["forward"]
    assert res["mode"] == "auto" and res["decode_steps"] == "queued"
    assert fwd["queued"] == 6 and fwd["per_layer"] == 0 and fwd["optimistic"] == 0
    assert res["faults_per_step"] > 0 and res["runtime"]["faults"] >= 1
    assert 0.0 < res["fault_latency_p50_ms"] <= res["fault_latency_p99_ms"]
    # Every mode gives the same tokens; the counters show each ran as asked.
    for mode, counter in (("per-layer", "per_layer"), ("whole", "optimistic")):
        assert main(["demo", "--model", str(quick_store), "--tokens", "4", "--resident", "0.25", "--json",
                     "--mode", mode]) == 0
        res = json.loads(capsys.readouterr().out)
        assert res["tokens_identical"] is True and res["audit_clean"] is True
        assert res["decode_steps"] == mode and res["forward"][counter] == 4, (mode, res["forward"])
    assert main(["demo", "--model", str(quick_store), "--tokens", "3", "--resident", "0.5", "--lookahead-extra", "2"]) == 0
    out = capsys.readouterr().out
    for row in ("decode tokens/s", "hit rate", "stall time", "event-loop lag", "tokens identical", "faults per token"):
        assert row in out, row


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("ASYNCSIDE_SLOW_TESTS"),
                    reason="builds a 2-layer qwen3-30b-a3b (~0.8 GB, minutes on 2 CPUs); set ASYNCSIDE_SLOW_TESTS=1")
def test_shape_builds_and_runs(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    assert main(["bench", "generate", "--json", "--shape", "qwen3-30b-a3b", "--layers", "2", "--vocab", "small",
                 "--cache-dir", str(tmp_path), "--tokens", "3", "--repeats", "1", "--residency", "0.25",
                 "--no-cold", "--plot", "none"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["tokens_identical"] is True
    info = res["model_info"]
    assert info["kind"] == "shape" and info["layers"] == 2 and info["vocab"] == 512 and info["built_now"] is True
    assert res["moe_layers"] == 2 and res["experts_per_layer"] == 128 and res["record_bytes"] == 2949120
    for r in res["rows"]:
        _check_row(r, res)
    # Built once: the second call finds it.
    again = shapes.ensure_shape("qwen3-30b-a3b", layers=2, vocab=512, cache_dir=tmp_path, progress=False)
    assert again["built"] is False and again["store_bytes"] == info["store_bytes"]


def test_demo_under_a_memory_budget(quick_store: pathlib.Path, capsys: pytest.CaptureFixture[str],
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """`asyncside demo --memory SIZE` on a store the budget cannot cache: the plan reads past the
    page cache, the tokens are checked against the slot cache (the whole model is never loaded),
    and the run reports the disk's bandwidth, the I/O limit, the bytes read and peak RSS; a budget
    the pools cannot fit is one clear line and status 2."""
    from asyncside import ExpertStore
    from asyncside.demo import choose_reference

    monkeypatch.delenv("ASYNCSIDE_DIRECT", raising=False)
    store = ExpertStore.open(quick_store)
    pools = memory.pool_bytes(store, 0.25)
    from asyncside.runtime import _plan

    monkeypatch.setattr(_plan, "_resident_now", lambda: 0)  # the budget is for the runtime alone here
    side = sum(f.stat().st_size for f in quick_store.glob("*.safetensors"))
    budget = direct_budget(store)  # 1 MiB of page cache for a larger store
    capsys.readouterr()
    assert main(["demo", "--model", str(quick_store), "--tokens", "5", "--resident", "0.25", "--json",
                 "--memory", str(budget), "--reference", "slot-cache"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["reference"] == "slot-cache"
    assert res["tokens_identical"] is True and res["audit_clean"] is True
    assert res["direct"] is True and res["memory"]["direct"] is True and "exceed" in res["memory"]["direct_reason"]
    assert res["memory"]["budget_bytes"] == budget and res["memory"]["page_cache_bytes"] == 1 << 20
    lim = res["limits"]
    assert lim["disk_bytes_per_s"] > 0 and lim["miss_bytes_per_token"] > 0 and lim["io_limit_tokens_per_s"] > 0
    assert res["peak_rss_bytes"] > 0 and res["disk_read_bytes"] >= 0
    assert main(["demo", "--model", str(quick_store), "--tokens", "2", "--memory", str(pools // 2), "--json"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the pools need" in err and "memory budget" in err
    # auto: the all-resident model when it fits half of the budget and the streaming run still fits
    # after it (what the process holds, the model, the smallest pools, the headroom and the margin a
    # refusal's memory= adds, kept for the reference's code), else the slot cache.
    model = sum(store.layer(i).blob_bytes for i in store.layers) + side
    monkeypatch.setattr(memory, "proc_self_bytes", lambda *a: 64 << 20)  # what the process holds, fixed
    after = ((64 << 20) + model + memory.pool_bytes(store, 0.0, min_rows=min_rows(store))
             + _plan.plan_headroom(store) + _plan.NEED_MARGIN)
    if max(2 * model, after) <= memory.available_memory().available:
        assert choose_reference(store, "auto", max(2 * model, after))[0] == "all-resident"
        assert choose_reference(store, "auto", max(2 * model, after) - 1)[0] == "slot-cache"
    kind, why = choose_reference(store, "auto", model)
    assert kind == "slot-cache" and "do not fit" in why
    assert choose_reference(store, "none", None) == ("none", "asked for")


@pytest.mark.parametrize(("extra", "want"), [([], (2, "small")), (["--layers", "3"], (3, "small")),
                                             (["--vocab", "full"], (2, None)), (["--layers", "1", "--vocab", "600"],
                                                                              (1, 600))])
def test_quick_on_a_shape_builds_a_few_layers_and_a_small_vocabulary(
        extra: list[str], want: tuple[int, str | int | None], monkeypatch: pytest.MonkeyPatch,
        tmp_path: pathlib.Path) -> None:
    # --quick with --shape built the whole shape with its full vocabulary (qwen3-30b-a3b: 48
    # layers, 151,936 tokens): not a smoke run
    asked: list[dict[str, object]] = []

    def fake(shape: str, **kw: object) -> dict[str, object]:
        asked.append(kw)
        raise RuntimeError("stop before building")

    monkeypatch.setattr(shapes, "ensure_shape", fake)
    p = argparse.ArgumentParser()
    bench.add_generate_arguments(p)
    args = p.parse_args(["--shape", "qwen3-30b-a3b", "--quick", "--cache-dir", str(tmp_path), *extra])
    with pytest.raises(RuntimeError, match="stop before building"):
        bench._resolve_store(args, verbose=False)
    layers, vocab = want
    assert asked[0]["layers"] == layers
    assert asked[0]["vocab"] == (bench.SMALL_VOCAB if vocab == "small" else vocab)
    args = p.parse_args(["--shape", "qwen3-30b-a3b", "--cache-dir", str(tmp_path)])  # not quick: as asked
    with pytest.raises(RuntimeError):
        bench._resolve_store(args, verbose=False)
    assert asked[1]["layers"] is None and asked[1]["vocab"] is None
