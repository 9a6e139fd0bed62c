"""A decode step handed to MLX while the step before still computes writes its KV cache update in
place, as mlx-lm's own generation does, instead of copying every layer's cache.

MLX writes ``keys[..., a:b, :] = new`` into the cache's buffer only where nothing else holds that
buffer when the update is handed over. Generation queues step n+1 before step n computes, and step
n's attention, still to run, holds the buffer: on the CPU, where steps go to MLX past its throttle,
every layer's cache was copied whole on every step (a second KV cache in memory, and its copy in
time). The queued path now hands a layer over once the step before computed it, for layers whose
cache is large (``PACE_KV_BYTES``); the native plan lists no cache update as an output and keeps
no reference to one once it is handed over.

Checked with MLX's own peak-memory counter over the decode steps of a real model, each step held
on the stream behind other work so that the next is always handed over first (the control, not
paced, copies), tokens against mlx-lm's; the plan's part on a chain of cache updates built here,
paced as the queued path paces.
"""

from __future__ import annotations

import pathlib
from typing import Any

import anyio
import mlx.core as mx
import numpy as np
import pytest
from _fault_helpers import model_store

import asyncside._native as _native
import asyncside.models.queued as queued
from asyncside.bridge import completed
from asyncside.models import ForwardOptions, load_streaming_model, reference_generate
from asyncside.models.forward import StepMode
from asyncside.runtime import Runtime

pytestmark = pytest.mark.skipif(mx.default_device() != mx.cpu,
                                reason="the CPU's hand-over past MLX's throttle (a GPU step goes whole, as its roots)")


def _decode(store_dir: pathlib.Path, prompt: list[int], max_tokens: int) -> tuple[list[int], int, list[int]]:
    """(tokens, MLX's peak bytes above what was active after the first token, each layer's cache
    bytes at the end) of a queued greedy generation."""
    sm = load_streaming_model(store_dir, completed=completed, options=ForwardOptions(mode=StepMode.QUEUED))
    caches: list[Any] = []
    make = sm.make_cache

    def keep() -> Any:
        caches.append(make())
        return caches[-1]

    sm.make_cache = keep  # type: ignore[method-assign]

    async def main() -> tuple[list[int], int]:
        async with Runtime(sm.store, resident=1.0, reader="threads") as rt:
            gen = sm.generate(prompt, max_tokens=max_tokens, source=rt, stop_at_eos=False)
            toks = [await gen.__anext__()]
            mx.synchronize()
            base = mx.get_active_memory()
            mx.reset_peak_memory()
            toks += [t async for t in gen]
            return toks, mx.get_peak_memory() - base

    toks, peak = anyio.run(main)
    return toks, peak, [int(c.nbytes) for c in caches[-1]]


#: the work each step waits behind (see _stalled): matrix-vector products over a 64 MiB matrix
STALL_WIDTH, STALL_PRODUCTS = 4096, 8
#: the buffers of two steps' stalls (each step's are allocated as it is handed over)
STALL_BYTES = 2 * (STALL_PRODUCTS + 1) * STALL_WIDTH * 4


def _stalled(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each queued step waits on the stream behind other work (a few matrix-vector products: tens
    of milliseconds, a few KiB of buffers), so the next step is always handed over before this
    one computed, as on a busy machine or behind a slow step."""
    schedule = queued.QueuedSteps._schedule
    a = mx.random.normal((STALL_WIDTH, STALL_WIDTH), key=mx.random.key(0)) / STALL_WIDTH
    mx.eval(a)

    async def stalled(self: queued.QueuedSteps, out: mx.array, *args: Any, **kwargs: Any) -> None:
        v = mx.ones((STALL_WIDTH,))
        for _ in range(STALL_PRODUCTS):
            v = a @ v
        plan = _native.StepPlan([v])  # past MLX's throttle, as the steps go (which mx.async_eval
        while not plan.advance(lend=True)[0]:  # would wait in: a pacing of its own)
            pass
        await schedule(self, out, *args, **kwargs)

    monkeypatch.setattr(queued.QueuedSteps, "_schedule", stalled)


def test_decode_steps_write_their_cache_updates_in_place(tmp_path: pathlib.Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    store_dir, model, _ = model_store(tmp_path, "qwen3_moe", None)
    # positions 2,000 to 2,011: no step grows the caches (they grow 256 positions at a time)
    prompt = [int(t) for t in np.random.default_rng(3).integers(0, 128, 2000)]
    want = reference_generate(model, prompt, max_tokens=12)
    _stalled(monkeypatch)
    monkeypatch.setattr(queued, "PACE_KV_BYTES", 1)  # this tiny model's caches are far below the real bound
    toks, peak, layers = _decode(store_dir, prompt, 12)
    assert toks == want
    # the steps' own small buffers and the stalls', no layer's cache copied
    assert peak < min(layers) + STALL_BYTES, (peak, layers)

    # The control: not paced, the steps copy every layer's cache.
    monkeypatch.setattr(queued, "PACE_KV_BYTES", 10**12)
    toks, copied, _ = _decode(store_dir, prompt, 12)
    assert toks == want
    assert copied >= sum(layers), (copied, layers)


def test_only_layers_with_large_caches_wait_for_the_step_before(tmp_path: pathlib.Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    # Whether the step before has computed a layer yet depends on timing; told it never has, every
    # layer of every decode step after the first waits for it exactly when its cache is large.
    store_dir, model, _ = model_store(tmp_path, "qwen3_moe", None)
    prompt = [int(t) for t in np.random.default_rng(4).integers(0, 128, 600)]
    waited: list[int] = []
    after = queued.QueuedSteps._after

    async def counting(self: queued.QueuedSteps, x: mx.array) -> None:
        waited.append(id(x))
        await after(self, x)

    monkeypatch.setattr(queued.QueuedSteps, "_after", counting)
    monkeypatch.setattr(queued.QueuedSteps, "_computed", staticmethod(lambda x: False))
    try:
        monkeypatch.setattr(queued, "PACE_KV_BYTES", 10**12)  # every cache small: nothing waits
        toks, _, layers = _decode(store_dir, prompt, 6)
        assert waited == []
        monkeypatch.setattr(queued, "PACE_KV_BYTES", min(layers))  # every cache large
        paced, _, _ = _decode(store_dir, prompt, 6)
    finally:
        monkeypatch.undo()
    assert paced == toks == reference_generate(model, prompt, max_tokens=6)
    # the decode steps after the first (five of the six tokens' steps, the first queued ahead of
    # none), each layer once
    assert len(waited) >= 4 * len(layers), (len(waited), len(layers))


def test_the_plan_keeps_no_hold_on_a_cache_update() -> None:
    """Steps of cache updates handed over through StepPlan, each layer once the step before
    computed it: no update is copied (a copy of a layer's cache is the peak's whole size)."""
    n_layers, positions = 6, 2048
    caches = [mx.zeros((1, 2, positions, 64)) for _ in range(n_layers)]
    mx.eval(caches)
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    h = mx.ones((1, 1, 128))
    last: list[mx.array] = []
    for step in range(8):
        at = 1500 + step
        layers = []
        for i in range(n_layers):
            new = h.reshape(1, 2, 1, 64)
            c = caches[i]
            c[..., at:at + 1, :] = new  # the cache update: a SliceUpdate of the cache's last array
            caches[i] = c
            h = h + 1e-9 * (new @ c[..., :at + 1, :].swapaxes(-1, -2)).sum()
            layers.append(h)
        for i, root in enumerate(layers):
            if last:
                mx.eval(last[i])  # paced, as QueuedSteps._schedule paces a large cache's layer
            plan = _native.StepPlan([root])
            while not plan.advance(slice_ns=0, lend=True)[0]:
                pass
        last = layers
    mx.eval(h)
    _native.wait_for_graph_releases()
    assert mx.get_peak_memory() - base < caches[0].nbytes, (mx.get_peak_memory() - base, caches[0].nbytes)
