"""Queued decode over fewer dynamic rows than the top-k, under a plan that reads past the page cache.

There a step whose experts exceed the lent rows went layer by layer (``capacity`` 0: a batch cut in
parts ran slower and peaked past the budget), and with ``side_rows`` below the model's top-k every
one-token decode step's experts exceed them: every token went per layer. A one-token step is cut in
sorted parts of its own pairs instead (its buffers are one token's), tokens exact; a decode batch
still goes per layer unless ``ASYNCSIDE_DIRECT_DECODE_TOKENS`` says otherwise.
"""

from __future__ import annotations

import pathlib
from typing import Any

import anyio
import pytest
from _fault_helpers import model_store

from asyncside.audit import audit_problems
from asyncside.bridge import completed
from asyncside.models import load_streaming_model, reference_generate
from asyncside.runtime import Runtime

NEW_TOKENS = 6


def test_one_token_decode_below_top_k_side_rows_runs_queued_past_the_page_cache(tmp_path: pathlib.Path,
                                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ASYNCSIDE_DIRECT_DECODE_TOKENS", raising=False)
    store_dir, model, prompt = model_store(tmp_path, "qwen3_moe", None)
    ref = reference_generate(model, prompt, max_tokens=NEW_TOKENS)
    sm = load_streaming_model(store_dir, completed=completed)

    async def main() -> tuple[list[int], dict[str, int]]:
        async with Runtime(sm.store, side_rows=2, direct=True) as rt:
            if not rt.memory["direct"]:
                pytest.skip("this file system refuses O_DIRECT")
            before: dict[str, Any] = dict(sm.forward.counters)
            tokens = [t async for t in sm.generate(prompt, max_tokens=NEW_TOKENS, source=rt)]
            await rt.quiesce()
            assert audit_problems(rt) == []
            return tokens, {k: sm.forward.counters[k] - before.get(k, 0) for k in sm.forward.counters}

    tokens, counters = anyio.run(main)
    assert tokens == ref
    assert counters["queued"] == NEW_TOKENS and counters["per_layer"] == 0, counters
    assert counters["sorted_parts"] > 0, counters
