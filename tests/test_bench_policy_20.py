"""``asyncside bench policy`` as a user comparing policies runs it: MIN's vectorised replay giving
the hits of the per-step one."""

from __future__ import annotations

import numpy as np
import pytest

from asyncside.policy_replay import belady_bypass, belady_no_bypass, replay_trace
from asyncside.routing import RoutingTrace, preset


def _layers_that_differ() -> RoutingTrace:
    """Two sequences; layer 0 routes over 6 of the 32 experts, layer 1 over all, layer 2 a moving set."""
    rng = np.random.default_rng(7)
    steps = 150
    ids = np.zeros((steps, 3, 4), dtype=np.int32)
    for t in range(steps):
        ids[t, 0] = rng.choice(6, 4, replace=False)
        ids[t, 1] = rng.choice(32, 4, replace=False)
        ids[t, 2] = (rng.choice(8, 4, replace=False) + 4 * (t // 20)) % 32
    return RoutingTrace(ids, np.array([70, 80]), 32, {})


@pytest.mark.parametrize("rows", [4, 5, 9, 16, 32, [4, 12, 7]])
def test_min_replay_counts_what_the_per_step_min_counts(rows: int | list[int]) -> None:
    """MIN with and without bypass now replays every layer at once (numpy) instead of a Python loop
    per step; its hits and accesses per layer are those of belady_bypass / belady_no_bypass."""
    for tr in (_layers_that_differ(), preset("high", tokens=200, n_layers=2, n_experts=24, top_k=4, seed=1)):
        per_layer = [rows] * tr.n_layers if isinstance(rows, int) else rows[:tr.n_layers]
        for method, reference in (("min", belady_bypass), ("min-no-bypass", belady_no_bypass)):
            got = [(c.hits, c.accesses) for c in replay_trace(tr, per_layer, method=method)]
            want = [(c.hits, c.accesses) for c in (reference(tr.layer_steps(layer), [], r)
                                                   for layer, r in enumerate(per_layer))]
            assert got == want, (method, rows)
