"""The small streamed model and the fixtures the facade's test modules share: its two directories
(the mlx-lm model and its expert store), mlx-lm's all-resident load of it, and asyncside's
``load`` of the store with a quarter of each layer's experts in pools."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator
from typing import Any

import mlx_lm
import pytest

from asyncside.facade import load
from asyncside.models.embedded import ensure_embedded_default

from _models_support import SMALL_EMBEDDED

PROMPT = "Mixture-of-Experts models route every token to a few experts. "


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[pathlib.Path, pathlib.Path]:
    return ensure_embedded_default(tmp_path_factory.mktemp("facade"), spec=SMALL_EMBEDDED, progress=False)


@pytest.fixture(scope="module")
def reference(dirs: tuple[pathlib.Path, pathlib.Path]) -> tuple[Any, Any]:
    return mlx_lm.load(str(dirs[0]))


@pytest.fixture(scope="module")
def streaming(dirs: tuple[pathlib.Path, pathlib.Path]) -> Iterator[tuple[Any, Any]]:
    model, tokenizer = load(dirs[1], resident=0.25)
    yield model, tokenizer
    model.close()
