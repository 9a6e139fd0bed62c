"""Inputs the repository never made, eighth sweep: the RESULTS on unseen inputs. Model shapes
built from configs of our own (a Mixtral-like 8 experts top-2, a top-1 model, 60 experts top-4,
512 small experts top-10), routing traces written by hand (several sequences, fewer layers or
experts than the model, an expert never routed, the same experts every token, predictions wider
or narrower than the model's top-k) and queued steps that prefetch what a trace predicts. What is
checked is what a run reports: the tokens against mlx-lm's under the same routing, the ledger
audit, and the counters against each other (bytes read = records read x stride).
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import anyio
import mlx.core as mx
import numpy as np
import pytest

from asyncside.bridge import completed
from asyncside.models import ForwardOptions, load_reference_model, load_streaming_model, reference_generate
from asyncside.models.forcing import force_reference, rewind_reference
from asyncside.models.forward import StepMode
from asyncside.routing import RoutingTrace
from asyncside.runtime import Runtime

TOKENS = 12

pytestmark = pytest.mark.skipif(mx.default_device() == mx.gpu, reason="streamed switches: the host pools' path")


@pytest.fixture(scope="module")
def odd_store(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A bench shape of a config no preset has: qwen2-moe-like, 60 experts top-4, records of
    23,040 bytes (not a multiple of 4096), two MoE layers, a small vocabulary (about a second)."""
    from asyncside.bench.shapes import ensure_shape

    root = tmp_path_factory.mktemp("odd-shape")
    (root / "config.json").write_text(json.dumps({
        "model_type": "qwen2_moe", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 320, "num_hidden_layers": 2, "num_experts": 60, "num_experts_per_tok": 4,
        "moe_intermediate_size": 160, "rms_norm_eps": 1e-6, "rope_theta": 10000.0}))
    return pathlib.Path(ensure_shape(root / "config.json", cache_dir=root / "cache", progress=False)["store"])


def _trace_with_extra_predictions(path: pathlib.Path, n_layers: int, n_experts: int, top_k: int) -> None:
    """A trace of the model's own shape whose predictions name every routed expert and two that
    are never routed at that (token, layer): each step prefetches two records nobody routes."""
    rng = np.random.default_rng(8)
    tokens = 64
    ids = np.stack([np.stack([rng.choice(n_experts, top_k, replace=False) for _ in range(n_layers)])
                    for _ in range(tokens)]).astype(np.int32)
    predicted = np.empty((tokens, n_layers, top_k + 2), dtype=np.int32)
    for t in range(tokens):
        for layer in range(n_layers):
            others = np.setdiff1d(np.arange(n_experts), ids[t, layer])
            predicted[t, layer] = np.concatenate([ids[t, layer], rng.choice(others, 2, replace=False)])
    RoutingTrace(ids, np.array([tokens]), n_experts, {"source": "synthetic"}, predicted=predicted).save(path)


def test_a_drained_runtime_has_published_the_last_steps_prefetches(odd_store: pathlib.Path, tmp_path: pathlib.Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Queued steps past the page cache prefetch what the predictor names; the reads nobody routed
    stay unpublished in the fault table until the next step begins. After the last step nothing
    began, and ``Runtime.drain()`` (which the demo and ``bench generate`` call before auditing)
    left them so: the audit failed ("native fault table differs from the ledger", "rows lent
    natively ... != lent by the ledger"), ``demo --direct --lookahead-extra 3`` on a 60-expert
    top-4 shape printed "ledger audit FAILED" and exited 1 with identical tokens, and the stats
    missed those reads. Drain now publishes them once no step is in flight."""
    monkeypatch.setenv("ASYNCSIDE_DIRECT", "1")
    sm = load_streaming_model(odd_store, completed=completed,
                              options=ForwardOptions(mode=StepMode.QUEUED, streamed_switch=True))
    moe = sm.moe_layers
    n_experts, top_k = sm.store.layer(moe[0]).n_experts, int(sm.config["num_experts_per_tok"])
    trace = tmp_path / "extra.npz"
    _trace_with_extra_predictions(trace, len(moe), n_experts, top_k)

    prompt = sm.tokenizer.encode("Mixture of experts")
    model, _config = load_reference_model(odd_store)
    replay = sm.set_routing(trace)
    force_reference(model, sm.arch.block_attr, replay)
    try:
        ref = reference_generate(model, prompt, max_tokens=TOKENS)
    finally:
        rewind_reference(model)

    async def main() -> tuple[list[int], Any, Any, tuple[int, int], int, dict[int, int]]:
        async with Runtime(sm.store, resident=0.5) as rt:
            if not rt.memory["direct"]:
                pytest.skip("this file system refuses O_DIRECT")
            tokens = [t async for t in sm.generate(prompt, max_tokens=TOKENS, source=rt, predictor="trace")]
            await rt.drain()
            stride = sm.store.layer(moe[0]).stride
            rows = {layer: rt.ledger(layer).rows for layer in moe}
            return tokens, rt.audit(), rt.stats(), rt.queued.prefetch_counts(), stride, rows

    tokens, reports, stats, (native_reads, _hits), stride, rows = anyio.run(main)
    assert tokens == ref
    assert all(r.ok for r in reports.values()), {i: r.problems for i, r in reports.items()}
    assert stats["prefetch_reads"] > 0
    # Every prefetch read is counted once drained, and the bytes are the records read.
    assert stats["prefetch_reads"] + stats["prefetch_failures"] == native_reads
    records = stats["misses"] - stats["late"] - stats["tier_faults"] - stats["staged_copies"] + stats["prefetched"]
    assert stats["bytes_read"] == records * stride
    for layer in moe:  # no row leaked
        counts = reports[layer].counts
        assert counts["free"] + counts["live"] + counts["filling"] == rows[layer], counts
