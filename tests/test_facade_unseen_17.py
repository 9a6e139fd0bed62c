"""asyncside's ``load`` under the rest of mlx-lm's Python API, round 17: samplers and logits
processors under a seed, quantized KV caches, speculative decoding either way round, prompt caches
saved to a file and trimmed, ``verbose=True`` and ``max_tokens=-1``. Tokens must equal
``mlx_lm.load`` of the same model directory, all-resident."""

from __future__ import annotations

import contextlib
import io
import itertools
import pathlib
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm import generate, stream_generate
from mlx_lm.models.cache import (
    KVCache,
    QuantizedKVCache,
    can_trim_prompt_cache,
    load_prompt_cache,
    make_prompt_cache,
    save_prompt_cache,
    trim_prompt_cache,
)
from mlx_lm.sample_utils import make_logits_processors, make_sampler

from _facade_support import PROMPT, dirs, reference, streaming  # noqa: F401  (the fixtures)


def _both(reference: tuple[Any, Any], streaming: tuple[Any, Any], run: Any) -> tuple[Any, Any]:
    """``run(model, tokenizer)`` on mlx-lm's all-resident model, then on the streamed one."""
    return run(*reference), run(*streaming)


def test_a_seeded_sampler_and_logits_processors_give_mlx_lms_tokens(reference: tuple[Any, Any],
                                                                    streaming: tuple[Any, Any]) -> None:
    def sampled(model: Any, tok: Any) -> list[str]:
        out = []
        for seed in (0, 7):
            mx.random.seed(seed)
            sampler = make_sampler(temp=0.7, top_p=0.9, min_p=0.05, top_k=20)
            out.append(generate(model, tok, PROMPT, max_tokens=20, sampler=sampler))
        processors = make_logits_processors(repetition_penalty=1.3, logit_bias={5: 3.0, 17: -2.0})
        out.append(generate(model, tok, PROMPT, max_tokens=20, logits_processors=processors))
        return out

    want, got = _both(reference, streaming, sampled)
    assert got == want and want[0] != want[1]


def test_a_quantized_kv_cache_gives_mlx_lms_tokens(reference: tuple[Any, Any], streaming: tuple[Any, Any]) -> None:
    def quantized(model: Any, tok: Any) -> tuple[str, list[int], type]:
        text = generate(model, tok, PROMPT, max_tokens=20, kv_bits=4, kv_group_size=64, quantized_kv_start=0)
        cache = make_prompt_cache(model)
        tokens = [r.token for r in stream_generate(model, tok, PROMPT, max_tokens=20, kv_bits=8, kv_group_size=32,
                                                   quantized_kv_start=3, prompt_cache=cache)]
        return text, tokens, type(cache[0])

    want, got = _both(reference, streaming, quantized)
    assert got == want and want[2] is QuantizedKVCache


def test_speculative_decoding_either_way_round(reference: tuple[Any, Any], streaming: tuple[Any, Any]) -> None:
    """The streamed model as the main model with mlx-lm's as the draft, and the other way round."""
    ref_model, ref_tok = reference
    model, tok = streaming
    want = [(r.token, r.from_draft) for r in stream_generate(ref_model, ref_tok, PROMPT, max_tokens=20,
                                                             draft_model=ref_model, num_draft_tokens=3)]
    for main, draft, n in ((model, ref_model, 3), (ref_model, model, 2), (model, model, 4)):
        got = [(r.token, r.from_draft) for r in stream_generate(main, tok, PROMPT, max_tokens=20,
                                                                draft_model=draft, num_draft_tokens=n)]
        assert [t for t, _ in got] == [t for t, _ in want]
        assert any(d for _, d in got)
    assert generate(model, tok, PROMPT, max_tokens=20, draft_model=ref_model) == generate(ref_model, ref_tok, PROMPT,
                                                                                          max_tokens=20)


def test_a_prompt_cache_saved_loaded_and_trimmed(reference: tuple[Any, Any], streaming: tuple[Any, Any],
                                                 tmp_path: pathlib.Path) -> None:
    """A streamed model's prompt cache saved to a file goes on in either model, as mlx-lm's does."""
    def turns(model: Any, tok: Any, name: str, other: Any = None) -> tuple[Any, ...]:
        cache = make_prompt_cache(model)
        first = generate(model, tok, "First turn. ", max_tokens=8, prompt_cache=cache)
        save_prompt_cache(str(tmp_path / f"{name}.safetensors"), cache, {"turn": "1"})
        loaded, meta = load_prompt_cache(str(tmp_path / f"{name}.safetensors"), return_metadata=True)
        second = generate(other or model, tok, "Second turn. ", max_tokens=8, prompt_cache=loaded)
        trimmable = can_trim_prompt_cache(loaded)
        trimmed = trim_prompt_cache(loaded, 4)
        third = generate(model, tok, "Third. ", max_tokens=8, prompt_cache=loaded)
        return first, second, meta, trimmable, trimmed, third, loaded[0].offset

    ref_model, ref_tok = reference
    model, tok = streaming
    want = turns(ref_model, ref_tok, "ref")
    assert turns(model, tok, "ours") == want
    assert turns(model, tok, "ours-then-ref", other=ref_model) == want
    assert want[3] is True and want[4] == 4


def test_verbose_and_unlimited_max_tokens(reference: tuple[Any, Any], streaming: tuple[Any, Any]) -> None:
    """``generate(verbose=True)`` prints its speed and peak memory lines; ``max_tokens=-1`` is no limit
    (and 0 mlx-lm's own ValueError), on either model."""
    def run(model: Any, tok: Any) -> tuple[str, list[str], list[int], str]:
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            text = generate(model, tok, PROMPT, max_tokens=8, verbose=True)
        lines = [line.split(":")[0] for line in printed.getvalue().splitlines() if ":" in line]
        unlimited = [r.token for r in itertools.islice(stream_generate(model, tok, PROMPT, max_tokens=-1), 40)]
        try:
            generate(model, tok, PROMPT, max_tokens=0)
            zero = "generated"
        except ValueError as e:
            zero = str(e)
        return text, lines, unlimited, zero

    want, got = _both(reference, streaming, run)
    assert got == want
    assert want[1] == ["Prompt", "Generation", "Peak memory"] and len(want[2]) == 40


def test_a_prompt_cache_of_fewer_layers_is_refused(reference: tuple[Any, Any], streaming: tuple[Any, Any]) -> None:
    """``generate(model, tok, prompt, prompt_cache=load_prompt_cache(file))`` with a file saved for
    a model of fewer layers failed with "IndexError: list index out of range" from inside the
    streamed walk (mlx-lm's own model skips the layers left over without a word). One more cache
    than layers is left over as mlx-lm leaves it."""
    ref_model, ref_tok = reference
    model, tok = streaming
    n = len(model.layers)
    with pytest.raises(ValueError, match=rf"^cache: {n - 1} layer caches for a model of {n} decoder layers \(a "
                                         rf"prompt cache made for another model\?\)"):
        generate(model, tok, PROMPT, max_tokens=4, prompt_cache=[KVCache() for _ in range(n - 1)])
    want, got = (generate(m, tok, PROMPT, max_tokens=4, prompt_cache=[KVCache() for _ in range(n + 1)])
                 for m in (ref_model, model))
    assert got == want == generate(ref_model, ref_tok, PROMPT, max_tokens=4)
