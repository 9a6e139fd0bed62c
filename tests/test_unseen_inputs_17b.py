"""Unseen inputs, round 17 (b): routing traces, model shapes and memory budgets not in the repo, run
through ``bench offload``, ``demo --memory --routing`` and ``bench generate --routing``, each figure
judged against what the project claims of it (tokens equal to the all-resident reference's under
the same routing, hits against Belady's MIN from the same start, one line for what cannot run)."""

from __future__ import annotations

import os
import pathlib
from typing import Any

import numpy as np
import pytest
from _offload_support import stand_in_timed_reads

from asyncside.bench import offload
from asyncside.routing import RoutingTrace


def _one_sequence(path: pathlib.Path, ids: np.ndarray, n_experts: int) -> str:
    """A trace of the store's own shape (replayed as is), one sequence: what an arm's child replays."""
    RoutingTrace(ids.astype(np.int32), np.array([ids.shape[0]], dtype=np.int64), n_experts, {}).save(path)
    return str(path)


def _skip_without_o_direct(path: pathlib.Path) -> None:
    """Skip where the platform or the file system of ``path`` refuses O_DIRECT (the offload bench's
    slot cache reads with it)."""
    if not hasattr(os, "O_DIRECT"):
        pytest.skip("no O_DIRECT on this platform")
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
    except OSError:
        pytest.skip("this file system refuses O_DIRECT")


def test_offload_holds_the_slot_cache_to_min_from_what_its_slots_start_with(quick_store: pathlib.Path,
                                                                            tmp_path: pathlib.Path) -> None:
    """The slot cache starts holding what the runtime's rows start with (the store's hottest
    experts), but its Belady's MIN was computed from empty rows, while asyncside's started from its
    warm rows: with a budget that holds every expert the slot cache hit every demand and its "of
    MIN" read 1.19x (MIN from empty missed each expert's first use), and at a few rows a layer it
    leaned on the slot cache's side. Both arms' MIN now start from what their rows held."""
    from asyncside.store import ExpertStore

    store = ExpertStore.open(quick_store)
    layers = sorted(store.layers)
    _skip_without_o_direct(store.layer(layers[0]).path)
    n_experts, top_k = store.layer(layers[0]).n_experts, offload._store_top_k(str(quick_store))
    rng = np.random.default_rng(17)
    ids = np.stack([np.stack([rng.choice(n_experts, top_k, replace=False) for _ in layers]) for _ in range(12)])
    trace = _one_sequence(tmp_path / "mine.npz", ids, n_experts)
    spec = {"store": str(quick_store), "prompt": offload.prompt_for(str(quick_store)), "seconds": 60.0, "tokens": 6,
            "policy": "lru", "predictor": "none", "budget": 1 << 30, "system": "slot-cache", "routing": trace,
            "fraction": 1.0}
    run: dict[str, Any] = {**offload.child_main(spec), "status": "ok"}
    sh = {"store": str(quick_store), "record_bytes": store.layer(layers[0]).stride, "io": {"GBps": 1.0}}
    offload._figures(run, sh, trace, {"tokens": run["tokens"], "decode_tokens_per_s": 1.0})
    assert run["hit_rate"] == 1.0
    assert run["belady"]["hit_rate"] == 1.0 and run["of_min"] == 1.0
    assert run["warm_experts"] == {str(i): list(range(n_experts)) for i in layers}  # every expert, every slot


def test_offload_disk_bytes_stop_at_the_last_token_of_a_run_ended_by_time(quick_store: pathlib.Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A run that ends by ``--seconds`` has a step queued ahead of its last token, and that step's
    reads went on until the runtime drained: for a token never generated, counted as no miss. The
    disk's bytes per token then held one step of records more than the misses' (the gpt-oss-20b
    low-locality row, 1.02x; measured on the embedded store: 19 MB, about one step of misses,
    where a run ended by --tokens read 1.5 MB more than its misses). The disk's bytes are now those
    up to the last token."""
    record = 1 << 20
    stand_in_timed_reads(monkeypatch, offload, record)
    spec = {"store": str(quick_store), "prompt": offload.prompt_for(str(quick_store)), "seconds": 0.025,
            "tokens": 1000, "policy": "lru", "predictor": "none", "budget": 8 << 30, "system": "asyncside"}
    out = offload.child_main(spec)
    assert 2 <= len(out["tokens"]) < 1000  # ended by time
    assert out["read_bytes"] == 3 * record * len(out["tokens"])


def test_offload_slot_cache_gets_asyncsides_rows_of_a_layer_of_sixty_experts(tmp_path: pathlib.Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The slot cache is given asyncside's rows as a share of the experts, which it sizes back as
    ``ceil(share x experts)``: for 31 rows of 60 experts (qwen2-moe-a2.7b's count) the share came
    back as 31.000000000000004 and the slot cache held 32 slots a layer beside asyncside's 31, in
    a table that says both hold the same rows. (The children are stood in for: what is checked is
    the slot cache that the fraction asked for builds.)"""
    from _cli_support import offload_args
    from _offload_support import stand_in_runs

    from asyncside.bench.generate import _quick_spec
    from asyncside.bench.slot_cache import SlotCache
    from asyncside.models.embedded import EmbeddedSpec, ensure_embedded_default
    from asyncside.store import ExpertStore

    base = _quick_spec()
    spec = EmbeddedSpec(config={**base.config, "num_experts": 60}, profile_tokens=base.profile_tokens)
    store_dir = ensure_embedded_default(tmp_path / "cache", spec=spec, progress=False)[1]
    asked = stand_in_runs(monkeypatch, 31)
    monkeypatch.setattr(offload, "belady_of_run", lambda *a, **k: {"hit_rate": 0.5})
    args = offload_args("--stores", str(store_dir), "--memory", "8G", "--store-ratio", "0.0001", "--localities", "high",
                        "--systems", "asyncside,slot-cache", "--tokens", "3", "--quiet")
    offload.run_offload_bench(args)
    (fraction,) = [spec["fraction"] for spec in asked if spec["system"] == "slot-cache"]
    with SlotCache(ExpertStore.open(store_dir), fraction, warm=False) as sc:
        assert {layer: sc.layers[layer].slots for layer in sc.layers} == {0: 31, 1: 31}


def test_the_demos_slot_cache_reference_holds_the_runtimes_side_rows(quick_store: pathlib.Path, tmp_path: pathlib.Path,
                                                                    capsys: pytest.CaptureFixture[str],
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """``demo --resident 0.1 --side-rows 12`` on a model that does not fit half the budget: the
    runtime held 12 rows a layer (raised by --side-rows), the slot cache it is checked against 7
    (the fraction's), and the table set the two hit rates side by side (53.6% against 31.8% on the
    embedded model at 480M, a trace replayed) as if the pools were of one size. The slot cache now
    holds the runtime's rows."""
    import json

    from asyncside.bench import slot_cache
    from asyncside.cli import main
    from asyncside.memory import proc_self_bytes

    slots: list[dict[int, int]] = []

    class Counted(slot_cache.SlotCache):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            slots.append({layer: self.layers[layer].slots for layer in self.layers})

    monkeypatch.setattr(slot_cache, "SlotCache", Counted)
    rng = np.random.default_rng(5)
    ids = np.stack([np.stack([rng.choice(64, 8, replace=False) for _ in range(3)]) for _ in range(20)])
    trace = _one_sequence(tmp_path / "mine.npz", ids, 64)  # mapped onto the model's 32 experts, top-4
    budget = f"{proc_self_bytes('status', 'VmRSS') // 2**20 + 400}M"
    capsys.readouterr()
    assert main(["demo", "--model", str(quick_store), "--tokens", "4", "--resident", "0.1", "--side-rows", "12",
                 "--memory", budget, "--reference", "slot-cache", "--routing", trace, "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["reference"] == "slot-cache" and res["tokens_identical"] is True
    assert res["pool_rows_per_layer"] == 12
    assert slots == [{layer: 12 for layer in slots[0]}]
