"""A queued step's await that is cancelled stays a cancellation, even when the step read a failed
record: the failure is kept for a later await (or quiesce), not raised in place of the cancel."""

from __future__ import annotations

import pathlib
from typing import Any

import anyio
import mlx.core as mx
import pytest
from _fault_helpers import model_store

from asyncside.bridge import completed
from asyncside.errors import FillError
from asyncside.models import ForwardOptions, load_streaming_model
from asyncside.runtime import Runtime


def _damage_layer(spec: Any) -> None:
    """Flip a byte of every record of the layer: whatever the step routes there fails its checksum."""
    damaged = bytearray(spec.path.read_bytes())
    for e in range(spec.n_experts):
        damaged[spec.record_offset(e) + 64] ^= 0xFF
    spec.path.write_bytes(damaged)


def _failures(exc: BaseException) -> list[FillError]:
    if isinstance(exc, FillError):
        return [exc]
    if isinstance(exc, BaseExceptionGroup):
        return [f for e in exc.exceptions for f in _failures(e)]
    return []


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_cancelled_await_of_a_failed_step_stays_cancelled(tmp_path: pathlib.Path, backend: str) -> None:
    store_dir, _model, prompt = model_store(tmp_path, "qwen3_moe", None)
    sm = load_streaming_model(store_dir, completed=completed, options=ForwardOptions(mode="queued"))
    layer = sm.moe_layers[0]
    forward = sm.forward
    forward.queued.arm = None  # the await goes through forward.completed, which the test wraps
    inner = forward.completed

    async def main() -> list[FillError]:
        async with Runtime(sm.store, resident=0.0) as rt:
            _damage_layer(sm.store.layer(layer))  # after entry, which reads rows of its own
            with anyio.CancelScope() as scope:

                async def computed_then_cancelled(y: mx.array) -> None:
                    await inner(y)  # the step ran: its failed reads are in the fault log
                    scope.cancel()
                    await anyio.lowlevel.checkpoint()

                forward.completed = computed_then_cancelled
                await sm(mx.array(prompt)[None], sm.make_cache(), source=rt)
            forward.completed = inner
            assert scope.cancelled_caught  # a FillError raised in its place would have escaped the scope
            with pytest.raises((FillError, BaseExceptionGroup)) as caught:
                await rt.quiesce()  # the failure was kept, not lost
            return _failures(caught.value)

    failures = anyio.run(main, backend=backend)
    assert failures and all(f.layer == layer for f in failures)
