"""Memory over long generations, round 15: what the process holds beyond its plan while it
generates token after token, which is the margin a model larger than memory streams in.

- MLX's cache of freed buffers grows no faster per generated token under our queued steps than
  under mlx-lm's ``generate_step`` (it grew several times as fast on this small model, over ten
  times on the embedded default one, until the next clear).
"""

from __future__ import annotations

import pathlib
from collections.abc import Iterator
from typing import Any

import anyio
import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

from asyncside import ExpertStore, Runtime
from asyncside.models import load_streaming_model

from _facade_support import PROMPT, dirs, reference  # noqa: F401  (the fixtures)


@pytest.fixture
def roomy_mlx_cache() -> Iterator[None]:
    """MLX's cache of freed buffers without its CPU limit (a few tens of MB), as it is on a GPU,
    where the limit is the device's memory: what the cache keeps is then what a step left there."""
    mx.clear_cache()
    old = mx.set_cache_limit(1 << 34)
    yield
    mx.set_cache_limit(old)
    mx.clear_cache()


#: decode tokens whose cache growth is compared, after the first few
TOKENS, WARM = 200, 32


def test_mlx_cache_grows_no_faster_per_token_than_under_mlx_lm(
        dirs: tuple[pathlib.Path, pathlib.Path], reference: tuple[Any, Any],  # noqa: F811
        roomy_mlx_cache: None) -> None:
    """A queued step goes to MLX whole, so every buffer of the step was allocated before any was
    freed: the buffers sized by the context (each layer's attention scores and weights, a
    position larger every step) were neither reused by the next layer nor fit any later step,
    and MLX's cache kept them all until the next clear, every 256 tokens. mlx-lm's cache keeps
    about one a token. Our generation's cache now grows no faster than mlx-lm's, tokens unchanged."""
    ref_model, ref_tok = reference
    prompt = ref_tok.encode(PROMPT)

    def growth(held: list[int]) -> int:
        return max(held[WARM:]) - held[WARM]

    theirs: list[int] = []
    want: list[int] = []
    for tok, _ in generate_step(mx.array(prompt), ref_model, max_tokens=TOKENS):
        want.append(int(tok))
        theirs.append(mx.get_cache_memory())

    sm = load_streaming_model(dirs[1])
    ours: list[int] = []
    got: list[int] = []

    async def main() -> None:
        async with Runtime(ExpertStore.open(dirs[1]), resident=0.25) as rt:
            async for tok in sm.generate(prompt, max_tokens=TOKENS, source=rt, stop_at_eos=False):
                got.append(tok)
                ours.append(mx.get_cache_memory())

    anyio.run(main)
    assert got == want
    assert growth(theirs) > 0  # the comparison means something: mlx-lm's cache does grow
    # before, ours grew several times as fast
    assert growth(ours) <= growth(theirs), (growth(ours), growth(theirs))
