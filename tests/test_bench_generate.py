"""`asyncside bench generate --quick --json`: every field, tokens identical everywhere (no timing asserted).

Also checks the synchronous demand-loading baseline on its own: it serves exact tokens over the
runtime's Ledger and PoolSet, its rows hold the store's bytes, and its leases balance.
"""

from __future__ import annotations

import json
import pathlib

import anyio
import numpy as np
import pytest

from asyncside.bench import generate as bench
from asyncside.bridge import completed
from asyncside.cli import main
from asyncside.models import load_reference_model, load_streaming_model, reference_generate
from asyncside.models.embedded import ensure_embedded_default
from asyncside.runtime import plan_layer
from asyncside.store import ExpertStore


@pytest.fixture(scope="module")
def quick_store(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    cache = tmp_path_factory.mktemp("embedded")
    return ensure_embedded_default(cache, spec=bench._quick_spec(), progress=False)[1]


def test_quick_bench_json(quick_store: pathlib.Path, tmp_path: pathlib.Path,
                          capsys: pytest.CaptureFixture[str]) -> None:
    plot = tmp_path / "gen.png"
    capsys.readouterr()
    assert main(["bench", "generate", "--quick", "--json", "--model", str(quick_store), "--plot", str(plot),
                 "--tokens", "4", "--residency", "0.25", "0.5", "--no-drop-caches"]) == 0  # no global side effect
    res = json.loads(capsys.readouterr().out)
    assert res["bench"] == "generate" and res["tokens_identical"] is True
    s = res["settings"]
    assert s["tokens"] == 4 and s["residencies"] == [0.25, 0.5] and s["modes"] == list(bench.MODES)
    assert res["all_resident"]["mlx_lm"]["tokens_identical"] and res["all_resident"]["async_resident"]["tokens_identical"]
    assert res["all_resident"]["mlx_lm"]["tokens"] == 4
    # One row per (cache state, residency, mode); cold rows exist when the machine allows a method.
    caches = {"warm"} | ({"cold"} if s["cold_repeats"] else set())
    assert {(r["cache"], r["residency"], r["mode"]) for r in res["rows"]} == {
        (c, f, m) for c in caches for f in (0.25, 0.5) for m in bench.MODES}
    for r in res["rows"]:
        assert r["tokens_identical"] is True and r["audit_clean"] is True, r
        assert r["decode_tokens_per_s"] > 0 and r["tokens_per_s"] > 0 and r["tokens"] == 4
        assert 0.0 <= r["hit_rate"] <= 1.0 and r["bytes_read"] >= 0
        assert r["vs_all_resident"] > 0 and r["vs_sync_demand"] > 0
        # Paired ratios: one per round, the row's figure their median.
        per = r["vs_all_resident_per_round"]
        assert len(per) == r["repeats"] and all(x > 0 for x in per)
        assert min(per) <= r["vs_all_resident"] <= max(per)
        assert r["vs_all_resident_of_medians"] > 0
        assert r["reader"] == ("sync pread+memcpy" + (" (O_DIRECT)" if r["cache"] == "cold" and "O_DIRECT" in
                                                     res["cold_method"] else "")
                               if r["mode"] == "sync" else r["reader"])
    assert "cold_method" in res and "warm_method" in res
    # The resident set and side region the rows ran with, as the runtime sizes them.
    store = ExpertStore.open(quick_store)
    for frac in (0.25, 0.5):
        resident, side = plan_layer(store, next(iter(store.layers)), frac)
        assert res["pool_plan"][str(frac)] == {"resident_per_layer": len(resident), "side_rows": side}
    # Policies vs Belady on one trace: every policy with and without lookahead, ratios consistent.
    assert [p["residency"] for p in res["policies_vs_belady"]] == [0.25, 0.5]
    for p in res["policies_vs_belady"]:
        names = set(p["policies"])
        assert names == {n + suffix for n in bench.POLICIES for suffix in ("", "+lookahead")}
        for name, v in p["policies"].items():
            assert v["vs_belady"] == pytest.approx(v["hit_rate"] / p["belady"])
            if "+" not in name:  # MIN bounds every demand-only policy
                assert v["hit_rate"] <= p["belady"] + 1e-12
    assert res["trace"]["tokens_identical"] is True
    t = res["targets"]
    assert isinstance(t["vs_all_resident_met"], bool) and isinstance(t["vs_sync_demand_met"], bool)
    assert isinstance(t["policy_vs_belady_met"], bool)
    assert res["plot"] == str(plot) and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert res["machine"]["nproc"] >= 1 and res["machine"]["kernel"]


def test_sync_demand_source_exact_and_balanced(quick_store: pathlib.Path) -> None:
    sm = load_streaming_model(quick_store, completed=completed)
    store = sm.store
    ref_model, _ = load_reference_model(quick_store)
    prompt = sm.tokenizer.encode("abc def")
    ref = reference_generate(ref_model, prompt, max_tokens=6, eos_token_ids=sm.tokenizer.eos_token_ids)

    async def run() -> tuple[list[int], dict, list]:
        async with bench.SyncDemandSource(store, resident=0.25) as src:
            toks = [t async for t in sm.generate(prompt, max_tokens=6, source=src, predictor="lookahead")]
            await src._drain_releases()
            # Every present row holds exactly its expert's record bytes.
            for layer, spec in store.layers.items():
                table = np.array(src.lookup(layer))
                for e, row in enumerate(table.tolist()):
                    if row >= 0:
                        rec = store.read_record(layer, e)
                        for seg in spec.segments:
                            assert bytes(src._pools[layer].row_view(seg.key, row)) == rec[seg.offset:seg.offset + seg.nbytes]
            leases = [led.stats["leases"] - led.stats["releases"] for led in src._ledgers.values()]
            return toks, src.stats(), [r.problems for r in src.audit().values()] + [leases]

    toks, stats, checks = anyio.run(run)
    assert toks == ref
    assert stats["misses"] > 0 and stats["fills"] == stats["misses"] and stats["bytes_read"] == stats["fills"] * store.layer(0).stride
    assert stats["prefetch_hints"] > 0  # the lookahead hints were offered and ignored
    *problems, open_leases = checks
    assert all(not p for p in problems) and all(n == 0 for n in open_leases)


def test_bad_settings_are_refused(quick_store: pathlib.Path) -> None:
    with pytest.raises(ValueError, match="--tokens must be >= 2"):
        main(["bench", "generate", "--quick", "--model", str(quick_store), "--tokens", "1"])
    with pytest.raises(ValueError, match=r"--residency values must be in \(0, 1\], got 1.5"):
        main(["bench", "generate", "--quick", "--model", str(quick_store), "--residency", "1.5"])
    with pytest.raises(ValueError, match="--policy must be one of"):
        main(["bench", "generate", "--quick", "--model", str(quick_store), "--policy", "fifo"])


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
