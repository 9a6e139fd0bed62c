"""Unseen inputs, round 8a: options whose defaults could not be told from a given value, counts
past a layer's experts, impossible bench device combinations, a distributed rank's usage errors,
and bench shapes cached by older code. Each is one line and exit status 2 (or a LedgerError /
PlanArgumentError naming the most), before any work."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest
from _cli_support import run_cli

from asyncside import ExpertStore
from asyncside.runtime import PlanArgumentError, Runtime, plan_layer


def _never(*_args: object, **_kwargs: object) -> None:
    raise AssertionError("the command went on past its usage error")


# ---- --routing-sequence without --routing ----------------------------------------------------

ROUTING_NEEDED = "--routing-sequence picks a sequence of a --routing trace: give --routing FILE"


@pytest.mark.parametrize("value", ["0", "1"])
def test_demo_refuses_routing_sequence_without_routing(value: str, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """The default was 0, so ``--routing-sequence 0`` alone was taken as not given and ignored."""
    import asyncside.demo as demo

    monkeypatch.setattr(demo, "run_demo", _never)
    rc, err = run_cli(capsys, "demo", "--routing-sequence", value)
    assert rc == 2 and err.strip().splitlines() == [f"asyncside demo: error: {ROUTING_NEEDED}"], err


def test_demo_with_ranks_refuses_routing_sequence_without_routing(monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    import asyncside.distributed.demo as ranks_demo

    monkeypatch.setattr(ranks_demo, "ranks_demo_main", _never)
    rc, err = run_cli(capsys, "demo", "--ranks", "2", "--routing-sequence", "1")
    assert rc == 2 and err.strip().splitlines() == [f"asyncside demo: error: {ROUTING_NEEDED}"], err


def test_bench_generate_refuses_routing_sequence_zero_without_routing(monkeypatch: pytest.MonkeyPatch,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    from asyncside.bench import generate

    monkeypatch.setattr(generate, "_resolve_store", _never)
    rc, err = run_cli(capsys, "bench", "generate", "--quick", "--json", "--plot", "none", "--routing-sequence", "0")
    assert rc == 2 and err.strip().count("\n") == 0 and ROUTING_NEEDED in err, err


def test_bench_offload_refuses_routing_sequence_zero_without_routing(monkeypatch: pytest.MonkeyPatch,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    from asyncside.bench import offload

    monkeypatch.setattr(offload, "process_baseline", _never)
    rc, err = run_cli(capsys, "bench", "offload", "--json", "--quiet", "--routing-sequence", "0")
    assert rc == 2 and err.strip().count("\n") == 0 and ROUTING_NEEDED in err, err


def test_routing_sequence_not_given_is_no_problem() -> None:
    from asyncside.demo import routing_sequence_problem

    assert routing_sequence_problem(None, None) is None
    assert routing_sequence_problem(None, 0) == ROUTING_NEEDED


# ---- min_side_rows above a layer's experts ----------------------------------------------------

def _store(path: pathlib.Path, experts: tuple[int, ...] = (16, 16)) -> ExpertStore:
    rng = np.random.default_rng(0)
    return ExpertStore.create(path, {layer: {"w": rng.integers(0, 255, size=(n, 256), dtype=np.uint8)}
                                     for layer, n in enumerate(experts)})


def test_runtime_refuses_min_side_rows_past_a_layers_experts_when_made(tmp_path: pathlib.Path) -> None:
    """min_side_rows=17 on layers of 16 experts was cut to 16 and the plan said the rows were
    raised to "the least rows a layer": refused as side_rows=17 is, naming the most."""
    store = _store(tmp_path / "s")
    with pytest.raises(PlanArgumentError, match=r"^min_side_rows=17: at most 16 dynamic rows a layer "
                       r"\(this model's layers have 16 experts each"):
        Runtime(store, min_side_rows=17)
    Runtime(store, min_side_rows=16)
    with pytest.raises(PlanArgumentError, match=r"^min_side_rows=14: at most 13 dynamic rows a layer "
                       r"\(layer 0 pins 3 of its 16 experts"):
        Runtime(store, pinned={0: [1, 2, 3], 1: []}, min_side_rows=14)
    with pytest.raises(PlanArgumentError, match=r"^min_side_rows=9: at most 8 dynamic rows a layer \(layer 1 has 8"):
        Runtime(_store(tmp_path / "mixed", experts=(16, 8)), min_side_rows=9)


def test_the_default_least_rows_is_still_capped_at_a_small_layer(tmp_path: pathlib.Path) -> None:
    """The default floor (8 where the store says no top-k) passes a layer of 4 experts: capped, as
    memory.layer_rows documents, not refused."""
    from asyncside.memory import layer_rows

    store = _store(tmp_path / "s", experts=(4, 4))
    Runtime(store)
    assert plan_layer(store, 0, 0.25) == ([], 4)
    assert layer_rows(4, 0.25) == 4


# ---- a distributed rank's --side-rows past the experts -----------------------------------------

@pytest.fixture()
def no_launch_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No distributed launch environment: the usage error must come before it is looked for."""
    for name in ("MLX_RANK", "MLX_HOSTFILE", "MLX_WORLD_SIZE", "NCCL_HOST_IP", "NCCL_PORT",
                 "MLX_JACCL_COORDINATOR", "MLX_IBV_DEVICES"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("single", [False, True])
def test_a_rank_refuses_side_rows_past_the_experts_as_a_usage_error(
        single: bool, tmp_path: pathlib.Path, no_launch_env: None, capsys: pytest.CaptureFixture[str]) -> None:
    """``python -m asyncside.distributed STORE --side-rows 17`` on layers of 16 experts ended with
    status 1 (after the launch environment was looked for; --single in a traceback): one line, 2."""
    from asyncside.distributed.rank import main as rank_main

    store = _store(tmp_path / "s")
    rc = rank_main([str(store.path), "--side-rows", "17", *(["--single"] if single else [])])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err == ["asyncside rank ?: --side-rows 17: at most 16 dynamic rows a layer (this model's "
                               "layers have 16 experts each; at 16 every row is dynamic and none pinned)"], err


def test_serve_pipeline_refuses_side_rows_past_the_experts_as_a_usage_error(
        tmp_path: pathlib.Path, no_launch_env: None, capsys: pytest.CaptureFixture[str]) -> None:
    store = _store(tmp_path / "s")
    rc, err = run_cli(capsys, "serve", "--pipeline", "--model", str(store.path), "--side-rows", "17")
    assert rc == 2 and err.strip().splitlines() == [
        "asyncside serve: --side-rows 17: at most 16 dynamic rows a layer (this model's layers have 16 experts "
        "each; at 16 every row is dynamic and none pinned)"], err


# ---- bench device: impossible combinations ---------------------------------------------------

def test_bench_device_refuses_more_side_rows_than_experts_before_any_work(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """``python -m asyncside.bench.device --experts 4 --side-rows 32`` measured the copy limit and
    built the store, then ended in the runtime's PlanArgumentError traceback: one line, status 2."""
    from asyncside.bench import device

    monkeypatch.setattr(device, "_run", _never)
    assert device.main(["--experts", "4", "--side-rows", "32"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["python -m asyncside.bench.device: error: --side-rows 32: at most --experts (4) rows: each "
                   "row holds a distinct expert of the bench layer"], err


@pytest.mark.parametrize("option, value", [("--experts", "0"), ("--side-rows", "0"), ("--repeats", "0"),
                                           ("--upload-queue", "0"), ("--bridge-samples", "-1"),
                                           ("--reader", "bogus")])
def test_bench_device_refuses_counts_it_cannot_run_with(option: str, value: str, monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """No repeats (min() of nothing), no queued upload (an empty list's last), no side rows (a
    range step of 0), no experts: each a traceback after the store was built; now argparse's."""
    from asyncside.bench import device

    monkeypatch.setattr(device, "_run", _never)
    with pytest.raises(SystemExit) as info:
        device.main([f"{option}={value}"])
    assert info.value.code == 2
    assert f"argument {option}:" in capsys.readouterr().err.strip().splitlines()[-1]


# ---- bench shapes cached by older code -------------------------------------------------------

def _one_expert_config(tmp_path: pathlib.Path) -> pathlib.Path:
    config = tmp_path / "one-expert" / "config.json"
    config.parent.mkdir()
    config.write_text(json.dumps({
        "model_type": "mixtral", "hidden_size": 128, "intermediate_size": 128, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 1, "num_experts_per_tok": 1,
        "vocab_size": 512}))
    return config


def _finite_store(store: pathlib.Path) -> bool:
    import mlx.core as mx

    files = sorted(store.glob("*.safetensors"))
    return bool(files) and all(bool(mx.isfinite(v.astype(mx.float32)).all()) for f in files
                               for v in mx.load(str(f)).values() if mx.issubdtype(v.dtype, mx.floating))


def test_a_one_expert_shape_cached_by_older_code_is_rebuilt(tmp_path: pathlib.Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """A shape of one expert a layer built before its router was made finite (READY holding the
    spec's key alone, as older code wrote it) was reused forever, NaN router and all: its key did
    not change. Its marker now names the build, and an older one of such a shape is rebuilt."""
    from asyncside.bench import shapes

    config, cache = _one_expert_config(tmp_path), tmp_path / "cache"
    first = shapes.ensure_shape(config, layers=1, vocab=512, cache_dir=cache, progress=False)
    final = pathlib.Path(first["store"]).parent
    key = (final / "READY").read_text().splitlines()[0]
    # What older code left: the marker without a build, a store of NaN weights (here: none at all).
    (final / "READY").write_text(key + "\n")
    for f in pathlib.Path(first["store"]).glob("*.safetensors"):
        f.unlink()
    again = shapes.ensure_shape(config, layers=1, vocab=512, cache_dir=cache, progress=True)
    assert again["built"] is True and _finite_store(pathlib.Path(again["store"]))
    assert "built by older code" in capsys.readouterr().err
    assert shapes.ensure_shape(config, layers=1, vocab=512, cache_dir=cache, progress=False)["built"] is False


def test_older_builds_of_other_shapes_are_still_reused(tmp_path: pathlib.Path) -> None:
    """Only the specs whose weights changed are rebuilt: an older marker of a shape of several
    experts (drawn the same before and after) is a finished build, however large the shape."""
    from asyncside.models.embedded import EmbeddedSpec, build_is_current, ready_marker

    many, one = EmbeddedSpec(), EmbeddedSpec(config={**EmbeddedSpec().config, "num_experts": 1})
    (tmp_path / "READY").write_text(many.key() + "\n")
    assert build_is_current(tmp_path, many) and not build_is_current(tmp_path, one)
    (tmp_path / "READY").write_text(ready_marker(one))
    assert build_is_current(tmp_path, one)
    (tmp_path / "READY").write_text(many.key() + "\nbuild two\n")
    assert not build_is_current(tmp_path, many)  # a marker that cannot be read is no build
    assert not build_is_current(tmp_path / "missing", many)
