"""asyncside's ``load`` under mlx-lm's uses other than ``generate``, round 18: the model called
directly for logits, as perplexity and evaluation code calls it (batches, chunks over a prompt
cache, a deep copy of one); ``batch_generate`` and ``BatchGenerator`` with a length per prompt;
``stream_generate``'s prompt forms and prefill chunk sizes, its responses and the streaming
detokenizer; two models at once, and a model dropped and loaded again. Logits and tokens must equal
``mlx_lm.load`` of the same model directory, all-resident, or be refused as mlx-lm refuses them."""

from __future__ import annotations

import copy
import gc
import math
import pathlib
import threading
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm import batch_generate, generate, stream_generate
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.perplexity import eval_ppl

from asyncside.errors import AsyncsideError
from asyncside.facade import _OPEN, load
from asyncside.models.embedded import ensure_embedded_default

from _facade_support import PROMPT, dirs, reference, streaming  # noqa: F401  (the fixtures)
from _models_support import embedded_spec

#: Logits equal to mlx-lm's up to the order of a sum: on a GPU the pooled experts' kernels may add
#: in another order than mlx-lm's gathered ones (on the CPU they are equal bit for bit).
_CLOSE = {"atol": 1e-3, "rtol": 1e-3}


def _logits(model: Any, x: mx.array, chunk: int | None) -> np.ndarray:
    """``model(x)`` whole, or chunk by chunk over one prompt cache; computed, as float32."""
    if chunk is None:
        out = model(x)
    else:
        cache = make_prompt_cache(model)
        out = mx.concatenate([model(x[:, i:i + chunk], cache=cache) for i in range(0, x.shape[1], chunk)], axis=1)
    mx.eval(out)
    assert out.dtype == mx.float32 or out.dtype == mx.bfloat16 or out.dtype == mx.float16
    return np.array(out.astype(mx.float32))


@pytest.mark.parametrize("batch", [1, 3])
def test_direct_calls_give_mlx_lms_logits(reference: tuple[Any, Any], streaming: tuple[Any, Any], batch: int) -> None:
    """``model(x)`` of (B, T), T from one to past two hundred, whole and in chunks over a cache."""
    ref_model, model = reference[0], streaming[0]
    rng = np.random.default_rng(batch)
    for length in (1, 9, 260):
        x = mx.array(rng.integers(0, model._vocab, size=(batch, length)))
        for chunk in (None, 64):
            want, got = _logits(ref_model, x, chunk), _logits(model, x, chunk)
            assert got.shape == want.shape == (batch, length, model._vocab)
            np.testing.assert_allclose(got, want, **_CLOSE)


def test_perplexity_and_evaluate_loops_give_mlx_lms_scores(reference: tuple[Any, Any],
                                                           streaming: tuple[Any, Any]) -> None:
    """mlx_lm.perplexity's eval_ppl and its per-token losses; mlx_lm.evaluate's right-padded batch
    scored chunk by chunk over one cache, then a prompt's cache deep-copied to score a continuation
    (its core loops: importing mlx_lm.evaluate needs lm_eval)."""
    vocab = streaming[0]._vocab

    def scores(model: Any) -> list[np.ndarray]:
        rng = np.random.default_rng(5)
        batch = mx.array(rng.integers(0, vocab, size=(4, 33)))
        losses = nn.losses.cross_entropy(model(batch[:, :-1]).astype(mx.float32), batch[:, 1:], reduction="none")
        rows = [rng.integers(0, vocab, size=n) for n in (5, 40, 23)]
        padded = mx.array(np.stack([np.pad(r, (0, 40 - len(r))) for r in rows]))
        inputs, targets = padded[:, :-1], padded[:, 1:]
        cache, scored = make_prompt_cache(model), []
        for i in range(0, inputs.shape[1], 16):
            logprobs = nn.log_softmax(model(inputs[:, i:i + 16], cache=cache).astype(mx.float32))
            scored.append(mx.take_along_axis(logprobs, targets[:, i:i + 16, None], axis=-1)[..., 0])
            mx.eval(scored[-1])
            mx.clear_cache()
        prompt_cache = make_prompt_cache(model)
        for i in range(0, 49, 16):
            model(mx.array(rng.integers(0, vocab, size=(1, 49)))[:, i:i + 16], cache=prompt_cache)
            mx.eval([c.state for c in prompt_cache])
        tail = mx.array([[3, 4, 5]])
        copied = model(tail, cache=copy.deepcopy(prompt_cache))
        again = model(tail, cache=prompt_cache)
        out = [losses, mx.concatenate(scored, axis=1), copied, again]
        mx.eval(out)
        return [np.array(a.astype(mx.float32)) for a in out]

    want, got = scores(reference[0]), scores(streaming[0])
    for w, g in zip(want, got):
        np.testing.assert_allclose(g, w, **_CLOSE)
    np.testing.assert_allclose(got[2], got[3], atol=1e-5)  # the copy left the prompt's cache as it was
    data = mx.array(np.random.default_rng(6).integers(0, vocab, size=(5, 40)))
    assert eval_ppl(streaming[0], data, batch_size=2) == pytest.approx(eval_ppl(reference[0], data, batch_size=2),
                                                                        rel=1e-4)


def test_batch_generate_and_batch_generator_give_mlx_lms_tokens(reference: tuple[Any, Any],
                                                                streaming: tuple[Any, Any]) -> None:
    tok = streaming[1]
    prompts = [tok.encode(p) for p in ("Hi", PROMPT * 3, "Routing picks experts " * 2, "x")]

    def run(model: Any, t: Any) -> tuple[Any, ...]:
        per_prompt = batch_generate(model, t, prompts, max_tokens=[3, 17, 9, 1], return_token_ids=True,
                                    return_logprobs=True)
        small = batch_generate(model, t, prompts, max_tokens=8, prefill_step_size=4, prefill_batch_size=2,
                               completion_batch_size=2, return_prompt_caches=True)
        resumed = batch_generate(model, t, [[5, 6], [7], [8, 9], [10]], max_tokens=5, prompt_caches=small.caches)
        gen = BatchGenerator(model, max_tokens=10, stop_tokens=[[e] for e in t.eos_token_ids], prefill_step_size=8)
        uids = gen.insert(prompts[:2], [4, 10])
        out: dict[int, list[int]] = {u: [] for u in uids}
        finished = []
        with gen.stats() as stats:
            while responses := gen.next_generated():
                for r in responses:
                    out[r.uid].append(r.token)
                    if r.finish_reason:
                        finished.append((r.uid, r.finish_reason))
                if len(out[uids[0]]) == 2:  # a prompt inserted mid-run
                    out[gen.insert([prompts[3]], [6])[0]] = []
        gen.close()
        sane = [v >= 0 and math.isfinite(v) for v in (stats.prompt_tps, stats.generation_tps, stats.peak_memory)]
        logprobs = [[round(v, 3) for v in row] for row in per_prompt.logprobs or []]
        return (per_prompt.token_ids, logprobs, small.texts, resumed.texts, out, finished,
                stats.prompt_tokens, stats.generation_tokens, sane)

    want, got = run(*reference), run(*streaming)
    assert got == want
    assert [len(ids) for ids in want[0]] == [3, 17, 9, 1] and all(want[-1])


@pytest.mark.parametrize("prefill_step_size", [1, 8, 4096])
def test_stream_generate_prompt_forms_responses_and_detokenizer(reference: tuple[Any, Any],
                                                                streaming: tuple[Any, Any],
                                                                prefill_step_size: int) -> None:
    """The prompt as text, a list of ids, an mx.array and a chat template's ids; the responses'
    fields and the streaming detokenizer fed the tokens, as mlx-lm's give them."""
    chat = [{"role": "user", "content": "What is a mixture of experts?"}]

    def run(model: Any, tok: Any) -> tuple[Any, ...]:
        forms = [PROMPT * 4, tok.encode(PROMPT), mx.array(tok.encode(PROMPT)),
                 tok.apply_chat_template(chat, add_generation_prompt=True)]
        texts = [generate(model, tok, p, max_tokens=10, prefill_step_size=prefill_step_size) for p in forms]
        responses = list(stream_generate(model, tok, PROMPT, max_tokens=12, prefill_step_size=prefill_step_size))
        last = responses[-1]
        sane = [v >= 0 and math.isfinite(v) for v in (last.prompt_tps, last.generation_tps, last.peak_memory)]
        detokenizer = tok.detokenizer
        detokenizer.reset()
        segments = []
        for r in responses:
            detokenizer.add_token(r.token)
            segments.append(detokenizer.last_segment)
        detokenizer.finalize()
        return (texts, [(r.text, r.token, r.finish_reason, r.prompt_tokens, r.generation_tokens) for r in responses],
                sane, segments + [detokenizer.last_segment], detokenizer.text)

    want, got = run(*reference), run(*streaming)
    assert got == want
    assert all(want[2]) and want[1][-1][2] == "length"


def test_input_embeddings_are_refused_as_for_a_model_without_them(reference: tuple[Any, Any],
                                                                 streaming: tuple[Any, Any]) -> None:
    """mlx-lm's qwen3_moe takes input_embeddings; the streamed model routes from token ids and its
    call does not name them, so mlx-lm refuses them before any step, as for a model without them."""
    ref_model, ref_tok = reference
    model, tok = streaming
    ids = tok.encode(PROMPT)
    embeddings = ref_model.model.embed_tokens(mx.array(ids))
    assert len(list(stream_generate(ref_model, ref_tok, ids, max_tokens=3, input_embeddings=embeddings))) == 3
    with pytest.raises(ValueError, match="^Model does not support input embeddings"):
        list(stream_generate(model, tok, ids, max_tokens=3, input_embeddings=embeddings))
    with pytest.raises(AsyncsideError, match="^input_embeddings: a streaming model takes token ids only"):
        model(mx.array(ids)[None], input_embeddings=embeddings[None])


def test_two_models_at_once_and_loaded_again_leak_no_thread(dirs: tuple[pathlib.Path, pathlib.Path],
                                                            reference: tuple[Any, Any], streaming: tuple[Any, Any],
                                                            tmp_path: pathlib.Path) -> None:
    """Two stores and the same store twice, generating alternately token by token; then a model
    dropped (``del``, ``gc.collect()``) and loaded again, rounds apart: no thread is left behind."""
    import mlx_lm

    spec = embedded_spec(hidden_size=64, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=32, num_experts=16, num_experts_per_tok=2, moe_intermediate_size=64)
    other_dir, other_store = ensure_embedded_default(tmp_path / "other", spec=spec, progress=False)
    other_ref, other_ref_tok = mlx_lm.load(str(other_dir))
    model, tok = streaming
    twice, twice_tok = load(dirs[1], resident=0.5)
    other, other_tok = load(other_store, resident=0.5)
    pairs = [(model, tok), (twice, twice_tok), (other, other_tok), (reference[0], reference[1]),
             (other_ref, other_ref_tok)]
    steps = [stream_generate(m, t, PROMPT, max_tokens=10) for m, t in pairs]
    tokens: list[list[int]] = [[] for _ in pairs]
    for _ in range(10):
        for out, step in zip(tokens, steps):
            out.append(next(step).token)
    assert tokens[0] == tokens[1] == tokens[3] and tokens[2] == tokens[4] and tokens[0] != tokens[2]
    twice.close()
    other.close()
    del steps, twice, other
    gc.collect()

    want = generate(*reference, PROMPT, max_tokens=4)
    counts = []
    for _ in range(3):
        again, again_tok = load(dirs[1], resident=0.25)
        assert generate(again, again_tok, PROMPT, max_tokens=4) == want
        del again
        gc.collect()
        counts.append((threading.active_count(), len(_OPEN)))
    assert counts[0] == counts[-1] and counts[0][1] == 1  # the module's own model is the one still open


def test_a_keyword_the_call_would_not_apply_is_refused(reference: tuple[Any, Any],
                                                       streaming: tuple[Any, Any]) -> None:
    """``model(x, cahce=cache)`` and ``model(x, mask=mask)`` raise a TypeError on mlx-lm's model. The
    streamed model swallowed every keyword: the misspelt cache gave the logits of no earlier tokens
    and left the cache empty, the mask was never applied, and both returned logits as if fine."""
    ref_model, model = reference[0], streaming[0]
    x = mx.array([[11, 12, 13]])
    for m in (ref_model, model):
        for kw in ({"cahce": make_prompt_cache(m)}, {"mask": mx.ones((3, 3), dtype=mx.bool_)}):
            with pytest.raises(TypeError, match="unexpected keyword argument"):
                m(x, **kw)
    cache = make_prompt_cache(model)
    with pytest.raises(TypeError, match=r"^StreamingLM.__call__\(\) got an unexpected keyword argument 'cahce'"):
        model(x, cahce=cache)
    assert cache[0].offset == 0
    # None where the mlx-lm model takes the name is its default: the call runs as without it.
    np.testing.assert_allclose(np.array(model(x, input_embeddings=None)), np.array(model(x)), atol=1e-6)


def test_a_nested_list_of_ids_gives_mlx_lms_logits(reference: tuple[Any, Any], streaming: tuple[Any, Any]) -> None:
    """``model([[...]])``: mlx-lm's model indexes its embedding with the list and returns logits;
    the streamed model failed with "AttributeError: 'list' object has no attribute 'size'". A NumPy
    array, which mlx-lm's model refuses too, is refused naming the argument."""
    ref_model, model = reference[0], streaming[0]
    ids = [[11, 12, 13, 14], [21, 22, 23, 24]]
    want = ref_model(ids)
    mx.eval(want)
    np.testing.assert_allclose(np.array(model(ids)), np.array(want), **_CLOSE)
    with pytest.raises(ValueError):
        ref_model(np.array(ids))
    with pytest.raises(TypeError, match=r"^inputs: expected an mx.array of token ids of shape \(batch, tokens\), "
                                        r"got ndarray"):
        model(np.array(ids))


def test_a_call_inside_mx_compile_is_refused_saying_why(reference: tuple[Any, Any],
                                                        streaming: tuple[Any, Any]) -> None:
    """``mx.compile(lambda x: model(x))``: mlx-lm's model traces into one graph and gives its logits;
    the streamed model's step cannot (its experts are read as tokens route to them, on the runtime's
    thread), and the user read only MLX's "[eval] Attempting to eval an array during function
    transformations like compile or vmap is not allowed"."""
    ref_model, model = reference[0], streaming[0]
    x = mx.array([[11, 12, 13]])
    assert mx.compile(lambda a: ref_model(a))(x).shape == (1, 3, model._vocab)
    with pytest.raises(ValueError, match=r"^model\(\.\.\.\) inside mx.compile, mx.vmap or a gradient: a streamed "
                                         r"model's step reads experts from the store"):
        mx.compile(lambda a: model(a))(x)
    np.testing.assert_allclose(np.array(model(x)), np.array(ref_model(x)), **_CLOSE)  # still fine outside
