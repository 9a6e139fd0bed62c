"""Queued steps over fewer dynamic rows than the model routes a token to.

``Runtime(store, side_rows=2)`` on a top-4 model (or ``min_side_rows`` below the top-k with a
small ``resident``, or ``pinned`` experts beside few side rows) leaves each layer fewer lendable
rows than one token's experts. An unsorted cut of such a step is whole tokens, and no whole token
fit: every decode step, and every prompt too short for mlx-lm's sorted switch, went per layer
silently (no fallback counted under the default mode). They now run queued, their pairs sorted by
expert and cut into parts of at most the lendable rows: tokens and logits exact against mlx-lm with
every expert in memory, and a step cancelled or failed mid-way leaves no row taken.
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any

import anyio
import mlx.core as mx
import numpy as np
import pytest
from _fault_helpers import model_store
from mlx_lm.models.cache import make_prompt_cache

from asyncside.audit import audit_problems
from asyncside.bridge import completed
from asyncside.errors import FillError
from asyncside.models import ForwardOptions, load_streaming_model, reference_generate
from asyncside.models.forward import StepMode
from asyncside.runtime import Runtime

QUEUED = ForwardOptions(mode=StepMode.QUEUED)
NEW_TOKENS = 6


@pytest.fixture
def _on_mlxs_cpu() -> Any:
    """For the tests that pin the CPU path (``on_the_cpu``): its part counters, logits bitwise equal
    to mlx-lm's, a cancel landing mid-generation, a failed read of a routed expert. On a GPU
    machine they run on MLX's CPU device: there hits resolve on the device (other counters and
    reads), a six-token generation ends before the cancel, and a sorted part's matmuls round
    otherwise than mlx-lm's whole gather (logits within 2e-6 on an H100). The other tests run on
    the default device (on an H100: tokens equal mlx-lm's, no step per layer)."""
    device = mx.default_device()
    mx.set_default_device(mx.cpu)
    try:
        yield
    finally:
        mx.set_default_device(device)


on_the_cpu = pytest.mark.usefixtures("_on_mlxs_cpu")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[pathlib.Path, Any, list[int]]:
    """A tiny qwen3_moe store (top-4 of 16 experts, two MoE layers), its model and a prompt."""
    return model_store(tmp_path_factory.mktemp("side_rows"), "qwen3_moe", None)


def _delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before.get(k, 0) for k in after}


@pytest.mark.parametrize("rows", [dict(side_rows=1), dict(side_rows=2), dict(side_rows=3),
                                  dict(resident=0.0, min_side_rows=2), dict(resident=0.5, side_rows=2)],
                         ids=["side_rows=1", "side_rows=2", "side_rows=3", "min_side_rows=2", "resident-half-side_rows=2"])
def test_decode_below_top_k_side_rows_runs_queued_and_exact(tiny: tuple[pathlib.Path, Any, list[int]],
                                                            rows: dict[str, Any]) -> None:
    """Every step of a generation (the prompt's too) runs queued, none per layer; the tokens are
    mlx-lm's with every expert in memory and the ledgers audit clean."""
    store_dir, model, prompt = tiny
    ref = reference_generate(model, prompt, max_tokens=NEW_TOKENS)
    sm = load_streaming_model(store_dir, completed=completed)  # the default mode: a fallback is not counted
    k = int(sm.forward.walk.top_k)
    assert k == 4

    async def main() -> tuple[list[int], dict[str, int], dict[int, int]]:
        async with Runtime(sm.store, **rows) as rt:
            side = {i: rt.ledger(i).side_rows for i in sm.moe_layers}
            before = dict(sm.forward.counters)
            tokens = [t async for t in sm.generate(prompt, max_tokens=NEW_TOKENS, source=rt)]
            await rt.quiesce()
            assert audit_problems(rt) == []
            return tokens, _delta(sm.forward.counters, before), side

    tokens, counters, side = anyio.run(main)
    assert max(side.values()) < k, side  # the case: fewer dynamic rows than a token's experts
    assert tokens == ref
    assert counters["queued"] == NEW_TOKENS and counters["per_layer"] == 0, counters
    assert counters["queued_prefill"] == 1 and counters["sorted_parts"] > 0, counters


@on_the_cpu
def test_default_rows_keep_their_token_cut(tiny: tuple[pathlib.Path, Any, list[int]]) -> None:
    """Side rows of at least the top-k: a decode step too large for them still cuts by whole tokens
    (unchanged), never sorted."""
    store_dir, model, prompt = tiny
    ref = reference_generate(model, prompt, max_tokens=NEW_TOKENS)
    sm = load_streaming_model(store_dir, completed=completed, options=QUEUED)

    async def main() -> tuple[list[int], dict[str, int]]:
        async with Runtime(sm.store, resident=0.0) as rt:
            before = dict(sm.forward.counters)
            tokens = [t async for t in sm.generate(prompt, max_tokens=NEW_TOKENS, source=rt)]
            await rt.quiesce()
            assert audit_problems(rt) == []
            return tokens, _delta(sm.forward.counters, before)

    tokens, counters = anyio.run(main)
    assert tokens == ref
    assert counters["queued"] == NEW_TOKENS and counters["token_parts"] > 0 and counters["sorted_parts"] == 0


@on_the_cpu
@pytest.mark.parametrize("slices", ["experts", "pairs"])
def test_a_batch_below_top_k_side_rows_is_bitwise_mlx_lm(tiny: tuple[pathlib.Path, Any, list[int]],
                                                         slices: str) -> None:
    """A batch of four sequences (a server's decode step routes 16 pairs a layer; its prompts 48,
    below mlx-lm's sorted switch) over one side row a layer: each step's logits bitwise equal
    mlx-lm's over the same batch, in expert slices (a GPU's default) or sorted parts of pairs."""
    store_dir, model, _prompt = tiny
    rng = np.random.default_rng(20)
    steps = [rng.integers(0, model.args.vocab_size, (4, 3)), *(rng.integers(0, model.args.vocab_size, (4, 1))
                                                                for _ in range(3))]
    ref_cache = make_prompt_cache(model)
    ref_logits = [model(mx.array(s), cache=ref_cache) for s in steps]
    mx.eval(ref_logits)
    options = dataclasses.replace(QUEUED, staged_switches=False, expert_slices=slices == "experts")
    sm = load_streaming_model(store_dir, completed=completed, options=options)

    async def main() -> tuple[list[mx.array], dict[str, int]]:
        async with Runtime(sm.store, side_rows=1) as rt:
            fwd = sm.forward_with(options)
            before = dict(fwd.counters)
            cache = sm.make_cache()
            logits = [await sm(mx.array(s), cache, source=rt) for s in steps]
            await rt.quiesce()
            assert audit_problems(rt) == []
            return logits, _delta(fwd.counters, before)

    logits, counters = anyio.run(main)
    for i, (a, b) in enumerate(zip(ref_logits, logits)):
        assert mx.array_equal(a, b).item(), f"step {i}: logits differ (max {mx.abs(a - b).max().item()})"
    assert counters["queued"] == len(steps) and counters["per_layer"] == 0 and counters["fallbacks"] == 0, counters
    if slices == "experts":
        assert counters["expert_slices"] > 0, counters
    else:
        assert counters["sorted_parts"] > 0 and counters["expert_slices"] == 0, counters


@on_the_cpu
def test_a_cancelled_generation_below_top_k_leaves_no_row_taken(tiny: tuple[pathlib.Path, Any, list[int]],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Generations cancelled at a checkpoint of a queued step (the prompt's step being scheduled, a
    decode step being scheduled, a decode step being built), then one cancelled between tokens:
    the ledgers audit clean after each, and the runtime's next generation is exact."""
    from asyncside.models import queued as queued_mod

    store_dir, model, prompt = tiny
    ref = reference_generate(model, prompt, max_tokens=NEW_TOKENS)
    sm = load_streaming_model(store_dir, completed=completed, options=QUEUED)
    real = queued_mod.between_layers

    async def main() -> list[int]:
        async with Runtime(sm.store, side_rows=2) as rt:
            for cancel_at in (7, 12, 16):
                left = [cancel_at]  # checkpoints to pass before the cancel
                with anyio.CancelScope() as scope:

                    async def cancelling(scope: anyio.CancelScope = scope, left: list[int] = left) -> None:
                        left[0] -= 1
                        if left[0] == 0:  # mid-step
                            scope.cancel()
                        await real()

                    monkeypatch.setattr(queued_mod, "between_layers", cancelling)
                    async for _t in sm.generate(prompt, max_tokens=NEW_TOKENS, source=rt):
                        pass
                assert scope.cancelled_caught, cancel_at
                monkeypatch.setattr(queued_mod, "between_layers", real)
                with anyio.fail_after(10):
                    await rt.quiesce()
                assert audit_problems(rt) == []
            got: list[int] = []
            with anyio.CancelScope() as scope:
                async for t in sm.generate(prompt, max_tokens=NEW_TOKENS, source=rt):
                    got.append(t)
                    if len(got) == 2:
                        scope.cancel()
            await rt.quiesce()
            assert audit_problems(rt) == [] and got == ref[:2]
            tokens = [t async for t in sm.generate(prompt, max_tokens=NEW_TOKENS, source=rt)]
            await rt.quiesce()
            assert audit_problems(rt) == []
            assert rt.stats()["failed_fills"] == 0
            return tokens

    assert anyio.run(main) == ref
    assert sm.forward_with(QUEUED).counters["per_layer"] == 0


@on_the_cpu
def test_a_failed_read_below_top_k_fails_its_step_and_frees_its_row(tiny: tuple[pathlib.Path, Any, list[int]]) -> None:
    """A record that fails to read inside a sorted queued decode step: the generation raises the
    FillError naming the blob, no row stays taken, and once the disk reads again the tokens are
    exact."""
    from asyncside.testing import FaultyReader

    store_dir, model, prompt = tiny
    ref = reference_generate(model, prompt, max_tokens=NEW_TOKENS)
    sm = load_streaming_model(store_dir, completed=completed, options=QUEUED)
    layer = sm.moe_layers[0]
    spec = sm.store.layer(layer)

    async def main() -> list[int]:
        async with Runtime(sm.store, side_rows=1) as rt:
            faulty = FaultyReader(rt)
            for expert in range(spec.n_experts):  # whichever expert the first step routes
                faulty.fail(layer, expert)
                try:
                    async for _t in sm.generate(prompt, max_tokens=NEW_TOKENS, source=rt):
                        pass
                except FillError as e:
                    assert e.expert == expert and str(spec.path) in str(e), e
                    break
            else:
                pytest.fail("no expert of the layer was routed")
            faulty.clear()
            try:
                await rt.quiesce()
            except FillError:
                pass  # a failure no await took is raised here once
            assert audit_problems(rt) == []
            tokens = [t async for t in sm.generate(prompt, max_tokens=NEW_TOKENS, source=rt)]
            await rt.quiesce()
            assert audit_problems(rt) == []
            return tokens

    assert anyio.run(main) == ref
    assert sm.forward_with(QUEUED).counters["per_layer"] == 0  # the failed step was a queued one
