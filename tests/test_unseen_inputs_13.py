"""Unseen inputs, round 13: a new user's own routing traces, model shapes and memory limits, as
the Python API and the command line take them: layer indices of another type than an int, a budget
of a few KiB. What is refused is one line naming the argument and what was expected; a size is
shown as it was given, never as nothing."""

from __future__ import annotations

import pathlib
from typing import Any

import anyio
import numpy as np
import pytest

from asyncside import ExpertStore, Runtime
from asyncside.runtime import PlanArgumentError


@pytest.mark.parametrize(("kwargs", "said"), [
    ({"layers": [True]}, "layers: expected layer indices (integers), got True"),
    ({"layers": [0, 1.0]}, "layers: expected layer indices (integers), got 1.0"),
    ({"layers": ["0"]}, "layers: expected layer indices (integers), got '0'"),
    ({"pinned": {True: [1]}}, "pinned: expected layer indices (integers), got True"),
])
def test_a_layer_index_that_is_no_integer_is_refused_when_made(quick_store: pathlib.Path, kwargs: dict[str, Any],
                                                               said: str) -> None:
    """``Runtime(store, layers=[True])`` streamed layer 1 (True == 1) under a key of True, and
    ``layers=[1.0]`` ended, once entered, in the native fault table's TypeError, which names no
    argument the user wrote. A NumPy integer is an index, as an int is."""
    with pytest.raises(PlanArgumentError) as info:
        Runtime(ExpertStore.open(quick_store), **kwargs)
    assert str(info.value) == said

    async def go() -> list[int]:
        async with Runtime(ExpertStore.open(quick_store), layers=[np.int64(1)], resident=0.5) as rt:
            return list(rt._s.layers)

    layers = anyio.run(go)
    assert layers == [1] and type(layers[0]) is int
