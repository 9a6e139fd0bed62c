"""asyncside's ``load`` under mlx-lm's own API, round 13: the arguments of mlx-lm's ``generate`` /
``stream_generate`` that shape the caches (``max_kv_size``), as a user passes them to code written
for mlx-lm. Tokens must equal ``mlx_lm.load`` of the same model directory, all-resident."""

from __future__ import annotations

import gc
import pathlib
import weakref
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm import batch_generate, generate, stream_generate
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache
from mlx_lm.utils import save_config, save_model

from asyncside.facade import load
from asyncside.models.tokenizer import save_byte_level_tokenizer

from _facade_support import PROMPT, dirs, reference, streaming  # noqa: F401  (the fixtures)
from _models_support import tiny_model


@pytest.mark.parametrize("prefill_step_size", [3, 2048])
def test_max_kv_size_keeps_a_window_as_mlx_lm_does(reference: tuple[Any, Any], streaming: tuple[Any, Any],
                                                   prefill_step_size: int) -> None:
    """``stream_generate(..., max_kv_size=16)``: mlx-lm's model has no make_cache, so
    ``make_prompt_cache`` builds rotating caches; the facade's model had a make_cache for every
    model, the argument was dropped, every key was kept and the tokens differed from the first."""
    ref_model, ref_tok = reference
    model, tok = streaming
    kw: dict[str, Any] = {"max_tokens": 30, "max_kv_size": 16, "prefill_step_size": prefill_step_size}
    want = [r.token for r in stream_generate(ref_model, ref_tok, PROMPT, **kw)]
    got = [r.token for r in stream_generate(model, tok, PROMPT, **kw)]
    assert got == want
    unbounded = [r.token for r in stream_generate(ref_model, ref_tok, PROMPT, max_tokens=30)]
    assert want != unbounded  # the window changes this model's tokens: the test tells them apart


def test_batch_generate_with_max_kv_size_equals_mlx_lm(reference: tuple[Any, Any],
                                                       streaming: tuple[Any, Any]) -> None:
    """batch_generate's BatchGenerator builds each prompt's cache by make_prompt_cache(model,
    max_kv_size): every key was kept there too."""
    ref_model, ref_tok = reference
    model, tok = streaming
    prompts = [ref_tok.encode(PROMPT * 2), ref_tok.encode("hey")]
    want = batch_generate(ref_model, ref_tok, prompts, max_tokens=20, max_kv_size=16, return_token_ids=True)
    got = batch_generate(model, tok, prompts, max_tokens=20, max_kv_size=16, return_token_ids=True)
    assert got.token_ids == want.token_ids


def test_make_prompt_cache_builds_what_it_builds_for_mlx_lm(reference: tuple[Any, Any],
                                                           streaming: tuple[Any, Any]) -> None:
    ref_model, _ = reference
    model, _ = streaming
    assert not hasattr(model, "make_cache") and not hasattr(ref_model, "make_cache")
    for kv, kind in ((None, KVCache), (16, RotatingKVCache)):
        ours, ref = make_prompt_cache(model, max_kv_size=kv), make_prompt_cache(ref_model, max_kv_size=kv)
        assert [type(c) for c in ours] == [type(c) for c in ref] == [kind] * len(model.layers)
        if kv is not None:
            assert [c.max_size for c in ours] == [c.max_size for c in ref] == [kv] * len(model.layers)


def test_a_model_with_its_own_make_cache_keeps_it(tmp_path: pathlib.Path) -> None:
    """gpt_oss's mlx-lm model makes its own caches (sliding-window layers): the facade's model
    still hands make_prompt_cache that maker."""
    ref_model, config = tiny_model("gpt_oss")
    save_model(tmp_path / "model", ref_model)
    save_config(dict(config), tmp_path / "model" / "config.json")
    save_byte_level_tokenizer(tmp_path / "model")
    model, _tok = load(tmp_path / "model", cache_dir=tmp_path / "cache", progress=False)
    try:
        assert hasattr(model, "make_cache")
        ours, ref = make_prompt_cache(model, max_kv_size=4), make_prompt_cache(ref_model, max_kv_size=4)
        assert [type(c) for c in ours] == [type(c) for c in ref]
        assert RotatingKVCache in {type(c) for c in ours}
    finally:
        model.close()


def test_a_model_dropped_without_close_is_collected_and_its_runtime_closed(
        dirs: tuple[pathlib.Path, pathlib.Path], reference: tuple[Any, Any]) -> None:
    """A notebook cell re-run (``model, tok = load(...)`` again) drops the previous model: an
    mlx-lm model is freed then, but the facade's runtime task held the StreamingLM, so every
    dropped model kept its runtime (pools, reads) open until the interpreter exited. Also one
    dropped mid-generation (an abandoned stream_generate)."""
    ref_model, ref_tok = reference
    want = generate(ref_model, ref_tok, PROMPT, max_tokens=6)
    for abandon in (False, True):
        model, tok = load(dirs[1], resident=0.5)
        assert generate(model, tok, PROMPT, max_tokens=6) == want
        streaming, host, alive = model.streaming, model._host, weakref.ref(model)
        if abandon:
            steps = stream_generate(model, tok, PROMPT, max_tokens=50)
            next(steps)
            del steps
        del model
        gc.collect()
        assert alive() is None
        host.result(timeout=60)  # the runtime task ended: its runtime closed
        assert streaming.source is None


def test_an_interrupted_call_returns_once_its_step_has_ended(reference: tuple[Any, Any], streaming: tuple[Any, Any],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C (a KeyboardInterrupt in the waiting thread) during a prompt's prefill: the call
    returned at once while its step went on filling the caller's prompt_cache on the runtime
    thread, and reusing that cache read arrays on the runtime thread's stream ("There is no
    Stream(cpu, ...) in current thread") or raced the step. The interruption now lands once the
    step has ended: the cache holds the whole chunk, computed, and generation goes on from it."""
    import asyncio

    from asyncside import facade

    ref_model, ref_tok = reference
    model, tok = streaming
    real_submit = facade._LoopThread.submit

    def interrupted(self: Any, coro: Any) -> Any:
        async def later() -> Any:
            await asyncio.sleep(0.2)  # the step is still to run when the wait is interrupted
            return await coro

        future = real_submit(self, later())

        def result(timeout: float | None = None) -> Any:
            raise KeyboardInterrupt

        future.result = result  # type: ignore[method-assign]
        return future

    ids = mx.array(tok.encode(PROMPT))[None]
    ours, ref = make_prompt_cache(model), make_prompt_cache(ref_model)
    monkeypatch.setattr(facade._LoopThread, "submit", interrupted)
    with pytest.raises(KeyboardInterrupt):
        model(ids, cache=ours)
    monkeypatch.undo()
    assert [c.offset for c in ours] == [ids.shape[1]] * len(ours)
    ref_model(ids, cache=ref)
    kw: dict[str, Any] = {"max_tokens": 8}
    assert generate(model, tok, "More.", prompt_cache=ours, **kw) == generate(ref_model, ref_tok, "More.",
                                                                               prompt_cache=ref, **kw)


@pytest.mark.parametrize("past", [0, 1])
def test_token_ids_outside_the_vocabulary_are_refused(streaming: tuple[Any, Any], past: int) -> None:
    """mlx-lm's generate takes a list of ids as given: one far past the vocabulary killed the
    process with SIGSEGV in the embedding (on the runtime thread), one just past it read another
    row's memory. The call now says which id, before the step is submitted; the model still runs."""
    model, tok = streaming
    vocab = model.args.vocab_size
    with pytest.raises(ValueError, match=rf"^inputs: token id {vocab + past}, outside the model's vocabulary "
                                         rf"\[0, {vocab}\)$"):
        generate(model, tok, [1, 2, vocab + past], max_tokens=2)
    assert len(generate(model, tok, [1, 2, vocab - 1], max_tokens=2)) > 0


def test_an_empty_name_is_no_model(quick_store: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``load(os.environ.get("MODEL", ""))`` with the variable unset: pathlib reads "" as the
    working directory, so whatever store or model directory the process ran in was loaded."""
    from asyncside.errors import ModelNotFoundError
    from asyncside.hub import store_for

    monkeypatch.chdir(quick_store)
    with pytest.raises(ModelNotFoundError, match=r"^'': an empty name; expected an expert store, an mlx-lm model "
                                                 r"directory or a Hugging Face repo id \(org/name\)$"):
        store_for("", progress=False)
    assert store_for(".", progress=False) == quick_store.absolute()  # the working directory, named
