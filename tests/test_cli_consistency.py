"""One meaning per option across the subcommands, and every refusal a one-line usage error."""

from __future__ import annotations

import argparse
import pathlib
import re
from typing import Any

import anyio
import pytest

from asyncside.cli import build_parser
from asyncside.store import ExpertStore

# The three subcommands taking --resident, with the positional arguments each needs.
RESIDENT_COMMANDS = {"demo": ["demo"], "serve": ["serve"], "convert": ["convert", "model", "store"]}
# Benches taking a plain fraction (no 'auto'): the same type, the same refusals.
FRACTION_ONLY = {"bench step": ["bench", "step"], "bench pipeline": ["bench", "pipeline"]}


def parse(argv: list[str]) -> Any:
    return build_parser(argv).parse_args(argv)


def refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as info:
        parse(argv)
    assert info.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize("command", sorted(RESIDENT_COMMANDS))
@pytest.mark.parametrize("text, value", [("0", 0.0), ("0%", 0.0), ("0.25", 0.25), ("25%", 0.25), ("1", 1.0),
                                         (" 100% ", 1.0)])
def test_resident_means_the_same_everywhere(command: str, text: str, value: float) -> None:
    """0 is nothing resident (every expert streamed through the least rows) in all three."""
    assert parse([*RESIDENT_COMMANDS[command], "--resident", text]).resident == value


@pytest.mark.parametrize("command", sorted(RESIDENT_COMMANDS))
@pytest.mark.parametrize("bad", ["-0.1", "1.5", "110%", "nan", "inf", "lots", ""])
def test_resident_refused_the_same_everywhere(command: str, bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    err = refused([*RESIDENT_COMMANDS[command], "--resident", bad], capsys)
    assert err.startswith(f"asyncside {command}: error: argument --resident: expected a fraction in [0, 1], got {bad}")


@pytest.mark.parametrize("command", sorted(FRACTION_ONLY))
def test_resident_of_the_benches_and_ranks(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    from asyncside.distributed.rank import build_parser as rank_parser

    argv = FRACTION_ONLY[command]
    assert parse([*argv, "--resident", "0"]).resident == 0.0
    assert parse([*argv, "--resident", "25%"]).resident == 0.25
    for bad in ("1.5", "-0.1", "nan", "auto"):
        err = refused([*argv, "--resident", bad], capsys)
        assert err.startswith(f"asyncside {command}: error: argument --resident: expected a fraction in [0, 1], got {bad}")
    rank = rank_parser()
    assert rank.parse_args(["store", "--resident", "0"]).resident == 0.0
    with pytest.raises(SystemExit):
        rank.parse_args(["store", "--resident", "1.5"])
    assert "argument --resident: expected a fraction in [0, 1], got 1.5" in capsys.readouterr().err


def test_resident_auto_only_where_it_means_something(capsys: pytest.CaptureFixture[str]) -> None:
    """``auto`` sizes the pools to the memory budget: a run's setting, not a store's recorded set."""
    for command in ("demo", "serve"):
        assert parse([*RESIDENT_COMMANDS[command], "--resident", "AUTO"]).resident == "auto"
    err = refused([*RESIDENT_COMMANDS["convert"], "--resident", "auto"], capsys)
    assert "got auto" in err and "'auto'" not in err


def test_resident_zero_runs(expert_store: ExpertStore) -> None:
    """The value the parsers give for ``--resident 0`` is one the Runtime takes: the least rows."""
    from asyncside.runtime import Runtime
    from asyncside.runtime._plan import min_rows

    resident = parse(["demo", "--resident", "0"]).resident

    async def rows() -> dict[Any, int]:
        async with Runtime(expert_store, resident=resident) as rt:
            return dict(rt.memory["rows"])

    assert set(anyio.run(rows).values()) == {min(min_rows(expert_store), expert_store.layer(0).n_experts)}


# The ASYNCSIDE_* variables the native extension reads itself: refused from Python, listed in the docs.
ROOT = pathlib.Path(__file__).resolve().parents[1]
GOOD_ENV = {"ASYNCSIDE_FAULT_READ_THREADS": ["0", "4", "64", ""],
            "ASYNCSIDE_FAULT_BACKGROUND_THREADS": ["1", "64", ""],
            "ASYNCSIDE_FAULT_READ_CHUNK": ["0", "4096", str(1 << 20), str(1 << 30)],
            "ASYNCSIDE_FAULT_READ_WINDOW": ["0", "1", "8", "32"],
            "ASYNCSIDE_GRAPH_RELEASE": ["caller", "thread", ""],
            "ASYNCSIDE_CUDA_FAULT_NODE": ["device", "host", "child", ""]}
BAD_ENV = {"ASYNCSIDE_FAULT_READ_THREADS": ["abc", "-1", "65", "4.0", " 4", "1e2"],
           "ASYNCSIDE_FAULT_BACKGROUND_THREADS": ["0", "x", "-2", "65"],
           "ASYNCSIDE_FAULT_READ_CHUNK": ["", "abc", "-4096", "4095", "6000", str((1 << 30) + 4096)],
           "ASYNCSIDE_FAULT_READ_WINDOW": ["", "33", "-1", "x", "8.0", " 8"],
           "ASYNCSIDE_GRAPH_RELEASE": ["Caller", "yes", "1"],
           "ASYNCSIDE_CUDA_FAULT_NODE": ["gpu", "HOST", "0"]}


def test_every_native_variable_is_checked_and_documented() -> None:
    """What native/ reads with getenv is what NATIVE_VARIABLES checks; docs/api.md lists each, and
    every ASYNCSIDE_* variable the package reads from Python too."""
    from asyncside.native_env import NATIVE_VARIABLES

    native = set()
    for source in (ROOT / "native").glob("*.[ch]*"):
        text = source.read_text(errors="replace")
        native |= set(re.findall(r'getenv\("(ASYNCSIDE_\w+)"\)', text))
        native |= set(re.findall(r'k\w*Env = "(ASYNCSIDE_\w+)"', text))
    assert native == set(NATIVE_VARIABLES) == set(GOOD_ENV) == set(BAD_ENV)
    api = (ROOT / "docs" / "api.md").read_text()
    section = api[api.index("## Environment variables"):]
    documented = set(re.findall(r"^\| `\$(ASYNCSIDE_\w+)` \|", section, re.M))
    python = set()
    for source in (ROOT / "asyncside").rglob("*.py"):
        python |= set(re.findall(r"[\"'](ASYNCSIDE_[A-Z_]+)[\"']", source.read_text()))
    assert native | python <= documented, sorted((native | python) - documented)


@pytest.mark.parametrize("name, value", [(n, v) for n, values in GOOD_ENV.items() for v in values])
def test_native_variable_accepted(name: str, value: str) -> None:
    from asyncside.native_env import check_native_env

    check_native_env({name: value})


@pytest.mark.parametrize("name, value", [(n, v) for n, values in BAD_ENV.items() for v in values])
def test_native_variable_refused(name: str, value: str) -> None:
    from asyncside.errors import AsyncsideError, EnvVarError
    from asyncside.native_env import NATIVE_VARIABLES, check_native_env

    with pytest.raises(EnvVarError) as info:
        check_native_env({name: value})
    assert isinstance(info.value, AsyncsideError) and isinstance(info.value, ValueError)
    assert (info.value.variable, info.value.value) == (name, value)
    assert str(info.value) == f"{name}: expected {NATIVE_VARIABLES[name].expected}, got {value!r}"


def test_runtime_refuses_a_bad_read_threads_value(expert_store: ExpertStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the Runtime starts, before its pools or reads: the extension would have run with its default."""
    from asyncside.errors import EnvVarError
    from asyncside.runtime import Runtime

    async def enter() -> None:
        async with Runtime(expert_store, resident=0.5):
            pass

    monkeypatch.setenv("ASYNCSIDE_FAULT_READ_THREADS", "abc")
    with pytest.raises(EnvVarError, match=r"ASYNCSIDE_FAULT_READ_THREADS: expected an integer from 0 to 64.*'abc'"):
        anyio.run(enter)
    monkeypatch.setenv("ASYNCSIDE_FAULT_READ_THREADS", "2")
    anyio.run(enter)


@pytest.mark.parametrize("argv", [["demo", "--tokens", "1"], ["serve", "--port", "0"],
                                  ["bench", "policy", "--quick"], ["convert", "no-such-model", "out"]])
def test_cli_refuses_a_bad_native_variable_before_loading(argv: list[str], monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    from asyncside.cli import main

    monkeypatch.setenv("ASYNCSIDE_FAULT_BACKGROUND_THREADS", "-3")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "environment: ASYNCSIDE_FAULT_BACKGROUND_THREADS" in err and "'-3'" in err


def _options(parser: argparse.ArgumentParser, name: str = "asyncside") -> list[tuple[str, argparse.Action]]:
    """Every option of every subcommand (and bench), with the command it belongs to."""
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, subparser in action.choices.items():
                out += _options(subparser, f"{name} {sub}")
        elif action.option_strings:
            out.append((name, action))
    return out


def test_help_states_the_defaults_the_options_have() -> None:
    """A number the help gives as the default is the option's default (bench serve's --resident
    said serve's 0.25 while it ran at 0.5), and every --cache-dir names $ASYNCSIDE_CACHE, which wins
    over the user cache."""
    checked = 0
    for command, action in _options(build_parser()):
        text = argparse.HelpFormatter("asyncside")._expand_help(action) if action.help else ""
        said = re.search(r"\(default:? (-?[0-9][0-9.]*)[;,)]", text)
        if said and isinstance(action.default, (int, float)):
            checked += 1
            assert float(said.group(1)) == float(action.default), (command, action.option_strings, text)
        if "--cache-dir" in action.option_strings:
            assert "$ASYNCSIDE_CACHE" in text or "ASYNCSIDE_CACHE" in text, (command, text)
    assert checked > 20  # the check saw the options it is about


def test_version_and_what_the_subcommands_take(capsys: pytest.CaptureFixture[str]) -> None:
    """``asyncside --version`` answers; the overview does not say demo runs only the embedded model
    or that convert takes only a directory (both take more)."""
    import asyncside
    from asyncside.cli import main

    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out.strip() == f"asyncside {asyncside.__version__}"
    with pytest.raises(SystemExit):
        main(["--help"])
    overview = " ".join(capsys.readouterr().out.split())
    assert "--model" in overview and "Hugging Face repo id" in overview


def test_demo_side_rows_help_says_what_leaving_it_out_does(expert_store: ExpertStore) -> None:
    """Left out, --side-rows pins nothing (every row managed by the policy), as its help says; given,
    the rest of the rows hold the hottest experts."""
    from asyncside.runtime._plan import plan_layer

    parser = build_parser(["demo"])
    (demo,) = [a.choices["demo"] for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    (action,) = [a for a in demo._actions if "--side-rows" in a.option_strings]
    assert action.help is not None and "default: every row managed, none pinned" in action.help
    assert parse(["demo"]).side_rows is None
    layer = next(iter(expert_store.layers))  # a layer index
    pinned, side = plan_layer(expert_store, layer, 0.5, side_rows=None)
    assert pinned == [] and side > 0
    pinned, side = plan_layer(expert_store, layer, 0.5, side_rows=1)
    assert len(pinned) > 0 and side == 1


def test_a_shape_that_cannot_be_built_is_a_usage_error(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    """bench generate/offload --shape naming a config that is no MoE model: exit status 2, one line."""
    from asyncside.cli import main

    config = tmp_path / "dense" / "config.json"
    config.parent.mkdir()
    config.write_text('{"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2}')
    assert main(["bench", "generate", "--shape", str(config.parent), "--plot", "none"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("asyncside bench generate: ") and "not a mixture-of-experts" in err


@pytest.mark.parametrize(("argv", "want"), [
    ([], 0.25),
    (["--memory", "1G"], "auto"),
    (["--memory", "1G", "--resident", "0.5"], 0.5),
    (["--resident", "0"], 0.0),
])
def test_demo_resident_is_auto_under_a_memory_budget_unless_given(argv: list[str], want: object) -> None:
    """A budget asks the plan to size the pools: ``demo --memory`` alone must not refuse a budget
    that smaller pools fit because a fixed share was assumed."""
    from asyncside.demo import add_demo_arguments, resident_of

    p = argparse.ArgumentParser()
    add_demo_arguments(p)
    assert resident_of(p.parse_args(argv)) == want


def test_every_policy_option_names_every_policy() -> None:
    """Each --policy option's help (or choices) names every policy a Runtime takes, aliases aside
    (serve's help once left adaptive-lrfu out)."""
    from asyncside.policies import POLICY_NAMES

    seen = 0
    for command, action in _options(build_parser()):
        if "--policy" not in action.option_strings:
            continue
        seen += 1
        text = argparse.HelpFormatter("asyncside")._expand_help(action) if action.help else ""
        listed = set(action.choices or ()) | set(re.findall(r"[a-z][a-z-]+", text))
        assert set(POLICY_NAMES) <= listed, (command, sorted(set(POLICY_NAMES) - listed))
    assert seen >= 2
