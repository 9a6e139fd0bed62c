"""asyncside's ``load`` under the rest of mlx-lm's Python API, round 17: samplers and logits
processors under a seed, quantized KV caches, speculative decoding either way round, prompt caches
saved to a file and trimmed, ``verbose=True`` and ``max_tokens=-1``. Tokens must equal
``mlx_lm.load`` of the same model directory, all-resident. And what a library around mlx-lm calls
on a model as an ``mlx.nn.Module`` (LoRA tooling, ``nn.quantize``), or code written for
``mlx_lm.load`` passes it: refused by name, saying why and what to use instead."""

from __future__ import annotations

import contextlib
import io
import itertools
import pathlib
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
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
from mlx_lm.tuner.utils import linear_to_lora_layers, print_trainable_parameters

from asyncside.errors import AsyncsideError
from asyncside.facade import load

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

    def outcome(model: Any, tok: Any) -> Any:
        try:
            return quantized(model, tok)
        except RuntimeError as exc:  # MLX CUDA has no quantized matmul of some shapes: mlx-lm's own error
            return f"raised: {exc}"

    want, got = _both(reference, streaming, outcome)
    assert got == want
    if isinstance(want, str):  # both raised the same: only where MLX lacks the kernel, never on the CPU
        assert mx.default_device() != mx.cpu, want
    else:
        assert want[2] is QuantizedKVCache


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


@pytest.mark.parametrize("use", [
    lambda m: nn.quantize(m, group_size=64, bits=4),
    lambda m: print_trainable_parameters(m),
    lambda m: tree_flatten(m.parameters()),
    lambda m: m.trainable_parameters(),
    lambda m: m.freeze(),
    lambda m: m.load_weights("adapters.safetensors", strict=False),
    lambda m: m.update({}),
], ids=["nn.quantize", "print_trainable_parameters", "parameters", "trainable_parameters", "freeze", "load_weights",
        "update"])
def test_mlx_nn_module_api_is_refused_by_name(streaming: tuple[Any, Any], use: Any) -> None:
    """What LoRA tooling, ``nn.quantize`` or a server counting parameters calls on an mlx-lm model
    failed on the facade's model with "'StreamingLM' object has no attribute 'leaf_modules'" from
    inside MLX (``named_modules`` from mlx-lm's tuner): nothing said why, or what to use instead."""
    model, tok = streaming
    with pytest.raises(AttributeError, match=r"^StreamingLM\.\w+: asyncside\.load's model is no mlx\.nn\.Module, its "
                                             r"experts stream from the expert store.*mlx_lm\.load$"):
        use(model)
    assert not hasattr(model, "parameters") and not hasattr(model, "make_cache")
    with pytest.raises(AttributeError, match=r"models have no make_cache: make_prompt_cache builds their caches"):
        model.make_cache  # noqa: B018  (the property's own message, not the refusal's)
    with pytest.raises(AttributeError, match=r"^'StreamingLM' object has no attribute 'nothing_such'$"):
        model.nothing_such  # noqa: B018
    # What works on the streamed model's resident part, and model.eval(), as after mlx_lm.load.
    assert model.eval() is model
    assert {k.split(".")[-2] for k, _ in tree_flatten(model.streaming.model.parameters())} >= {"q_proj", "gate"}
    assert generate(model, tok, PROMPT, max_tokens=4)


def test_mlx_lms_lora_tooling_is_refused_by_name(dirs: tuple[pathlib.Path, pathlib.Path]) -> None:
    """``linear_to_lora_layers(model, ...)`` failed with "'StreamingLM' object has no attribute
    'named_modules'" from inside mlx-lm's tuner. (It has changed ``model.layers`` by then: a model
    of its own here.)"""
    with load(dirs[1], resident=0.25)[0] as model:
        with pytest.raises(AttributeError, match=r"^StreamingLM\.named_modules: asyncside\.load's model is no "
                                                 r"mlx\.nn\.Module"):
            linear_to_lora_layers(model, 1, {"rank": 4, "scale": 10.0, "dropout": 0.0})


@pytest.mark.parametrize("name, value, why", [
    ("adapter_path", "adapters", r"fuse it into the model \(mlx_lm\.fuse\)"),
    ("tokenizer_config", {"trust_remote_code": True}, r"pass a tokenizer of your own"),
    ("model_config", {"rope_theta": 1.0}, r"change the model directory's config\.json"),
    ("lazy", True, r"leave lazy out"),
    ("return_config", True, r"model\.streaming\.config"),
    ("trust_remote_code", True, r"pass a tokenizer of your own"),
])
def test_mlx_lm_loads_own_arguments_are_named_as_such(dirs: tuple[pathlib.Path, pathlib.Path], name: str,
                                                      value: Any, why: str) -> None:
    """Code written for ``mlx_lm.load(path, adapter_path=..., return_config=True)`` swapped to
    ``asyncside.load`` got "unexpected keyword argument 'adapter_path' (besides its own, it takes
    the Runtime's: pinned, side_rows, ...)": a list of runtime knobs, no word of why."""
    with pytest.raises(TypeError, match=rf"^load\(\) got an unexpected keyword argument '{name}': mlx_lm\.load's, "
                                        rf"which asyncside\.load does not take: .*{why}"):
        load(dirs[1], **{name: value})


def test_a_layer_changed_on_the_callers_thread_is_named(dirs: tuple[pathlib.Path, pathlib.Path]) -> None:
    """mlx-lm's ``linear_to_lora_layers(model, ...)`` adds LoRA layers to ``model.layers`` before it
    is refused on the model itself; their weights are lazy on the caller's thread, and every later
    ``generate`` failed with "RuntimeError: There is no Stream(cpu, 0) in current thread" from the
    runtime's thread. It now names the cause and the remedy, which works."""
    model, tok = load(dirs[1], resident=0.25)
    with model:
        want = generate(model, tok, PROMPT, max_tokens=6)
        with pytest.raises(AttributeError, match=r"named_modules"):
            linear_to_lora_layers(model, 1, {"rank": 4, "scale": 10.0, "dropout": 0.0})
        with pytest.raises(AsyncsideError, match=r"^the step read a weight of the model made on another thread and "
                                                 r"not yet computed .*mx\.eval\(model\.streaming\.model\.parameters"):
            generate(model, tok, PROMPT, max_tokens=6)
        mx.eval(model.streaming.model.parameters())
        assert generate(model, tok, PROMPT, max_tokens=6) == want  # LoRA's B starts at zero
