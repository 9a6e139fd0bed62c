"""Unseen inputs, round 8a: options whose defaults could not be told from a given value, counts
past a layer's experts, impossible bench device combinations, a distributed rank's usage errors,
and bench shapes cached by older code. Each is one line and exit status 2 (or a LedgerError /
PlanArgumentError naming the most), before any work."""

from __future__ import annotations

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
