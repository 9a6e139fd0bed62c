"""BatchCaches drops and extracts rows without reading the device, and gets mlx-lm's own results.

mlx-lm's ``BatchKVCache.filter`` and ``extract`` read the left padding back to the host; the
engine's :class:`~asyncside.serving.engine.BatchCaches` mirrors it instead (so a step may be in
flight meanwhile). Here random joins, drops and extractions run both ways side by side: every
array and every index must be equal, and the mirror must equal the device's padding throughout.
"""

from __future__ import annotations

import random
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import BatchKVCache, KVCache

from asyncside.serving.engine import BatchCaches

LAYERS, HEADS, DIM = 2, 2, 4


def request_cache(rng: random.Random, n: int) -> list[Any]:
    """A request's own caches after ``n`` tokens (0: nothing fed yet)."""
    caches = []
    for _ in range(LAYERS):
        c = KVCache()
        if n:
            k = mx.array([[[[rng.random() for _ in range(DIM)] for _ in range(n)] for _ in range(HEADS)]])
            c.update_and_fetch(k, k * 2)
        caches.append(c)
    return caches


class MlxLmWay:
    """The same operations through mlx-lm's own methods (which read the padding back)."""

    def __init__(self) -> None:
        self.layers: list[Any] | None = None

    def join(self, caches: list[list[Any]]) -> None:
        new = [BatchKVCache.merge([c[i] for c in caches]) for i in range(LAYERS)]
        if self.layers is None:
            self.layers = new
        else:
            for mine, theirs in zip(self.layers, new):
                mine.extend(theirs)

    def drop(self, keep: list[int]) -> None:
        assert self.layers is not None
        for c in self.layers:
            c.filter(keep)


def same_cache(a: Any, b: Any) -> None:
    assert a._idx == b._idx
    assert a.left_padding.tolist() == b.left_padding.tolist()
    assert a.offset.tolist() == b.offset.tolist()
    if a.keys is None or b.keys is None:
        assert a.keys is None and b.keys is None
        return
    assert mx.array_equal(a.keys, b.keys).item() and mx.array_equal(a.values, b.values).item()


@pytest.mark.parametrize("seed", range(6))
def test_drop_and_extract_match_mlx_lm_without_reading_the_device(seed: int) -> None:
    rng = random.Random(seed)
    ours, theirs = BatchCaches(), MlxLmWay()
    assert ours.tracked
    rows = 0
    for _ in range(24):
        if rows and rng.random() < 0.4:
            keep = sorted(rng.sample(range(rows), rng.randint(0, rows - 1)))
            if not keep:
                continue  # dropping every row resets: covered by the engine tests
            ours.drop([i for i in range(rows) if i not in keep])
            theirs.drop(keep)
            rows = len(keep)
        else:
            joining = [request_cache(rng, rng.choice([0, 1, 3, 7, 12])) for _ in range(rng.randint(1, 3))]
            ours.join(joining)
            theirs.join(joining)
            rows += len(joining)
        assert ours.size == rows and ours.tracked
        assert ours.layers is not None and theirs.layers is not None
        for n, (a, b) in enumerate(zip(ours.layers, theirs.layers)):
            same_cache(a, b)
            assert ours._pads[n] == b.left_padding.tolist()  # the mirror is the device's padding
        row = rng.randrange(rows)
        for a, c in zip(ours.extract(row), theirs.layers):
            if c.keys is None:  # mlx-lm cannot extract from an empty batch cache; ours gives an empty one
                assert a.keys is None and a.offset == 0
                continue
            b = c.extract(row)
            assert a.offset == b.offset
            assert mx.array_equal(a.keys, b.keys).item() and mx.array_equal(a.values, b.values).item()
        # A batch step goes on from the merged state the same way both ways.
        k = mx.ones((rows, HEADS, 1, DIM))
        for a, b in zip(ours.layers, theirs.layers):
            a.update_and_fetch(k, k)
            b.update_and_fetch(k, k)
