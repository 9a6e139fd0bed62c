"""Queued steps count a layer's uses once per step, however many resolves split its switch.

A step whose experts do not fit a layer's rows at once (a prefill chunk, a decode batch) resolves
the layer in parts; each part logs its own distinct experts. The ledger's hits and misses count
each distinct expert a layer used in a step once (a hit when the step first found it in place),
as the per-layer path counts it: on the same steps both paths' hits + misses agree.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
from collections import deque

import anyio
import mlx.core as mx
import numpy as np
import pytest

from asyncside.bridge import completed
from asyncside.models import ForwardOptions, load_streaming_model
from asyncside.runtime import Runtime

#: the reviewer's reproducer: 8 experts top-1, two MoE layers, rows for a quarter of the experts.
#: Its widths are 128 and 96, not 64, so that no quantized matrix (the bench's 4-bit ones, groups of
#: 32 here; the 8-bit router's, groups of 64) is a single group per row: MLX CUDA's quantized
#: matmul of several tokens computes those wrong, the all-resident reference's included
#: (tools/device/probe_qmm.py).
CONFIG = {"model_type": "mixtral", "hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
          "vocab_size": 320, "num_hidden_layers": 2, "num_local_experts": 8, "num_experts_per_tok": 1,
          "intermediate_size": 96}


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    from asyncside.bench.shapes import ensure_shape

    root = tmp_path_factory.mktemp("split-counts")
    (root / "config.json").write_text(json.dumps(CONFIG))
    return pathlib.Path(ensure_shape(root / "config.json", cache_dir=root / "cache", progress=False)["store"])


def _demo(store: pathlib.Path, mode: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "asyncside", "demo", "--model", str(store), "--tokens", "10",
                          "--predictor", "none", "--json", "--mode", mode], capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout)


def test_demo_queued_counts_as_many_uses_as_per_layer(store: pathlib.Path) -> None:
    """The reproducer: the prompt's chunk splits every layer's switch in parts; queued counted
    every part's experts again (hits 45, misses 13 where per-layer counted 27 uses in all)."""
    queued, per_layer = _demo(store, "queued"), _demo(store, "per-layer")
    assert queued["tokens_identical"] and per_layer["tokens_identical"]
    assert queued["audit_clean"] and per_layer["audit_clean"]
    q, p = queued["runtime"], per_layer["runtime"]
    assert q["hits"] + q["misses"] == p["hits"] + p["misses"], (q, p)
    # A miss is a fault into a row or, with device pools and a host tier, a staged resolve's copy
    # from the tier (a prefill chunk's experts, no row taken); the CPU has no staged copies.
    assert q["misses"] == q["faults"] + q["staged_copies"], q
    assert mx.default_device() == mx.gpu or q["staged_copies"] == 0


def _step_uses(store: pathlib.Path, mode: str, batches: list[np.ndarray]) -> tuple[list[int], dict[str, int]]:
    """hits + misses each step added (the runtime quiesced after each), and the forward's counters."""
    options = ForwardOptions(mode=mode, staged_switches=False)
    sm = load_streaming_model(store, completed=completed, options=options)

    async def main() -> list[int]:
        uses: list[int] = []
        async with Runtime(sm.store, resident=0.0, min_side_rows=2) as rt:
            cache = sm.make_cache()
            for batch in batches:
                before = rt.stats()
                mx.eval(await sm(mx.array(batch), cache, source=rt))
                await rt.quiesce()
                after = rt.stats()
                uses.append(after["hits"] + after["misses"] - before["hits"] - before["misses"])
            assert all(r.ok for r in rt.audit().values())
        return uses

    uses = anyio.run(main)
    return uses, dict(sm.forward_with(options).counters)


def test_split_steps_count_each_expert_once_per_layer(store: pathlib.Path) -> None:
    """A prefill chunk of 4 x 24 tokens (sorted parts or expert slices) and decode steps of a batch
    of 4: every step's switches split (more distinct experts than the 2 rows), and each step's
    hits + misses equal the per-layer path's, the distinct experts its layers routed."""
    rng = np.random.default_rng(3)
    batches = [rng.integers(0, CONFIG["vocab_size"], (4, 24))] + [rng.integers(0, CONFIG["vocab_size"], (4, 1))
                                                                 for _ in range(4)]
    queued, counters = _step_uses(store, "queued", batches)
    per_layer, _ = _step_uses(store, "per-layer", batches)
    assert counters["queued"] + counters.get("queued_prefill", 0) == len(batches), counters
    assert counters["expert_slices"] + counters["sorted_parts"] > 0 and counters["token_parts"] > 0, counters
    assert queued == per_layer


@pytest.mark.skipif(mx.default_device() == mx.gpu, reason="streamed resolves: the host pools' path")
def test_a_routed_prefetch_whose_read_failed_is_logged_a_miss_not_a_hit(tmp_path: pathlib.Path) -> None:
    """A begin that adopts a pending prefetch logs the expert a hit; if the prefetch's read then
    fails, the expert was never in its row (the table counts no hit): the log must not say hit,
    or reconcile counts one (it counted none before the log marked misses)."""
    import os

    from _fault_helpers import eval_failed_step, fault_table

    from asyncside import _native

    cpu = mx.default_stream(mx.cpu)
    store, _pools, table = fault_table(tmp_path, tag=False)
    table.lend([0, 1, 2, 3])
    spec = store.layer(0)
    os.truncate(spec.path, spec.stride * 8)  # experts 8.. now lie past the end of the blob
    table.prefetch([12])
    ids = mx.array([[12, 3]], dtype=mx.uint32)
    both = _native.begin_rows(ids, table, cpu)
    slots = [_native.finish_rows(ids[:, s:s + 1], both[:, s:s + 1], table, cpu) for s in range(2)]
    eval_failed_step(mx.concatenate(slots, axis=-1))
    _events, used, sizes, missed = table.drain()
    assert np.frombuffer(sizes, dtype=np.int32).tolist() == [2]
    got = dict(zip(np.frombuffer(used, dtype=np.int32).tolist(), np.frombuffer(missed, dtype=np.uint8).tolist()))
    assert got == {12: 1, 3: 1}, got
    assert table.counters()["hits"] == 0


def test_a_drain_of_only_empty_resolves_still_ends_the_step_they_belong_to(store: pathlib.Path) -> None:
    """A step's expert slices are counted at build time from the pairs, not the distinct experts
    routed, so its last slices may resolve nothing (every id NO_EXPERT): resolves of no expert,
    whose log holds sizes and no ids. A drain that holds only those must still close the step it
    left partway; else the next step's resolves are taken for that step's rest (its experts
    counted against the old step's, hits lost) and every later step is off by as many resolves."""
    sm = load_streaming_model(store, completed=completed)
    layer = sm.moe_layers[0]

    class Log:
        def __init__(self, real: object, drains: list[tuple[list[int], list[int], list[int]]]) -> None:
            self.real, self.drains = real, drains

        def drain(self, positions: bool = False) -> tuple[bytes, ...]:
            used, sizes, missed = self.drains.pop(0)
            return (b"", np.asarray(used, np.int32).tobytes(), np.asarray(sizes, np.int32).tobytes(),
                    np.asarray(missed, np.uint8).tobytes()) + ((b"",) if positions else ())

    async def main() -> tuple[int, list[list[int]]]:
        async with Runtime(sm.store, resident=0.0, min_side_rows=2) as rt:
            q, st = rt.queued, rt._s.layer(layer)
            real = st.faults
            # A step of three resolves (its last two of no expert), then a step of one.
            q._step_resolves[layer] = deque([(1, 3), (2, 1)])  # (step, its resolves)
            st.faults = Log(real, [([5, 6], [2], [1, 1]), ([], [0, 0], []), ([5, 7], [2], [0, 1])])
            uses: list[list[int]] = []
            record = st.ledger.record_uses
            st.ledger.record_uses = lambda ids, sizes: (uses.append(np.asarray(ids).tolist()), record(ids, sizes))
            hits = rt._s.cache.hits
            try:
                for _ in range(3):
                    q.reconcile(st)
            finally:
                st.faults = real
                del st.ledger.record_uses
            return rt._s.cache.hits - hits, uses

    hits, uses = anyio.run(main)
    assert [u for u in uses if u] == [[5, 6], [5, 7]], uses  # the second step's 5 is a use of its own
    assert hits == 1
