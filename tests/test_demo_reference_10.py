"""The demo's reference figures under the name of the run that made them, the limit its
"decode tokens/s of ..." row is held to, one refusal style for ``--routing-sequence`` out of range
in ``demo``, ``bench generate`` and ``bench offload``, and the positions each system of ``bench
offload`` routes."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import numpy as np
import pytest
from _cli_support import run_cli

from asyncside.cli import main
from asyncside.memory import proc_self_bytes
from asyncside.routing import RoutingTrace, preset


def _never(*_args: object, **_kwargs: object) -> None:
    raise AssertionError("the command went on past its usage error")


def _demo(capsys: pytest.CaptureFixture[str], store: pathlib.Path, *argv: str) -> dict[str, Any]:
    capsys.readouterr()
    assert main(["demo", "--model", str(store), "--tokens", "4", "--resident", "0.25", "--json", *argv]) == 0
    res: dict[str, Any] = json.loads(capsys.readouterr().out)
    assert res["tokens_identical"] in (True, None) and res["audit_clean"] is True
    return res


def _budget() -> str:
    """A --memory that fits this small store beside what the process holds already: the suite's
    earlier tests leave the process at a few hundred MiB, which a fixed figure does not leave room
    for (the plan counts what the process holds)."""
    return f"{proc_self_bytes('status', 'VmRSS') // 2**20 + 400}M"


def _table_text(res: dict[str, Any], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> str:
    from asyncside import demo

    monkeypatch.setenv("COLUMNS", "400")  # one line a row: a row's label is not wrapped
    demo._table(res)
    return capsys.readouterr().out


def test_slot_cache_figures_are_not_called_all_resident(quick_store: pathlib.Path, capsys: pytest.CaptureFixture[str],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Under --memory with the slot cache as the reference, ``all_resident`` held the slot cache's
    figures; and the row held to the I/O limit alone was labelled min(compute, I/O limit)."""
    res = _demo(capsys, quick_store, "--memory", _budget(), "--reference", "slot-cache")
    assert res["reference"] == "slot-cache" and res["all_resident"] is None
    assert res["slot_cache"]["tokens"] == res["streaming"]["tokens"] == 4
    assert res["reference_reads"]["bytes_read"] > 0  # the slot cache read its misses
    lim = res["limits"]
    assert lim["compute_limit_tokens_per_s"] is None and lim["io_limit_tokens_per_s"] > 0
    assert lim["of_limit_against"] == "I/O limit"
    assert lim["of_limit"] == pytest.approx(res["streaming"]["decode_tokens_per_s"] / lim["io_limit_tokens_per_s"])
    out = _table_text(res, capsys, monkeypatch)
    assert "decode tokens/s of the I/O limit (compute limit not measured: the reference was the slot cache)" in out
    assert "min(compute" not in out and "slot cache (reference)" in out


def test_no_reference_has_no_reference_figures(quick_store: pathlib.Path, capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """--reference none: no figures under either name (they were zeros under ``all_resident``)."""
    res = _demo(capsys, quick_store, "--memory", _budget(), "--reference", "none")
    assert res["reference"] == "none" and res["all_resident"] is None and res["slot_cache"] is None
    # No reference, no ratio (it was 0.0, a figure read as "infinitely slower")
    assert res["speed_ratio"] is None and res["decode_speed_ratio"] is None
    assert res["tokens_identical"] is None and res["limits"]["of_limit_against"] == "I/O limit"
    out = _table_text(res, capsys, monkeypatch)
    assert "of the I/O limit (compute limit not measured: no reference ran)" in out and "min(compute" not in out


def test_all_resident_figures_keep_their_name_and_the_limits_say_which(
        quick_store: pathlib.Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The all-resident reference's figures stay under ``all_resident``; the row says min(compute,
    I/O limit) only where both were measured (without --memory the disk is not probed: the compute
    limit alone)."""
    res = _demo(capsys, quick_store, "--memory", _budget(), "--reference", "all-resident")
    assert res["reference"] == "all-resident" and res["slot_cache"] is None
    assert res["all_resident"]["tokens"] == res["streaming"]["tokens"] == 4
    lim = res["limits"]
    assert lim["of_limit_against"] == "min(compute, I/O limit)"
    bound = min(lim["compute_limit_tokens_per_s"], lim["io_limit_tokens_per_s"])
    assert lim["of_limit"] == pytest.approx(res["streaming"]["decode_tokens_per_s"] / bound)
    assert "decode tokens/s of min(compute, I/O limit)" in _table_text(res, capsys, monkeypatch)
    res = _demo(capsys, quick_store)
    lim = res["limits"]
    assert res["reference"] == "all-resident" and lim["io_limit_tokens_per_s"] is None
    assert lim["of_limit_against"] == "compute limit"
    out = _table_text(res, capsys, monkeypatch)
    assert "of the compute limit (I/O limit not measured: the disk is probed under --memory only)" in out
    assert "min(compute" not in out


def test_tokens_that_differ_name_the_reference_that_ran(monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    from asyncside import demo

    result = {"reference": "slot-cache", "tokens_identical": False, "audit_clean": True, "text": "a b",
              "reference_text": "a c"}
    monkeypatch.setattr(demo, "run_demo", lambda args: result)
    monkeypatch.setattr(demo, "_table", lambda res: None)
    rc, err = run_cli(capsys, "demo", "--tokens", "2")
    assert rc == 1 and "tokens differ from the slot-cache run" in err and "all-resident" not in err, err
    assert "slot-cache:   'a c'" in err, err


# ---- --routing-sequence out of range: one style, exit status 2 -----------------------------------


def _two_sequences(path: pathlib.Path) -> pathlib.Path:
    a = preset("low", tokens=6, n_layers=2, n_experts=32, top_k=4, seed=1)
    b = preset("high", tokens=5, n_layers=2, n_experts=32, top_k=4, seed=2)
    RoutingTrace(np.concatenate([a.ids, b.ids]), np.array([6, 5]), 32, {"source": "test"}).save(path)
    return path


@pytest.mark.parametrize("command", [["demo"], ["bench", "generate", "--quick", "--plot", "none"],
                                     ["bench", "offload", "--quiet"]])
def test_a_sequence_out_of_range_is_a_usage_error_everywhere(command: list[str], tmp_path: pathlib.Path,
                                                             monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """demo said "asyncside demo: error: ...", the benches the same refusal without "error:"; each
    is now the CLI's usage error, worded from the option."""
    from asyncside import demo
    from asyncside.bench import generate, offload

    monkeypatch.setattr(demo, "run_demo", _never)
    monkeypatch.setattr(generate, "_resolve_store", _never)
    monkeypatch.setattr(offload, "process_baseline", _never)
    two = _two_sequences(tmp_path / "two.npz")
    rc, err = run_cli(capsys, *command, "--json", "--routing", str(two), "--routing-sequence", "2")
    name = " ".join(command[:2]) if command[0] == "bench" else "demo"
    assert rc == 2 and err.strip().splitlines() == [
        f"asyncside {name}: error: --routing-sequence 2 out of range: {two} has 2 sequences"], err


def test_demo_refuses_routing_beside_ranks_as_a_usage_error(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    import asyncside.distributed.demo as ranks_demo

    monkeypatch.setattr(ranks_demo, "ranks_demo_main", _never)
    rc, err = run_cli(capsys, "demo", "--ranks", "2", "--routing", str(_two_sequences(tmp_path / "t.npz")))
    assert rc == 2 and err.strip().splitlines() == [
        "asyncside demo: error: --routing / --record-routing run in one process (not with --ranks)"], err


# ---- bench offload: the positions each system routes ---------------------------------------------


def test_offload_positions_each_system_routes(quick_store: pathlib.Path, tmp_path: pathlib.Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The note said "a run routes 1+T positions", mlx-lm's count (it computes the step after each
    token before handing it over); asyncside and the slot cache route one fewer. Counted here from
    the positions each system asks the replay for, on the same trace and prompt."""
    import anyio
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    from asyncside.bench import offload
    from asyncside.bench.slot_cache import SlotCache, slot_generate
    from asyncside.models import load_reference_model, load_streaming_model
    from asyncside.models.forcing import RoutingReplay, force_reference
    from asyncside.runtime import Runtime
    from asyncside.store import ExpertStore

    store = ExpertStore.open(quick_store)
    sm = load_streaming_model(quick_store)
    config = json.loads((quick_store / "config.json").read_text())
    n_experts = store.layer(next(iter(store.layers))).n_experts
    path = tmp_path / "long.npz"
    preset("low", tokens=64, n_layers=len(store.layers), n_experts=n_experts, top_k=config["num_experts_per_tok"],
           seed=3).save(path)
    replay = sm.set_routing(str(path))
    prompt, tokens = [1, 2, 3], 5
    routed = offload.positions_routed(len(prompt) + tokens)

    model, _config = load_reference_model(quick_store)
    blocks = force_reference(model, sm.arch.block_attr, replay)
    for n, _ in enumerate(generate_step(mx.array(prompt), model, max_tokens=tokens), 1):
        if n >= tokens:
            break
    assert blocks[0]._position == routed["mlx-lm"]

    seen: list[int] = []
    step_ids = RoutingReplay.step_ids
    host_ids = RoutingReplay.host_ids

    def counted_step(self: Any, layer: int, start: int, shape: Any) -> Any:
        seen.append(start + int(np.prod(shape)))
        return step_ids(self, layer, start, shape)

    def counted_host(self: Any, layer: int, start: int, n: int) -> Any:
        seen.append(start + n)
        return host_ids(self, layer, start, n)

    monkeypatch.setattr(RoutingReplay, "step_ids", counted_step)
    monkeypatch.setattr(RoutingReplay, "host_ids", counted_host)

    async def streamed() -> None:
        async with Runtime(store, resident=0.25) as rt:
            got = []
            async for tok in sm.generate(prompt, max_tokens=tokens, source=rt, predictor="none"):
                got.append(tok)
                if len(got) >= tokens:
                    break

    anyio.run(streamed)
    assert max(seen) == routed["asyncside"]
    seen.clear()
    with SlotCache(store, 0.25) as sc:
        for n, _tok in enumerate(slot_generate(sm, sc, prompt, max_tokens=tokens), 1):
            if n >= tokens:
                break
    assert max(seen) == routed["slot-cache"] == routed["mlx-lm"] - 1


def test_offload_routing_note_says_which_system_routes_how_many(tmp_path: pathlib.Path) -> None:
    from asyncside.bench import offload

    path = tmp_path / "short.npz"
    preset("low", tokens=8, n_layers=2, n_experts=32, top_k=4, seed=1).save(path)
    (user,) = offload.load_routings([str(path)])
    _trace, info = offload.fit_routing(user, shape="s", moe_layers=2, n_experts=32, top_k=4, positions=12,
                                       predictor="none")
    assert info["positions_routed"] == {"asyncside": 11, "slot-cache": 11, "mlx-lm": 12}
    note = offload.routing_note(info)
    assert ("positions wrap: a run routes up to 11 positions in asyncside and the slot cache, 12 in mlx-lm "
            "(one step ahead of its tokens)") in note, note
    _trace, info = offload.fit_routing(user, shape="s", moe_layers=2, n_experts=32, top_k=4, positions=9,
                                       predictor="none")
    assert info["wraps"] and "positions wrap in mlx-lm alone: a run routes up to 8 positions" in offload.routing_note(info)
    _trace, info = offload.fit_routing(user, shape="s", moe_layers=2, n_experts=32, top_k=4, positions=8,
                                       predictor="none")
    assert not info["wraps"] and "wrap" not in offload.routing_note(info)


def test_offload_of_limit_says_which_limit_it_is_held_to(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the compute limit was not measured (its run failed) or the I/O limit not (no misses),
    the "of limit" cell is of the other alone, and says so."""
    from asyncside.bench import offload

    monkeypatch.setattr(offload, "belady_of_run", lambda *a, **k: {"hit_rate": 0.5})
    mb = offload.MB
    sh = {"record_bytes": mb, "io": {"GBps": 1000 * mb / 1e9}, "store": "store"}  # 1000 records a second

    def run_of(misses: int, compute: float | None) -> dict[str, Any]:
        run: dict[str, Any] = {"status": "ok", "tokens": [1] * 10, "rows_per_layer": 4, "read_bytes": 0,
                               "decode_tokens_per_s": 5.0, "stats": {"hits": 50, "misses": misses},
                               "shape": "s", "locality": "low", "system": "asyncside"}
        offload._figures(run, sh, "trace.npz", {"tokens": [1] * 10, "decode_tokens_per_s": compute})
        return run

    both = run_of(100, 20.0)  # I/O limit 100 tok/s, compute 20
    assert both["of_limit_against"] == "min(compute, I/O limit)" and both["of_limit"] == 0.25
    col = offload.COLUMNS.index("of limit")
    assert offload._row(both)[col] == "0.25x"
    io_only = run_of(100, None)
    assert io_only["of_limit_against"] == "I/O limit" and io_only["of_limit"] == 0.05
    assert offload._row(io_only)[col] == "0.05x (of the I/O limit; the other not measured)"
    compute_only = run_of(0, 20.0)
    assert compute_only["of_limit_against"] == "compute limit"
    assert offload._row(compute_only)[col] == "0.25x (of the compute limit; the other not measured)"
