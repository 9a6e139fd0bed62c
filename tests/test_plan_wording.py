"""What the runtime's plan, the ranks demo's title and bench policy say of the pools' share: what
the pools hold, and where the plan raised the rows above what was asked, what was asked and why.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest
from _cli_support import run_cli

from asyncside import ExpertStore, memory
from asyncside.runtime import _plan

QUICK_POLICY = ("bench", "policy", "--presets", "low", "--tokens", "16", "--layers", "2", "--shapes", "16x2")


def _plan_of(store_dir: pathlib.Path, **args: Any) -> _plan.MemoryPlan:
    store = ExpertStore.open(store_dir)
    plan = {"resident": 0.25, "pinned": None, "side_rows": None, "min_side_rows": None, "memory": None,
            "direct": None, "host_tier": 0, "tier_possible": False, **args}
    return _plan.plan_memory(store, list(store.layers), **plan)  # type: ignore[arg-type]


@pytest.mark.parametrize(("args", "raised", "said"), [
    ({"resident": 0.05}, {"asked": 0.05, "asked_by": "resident", "rows": 4, "why": "top-k"},
     "(12% of experts, 8 rows in 2 layers; resident 0.05 asked, raised to 4 rows a layer (top-k))"),
    ({"resident": 0.0}, {"asked": 0.0, "asked_by": "resident", "rows": 4, "why": "top-k"},
     "(12% of experts, 8 rows in 2 layers; resident 0 asked, raised to 4 rows a layer (top-k))"),
    ({"resident": 0.05, "side_rows": 6}, {"asked": 0.05, "asked_by": "resident", "rows": 6, "why": "side_rows=6"},
     "(19% of experts, 12 rows in 2 layers; resident 0.05 asked, raised to 6 rows a layer (side_rows=6))"),
    ({"resident": 0.05, "min_side_rows": 5}, {"asked": 0.05, "asked_by": "resident", "rows": 5,
                                              "why": "min_side_rows=5"},
     "(16% of experts, 10 rows in 2 layers; resident 0.05 asked, raised to 5 rows a layer (min_side_rows=5))"),
    ({"resident": 0.5}, None, "(50% of experts, 32 rows in 2 layers; resident 0.5)"),
])
def test_the_plan_says_what_the_pools_hold(args: dict[str, Any], raised: dict[str, Any] | None, said: str,
                                           quick_store: pathlib.Path) -> None:
    """``demo --resident 0.05`` on a top-4 model of 32 experts a layer printed "pools 0.2 MiB
    (resident 0.05, 8 rows in 2 layers)": the plan raises the rows to the model's top-k, and the
    pools held 12%. The plan line says what they hold and, where more than asked, what was asked
    and why; ``Runtime.memory`` keeps ``resident`` (what was asked) and gains what they hold."""
    plan = _plan_of(quick_store, **args)
    assert f" {said} of a " in plan.describe().splitlines()[1], plan.describe()
    figures = plan.as_dict()
    assert figures["resident"] == args["resident"] and figures["rows_raised"] == raised, figures
    assert figures["pools_fraction"] == sum(plan.rows.values()) / 64, figures
    json.dumps(figures)


def test_the_plan_says_a_fraction_chosen_for_the_budget(quick_store: pathlib.Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """``resident="auto"`` under a budget that leaves less than the least pools: the fraction the
    plan chose is raised to the model's top-k, and the line says it was chosen, not asked."""
    least = _plan_of(quick_store, resident=0.0).pool_bytes
    tight = memory.MemoryBudget(_plan.plan_headroom(ExpertStore.open(quick_store)) + least, "a test limit")
    monkeypatch.setattr(memory, "available_memory", lambda: tight)
    plan = _plan_of(quick_store, resident="auto")
    assert plan.rows_raised == {"asked": 0.0, "asked_by": "auto", "rows": 4, "why": "top-k"}, plan.rows_raised
    assert "; resident 0 chosen for the budget, raised to 4 rows a layer (top-k))" in plan.describe(), plan.describe()


def test_the_ranks_title_says_what_the_pools_hold(quick_store: pathlib.Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """``demo --ranks 2 --resident 0.05`` titled its table "5% of experts in pools" while the
    pools held 12% (the rows raised to the model's top-k): the title says it as the one-process
    demo's does."""
    from asyncside import cli
    from asyncside.distributed import demo

    argv = ["demo", "--model", str(quick_store), "--ranks", "2", "--resident", "0.05", "--tokens", "2", "--json"]
    assert cli.main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["pools_fraction"] == 0.125 and result["resident_fraction"] == 0.05, result
    assert result["rows_raised"] == {"asked": 0.05, "asked_by": "--resident", "rows": 4, "why": "top-k"}, result
    assert demo.title(result) == (
        f"asyncside demo --ranks 2 — split {result['split']}, 12% of experts in pools (4/32 rows per layer; 5% asked, "
        f"raised to 4 rows a layer (top-k)), {result['transport']}"), demo.title(result)


@pytest.mark.parametrize("given", ["0", "0%", "0.5,0"])
def test_bench_policy_says_why_a_replay_needs_rows(given: str, capsys: pytest.CaptureFixture[str]) -> None:
    """``bench policy --fractions 0`` was refused "expected fractions in (0, 1]" where demo and
    bench generate take 0. A replayed cache holds at least its trace's top-k rows, so a row
    labelled 0% would misstate it: the refusal says so and how to ask for the least cache."""
    rc, err = run_cli(capsys, *QUICK_POLICY, "--fractions", given)
    last = err.strip().splitlines()[-1]
    assert rc == 2 and "Traceback" not in err, err
    assert last.startswith("asyncside bench policy: error: argument --fractions: expected fractions in (0, 1]"), err
    assert "a replay needs a cache, and each layer's holds at least its trace's top-k rows" in last, err
    assert "give top_k/experts of the shape, such as 0.0938 for 64x6" in last, err
    rc, err = run_cli(capsys, *QUICK_POLICY, "--fractions", "-0.1")
    assert rc == 2 and err.strip().endswith("expected fractions in (0, 1] such as 0.25 or 25%, got '-0.1'"), err


def test_top_k_over_experts_replays_the_least_cache(capsys: pytest.CaptureFixture[str]) -> None:
    """The fraction the refusal points to, top_k/experts, replays the least cache: top-k rows."""
    from asyncside import cli

    assert cli.main([*QUICK_POLICY, "--fractions", "0.125", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert [(r["fraction"], r["rows"]) for r in result["rows"]] == [(0.125, 2)], result["rows"]
