"""Checkpoints from the wild, round 14: model directories as the Hub has them (original releases'
per-expert tensors, configs that mlx-lm's sanitize acts on), which ``asyncside convert``,
``demo --model DIR`` and ``load(DIR)`` take. What they build computes what mlx-lm computes loading
the same directory; what they refuse is one line naming the file and the tensor at fault."""

from __future__ import annotations

import pathlib

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.utils import load_model, save_config, save_model

from asyncside.facade import load
from asyncside.models.tokenizer import save_byte_level_tokenizer

from _models_support import BASE, tiny_model


def _save(d: pathlib.Path, model: nn.Module, config: dict[str, object]) -> pathlib.Path:
    d.mkdir(parents=True)
    save_model(d, model)
    save_config(dict(config), d / "config.json")
    save_byte_level_tokenizer(d)
    return d


def test_a_head_that_sanitize_normalises_is_normalised_once(tmp_path: pathlib.Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A bailing_moe checkpoint with ``norm_head: true`` (as Ling models are): mlx-lm's sanitize
    divides the LM head by its column norms when it loads the directory. The converter stored the
    head so divided, and loading the store ran sanitize over it again: a head divided twice, so the
    streaming model's logits were not mlx-lm's (tokens could differ where two were close). Now a
    store's weights load as they were stored, and the logits equal mlx-lm's bit for bit."""
    monkeypatch.setitem(BASE, "bailing_moe", dict(BASE["bailing_moe"], norm_head=True))
    model, config = tiny_model("bailing_moe")
    d = _save(tmp_path / "model", model, config)
    reference, _ = load_model(d)
    x = mx.array([[1, 2, 3, 4, 5, 6, 7]])
    want = reference(x)
    streaming, _tok = load(d, resident=0.25, cache_dir=tmp_path / "cache", progress=False)
    with streaming:
        got = streaming(x)
    assert mx.array_equal(got, want).item()

