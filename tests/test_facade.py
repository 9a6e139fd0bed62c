"""asyncside's ``load`` facade under mlx-lm's own functions: tokens equal mlx-lm all-resident.

The model streams (a quarter of each layer's experts in pools, the rest read from the store), and
mlx-lm's ``generate``, ``stream_generate``, ``batch_generate`` and ``make_prompt_cache`` are used
exactly as on an mlx-lm model; the reference is ``mlx_lm.load`` of the original model directory.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys
import textwrap
import threading
from typing import Any

import pytest
from mlx_lm import batch_generate, generate, stream_generate
from mlx_lm.models.cache import make_prompt_cache

from asyncside.errors import AsyncsideError
from asyncside.facade import StreamingLM, load

from _facade_support import PROMPT, dirs, reference, streaming  # noqa: F401  (the fixtures)


def test_generate_equals_mlx_lm_all_resident(reference: tuple[Any, Any], streaming: tuple[Any, Any]) -> None:
    ref_model, ref_tok = reference
    model, tok = streaming
    assert isinstance(model, StreamingLM) and type(tok) is type(ref_tok)
    before = model.stats()
    want = generate(ref_model, ref_tok, PROMPT, max_tokens=32)
    got = generate(model, tok, PROMPT, max_tokens=32)
    assert len(want) >= 16 and got == want
    after = model.stats()
    assert after["misses"] > before["misses"]  # experts were read from the store meanwhile
    assert after["queued_steps"] > before["queued_steps"]  # decode steps were queued steps


def test_stream_generate_equals_mlx_lm(reference: tuple[Any, Any], streaming: tuple[Any, Any]) -> None:
    ref_model, ref_tok = reference
    model, tok = streaming
    want = [(r.token, r.text) for r in stream_generate(ref_model, ref_tok, PROMPT, max_tokens=24)]
    got = [(r.token, r.text) for r in stream_generate(model, tok, PROMPT, max_tokens=24)]
    assert len(want) == 24 and got == want


def test_batch_generate_equals_mlx_lm(reference: tuple[Any, Any], streaming: tuple[Any, Any]) -> None:
    ref_model, ref_tok = reference
    model, tok = streaming
    # Different lengths: the batch is padded, caches are batch caches.
    prompts = [ref_tok.encode(p) for p in ("Hi there", "The quick brown fox jumps over", "a", PROMPT)]
    want = batch_generate(ref_model, ref_tok, prompts, max_tokens=16, return_token_ids=True)
    got = batch_generate(model, tok, prompts, max_tokens=16, return_token_ids=True)
    assert got.token_ids == want.token_ids and got.texts == want.texts
    assert all(len(t) == 16 for t in want.token_ids)


def test_make_prompt_cache_and_multi_turn(reference: tuple[Any, Any], streaming: tuple[Any, Any]) -> None:
    ref_model, ref_tok = reference
    model, tok = streaming
    caches = {}
    outs: dict[str, list[str]] = {"ref": [], "ours": []}
    for name, (m, t) in (("ref", (ref_model, ref_tok)), ("ours", (model, tok))):
        caches[name] = make_prompt_cache(m)
        for turn in ("First turn. ", "Second turn, longer than the first. "):
            outs[name].append(generate(m, t, turn, max_tokens=12, prompt_cache=caches[name]))
    assert len(caches["ours"]) == len(caches["ref"]) == len(model.layers)
    assert outs["ours"] == outs["ref"]
    assert caches["ours"][0].offset == caches["ref"][0].offset > 0


def test_calls_from_several_threads(reference: tuple[Any, Any], streaming: tuple[Any, Any]) -> None:
    ref_model, ref_tok = reference
    model, tok = streaming
    prompts = ["One. ", "Two, two. ", "Three: 3 3 3."]
    want = [generate(ref_model, ref_tok, p, max_tokens=10) for p in prompts]
    got: list[str | None] = [None] * len(prompts)

    def run(i: int) -> None:
        got[i] = generate(model, tok, prompts[i], max_tokens=10)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=300)
    assert got == want


def test_memory_budget_and_close(dirs: tuple[pathlib.Path, pathlib.Path], reference: tuple[Any, Any]) -> None:
    ref_model, ref_tok = reference
    first, _tok = load(dirs[1], resident=0.5)
    with first:  # a model is its own context manager
        assert first.runtime.memory["resident"] == 0.5
    assert "closed" in repr(first)
    # A memory budget: the runtime plans against it, the pools sized to fit ("auto").
    budget = 4 * 2**30
    model, tok = load(dirs[1], memory=budget)
    try:
        plan = model.runtime.memory
        # The budget is the process's whole: what it holds already comes out of it.
        assert 0 < plan["budget_bytes"] < budget and "held by the process" in plan["source"]
        assert plan["pool_bytes"] <= plan["budget_bytes"]
        assert generate(model, tok, "Budget", max_tokens=8) == generate(ref_model, ref_tok, "Budget", max_tokens=8)
    finally:
        model.close()
    model.close()  # idempotent
    with pytest.raises(AsyncsideError, match="closed"):
        generate(model, tok, "x", max_tokens=2)
    with pytest.raises(AsyncsideError, match="memory budget"):
        load(dirs[1], resident=1.0, memory=4096)


def test_a_model_directory_is_converted_on_first_use(dirs: tuple[pathlib.Path, pathlib.Path],
                                                     reference: tuple[Any, Any], tmp_path: pathlib.Path) -> None:
    ref_model, ref_tok = reference
    model, tok = load(dirs[0], cache_dir=tmp_path, progress=False)
    try:
        assert model.streaming.store.path.parent == tmp_path / "stores"
        assert generate(model, tok, PROMPT, max_tokens=8) == generate(ref_model, ref_tok, PROMPT, max_tokens=8)
    finally:
        model.close()


def test_interpreter_exit_with_a_model_still_open(dirs: tuple[pathlib.Path, pathlib.Path]) -> None:
    """No close(): the runtime is closed at exit, and the process exits 0 (a thread that used MLX
    ending during interpreter finalization used to abort it with std::terminate, about one run
    in three)."""
    script = textwrap.dedent(f"""
        from mlx_lm import generate
        from asyncside.facade import load
        model, tok = load({str(dirs[1])!r}, resident=0.25)
        print(repr(generate(model, tok, "Exit", max_tokens=6)))
    """)
    for _ in range(4):
        proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0 and "terminate" not in proc.stderr, (proc.returncode, proc.stderr)
        assert proc.stdout.strip().startswith("'")
