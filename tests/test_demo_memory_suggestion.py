"""``asyncside demo --memory``: the memory= a refusal names is accepted when followed.

The all-resident reference runs between the plan made before it (which refuses early) and the
streaming run's own plan; what it leaves in the process (its model's weights, freed into the heap,
and its code) must be counted before it runs, or the figure a refusal names is refused again once
the reference has run. The process's size is stood in (``_plan._resident_now`` and VmRSS), never
the pytest process's own."""
from __future__ import annotations

import dataclasses
import json
import pathlib
import re
from typing import Any

import pytest

import asyncside.memory as memory
import asyncside.models as models
from asyncside.cli import main
from asyncside.runtime import _plan

MiB = 1 << 20
#: what the stood-in process holds before the demo plans
BASE = 100 * MiB
#: what the reference's code (its modules, MLX's kernels) leaves beside its weights: less than the
#: margin a refusal's memory= adds, more than the margin less this model's weights
CODE = 10 * MiB


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A store whose all-resident model is a little smaller than a refusal's margin: the reference
    fits the memory= named without it, and takes the process past that figure."""
    from asyncside.bench import generate as bench
    from asyncside.models.embedded import ensure_embedded_default

    quick = bench._quick_spec()
    spec = dataclasses.replace(quick, config={**quick.config, "num_experts": 128, "moe_intermediate_size": 256})
    return ensure_embedded_default(tmp_path_factory.mktemp("mid"), spec=spec, progress=False)[1]


def _model_bytes(store_dir: pathlib.Path) -> int:
    from asyncside.store import ExpertStore

    store = ExpertStore.open(store_dir)
    return sum(store.layer(i).blob_bytes for i in store.layers) + sum(
        f.stat().st_size for f in store_dir.glob("*.safetensors"))


@pytest.fixture
def process(store_dir: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The stood-in process: BASE bytes, and once the all-resident reference model has loaded,
    its weights and CODE more (what the reference leaves until the streaming run plans)."""
    state: dict[str, Any] = {"rss": BASE, "references": 0}
    real_proc = memory.proc_self_bytes
    real_load = models.load_reference_model

    def proc_self_bytes(name: str, field: str) -> int:
        return int(state["rss"]) if (name, field) == ("status", "VmRSS") else real_proc(name, field)

    def load_reference_model(path: Any) -> Any:
        state["references"] += 1
        state["rss"] += _model_bytes(store_dir) + CODE
        return real_load(path)

    monkeypatch.setattr(_plan, "_resident_now", lambda: int(state["rss"]))
    monkeypatch.setattr(memory, "proc_self_bytes", proc_self_bytes)
    monkeypatch.setattr(models, "load_reference_model", load_reference_model)
    monkeypatch.delenv("ASYNCSIDE_DIRECT", raising=False)
    return state


def _demo(store_dir: pathlib.Path, budget: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(["demo", "--model", str(store_dir), "--tokens", "2", "--memory", budget, "--json"])
    out, err = capsys.readouterr()
    return rc, out, err


def test_the_memory_a_refusal_names_is_accepted_after_the_reference(
        store_dir: pathlib.Path, process: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    """``demo --memory`` just too small names a memory=; followed, the demo planned the all-resident
    reference (the model fits the margin the figure adds) and was refused again after it, the
    process having grown by the model's weights and the reference's code."""
    model = _model_bytes(store_dir)
    assert model + CODE > _plan.NEED_MARGIN > model and CODE < _plan.NEED_MARGIN  # the case found
    from asyncside import ExpertStore

    too_small = BASE + _plan.estimate_headroom(ExpertStore.open(store_dir), direct=False).total  # the least
    rc, _out, err = _demo(store_dir, str(too_small), capsys)
    assert rc == 2 and "the pools need" in err, err
    wanted = re.search(r"memory=([0-9.]+) MiB or more", err)
    assert wanted is not None, err
    assert process["references"] == 0  # refused before the reference ran
    process["rss"] = BASE  # a later run of the same command
    rc, out, err = _demo(store_dir, f"{wanted.group(1)}M", capsys)
    assert rc == 0, err
    res = json.loads(out)
    assert res["tokens_identical"] is True and res["audit_clean"] is True
    assert res["memory"]["budget_bytes"] > 0


def test_an_all_resident_reference_is_counted_in_the_plan_made_before_it(
        store_dir: pathlib.Path, process: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    """Where the budget holds the all-resident reference, the plan made before it counts what the
    reference leaves, and the streaming run's plan after it (the process grown by that) fits."""
    from asyncside import ExpertStore

    store = ExpertStore.open(store_dir)
    model = _model_bytes(store_dir)
    pools = memory.pool_bytes(store, 0.0, min_rows=_plan.min_rows(store))
    roomy = BASE + model + pools + _plan.plan_headroom(store) + _plan.NEED_MARGIN + MiB
    rc, out, err = _demo(store_dir, str(roomy), capsys)
    assert rc == 0, err
    assert json.loads(out)["reference"] == "all-resident" and process["references"] == 1


def test_a_refusal_counts_what_the_process_will_take_before_the_runtime_enters(
        store_dir: pathlib.Path, process: dict[str, Any]) -> None:
    """``Runtime.plan_now(grows_by=N)``: a refusal's memory= includes the N bytes, and that figure,
    followed once the process holds them, is accepted."""
    from asyncside import AsyncsideError, ExpertStore
    from asyncside.runtime import Runtime

    store = ExpertStore.open(store_dir)
    grows = 40 * MiB
    rt = Runtime(store, resident="auto", memory=BASE + _plan.plan_headroom(store))
    with pytest.raises(AsyncsideError) as info:
        rt.plan_now(grows_by=grows)
    text = str(info.value)
    assert "it will take before the runtime enters" in text, text
    wanted = re.search(r"memory=([0-9.]+) MiB or more", text)
    assert wanted is not None, text
    process["rss"] = BASE + grows
    plan = Runtime(store, resident="auto", memory=f"{wanted.group(1)}M").plan_now()
    assert plan.budget >= plan.pool_bytes + plan.headroom_bytes


def test_bench_offload_smallest_plan_is_accepted_by_a_run(store_dir: pathlib.Path, process: dict[str, Any],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """``bench offload`` names asyncside's smallest plan ("about N MB") as a budget to try; a run's
    process holds a few MiB more than the baseline and the non-expert weights when it plans (its
    tokenizer, what loading leaves: less than a refusal's margin), and the figure named fit no
    such run."""
    from asyncside import ExpertStore
    from asyncside.bench import offload
    from asyncside.runtime import Runtime

    store = ExpertStore.open(store_dir)
    first = store.layer(min(store.layers))
    model = _model_bytes(store_dir)
    expert = sum(store.layer(i).blob_bytes for i in store.layers)
    shape = {"moe_layers": len(store.layers), "top_k": _plan.min_rows(store), "record_bytes": _plan.record_bytes(first),
             "store_bytes": model, "expert_bytes": expert, "process_bytes": BASE}
    least = offload.least_budget(shape)
    process["rss"] = BASE + (model - expert) + _plan.NEED_MARGIN // 2  # the run's process when it plans
    plan = Runtime(store, resident="auto", memory=least).plan_now()
    assert plan.budget >= plan.pool_bytes + plan.headroom_bytes
