"""A CPU decode step goes to MLX a layer at a time (QueuedSteps._schedule with the step's layers).

Handed over in slices, a queued step called into MLX every few nodes, and each call cost the
event loop's thread more than those nodes' encoding. Each layer now goes in one call, with a
checkpoint after it; a layer past ``WHOLE_LAYER_NODES`` is still sliced. Tokens stay mlx-lm's,
and a hand-over MLX refuses partway through the step (a later layer's) still fails the step's
awaiter with every fault logged, the runtime closing with its ledgers clean.
"""

from __future__ import annotations

import pathlib
from typing import Any

import anyio
import mlx.core as mx
import pytest
from _fault_helpers import model_store

from asyncside import _native
from asyncside.bridge import completed
from asyncside.models import ForwardOptions, load_streaming_model, reference_generate
from asyncside.models import queued as queued_mod
from asyncside.runtime import Runtime

QUEUED = ForwardOptions(mode="queued")
NEW_TOKENS = 6

pytestmark = pytest.mark.skipif(mx.default_device() != mx.cpu, reason="the layered hand-over is the CPU's")


class _Plans:
    """Stands in for ``_native.StepPlan`` in the queued module: records each plan's size and the
    slices its advances were given, per step (``step()`` starts one); ``refuse`` raises MLX's
    error when the given plan of a step is made."""

    def __init__(self) -> None:
        self.steps: list[list[dict[str, Any]]] = []
        self.refuse: tuple[int, int] | None = None  # (step, plan index within it)

    def step(self) -> None:
        self.steps.append([])

    def __call__(self, roots: list[mx.array]) -> Any:
        if not self.steps:
            self.step()
        k = len(self.steps[-1])
        if self.refuse == (len(self.steps) - 1, k):
            raise RuntimeError("[eval] cannot schedule this layer (simulated)")
        real = _native.StepPlan(roots)
        record: dict[str, Any] = {"size": real.size, "slices": []}
        self.steps[-1].append(record)

        class Plan:
            size = real.size

            @property
            def scheduled(self) -> int:
                return int(real.scheduled)

            def advance(self, **kw: Any) -> Any:
                record["slices"].append(kw.get("slice_ns", 0))
                return real.advance(**kw)

        return Plan()


def _setup(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, list[int], list[int], _Plans]:
    store_dir, model, prompt = model_store(tmp_path, "qwen3_moe", None)
    sm = load_streaming_model(store_dir, completed=completed, options=QUEUED)
    ref = reference_generate(model, prompt, max_tokens=NEW_TOKENS)
    plans = _Plans()
    native = type("N", (), {k: getattr(_native, k) for k in dir(_native) if not k.startswith("__")})
    native.StepPlan = plans  # type: ignore[attr-defined]
    monkeypatch.setattr(queued_mod, "_native", native)
    real_forward = queued_mod.QueuedSteps.forward

    async def forward(self: Any, *args: Any, **kw: Any) -> Any:
        plans.step()
        return await real_forward(self, *args, **kw)

    monkeypatch.setattr(queued_mod.QueuedSteps, "forward", forward)
    return sm, prompt, ref, plans


def _generate(sm: Any, prompt: list[int]) -> tuple[list[int], bool]:
    async def main() -> tuple[list[int], bool]:
        async with Runtime(sm.store, resident=0.0, min_side_rows=2 * int(sm.forward.walk.top_k)) as rt:
            tokens = [t async for t in sm.generate(prompt, max_tokens=NEW_TOKENS, source=rt)]
            await rt.quiesce()
            return tokens, all(r.ok for r in rt.audit().values())

    return anyio.run(main)


def test_a_cpu_decode_step_goes_to_mlx_one_layer_per_call(tmp_path: pathlib.Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    sm, prompt, ref, plans = _setup(tmp_path, monkeypatch)
    tokens, audit_ok = _generate(sm, prompt)
    assert tokens == ref and audit_ok
    n_layers = len(sm.forward.walk.layers)
    decode = [s for s in plans.steps if s][1:]  # past the prompt's steps: one token per step
    assert len(decode) >= NEW_TOKENS - 1
    for step in decode:
        # a plan per layer, then the logits and the draw; each in one call, no slice
        assert len(step) == n_layers + 1, [p["size"] for p in step]
        assert all(p["slices"] == [0] for p in step), step
        assert all(p["size"] <= queued_mod.WHOLE_LAYER_NODES for p in step)


def test_a_layer_past_the_bound_is_still_handed_over_in_slices(tmp_path: pathlib.Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    sm, prompt, ref, plans = _setup(tmp_path, monkeypatch)
    monkeypatch.setattr(queued_mod, "WHOLE_LAYER_NODES", 1)
    tokens, audit_ok = _generate(sm, prompt)
    assert tokens == ref and audit_ok
    decode = [s for s in plans.steps if s][1:]
    assert decode and all(p["slices"] and all(s == queued_mod.SCHEDULE_SLICE_NS for s in p["slices"])
                          for step in decode for p in step)


def test_a_later_layer_mlx_refuses_fails_the_step_and_the_runtime_still_closes(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The step's first layers are queued (their faults running on the stream) when MLX refuses
    the third layer's hand-over: the step's awaiter gets MLX's error, the stream runs out what was
    queued, and the runtime's ledgers audit clean; the next generation is exact."""
    sm, prompt, ref, plans = _setup(tmp_path, monkeypatch)
    k = int(sm.forward.walk.top_k)

    async def main() -> None:
        with anyio.fail_after(60):
            async with Runtime(sm.store, resident=0.0, min_side_rows=2 * k) as rt:
                tokens: list[int] = []
                with pytest.raises(RuntimeError, match="cannot schedule this layer"):
                    async for t in sm.generate(prompt, max_tokens=NEW_TOKENS, source=rt):
                        tokens.append(t)
                        if len(tokens) == 2:  # decoding: MLX refuses a later layer of the next step
                            plans.refuse = (len(plans.steps), 2)
                assert tokens == ref[:2]
                refused = plans.steps[plans.refuse[0]] if plans.refuse else []
                assert len(refused) == 2 and all(p["slices"] == [0] for p in refused)  # two layers were queued
                plans.refuse = None
                await rt.quiesce()
                assert not rt.queued_active
                reports = rt.audit()
                assert all(r.ok for r in reports.values()), {l: r.problems for l, r in reports.items()}
                again = [t async for t in sm.generate(prompt, max_tokens=NEW_TOKENS, source=rt)]
                assert again == ref

    anyio.run(main)
