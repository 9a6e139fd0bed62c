"""Unseen inputs, round 13: a new user's own routing traces, model shapes and memory limits, as
the Python API and the command line take them: layer indices of another type than an int, a budget
of a few KiB. What is refused is one line naming the argument and what was expected; a size is
shown as it was given, never as nothing."""

from __future__ import annotations

import pathlib
import re
from typing import Any

import anyio
import numpy as np
import pytest

from asyncside import ExpertStore, Runtime
from asyncside.cli import main as cli_main
from asyncside.errors import AsyncsideError
from asyncside.runtime import PlanArgumentError
from tests._cli_support import run_cli


@pytest.mark.parametrize(("kwargs", "said"), [
    ({"layers": [True]}, "layers: expected layer indices (integers), got True"),
    ({"layers": [0, 1.0]}, "layers: expected layer indices (integers), got 1.0"),
    ({"layers": ["0"]}, "layers: expected layer indices (integers), got '0'"),
    ({"pinned": {True: [1]}}, "pinned: expected layer indices (integers), got True"),
])
def test_a_layer_index_that_is_no_integer_is_refused_when_made(quick_store: pathlib.Path, kwargs: dict[str, Any],
                                                               said: str) -> None:
    """``Runtime(store, layers=[True])`` streamed layer 1 (True == 1) under a key of True, and
    ``layers=[1.0]`` ended, once entered, in the native fault table's TypeError, which names no
    argument the user wrote. A NumPy integer is an index, as an int is."""
    with pytest.raises(PlanArgumentError) as info:
        Runtime(ExpertStore.open(quick_store), **kwargs)
    assert str(info.value) == said

    async def go() -> list[int]:
        async with Runtime(ExpertStore.open(quick_store), layers=[np.int64(1)], resident=0.5) as rt:
            return list(rt._s.layers)

    layers = anyio.run(go)
    assert layers == [1] and type(layers[0]) is int


@pytest.mark.parametrize(("memory", "shown"), [("4K", "memory=4.0 KiB"), ("20KiB", "memory=20.0 KiB"),
                                               (5000, "memory=4.9 KiB")])
def test_a_budget_of_a_few_kib_is_shown_as_given(quick_store: pathlib.Path, memory: Any, shown: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """``Runtime(memory="4K")`` (and ``demo --memory 4K``) was refused with "memory=0.0 MiB", as if
    no budget had been given; the size given is shown in KiB, and the refusal still names the
    least memory= that fits."""
    async def go() -> None:
        async with Runtime(ExpertStore.open(quick_store), memory=memory):
            pass

    with pytest.raises(AsyncsideError) as info:
        anyio.run(go)
    assert f"({shown}, " in str(info.value) and "memory=0.0 MiB" not in str(info.value)
    assert "or more)" in str(info.value)
    rc, err = run_cli(capsys, "demo", "--model", str(quick_store), "--tokens", "2", "--reference", "none",
                      "--memory", str(memory))
    assert rc == 2 and len(err.strip().splitlines()) == 1 and f"({shown}, " in err, err


def test_counts_computed_with_numpy_are_taken_as_ints(quick_store: pathlib.Path) -> None:
    """``Runtime(store, side_rows=np.int64(4))`` (a count from ``np.ceil(...).astype(int)``) was
    refused as "side_rows: expected a number of rows >= 0, got np.int64(4)", which it is; so were
    ``min_side_rows``, ``host_tier`` and ``read_window``, though ``memory`` took one."""
    async def go() -> tuple[dict[int, int], Any]:
        async with Runtime(ExpertStore.open(quick_store), resident=0.5, side_rows=np.int64(4),
                           min_side_rows=np.int32(4), host_tier=np.int64(0), read_window=np.int64(2)) as rt:
            assert rt.plan is not None
            return dict(rt.plan.rows), rt.plan.host_tier_bytes

    rows, tier = anyio.run(go)
    assert set(rows.values()) == {16} and tier == 0
    with pytest.raises(PlanArgumentError, match=r"side_rows: expected a number of rows >= 0, got 4.0"):
        Runtime(ExpertStore.open(quick_store), side_rows=4.0)  # type: ignore[arg-type]


@pytest.mark.parametrize(("ids", "said"), [
    ([1.7], "pinned[0]: pinned experts must be integers in [0, 32), got 1.7 (float)"),
    ([True], "pinned[0]: pinned experts must be integers in [0, 32), got True (bool)"),
    ("12", "pinned[0]: expected a list of expert ids, got '12'"),
    (5, "pinned[0]: expected a list of expert ids, got 5"),
    ([40], "pinned[0]: pinned expert 40 out of range [0, 32)"),
    ([5, 2, 5], "pinned[0]: expert 5 is listed twice"),
])
def test_pinned_ids_that_are_no_expert_ids_are_refused_when_made(quick_store: pathlib.Path, ids: Any,
                                                                 said: str) -> None:
    """The plan read pinned ids through int(): ``pinned={0: [1.7]}`` pinned expert 1,
    ``{0: "12"}`` experts 1 and 2, ``{0: [True]}`` expert 1, without a word; ``{0: 5}`` ended in
    "'int' object is not iterable" once entered, and ``{0: [5, 2, 5]}`` in the ledger's "resident
    expert 5 is listed twice", naming neither pinned nor the layer."""
    with pytest.raises(PlanArgumentError) as info:
        Runtime(ExpertStore.open(quick_store), pinned={0: ids})
    assert str(info.value) == said
    with pytest.raises(PlanArgumentError, match=r"pinned: expected a mapping of layer to expert ids"):
        Runtime(ExpertStore.open(quick_store), pinned=[[1]])  # type: ignore[arg-type]

    async def go() -> list[int]:
        async with Runtime(ExpertStore.open(quick_store), pinned={0: np.array([3, 1]), 1: (2,)}) as rt:
            return sorted(rt._s.layers[0].ledger.resident)

    assert anyio.run(go) == [1, 3]


def test_a_synthetic_trace_takes_numpy_counts_and_refuses_what_no_number_is() -> None:
    """``synthetic(tokens=np.int64(50), ...)`` (a shape read off an array) was refused as "tokens
    must be a positive int, got np.int64(50)", though map_to and widen took one; ``skew=inf``
    ended in "[meta]: not JSON-able", an argument never given, and ``overlap="0.5"`` in a
    comparison's TypeError."""
    from asyncside.routing import preset, synthetic

    args = {"tokens": 12, "n_layers": 2, "n_experts": 8, "top_k": 2, "skew": 0.5, "overlap": 0.3, "layer_corr": 0.2}
    mine = synthetic(**{**args, "tokens": np.int64(12), "n_experts": np.int32(8), "top_k": np.int64(2)})
    assert np.array_equal(mine.ids, synthetic(**args).ids) and mine.meta["generator"]["tokens"] == 12
    assert preset("low", tokens=np.int64(40), n_layers=np.int64(2)).ids.shape == (40, 2, 6)
    for name, value, said in (("skew", float("inf"), "skew must be a finite number >= 0, got inf"),
                              ("skew", float("nan"), "skew must be a finite number >= 0, got nan"),
                              ("overlap", "0.5", "overlap must be in [0, 1], got '0.5'"),
                              ("layer_corr", None, "layer_corr must be in [0, 1], got None"),
                              ("tokens", True, "tokens must be a positive int, got True")):
        with pytest.raises(ValueError) as info:
            synthetic(**{**args, name: value})
        assert str(info.value) == f"synthetic: {said}"


@pytest.mark.parametrize("n_experts", [(1 << 20) + 1, 10**12])
def test_mapping_onto_more_experts_than_a_trace_holds_is_refused_first(n_experts: int) -> None:
    """``trace.map_to(3, 10**12, 2)`` set out to draw a permutation of a trillion ids (memory), and
    one past the limit was drawn, mapped and then refused as ``<in memory> [n_experts]``."""
    from asyncside.routing import RoutingTrace

    trace = RoutingTrace(np.array([[[0, 1]], [[1, 2]]]), np.array([2]), 4)
    with pytest.raises(ValueError) as info:
        trace.map_to(3, n_experts, 2)
    assert str(info.value) == f"map_to: n_experts must be at most {1 << 20} (a trace's limit), got {n_experts}"
    assert trace.map_to(3, 1 << 20, 2).n_experts == 1 << 20


def test_a_top_1_models_smallest_pools_are_one_row_a_layer(tmp_path: pathlib.Path) -> None:
    """A top-1 model under a budget no pools fit was told "these are the smallest pools (1 rows a
    layer, the model's top-k)"; a side_rows past a one-expert layer that pins it, "at most 0
    dynamic rows a layer (layer 0 pins 1 of its 1 experts ...)"."""
    from asyncside.testing import random_layers

    meta = {"asyncside_model": {"top_k": {"0": 1, "1": 1}}}
    store = ExpertStore.create(tmp_path / "top1", random_layers(2, 5), metadata=meta)

    async def go() -> None:
        async with Runtime(store, resident="auto", memory="4K"):
            pass

    with pytest.raises(AsyncsideError) as info:
        anyio.run(go)
    assert "these are the smallest pools (1 row a layer, the model's top-k)" in str(info.value)
    one = ExpertStore.create(tmp_path / "one", random_layers(1, 2))
    with pytest.raises(PlanArgumentError) as refused:
        Runtime(one, pinned={0: [0]}, side_rows=2)
    assert str(refused.value) == ("side_rows=2: at most 1 dynamic row a layer (layer 0 pins 1 of its 2 experts, "
                                  "which leaves 1 to stream through its dynamic rows)")
    single = ExpertStore.create(tmp_path / "single", random_layers(1, 1))
    with pytest.raises(PlanArgumentError) as refused:
        Runtime(single, side_rows=2)
    assert "at most 1 dynamic row a layer (this model's layers have 1 expert each" in str(refused.value)


@pytest.mark.parametrize(("given", "error", "said"), [
    ({"verify": "no"}, TypeError, "verify: expected True or False, got 'no'"),
    ({"side_rows": -1}, PlanArgumentError, "side_rows: expected a number of rows >= 0, got -1"),
    ({"min_side_rows": 1.5}, PlanArgumentError, "min_side_rows: expected a number of rows >= 0"),
    ({"layers": [True]}, PlanArgumentError, "layers: expected layer indices (integers), got True"),
    ({"pinned": {0: "12"}}, PlanArgumentError, "pinned[0]: expected a list of expert ids, got '12'"),
    ({"host_tier": "lots"}, ValueError, "host tier 'lots': expected a size"),
    ({"read_window": 99}, ValueError, "read_window: expected None"),
    ({"direct": "yes"}, TypeError, "direct: expected None (the plan chooses), True or False, got 'yes'"),
    ({"rows_profile": {"0": [1]}}, TypeError, "rows_profile: expected a RoutingTrace or the path of one (.npz), got "
                                              "dict"),
    ({"rows_profile": "mine.npz", "side_rows": 2}, PlanArgumentError, "rows_profile splits the dynamic rows between "
                                                                      "layers: it takes no pinned experts"),
    ({"resident": "auto", "pinned": {0: [1]}}, PlanArgumentError, "resident='auto' sizes the pools itself: it "
                                                                  "takes no pinned experts"),
])
def test_load_refuses_what_the_runtime_checks_without_a_store_before_converting(
        quick_store: pathlib.Path, tmp_path: pathlib.Path, given: dict[str, Any], error: type[Exception],
        said: str) -> None:
    """``load(MODEL_DIR, verify="no")`` (or a side_rows, layers, pinned, host_tier, read_window or
    direct the Runtime refuses) converted the model into the cache and loaded it before the Runtime
    refused the argument; only a misspelt name, a policy and a reader were refused first."""
    from asyncside import load

    with pytest.raises(error) as info:
        load(quick_store.parent / "model", cache_dir=tmp_path / "cache", progress=False, **given)
    assert said in str(info.value)
    assert not (tmp_path / "cache" / "stores").exists() or not any((tmp_path / "cache" / "stores").iterdir())


def test_load_hands_the_runtime_the_layers_an_iterator_named(quick_store: pathlib.Path) -> None:
    """load() checks ``layers`` before it loads anything: an iterator it read is handed on as the
    list it held, not as an exhausted iterator (no layer at all)."""
    from asyncside import load

    model, _tok = load(quick_store, progress=False, layers=iter([1, 0]), side_rows=np.int64(4))
    try:
        assert sorted(model.runtime._layer_ids) == [0, 1]
    finally:
        model.close()


def test_a_config_of_a_billion_layers_is_refused_naming_the_field() -> None:
    """A config.json whose ``num_hidden_layers`` was a billion (a typo) held ``bench offload
    --shapes CONFIG`` in the walk over every layer index for its MoE layers until the OOM killer
    ended the process."""
    from asyncside.bench import shapes

    config = {"model_type": "qwen3_moe", "hidden_size": 64, "num_hidden_layers": 10**9, "num_attention_heads": 4,
              "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64, "vocab_size": 300}
    with pytest.raises(shapes.ShapeError) as info:
        shapes.qwen3_moe_config(config)
    assert str(info.value) == f"config.json: num_hidden_layers must be at most {1 << 20}, got {10**9}"
    assert shapes.qwen3_moe_config({**config, "num_hidden_layers": 3})[0]["num_hidden_layers"] == 3


@pytest.mark.parametrize("layer", [True, 1.0, "1", None])
def test_a_layer_that_is_no_index_is_refused_by_the_runtimes_calls(quick_store: pathlib.Path, layer: Any) -> None:
    """``await rt.ensure(True, ids)`` and ``rt.prefetch(1.0, ids)`` filled layer 1 (a bool and a
    float equal to an index hash as it does), and ``rt.ensure("1", ids)`` was refused as "layer 1
    is not streamed by this runtime (layers: [0, 1])", a list that holds it. A NumPy integer is an
    index."""
    async def go() -> None:
        async with Runtime(ExpertStore.open(quick_store), resident=0.25) as rt:
            for call in (lambda: rt.prefetch(layer, [3]), lambda: rt.lookup(layer), lambda: rt.lease(layer, [3])):
                with pytest.raises(AsyncsideError) as info:
                    call()
                assert str(info.value) == f"layer {layer!r}: expected a layer index, an integer (layers: [0, 1])"
            with pytest.raises(AsyncsideError, match="expected a layer index, an integer"):
                await rt.ensure(layer, [3])
            assert rt.ledger(1).row_of(3) is None
            await rt.ensure(np.int64(1), [3])
            assert int(np.array(rt.lookup(1))[3]) >= 0

    anyio.run(go)


def test_convert_names_a_profile_that_is_a_routing_trace_or_no_text(quick_store: pathlib.Path, tmp_path: pathlib.Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """``asyncside convert MODEL STORE --profile mine.npz`` (a routing trace, which a user has at
    hand) ended in "error: 'utf-8' codec can't decode byte 0xff in position 18", naming neither the
    file nor what it is; a directory was said not to exist."""
    from asyncside.routing import preset

    model = quick_store.parent / "model"
    trace = tmp_path / "mine.npz"
    preset("low", tokens=8, n_layers=2, n_experts=32, top_k=4).save(trace)
    latin = tmp_path / "latin.json"
    latin.write_bytes(b'{"format": "caf\xe9"}')
    folder = tmp_path / "profiles"
    folder.mkdir()
    for given, said in ((trace, f"{trace}: a zip archive (a routing trace .npz?), not a routing profile: a profile "
                                "is JSON"),
                        (latin, f"{latin}: routing profile is not UTF-8 JSON text (invalid continuation byte at "
                                "byte 15)"),
                        (folder, f"{folder}: is a directory; --profile takes a routing profile file (JSON)")):
        rc, err = run_cli(capsys, "convert", str(model), str(tmp_path / "store"), "--profile", str(given), "--quiet")
        assert rc == 2 and len(err.strip().splitlines()) == 1 and said in err, err
        assert not (tmp_path / "store").exists()


def test_a_profile_keyed_by_a_padded_index_ranks_that_layer(quick_store: pathlib.Path, tmp_path: pathlib.Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """A routing profile keyed ``"01"`` passed the check, then the converter found no layer "1" in
    it and ranked that layer by id, saying "profile: hottest first"; a profile that did not fit the
    model was refused as ``<profile> [layers]``, naming no file."""
    import json

    from asyncside.models.convert import PROFILE_FORMAT, convert_model

    model = quick_store.parent / "model"
    counts = list(range(32))  # expert 31 the hottest
    profile = tmp_path / "mine.json"
    profile.write_text(json.dumps({"format": PROFILE_FORMAT, "version": 1, "layers": {"01": counts}}))
    store = convert_model(model, tmp_path / "store", profile=profile, progress=False)
    assert store.metadata["asyncside_model"]["expert_rank"]["1"][:3] == [31, 30, 29]
    profile.write_text(json.dumps({"format": PROFILE_FORMAT, "version": 1, "layers": {"01": counts, "1": counts}}))
    rc, err = run_cli(capsys, "convert", str(model), str(tmp_path / "other"), "--profile", str(profile), "--quiet")
    assert rc == 2 and f"{profile} [layers]: layer 1 is given twice" in err, err
    profile.write_text(json.dumps({"format": PROFILE_FORMAT, "version": 1, "layers": {"1": counts[:5]}}))
    rc, err = run_cli(capsys, "convert", str(model), str(tmp_path / "other"), "--profile", str(profile), "--quiet")
    assert rc == 2 and f"{profile} [layers.1]: layer 1 has 5 counts, the model has 32 experts" in err, err


def test_a_containers_memory_limit_is_read_where_its_hierarchy_is_mounted(tmp_path: pathlib.Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """In a container on cgroup v1 (``docker run --memory 2g``), ``/proc/self/cgroup`` names the
    host's path (``/docker/ID``) while the container's memory hierarchy is mounted from that very
    cgroup at ``/sys/fs/cgroup/memory``: the runtime looked for the limit under
    ``/sys/fs/cgroup/memory/docker/ID``, found nothing, and planned the pools against the host's
    MemAvailable. The mount's root (``/proc/self/mountinfo``) is taken off the path."""
    from asyncside import memory

    mount = tmp_path / "sys fs cgroup memory"
    mount.mkdir()
    # a limit below any machine's MemAvailable, so that the cgroup's room is the one taken
    (mount / "memory.limit_in_bytes").write_text(f"{64 << 20}\n")
    (mount / "memory.usage_in_bytes").write_text(f"{16 << 20}\n")
    (mount / "memory.stat").write_text(f"cache {8 << 20}\nrss {8 << 20}\n")
    cgroup = tmp_path / "cgroup"
    cgroup.write_text("12:memory:/docker/0123abcd\n11:cpu,cpuacct:/docker/0123abcd\n0::/\n")
    mountinfo = tmp_path / "mountinfo"
    where = str(mount).replace(" ", "\\040")
    mountinfo.write_text(
        "600 598 0:52 / /sys/fs/cgroup ro,nosuid - tmpfs tmpfs ro,mode=755\n"
        f"610 600 0:60 /docker/0123abcd {where} ro,nosuid,nodev,noexec,relatime master:20 - cgroup cgroup "
        "rw,memory\n"
        "611 600 0:61 /docker/0123abcd /sys/fs/cgroup/cpu ro,nosuid - cgroup cgroup rw,cpu,cpuacct\n")
    monkeypatch.setattr(memory, "PROC_CGROUP", cgroup)
    monkeypatch.setattr(memory, "PROC_MOUNTINFO", mountinfo)
    assert memory._cgroup_dirs() == [("v1", mount, mount)]
    budget = memory.available_memory()
    assert budget.available == (64 << 20) - (16 << 20) + (8 << 20)
    assert budget.source == "cgroup v1 memory.limit_in_bytes = 64.0 MiB"


def _cgroup_v2(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, mine: str,
               files: dict[str, dict[str, object]]) -> pathlib.Path:
    """A cgroup v2 hierarchy mounted at a temporary root, this process in its cgroup ``mine``:
    ``files`` maps each cgroup's path to its files' contents. Returns the mount's root."""
    from asyncside import memory

    root = tmp_path / "cgroup2"
    for rel, contents in files.items():
        (root / rel).mkdir(parents=True, exist_ok=True)
        for name, value in contents.items():
            (root / rel / name).write_text(f"{value}\n")
    cgroup = tmp_path / "cgroup"
    cgroup.write_text(f"0::/{mine}\n")
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(f"30 1 0:26 / {root} rw,nosuid shared:4 - cgroup2 cgroup2 rw,nsdelegate\n")
    monkeypatch.setattr(memory, "PROC_CGROUP", cgroup)
    monkeypatch.setattr(memory, "PROC_MOUNTINFO", mountinfo)
    return root


def test_a_limit_on_a_parent_cgroup_bounds_the_budget(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A memory limit set on a slice (``systemd-run --slice=small.slice``, ``MemoryMax=`` on the
    slice) leaves the process's own cgroup at ``max``: the runtime read only its own cgroup and
    planned the pools against MemAvailable, past the slice's limit."""
    from asyncside import memory

    root = _cgroup_v2(tmp_path, monkeypatch, "small.slice/run-1.scope", {
        "small.slice/run-1.scope": {"memory.max": "max", "memory.current": 8 << 20},
        # below any machine's MemAvailable
        "small.slice": {"memory.max": 96 << 20, "memory.current": 40 << 20,
                        "memory.stat": f"anon {30 << 20}\nfile {4 << 20}"}})
    slice_ = root / "small.slice"
    budget = memory.available_memory()
    assert budget.available == (96 << 20) - (40 << 20) + (4 << 20)
    assert budget.source == f"cgroup v2 memory.max = 96.0 MiB (of the parent cgroup {slice_})"


def test_policy_parameters_computed_with_numpy_are_taken() -> None:
    """``LRFU(np.float32(8))`` was refused as "lrfu half_life must be a positive number, got
    np.float32(8.0)", ``AgingLFU(np.int64(64))`` and ``AdaptiveLRFU(period=np.int64(32))`` as "must
    be a positive int", which they are; ``AdaptiveLRFU(half_lives=8)`` ended in "'int' object is
    not iterable"."""
    from asyncside.errors import LedgerError
    from asyncside.policies import LRFU, AdaptiveLRFU, AgingLFU

    assert LRFU(np.float32(4)).half_life == 4.0
    aging = AgingLFU(np.int64(16))
    assert aging.period == 16 and type(aging.period) is int
    adaptive = AdaptiveLRFU(half_lives=np.array([8.0, 64.0]), period=np.int64(8), rows=np.int32(4))
    assert adaptive.half_lives == (8.0, 64.0) and adaptive.period == 8 and adaptive.rows == 4
    with pytest.raises(LedgerError) as info:
        AdaptiveLRFU(half_lives=8)  # type: ignore[arg-type]
    assert str(info.value) == "adaptive-lrfu half_lives must be a sequence of positive numbers, got 8"
    for bad in (True, float("nan"), -1.0):
        with pytest.raises(LedgerError, match="lrfu half_life must be a positive number"):
            LRFU(bad)
    with pytest.raises(LedgerError, match="aging-lfu period must be a positive int, got 64.0"):
        AgingLFU(64.0)  # type: ignore[arg-type]


def test_offload_names_a_small_shapes_sizes_in_kb(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``bench offload --shapes mine.json:3 --memory 50M`` on a small config said "its 3 MoE
    layers' top-1 experts alone are 0 MB (records of 0 MB), and a run also holds 0 MB of other
    weights": sizes that are not zero read as nothing."""
    import json

    config = {"model_type": "qwen3_moe", "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "num_experts": 5, "num_experts_per_tok": 1,
              "moe_intermediate_size": 64, "intermediate_size": 96, "vocab_size": 300}
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(config))
    rc, err = run_cli(capsys, "bench", "offload", "--shapes", f"{path}:3", "--store-ratio", "0.0001", "--memory",
                      "50M", "--cache-dir", str(tmp_path / "cache"), "--localities", "low", "--quiet")
    assert rc == 2 and "holds no run of --shapes" in err, err
    assert " 0 MB" not in err and re.search(r"top-1 experts alone are \d+ kB \(records of \d+ kB\)", err), err
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").rglob("*.bin"))


def test_an_explicit_host_tier_the_pools_cannot_keep_is_said(quick_store: pathlib.Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """``demo --host-tier 2G`` (and ``Runtime(host_tier="2G")``) on host pools printed the same plan
    as without it: the tier, which only MLX CUDA device pools keep, was dropped without a word."""
    from asyncside import _native, pools

    if pools.device_pools_default() and _native.device_faults_available():
        pytest.skip("device pools keep a host tier here")

    async def go() -> tuple[str, ...]:
        async with Runtime(ExpertStore.open(quick_store), host_tier="2G") as rt:
            assert rt.plan is not None and rt.plan.host_tier_bytes == 0
            return rt.plan.notes

    note = "host tier: none kept (host_tier=2.00 GiB asked): the pools are not MLX CUDA device pools"
    assert any(n.startswith(note) for n in anyio.run(go))

    async def auto() -> tuple[str, ...]:
        async with Runtime(ExpertStore.open(quick_store)) as rt:
            assert rt.plan is not None
            return rt.plan.notes

    assert not any(n.startswith("host tier") for n in anyio.run(auto))
    assert cli_main(["demo", "--model", str(quick_store), "--tokens", "2", "--reference", "none",
                     "--host-tier", "2G"]) == 0
    assert note in capsys.readouterr().out


@pytest.mark.parametrize("address", ["https://huggingface.co/mlx-community/Qwen3-30B-A3B-4bit",
                                     "https://huggingface.co/mlx-community/Qwen3-30B-A3B-4bit/tree/main",
                                     "huggingface.co/mlx-community/Qwen3-30B-A3B-4bit/"])
def test_a_hub_page_address_names_the_repo_id_it_holds(address: str, capsys: pytest.CaptureFixture[str],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """``demo --model https://huggingface.co/org/name`` (the address pasted from the browser) was
    refused as "model directory does not exist (and not a Hugging Face repo id, org/name)", with no
    word of the repo id it holds."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    rc, err = run_cli(capsys, "demo", "--model", address, "--tokens", "2", "--reference", "none")
    assert rc == 2 and err.strip() == (f"asyncside demo: {address}: a Hugging Face page address: give its repo id, "
                                       f"mlx-community/Qwen3-30B-A3B-4bit"), err


@pytest.mark.parametrize(("layers", "said"), [
    ({}, "profile counts no routing at any MoE layer: expert id order"),
    ({"0": [0] * 32, "1": [0] * 32}, "profile counts no routing at any MoE layer: expert id order"),
    ({"0": list(range(32))}, "profile: hottest first; expert id order at layer 1 (no routing counted)"),
    ({"0": list(range(32)), "1": list(range(32))}, "profile: hottest first"),
])
def test_convert_says_which_layers_a_profile_ranked(quick_store: pathlib.Path, tmp_path: pathlib.Path,
                                                    layers: dict[str, list[int]], said: str,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """A routing profile of no layers (or of zero counts, or of some layers only) left those
    layers' experts in id order, while convert's summary said "profile: hottest first"."""
    import json

    from asyncside.models.convert import PROFILE_FORMAT

    profile = tmp_path / "mine.json"
    profile.write_text(json.dumps({"format": PROFILE_FORMAT, "version": 1, "layers": layers}))
    rc = cli_main(["convert", str(quick_store.parent / "model"), str(tmp_path / "store"), "--profile", str(profile),
                   "--quiet", "--json"])
    assert rc == 0 and json.loads(capsys.readouterr().out)["resident_from"] == said


def test_load_refuses_layers_that_leave_out_a_moe_layer(quick_store: pathlib.Path) -> None:
    """``load(STORE, layers=[0])`` on a model of MoE layers 0 and 1 loaded, and its first step
    failed deep in the forward with "layer 1 is not streamed by this runtime": the forward routes
    through every MoE layer, so a subset cannot run."""
    from asyncside import load

    with pytest.raises(PlanArgumentError) as info:
        load(quick_store, progress=False, layers=[0])
    assert str(info.value) == ("layers: load() runs the whole model, whose every MoE layer streams; [0] leaves out "
                               "[1] (its MoE layers: [0, 1]): leave layers out")
    model, _tok = load(quick_store, progress=False, layers=[1, 0])
    model.close()


def test_a_cgroup_v2_memory_high_bounds_the_budget(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``systemd-run -p MemoryHigh=...`` (cgroup v2 ``memory.high``, ``memory.max`` left at
    ``max``): past it the kernel throttles and reclaims the cgroup, and the runtime planned its
    pools and page cache against MemAvailable, above it. The lower of the two limits counts, and
    the plan names which."""
    from asyncside import memory

    root = _cgroup_v2(tmp_path, monkeypatch, "app.scope", {"app.scope": {
        "memory.max": "max", "memory.high": 80 << 20,  # below any machine's MemAvailable
        "memory.current": 30 << 20, "memory.stat": f"anon {20 << 20}\nfile {6 << 20}"}})
    leaf = root / "app.scope"
    budget = memory.available_memory()
    assert budget.available == (80 << 20) - (30 << 20) + (6 << 20)
    assert budget.source == "cgroup v2 memory.high = 80.0 MiB"
    # Where memory.max is the tighter, it is the one named.
    (leaf / "memory.max").write_text(f"{70 << 20}\n")
    budget = memory.available_memory()
    assert budget.available == (70 << 20) - (30 << 20) + (6 << 20)
    assert budget.source == "cgroup v2 memory.max = 70.0 MiB"


def test_demo_takes_a_policy_name_in_any_case() -> None:
    """``asyncside demo --policy LRU`` was refused ("invalid choice: 'LRU'") where ``Runtime``,
    ``bench policy`` and ``bench offload`` take the name in any case; a misspelt one is still a
    usage error."""
    import argparse

    from asyncside.demo import add_demo_arguments

    p = argparse.ArgumentParser(prog="asyncside demo", exit_on_error=False)
    add_demo_arguments(p)
    assert p.parse_args(["--policy", "LRU"]).policy == "lru"
    assert p.parse_args(["--policy", "Adaptive-LRFU"]).policy == "adaptive-lrfu"
    with pytest.raises(argparse.ArgumentError, match="invalid choice"):
        p.parse_args(["--policy", "lruu"])
