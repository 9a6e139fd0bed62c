"""The command line given sizes, fractions and environment values nobody in the project typed:
each is taken with one documented meaning, or refused as a usage error (exit status 2, one line)."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest

from asyncside import memory
from asyncside.cli import build_parser
from asyncside.demo import choose_reference
from asyncside.runtime._plan import NEED_MARGIN, min_rows
from asyncside.store import ExpertStore


def parse(argv: list[str]) -> Any:
    return build_parser(argv).parse_args(argv)


def refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as info:
        parse(argv)
    assert info.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize("text, size", [("10M", 10 << 20), ("1.5G", 3 << 29), ("1.5GiB", 3 << 29),
                                        ("1536MiB", 3 << 29), ("2GB", 2 << 30), ("2 GB", 2 << 30),
                                        ("1e9", 10**9), ("64G", 64 << 30), ("1T", 1 << 40)])
def test_memory_sizes_are_binary_everywhere(text: str, size: int) -> None:
    for argv in (["demo", "--memory", text], ["serve", "--memory", text]):
        assert parse(argv).memory == size


@pytest.mark.parametrize("text, message", [("0", "is 0 bytes; expected at least 4K"),
                                           ("16", "is 16 bytes; expected at least 4K"),
                                           ("-1", "expected a size >= 0"),
                                           ("auto", "leave --memory out for the default"),
                                           ("1.5.5G", "powers of 1024")])
def test_memory_sizes_refused(text: str, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    for command in ("demo", "serve"):
        err = refused([command, "--memory", text], capsys)
        assert "argument --memory" in err and message in err


def test_fractions_and_percentages(capsys: pytest.CaptureFixture[str]) -> None:
    assert parse(["demo", "--resident", "25%"]).resident == 0.25
    assert parse(["serve", "--resident", "25%"]).resident == 0.25
    assert parse(["demo", "--resident", "auto"]).resident == "auto"
    assert parse(["bench", "generate", "--residency", "25%", "0.5"]).residency == [0.25, 0.5]
    assert parse(["demo", "--resident", "0"]).resident == 0.0  # nothing resident: tests/test_cli_consistency.py
    assert parse(["bench", "generate", "--residency", "0"]).residency == [0.0]  # as demo --resident 0
    for bad in ("1.5", "-0.1", "nan", "110%"):
        assert "expected a fraction in [0, 1]" in refused(["demo", "--resident", bad], capsys)
        assert "expected a fraction in [0, 1]" in refused(["bench", "generate", "--residency", bad], capsys)
    assert "or 'auto'" not in refused(["bench", "generate", "--residency", "auto"], capsys)
    for argv in (["demo", "--tokens", "0"], ["bench", "generate", "--tokens", "-3"]):
        assert "expected an integer >= 1" in refused(argv, capsys)


def test_reference_leaves_room_for_the_streaming_run(expert_store: ExpertStore,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The all-resident reference is chosen only when the streaming run still fits after it: the
    process keeps the model's pages, so a budget that holds the model twice but not the model, the
    pools and the headroom together gets the slot cache."""
    monkeypatch.setattr(memory, "proc_self_bytes", lambda name, key: 0)
    model = sum(expert_store.layer(i).blob_bytes for i in expert_store.layers)
    model += sum(f.stat().st_size for f in expert_store.path.glob("*.safetensors"))
    pools = memory.pool_bytes(expert_store, 0.5)
    assert model < memory.MIN_HEADROOM  # a small store: twice the model leaves no room for the runtime
    kind, why = choose_reference(expert_store, "auto", 2 * model, 0.5)
    assert kind == "slot-cache" and "streaming run would need" in why
    # beside them the margin a refusal's memory= adds, kept for the code the reference leaves
    beside = memory.MIN_HEADROOM + NEED_MARGIN
    assert choose_reference(expert_store, "auto", model + pools + beside, 0.5)[0] == "all-resident"
    assert choose_reference(expert_store, "auto", model + pools + beside - 1, 0.5)[0] == "slot-cache"
    # The pools sized by the plan (no fraction): its smallest pools count, so the budget the fraction
    # passed with (the model, the pools, the headroom) is checked again, with the smallest pools.
    smallest = memory.pool_bytes(expert_store, 0.0, min_rows=min_rows(expert_store))
    assert choose_reference(expert_store, "auto", 2 * model)[0] == "slot-cache"
    enough = max(2 * model, model + smallest + beside)
    assert choose_reference(expert_store, "auto", enough)[0] == "all-resident"
    assert choose_reference(expert_store, "auto", None)[0] == "all-resident"  # no budget: the model's size alone


def test_a_bad_environment_value_is_one_line() -> None:
    env = {**os.environ, "ASYNCSIDE_FAULT_READ_CHUNK": "abc"}
    out = subprocess.run([sys.executable, "-m", "asyncside", "demo", "--tokens", "1"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr
    assert out.stderr.count("\n") == 1 and "ASYNCSIDE_FAULT_READ_CHUNK" in out.stderr and "'abc'" in out.stderr


def test_a_bad_reader_variable_is_one_line(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import asyncside.demo
    from asyncside.cli import main
    from asyncside.readers import choose_reader

    monkeypatch.setenv("ASYNCSIDE_READER", "bogus")
    # Where a run first picks its reader (the model load before it is not what is tested here).
    monkeypatch.setattr(asyncside.demo, "run_demo", lambda args: choose_reader("auto"))
    assert main(["demo", "--tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "ASYNCSIDE_READER" in err and "'bogus'" in err


@pytest.mark.parametrize("kwargs, message", [({"memory": "abc"}, "memory 'abc': expected a size"),
                                             ({"memory": 0}, "memory 0 is 0 bytes; expected at least 4K"),
                                             ({"resident": 1.5}, "resident: expected a fraction"),
                                             ({"resident": float("nan")}, "resident: expected a fraction"),
                                             ({"resident": True}, "resident: expected a fraction")])
def test_load_refuses_bad_arguments_before_touching_the_model(kwargs: dict[str, Any], message: str,
                                                              tmp_path: Any) -> None:
    import asyncside

    with pytest.raises(ValueError, match=message):
        asyncside.load(tmp_path / "no-such-model", **kwargs)


def test_the_memory_floor_is_one_check_for_load_and_memory(capsys: pytest.CaptureFixture[str],
                                                           tmp_path: Any) -> None:
    """--memory and load(memory=) refuse a budget under 4K with the same words (memory.check_memory)."""
    import asyncside
    from asyncside.memory import SIZE_UNITS, check_memory

    assert check_memory(4096, "4K") == 4096
    with pytest.raises(ValueError) as info:
        asyncside.load(tmp_path / "no-such-model", memory="16")
    assert str(info.value) == f"memory '16' is 16 bytes; expected at least 4K ({SIZE_UNITS})"
    assert f"argument --memory: {info.value}" in refused(["demo", "--memory", "16"], capsys)


def test_record_routing_to_an_unwritable_place(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """Refused before the run, not after it: a missing directory, a directory."""
    from asyncside.errors import TraceError
    from asyncside.routing import preset

    err = refused(["demo", "--record-routing", str(tmp_path / "no" / "t.npz")], capsys)
    assert "no such directory" in err and str(tmp_path / "no") in err
    assert "is a directory" in refused(["demo", "--record-routing", str(tmp_path)], capsys)
    assert parse(["demo", "--record-routing", str(tmp_path / "t.npz")]).record_routing == str(tmp_path / "t.npz")
    with pytest.raises(TraceError, match="cannot be written") as info:
        preset("low", tokens=2, n_layers=1, n_experts=4, top_k=1).save(tmp_path / "no" / "t.npz")
    assert info.value.path == str(tmp_path / "no" / "t.npz")


def test_convert_refuses_a_store(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """A store passed to convert is named as one, not read as a model missing its expert weights."""
    from asyncside.cli import main

    store = tmp_path / "store"
    store.mkdir()
    for name in ("manifest.json", "config.json"):
        (store / name).write_text("{}")
    assert main(["convert", str(store), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "is already an expert store" in err and str(store) in err and not (tmp_path / "out").exists()


@pytest.mark.parametrize("option, bad, message", [("--side-rows", "-1", "expected an integer >= 0"),
                                                  ("--lookahead-extra", "-1", "expected an integer >= 0"),
                                                  ("--ranks", "0", "expected an integer >= 1"),
                                                  ("--join-timeout", "0", "expected seconds > 0"),
                                                  ("--deadline", "inf", "expected seconds > 0")])
def test_demo_counts_and_seconds(option: str, bad: str, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    err = refused(["demo", option, bad], capsys)
    assert f"argument {option}" in err and message in err


POLICY_BENCH = ["bench", "policy", "--presets", "low", "--tokens", "16", "--layers", "2", "--shapes", "16x2"]


@pytest.mark.parametrize("option, bad, message", [
    ("--tokens", "0", "expected an integer >= 1, got '0'"),
    ("--layers", "-1", "expected an integer >= 1, got '-1'"),
    ("--shapes", "4x8", "1 <= TOP_K <= EXPERTS, got '4x8'"),
    ("--shapes", "64by6", "expected EXPERTSxTOP_K like 64x6, got '64by6'"),
    ("--shapes", ",", "expected at least one comma-separated value"),
    ("--fractions", "1.5", "expected fractions in (0, 1] such as 0.25 or 25%, got '1.5'"),
    ("--fractions", "0", "expected fractions in (0, 1]"),
    ("--fractions", "0.25,lots", "got 'lots'"),
    ("--policies", "bogus", "unknown policy 'bogus'"),
    ("--presets", "bogus", "unknown preset 'bogus'"),
    ("--seeds", "-1", "expected comma-separated integers >= 0, got '-1'"),
    ("--out", "/no/such/dir/out.json", "no such directory /no/such/dir"),
])
def test_policy_bench_refuses_a_bad_option_in_one_line(option: str, bad: str, message: str,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """bench policy's refusals are usage errors like every other subcommand's: exit status 2, the
    last line naming the option and the value, no traceback."""
    from asyncside.cli import main

    with pytest.raises(SystemExit) as info:
        main([*POLICY_BENCH, option, bad])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith(f"asyncside bench policy: error: argument {option}: ")
    assert message in err.strip().splitlines()[-1]


def test_policy_bench_refuses_a_bad_trace_or_nothing_in_one_line(tmp_path: Any,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from asyncside.cli import main

    (tmp_path / "t.npz").write_text("not an archive")
    for argv, message in ((["--trace", str(tmp_path / "none.npz")], f"{tmp_path / 'none.npz'}: no such file"),
                          (["--trace", str(tmp_path / "t.npz")], f"{tmp_path / 't.npz'}: expected an .npz archive"),
                          (["--presets", ""], "nothing to replay")):
        assert main([*POLICY_BENCH, *argv]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("asyncside bench policy: ") and message in err, err


def test_policy_bench_quick_keeps_the_options_given(capsys: pytest.CaptureFixture[str]) -> None:
    """--quick sizes what is not given; an option given is not silently replaced."""
    import json

    from asyncside.cli import main

    assert main(["bench", "policy", "--quick", "--json", "--policies", "lru", "--presets", "low",
                 "--tokens", "32", "--shapes", "16x2"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert {(r["trace"], r["tokens"], r["layers"]) for r in rows} == {("low 16x2 s0", 32, 2)}
