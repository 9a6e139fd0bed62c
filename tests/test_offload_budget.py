"""`bench offload`'s budget: the default is raised to asyncside's smallest plan (a default that
every asyncside run would be refused at is no default), and a store too small for it is named."""

from __future__ import annotations

import argparse

import pytest

from asyncside.bench import offload

MB = 1_000_000


def _shape(layers: int, *, top_k: int = 8, record_mb: float = 10.0) -> dict:
    """A store of ``layers`` layers of 64 experts, and 50 MB of other weights."""
    expert = int(layers * 64 * record_mb * MB)
    return {"shape": "s", "spec": "s", "store": "/s", "moe_layers": layers, "experts_per_layer": 64, "top_k": top_k, "record_bytes": int(record_mb * MB),
            "store_bytes": expert + 50 * MB, "expert_bytes": expert}


def _args(memory: int | None = None, stores: bool = False) -> argparse.Namespace:
    return argparse.Namespace(memory=memory, store_ratio=4.0, stores=["x"] if stores else None)


def test_least_budget_counts_the_smallest_pools_and_the_headroom() -> None:
    small, wide = offload.least_budget(_shape(8)), offload.least_budget(_shape(8, top_k=2))
    assert small - wide == 8 * 6 * 10 * MB  # six more rows a layer of 10 MB records


def test_the_default_budget_is_raised_to_the_smallest_plan(capsys: pytest.CaptureFixture[str]) -> None:
    big = _shape(64)  # a quarter (10.3 GB) is far above the smallest plan (5.1 GB of pools and more)
    assert offload.choose_budget(_args(), [big], False) == big["store_bytes"] // 4
    roomy = _shape(2)  # a quarter (0.35 GB) is below the smallest plan (160 MB of pools, 256 MiB, ...)
    least = offload.least_budget(roomy)
    assert least > roomy["store_bytes"] / 4
    with pytest.raises(ValueError, match=r"raised to asyncside's smallest plan.*MoE layers are \(--shapes s:\d+\)"):
        offload.choose_budget(_args(), [roomy], False)
    with pytest.raises(ValueError, match=r"a store of more layers"):
        offload.choose_budget(_args(stores=True), [roomy], False)


def test_an_explicit_budget_below_the_plan_is_warned_about(capsys: pytest.CaptureFixture[str]) -> None:
    shape = _shape(64)  # 41 GB: any budget below 10 GB passes the ratio
    assert offload.choose_budget(_args(memory=900 * MB), [shape], True) == 900 * MB
    assert "below asyncside's smallest plan" in capsys.readouterr().err
    assert offload.choose_budget(_args(memory=9000 * MB), [shape], True) == 9000 * MB
    assert "below" not in capsys.readouterr().err
