"""A step on a GPU stream handed to MLX by the native StepPlan lets MLX reuse its buffers as MLX's
own eval of the step does (skipped where MLX has no GPU)."""

from __future__ import annotations

import mlx.core as mx
import pytest

from asyncside import _native

pytestmark = pytest.mark.skipif(not mx.is_available(mx.gpu), reason="needs an MLX GPU device (CUDA or Metal)")

N = 1 << 22  # a float32 buffer of 16 MiB a node
DEPTH = 24


def chain(x: mx.array) -> mx.array:
    """Elementwise ops in a row: each may write into its input's buffer once nothing else holds it."""
    for i in range(DEPTH):
        x = (x + float(i)) * 1.0001 if i % 2 else mx.abs(x) - 0.5
    return mx.sum(x)


def peak_of(hand_over) -> int:  # type: ignore[no-untyped-def]
    with mx.stream(mx.gpu):
        x = mx.random.normal((N,))
        mx.eval(x)
        mx.synchronize()
        mx.clear_cache()
        mx.reset_peak_memory()
        before = mx.get_active_memory()
        y = chain(x)
        hand_over(y)
        mx.eval(y)
        mx.synchronize()
        value = y.item()
        assert value == value  # computed, not NaN
        return mx.get_peak_memory() - before


def by_plan(y: mx.array) -> None:
    plan = _native.StepPlan([y])
    assert plan.size >= DEPTH
    done, wait_on = plan.advance()
    assert done and wait_on is None and plan.chunks == 1


def test_a_gpu_step_through_the_plan_takes_no_more_memory_than_mlxs_own_eval() -> None:
    own = peak_of(mx.async_eval)
    planned = peak_of(by_plan)
    # MLX's own eval reuses buffers along the chain: a few nodes' worth at a time. Listing every
    # node (or holding them while MLX encodes) kept each node's 16 MiB: DEPTH of them.
    assert own < 6 * 4 * N
    assert planned <= own + 2 * 4 * N, (planned, own)


def test_a_gpu_step_through_the_plan_computes_what_mlxs_eval_computes() -> None:
    with mx.stream(mx.gpu):
        x = mx.random.normal((1 << 12,), key=mx.random.key(3))
        a, b = chain(x), chain(x)
        by_plan(a)
        mx.eval(b)
        assert a.item() == b.item()
