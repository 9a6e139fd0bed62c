"""Inputs the repository never made, second sweep: trace archives put together by hand, environment
variables, the serve benchmark's options and the ``load`` front door's arguments. Every bad input is
refused in one line naming the file, field, variable or option; nothing ends in a traceback, and a
run that measured nothing does not pass.
"""

from __future__ import annotations

import io
import pathlib
import zipfile

import numpy as np
import pytest
from _cli_support import offload_args, run_cli


def _npy(array: np.ndarray) -> bytes:
    out = io.BytesIO()
    np.save(out, array)
    return out.getvalue()


def test_an_archive_member_that_is_no_npy_array_is_named(tmp_path: pathlib.Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """A zip whose ids.npy holds no .npy data: np.load hands its bytes back, and routing info ended
    in AttributeError ('bytes' object has no attribute 'ndim'). A member that is none of the trace's
    arrays (a README) is left out as extra arrays are."""
    bad = tmp_path / "bad.npz"
    with zipfile.ZipFile(bad, "w") as z:
        z.writestr("ids.npy", b"garbage")
        z.writestr("n_experts.npy", _npy(np.array(16)))
    rc, err = run_cli(capsys, "routing", "info", str(bad))
    assert rc == 2 and "bad.npz [ids]" in err and "no .npy array" in err and "Traceback" not in err, err

    extra = tmp_path / "extra.npz"
    ids = np.array([[[0, 1]], [[2, 3]]], dtype=np.int64)
    with zipfile.ZipFile(extra, "w") as z:
        z.writestr("README.txt", b"recorded by hand")
        z.writestr("ids.npy", _npy(ids))
        z.writestr("n_experts.npy", _npy(np.array(16)))
    rc, err = run_cli(capsys, "routing", "info", str(extra), "--no-min")
    assert rc == 0, err


def test_a_preset_too_large_to_generate_is_refused_before_it_starts(tmp_path: pathlib.Path,
                                                                    monkeypatch: pytest.MonkeyPatch,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """``routing preset high OUT --tokens 100000000`` ended in numpy's MemoryError traceback (71.5
    GiB of random draws); it is refused with the ids it asked for and the memory they need."""
    from asyncside import memory

    monkeypatch.setattr(memory, "available_memory", lambda: memory.MemoryBudget(64 << 20, "test"))
    out = tmp_path / "p.npz"
    rc, err = run_cli(capsys, "routing", "preset", "high", str(out), "--tokens", "100000")
    assert rc == 2 and "--tokens 100000 x --layers 8 x --top-k 6" in err and "fewer tokens" in err, err
    assert "Traceback" not in err and not out.exists()
    rc, err = run_cli(capsys, "routing", "preset", "high", str(out), "--tokens", "20")
    assert rc == 0 and out.exists(), err
    # bench policy's synthetic traces: --layers 100000 was killed by the OOM killer.
    rc, err = run_cli(capsys, "bench", "policy", "--quick", "--layers", "100000")
    assert rc == 2 and "--layers 100000 --shapes 64x6" in err and "fewer tokens, layers or experts" in err, err


def test_bench_policy_names_the_first_shape_too_large_to_generate(monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """The ids grow with each shape's top-k: the refusal names the first shape whose trace does not
    fit, and without presets (traces from files only) nothing is generated, so nothing is refused."""
    from asyncside import memory

    monkeypatch.setattr(memory, "available_memory", lambda: memory.MemoryBudget(64 << 20, "test"))
    shape_args = ["--tokens", "1000", "--layers", "100", "--shapes", "64x1,64x2,64x4,64x8"]  # 256 B an id
    rc, err = run_cli(capsys, "bench", "policy", *shape_args)
    assert rc == 2 and "--shapes 64x4:" in err and "400000 expert ids" in err and "Traceback" not in err, err
    rc, err = run_cli(capsys, "bench", "policy", *shape_args, "--presets", "")
    assert rc == 2 and "nothing to replay" in err and "expert ids" not in err, err


@pytest.mark.parametrize(("variable", "value"), [
    ("ASYNCSIDE_ROWS_CONCURRENCY", "abc"), ("ASYNCSIDE_ROWS_CONCURRENCY", "0"), ("ASYNCSIDE_ROWS_CONCURRENCY", "-1"),
    ("ASYNCSIDE_ROWS_CONCURRENCY", "\u00b2"), ("ASYNCSIDE_DIRECT_DECODE_TOKENS", "-1"),
    ("ASYNCSIDE_DIRECT_DECODE_TOKENS", "x"), ("ASYNCSIDE_DIRECT", "maybe"), ("ASYNCSIDE_READER", "spdk"),
])
def test_python_read_variables_are_refused_before_anything_loads(variable: str, value: str, tmp_path: pathlib.Path,
                                                                 monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """docs/api.md: a bad ASYNCSIDE_* value is a one-line usage error before anything loads. The
    variables read from Python were read where used: ``serve`` with ASYNCSIDE_ROWS_CONCURRENCY=abc
    loaded the model, then failed its startup with a traceback group (exit status 1); ``demo``
    ignored it; a superscript digit passed str.isdigit and ended in int()'s ValueError."""
    from asyncside.errors import EnvVarError
    from asyncside.native_env import check_env

    monkeypatch.setenv(variable, value)
    missing = tmp_path / "no-such-store"  # never reached: the variable is refused first
    for command in (["serve", "--model", str(missing)], ["demo", "--model", str(missing)]):
        rc, err = run_cli(capsys, *command)
        assert rc == 2 and f"environment: {variable}: expected" in err and repr(value) in err, (command, err)
        assert "no-such-store" not in err and "Traceback" not in err
    with pytest.raises(EnvVarError, match=variable):
        check_env()


@pytest.mark.parametrize(("variable", "value"), [
    ("ASYNCSIDE_ROWS_CONCURRENCY", " 3 "), ("ASYNCSIDE_ROWS_CONCURRENCY", "OFF"), ("ASYNCSIDE_ROWS_CONCURRENCY", ""),
    ("ASYNCSIDE_DIRECT_DECODE_TOKENS", "0"), ("ASYNCSIDE_DIRECT", "Yes"), ("ASYNCSIDE_READER", "threads"),
])
def test_python_read_variables_accept_what_their_readers_take(variable: str, value: str,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from asyncside.native_env import check_env
    from asyncside.serving.kv_budget import rows_concurrency

    monkeypatch.setenv(variable, value)
    check_env()
    if variable == "ASYNCSIDE_ROWS_CONCURRENCY":
        assert rows_concurrency(None, None) == {" 3 ": 3, "OFF": None, "": None}[value]


_READ_AS_CHECKED = {
    "ASYNCSIDE_READER": ["threads", " aiofiles ", "", " ", "AIOFILES", "mmap", "auto"],
    "ASYNCSIDE_DIRECT": ["1", " TRUE ", "no", "", "2", "on", "maybe"],
    "ASYNCSIDE_DIRECT_DECODE_TOKENS": ["0", " 7 ", "", "-1", "1.5", "x", "\u00b2"],
    "ASYNCSIDE_ROWS_CONCURRENCY": ["auto", " Off ", "", "4", "0", "-2", "+3", "\u00b2", "many"],
}


@pytest.mark.parametrize(("variable", "value"), [(v, x) for v, xs in _READ_AS_CHECKED.items() for x in xs])
def test_python_read_variables_are_read_as_they_are_checked(variable: str, value: str,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """check_env refuses a value exactly when the variable's reader would: the command line checks
    before anything loads, the reader when the value is used."""
    from asyncside.native_env import check_env
    from asyncside.readers import _env_direct, choose_reader
    from asyncside.runtime._queued import direct_decode_tokens
    from asyncside.serving.kv_budget import rows_concurrency

    readers = {"ASYNCSIDE_READER": lambda: choose_reader("auto"), "ASYNCSIDE_DIRECT": _env_direct,
               "ASYNCSIDE_DIRECT_DECODE_TOKENS": direct_decode_tokens,
               "ASYNCSIDE_ROWS_CONCURRENCY": lambda: rows_concurrency(None, None)}
    monkeypatch.setenv(variable, value)
    try:
        check_env()
        checked = True
    except ValueError:
        checked = False
    try:
        readers[variable]()
        read = True
    except ValueError:
        read = False
    assert checked == read, (variable, value, checked, read)


@pytest.mark.parametrize(("option", "value"), [
    ("--duration", "0"), ("--duration", "nan"), ("--duration", "inf"), ("--warmup", "-1"), ("--warmup", "nan"),
    ("--warmup", "inf"), ("--warmup", "soon"), ("--max-tokens", "0"), ("--long-prompt", "-1"),
])
def test_bench_serve_numbers_are_checked_when_parsed(option: str, value: str,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """``bench serve --duration 0`` printed a bare message and exited 1 once its options were checked
    (--duration inf was taken); now a usage error (exit status 2) naming the option."""
    rc, err = run_cli(capsys, "bench", "serve", option, value)
    assert rc == 2 and f"argument {option}" in err and "Traceback" not in err, err


def test_bench_serve_warmup_takes_a_finite_number_at_least_0() -> None:
    """--warmup is argtypes.nonnegative_float: 0 is no warm-up; worded as --duration's positive_float."""
    import argparse

    from asyncside.argtypes import nonnegative_float
    from asyncside.bench.serve import add_serve_bench_arguments

    parser = argparse.ArgumentParser()
    add_serve_bench_arguments(parser)
    assert parser.parse_args(["--warmup", "0"]).warmup == 0.0
    assert parser.parse_args(["--warmup", "2.5"]).warmup == 2.5
    for bad in ("-0.5", "nan", "inf", "-inf", "soon", ""):
        with pytest.raises(argparse.ArgumentTypeError, match=f"expected a finite number >= 0, got {bad!r}"):
            nonnegative_float(bad)


def test_bench_serve_refusals_after_parsing_are_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    rc, err = run_cli(capsys, "bench", "serve", "--predictor", "trace", "--no-mlx-lm")
    assert rc == 2 and err.startswith("asyncside bench serve: error: --predictor trace needs --routing"), err


def test_bench_serve_refuses_prompts_past_the_context() -> None:
    """``bench serve --prompt-lengths 5000`` on a model of 4096 positions: every request came back
    400 context_length_exceeded, the table said 0 tokens/s, and the exit status was 0."""
    import argparse

    from asyncside.bench import BENCHES
    from asyncside.bench.serve import _check_context

    args = argparse.Namespace(prompt_lengths=[8, 5000], max_tokens=4, long_prompt=4093)
    with pytest.raises(ValueError, match=r"^--prompt-lengths 5000, --long-prompt 4093 with --max-tokens 4: .*"
                                         r"context of 4096 .* at most 4092 prompt tokens"):
        _check_context(args, 4096, [0, 4093])
    args.prompt_lengths = [8, 4092]
    _check_context(args, 4096, [0, 0])  # the long prompt not sent, the rest fits
    _check_context(args, None, [4093])  # no context known: the server refuses nothing either
    ok = BENCHES["serve"].ok
    assert not ok({"phases": [{"server": "asyncside", "requests_done": 0, "errors": ["HTTP 400"]},
                              {"server": "asyncside", "requests_done": 3}]})
    assert ok({"phases": [{"server": "asyncside", "requests_done": 2}, {"server": "mlx_lm.server", "requests_done": 0}]})


@pytest.mark.parametrize(("kwargs", "said"), [
    ({"memory": "1.5"}, "memory '1.5' is 1 byte; expected at least 4K"),
    ({"memory": 1.5}, "memory 1.5 is 1 byte; expected at least 4K"),
    ({"memory": "0"}, "memory '0' is 0 bytes"),
    ({"resident": [0.5]}, "resident: expected a fraction in [0, 1] or 'auto', got [0.5]"),
    ({"resident": "half"}, "resident: expected a fraction"),
])
def test_load_refuses_what_the_command_line_refuses(kwargs: dict[str, object], said: str,
                                                    tmp_path: pathlib.Path) -> None:
    """``load(store, memory="1.5")`` (a byte and a half) got past the arguments' check and failed in
    the plan ("the memory budget is 0.0 MiB"), where ``--memory 1.5`` says what was meant;
    ``resident=[0.5]`` raised float()'s TypeError naming no argument. Both are refused before the
    model is looked for (the path here does not exist)."""
    import asyncside

    with pytest.raises(ValueError) as info:
        asyncside.load(tmp_path / "never-looked-for", progress=False, **kwargs)  # type: ignore[arg-type]
    assert said in str(info.value)


def test_load_says_what_a_path_that_is_no_model_is(tmp_path: pathlib.Path) -> None:
    """A file (a trace, a store's own manifest.json) or an empty directory was "neither an expert
    store (manifest.json) nor an mlx-lm model directory (config.json)"."""
    import asyncside
    from asyncside.hub import ModelNotFoundError

    trace = tmp_path / "trace.npz"
    trace.write_bytes(b"PK")
    store = tmp_path / "store"
    store.mkdir()
    (store / "manifest.json").write_text("{}")
    empty = tmp_path / "empty"
    empty.mkdir()
    for path, said in ((trace, "trace.npz is a file; expected an expert store"),
                       (store / "manifest.json", f"manifest.json is a file: pass its directory, {store}"),
                       (empty, "empty is an empty directory; expected an expert store")):
        with pytest.raises(ModelNotFoundError) as info:
            asyncside.load(path, progress=False)
        assert said in str(info.value), str(info.value)


def test_a_reader_that_goes_away_ends_the_command_without_a_traceback(tmp_path: pathlib.Path) -> None:
    """``asyncside routing info T --json | head -2`` ended in a BrokenPipeError traceback."""
    import subprocess
    import sys

    trace = tmp_path / "t.npz"
    np.savez(trace, ids=np.array([[[0, 1]], [[2, 3]]], dtype=np.int64), n_experts=4)
    proc = subprocess.Popen([sys.executable, "-m", "asyncside", "routing", "info", str(trace), "--json", "--no-min"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # before the command writes: its first write meets a pipe nobody reads
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141 and "Traceback" not in err and "BrokenPipe" not in err, err


def test_offload_says_no_cgroup_before_building(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where no memory cgroup can be made, bench offload built every shape (minutes, GBs) before
    saying so; now it says so first and builds nothing."""
    from asyncside.bench import offload, shapes

    config = tmp_path / "my-moe" / "config.json"
    config.parent.mkdir()
    config.write_text('{"model_type": "qwen3_moe", "hidden_size": 256, "intermediate_size": 1024, '
                      '"moe_intermediate_size": 128, "num_hidden_layers": 8, "num_experts": 16, '
                      '"num_experts_per_tok": 2, "num_attention_heads": 8, "num_key_value_heads": 2, '
                      '"vocab_size": 512, "rope_theta": 1e6, "rms_norm_eps": 1e-6}')
    built: list[object] = []
    monkeypatch.setattr(shapes, "ensure_shape", lambda *a, **k: built.append(a) or pytest.fail("built"))
    monkeypatch.setattr(offload, "check_cgroups", lambda limit: (False, "no cgroup here"))
    # asyncside's smallest plan counts what this process holds: fixed, so the store ratio below
    # passes however much a long test session has grown the process
    from asyncside import memory

    held = memory.proc_self_bytes
    monkeypatch.setattr(memory, "proc_self_bytes",
                        lambda f, k: 100 << 20 if (f, k) == ("status", "VmRSS") else held(f, k))
    args = offload_args("--shapes", f"{config}:2", "--store-ratio", "0.001", "--cache-dir", str(tmp_path / "c"),
                        "--quiet")
    with pytest.raises(offload.CgroupError, match="no cgroup here .nothing was built"):
        offload.run_offload_bench(args)
    assert built == []


def test_a_budget_too_small_for_any_process_is_not_called_a_cgroup_failure() -> None:
    """``bench offload --memory 64K``: /bin/true, moved into the cgroup, is killed by its OOM killer;
    that was reported as "cannot move a process into ...: " with no reason."""
    from asyncside.bench import offload

    ok, why = offload.check_cgroups(1 << 30)
    if not ok:
        pytest.skip(f"no memory cgroup can be made here: {why}")
    ok, why = offload.check_cgroups(64 << 10)
    assert not ok and "killed (out of memory)" in why and "65536 bytes" in why, why


@pytest.mark.parametrize(("breakage", "file", "said"), [
    ("no config", "config.json", "the model's config is missing"),
    ("config not JSON", "config.json", "cannot be loaded from this store: Expecting"),
    ("weights truncated", "model.safetensors", "cannot be loaded from this store: [load_safetensors]"),
    ("a weight left out", "model.safetensors", "cannot be loaded from this store: Missing 1 parameters: lm_head"),
])
def test_a_store_whose_model_files_are_broken_names_the_file(breakage: str, file: str, said: str,
                                                             quick_store: pathlib.Path, tmp_path: pathlib.Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """A store without its config.json, or with a truncated model.safetensors, ended demo in a
    FileNotFoundError or MLX RuntimeError traceback and failed serve's startup with one in the log."""
    import shutil

    import mlx.core as mx

    store = tmp_path / "store"
    shutil.copytree(quick_store, store)
    if breakage == "no config":
        (store / "config.json").unlink()
    elif breakage == "config not JSON":
        (store / "config.json").write_text("{")
    elif breakage == "weights truncated":
        data = (store / "model.safetensors").read_bytes()
        (store / "model.safetensors").write_bytes(data[:1000])
    else:
        weights = mx.load(str(store / "model.safetensors"))
        assert isinstance(weights, dict)
        del weights["lm_head.biases"]
        mx.save_safetensors(str(store / "model.safetensors"), weights)
    for command in (["demo", "--tokens", "2"], ["serve", "--port", "0"]):
        rc, err = run_cli(capsys, *command, "--model", str(store))
        assert rc in (1, 2) and f"{store / file}: " in err and said in err, (command, err)
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize(("stop", "said"), [
    (["a", None], "'stop[1]' must be a string"), ([5], "'stop[0]' must be a string"),
    (5, "'stop' must be a string or a list of strings, got int"),
])
def test_a_stop_list_names_the_entry_at_fault(stop: object, said: str) -> None:
    """``"stop": ["a", null]`` was refused as "'stop' must be a string or a list of strings, got
    list": a list it was."""
    from asyncside.serving.protocol import RequestError, parse_completion

    with pytest.raises(RequestError) as info:
        parse_completion({"model": "m", "prompt": "hi", "stop": stop}, served_models=["m"])
    assert said in str(info.value) and info.value.param == "stop", str(info.value)


def test_the_slot_cache_gets_a_fraction_when_asyncside_gives_it_no_rows(quick_store: pathlib.Path) -> None:
    """On a store far smaller than the budget (--store-ratio for a quick check), with asyncside's
    run refused (a --tokens whose KV cache passes the plan's allowance), the slot cache was given
    budget / 2 / store = 541 of each layer's experts and refused: "resident: expected a fraction in
    [0, 1], got 541.75"."""
    from _offload_support import offload_budget

    from asyncside.bench import offload

    budget = offload_budget(700 * 2**20)
    ok, why = offload.check_cgroups(budget)
    if not ok:
        pytest.skip(f"no memory cgroup can be made here: {why}")

    args = offload_args("--stores", str(quick_store), "--memory", str(budget), "--store-ratio", "0.001",
                        "--seconds", "1", "--tokens", "100000000", "--systems", "asyncside,slot-cache",
                        "--localities", "low", "--quiet")
    runs = {r["system"]: r for r in offload.run_offload_bench(args)["runs"]}
    if runs["asyncside"]["status"] == "ok":
        pytest.skip("asyncside's run was not refused here: the slot cache got its rows")
    assert "resident" not in runs["slot-cache"]["status"], runs["slot-cache"]["status"]
    assert runs["slot-cache"]["status"] == "ok", runs["slot-cache"]["status"]


@pytest.mark.parametrize("command", [["demo", "--reference", "none"], ["bench", "generate", "--modes", "default"]])
def test_a_prompt_of_no_tokens_is_refused(command: list[str], quick_store: pathlib.Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    """``demo --prompt ''`` and ``bench generate --prompt ''`` ended in generate's ValueError
    traceback (prompt_ids is empty)."""
    rc, err = run_cli(capsys, *command, "--model", str(quick_store), "--prompt", "", "--tokens", "2")
    assert rc == 2 and "--prompt '' encodes to no tokens" in err and "Traceback" not in err, err


def test_serve_says_a_trace_of_another_shape_is_mapped(quick_store: pathlib.Path, tmp_path: pathlib.Path) -> None:
    """``serve --routing`` with an 8-layer, 64-expert top-6 trace on a 2-layer, 32-expert top-4
    model replayed it mapped onto the model and said nothing (demo says so since the first sweep):
    the engine's description (/health, bench serve's JSON) holds the file's shape and a note, and
    serve prints the note at start."""
    import anyio

    from asyncside.routing import preset
    from asyncside.serving import open_engine

    other = tmp_path / "other.npz"
    preset("high", tokens=20, n_layers=8, n_experts=64, top_k=6).save(other)

    async def described(trace: pathlib.Path) -> dict[str, object]:
        async with open_engine(str(quick_store), routing=trace, resident=0.5) as engine:
            return dict(engine.description["routing"])

    routing = anyio.run(described, other)
    assert routing["file"] == "other.npz" and routing["source_shape"] == {"n_layers": 8, "n_experts": 64, "top_k": 6}
    assert routing["mapped_from"] == routing["source_shape"]
    assert "8 layers x 64 experts top-6 mapped onto the model's 2 MoE layers x 32 experts top-4" in str(routing["note"])
    own = tmp_path / "own.npz"
    preset("high", tokens=20, n_layers=2, n_experts=32, top_k=4).save(own)
    routing = anyio.run(described, own)
    assert routing["mapped_from"] is None and routing["note"] is None


def test_widen_names_a_bad_seed() -> None:
    """``RoutingTrace.widen(3, seed=-1)`` raised numpy's "expected non-negative integer"."""
    from asyncside import RoutingTrace

    trace = RoutingTrace(np.array([[[0, 1]]]), np.array([1]), 4, {})
    for seed in (-1, 1.5, "0"):
        with pytest.raises(ValueError, match="widen: seed must be an int >= 0"):
            trace.widen(3, seed=seed)  # type: ignore[arg-type]
    assert trace.widen(3, seed=np.int64(7)).top_k == 3


@pytest.mark.parametrize(("change", "said"), [
    ({"num_experts": None}, "config.json: mlx-lm cannot build a 'qwen3_moe' model from it: TypeError"),
    ({"model_type": "llama4_weird"}, "model_type 'llama4_weird' is not supported"),
])
def test_converting_a_model_whose_config_mlx_lm_cannot_take_is_one_line(
        change: dict[str, object], said: str, quick_store: pathlib.Path, tmp_path: pathlib.Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A model directory whose config.json lacks num_experts (or names an architecture mlx-lm does
    not know) ended demo, on its first-use conversion, in mlx-lm's TypeError or ValueError traceback."""
    import json
    import shutil

    model = tmp_path / "model"
    shutil.copytree(quick_store.parent / "model", model)
    config = json.loads((model / "config.json").read_text())
    for key, value in change.items():
        if value is None:
            config.pop(key)
        else:
            config[key] = value
    (model / "config.json").write_text(json.dumps(config))
    rc, err = run_cli(capsys, "demo", "--model", str(model), "--cache-dir", str(tmp_path / "cache"), "--tokens", "2")
    assert rc == 2 and said in err and "Traceback" not in err, err
    assert not any(p.is_dir() for p in (tmp_path / "cache" / "stores").glob("*")), "no store left behind"


def test_the_demo_names_tokens_when_the_kv_allowance_cannot_hold_them(quick_store: pathlib.Path,
                                                                      capsys: pytest.CaptureFixture[str],
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """``demo --memory 3G --tokens 10000000``: the refusal named the API's ``max_tokens=``, an
    argument the command line does not have; it names --tokens (the API keeps its own word)."""
    from asyncside.runtime import _plan

    # The 3G is the runtime's alone: what this test process holds by now (the suite before it, up
    # to 2.9 GiB under load) would leave no room for the pools' headroom and refuse for that instead.
    monkeypatch.setattr(_plan, "_resident_now", lambda: 0)
    rc, err = run_cli(capsys, "demo", "--model", str(quick_store), "--memory", "3G", "--tokens", "10000000",
                      "--reference", "none", "--quiet")
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("asyncside demo: --tokens 10000000 after a prompt of ") and "new tokens fit" in err, err
    assert "max_tokens" not in err, err
    # Without --quiet the plan and the prompt are printed first: the line ends before the refusal
    # (the streaming run's own refusal, here without the early one before the reference).
    import asyncside.demo as demo
    from asyncside import cli

    monkeypatch.setattr(demo, "refuse_early", lambda *a: None)

    assert cli.main(["demo", "--model", str(quick_store), "--memory", "3G", "--tokens", "10000000",
                     "--reference", "none"]) == 2
    out = capsys.readouterr().out
    assert out.endswith("\n") and "--tokens" not in out, out


def test_the_demo_refuses_tokens_the_kv_allowance_cannot_hold_before_its_reference_run(
        quick_store: pathlib.Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """With the all-resident reference, ``demo --memory 3G --tokens 10000000`` generated the
    reference's ten million tokens (minutes of silence) before the streaming run refused them: the
    plan's refusal now comes before any reference run."""
    import asyncside.demo as demo
    from asyncside.runtime import _plan

    monkeypatch.setattr(_plan, "_resident_now", lambda: 0)  # the 3G is the runtime's alone (as above)

    def no_reference(*a: object, **k: object) -> None:
        raise AssertionError("the reference ran before the refusal")

    monkeypatch.setattr(demo, "reference_run", no_reference)
    monkeypatch.setattr(demo, "slot_cache_run", no_reference)
    rc, err = run_cli(capsys, "demo", "--model", str(quick_store), "--memory", "3G", "--tokens", "10000000",
                      "--reference", "all-resident", "--quiet")
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("asyncside demo: --tokens 10000000 after a prompt of ") and "new tokens fit" in err, err


@pytest.mark.parametrize("command", [["demo"], ["bench", "generate", "--quick", "--plot", "none"]])
def test_a_store_without_tokenizer_files_is_one_line_naming_the_store(command: list[str], quick_store: pathlib.Path,
                                                                     tmp_path: pathlib.Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """demo and bench generate on a store whose tokenizer files were left out ended in an
    AttributeError traceback (the prompt encoded by None); serve already refused such a store."""
    import shutil

    store = tmp_path / "store"
    shutil.copytree(quick_store, store)
    for f in [*store.glob("tokenizer*"), *store.glob("special_tokens_map.json")]:
        f.unlink()
    rc, err = run_cli(capsys, *command, "--model", str(store), "--tokens", "2")
    assert rc in (1, 2) and err.count("\n") == 1 and "Traceback" not in err, err  # as other broken stores
    assert str(store) in err and "holds no tokenizer files" in err and "--prompt cannot be encoded" in err, err


def test_under_a_budget_the_reference_runs_all_resident_only_if_the_streaming_run_fits_after_it(
        quick_store: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``demo --memory`` with the pools sized by the plan (``resident`` auto) chose the all-resident
    reference on the model's size alone: the process then held the model's pages beside what it
    held before, past the budget (the streaming run was refused after the reference, or the
    reference's peak passed the budget). The smallest pools and the headroom now count as a
    fractional ``resident``'s pools did."""
    import asyncside.memory as memory
    from asyncside.demo import choose_reference
    from asyncside.store import ExpertStore

    store = ExpertStore.open(quick_store)
    model = sum(store.layer(i).blob_bytes for i in store.layers) + sum(
        f.stat().st_size for f in quick_store.glob("*.safetensors"))
    monkeypatch.setattr(memory, "proc_self_bytes", lambda *a: 100 << 20)
    tight = 2 * model + (64 << 20)  # the model fits half of it, not the process, pools and headroom beside it
    chosen, why = choose_reference(store, "auto", tight, "auto")
    assert chosen == "slot-cache" and "streaming run would need" in why, why
    roomy = min(8 << 30, memory.available_memory().available)
    if 100 * (1 << 20) + model + memory.MIN_HEADROOM + (256 << 20) < roomy:
        assert choose_reference(store, "auto", roomy, "auto")[0] == "all-resident"
    assert choose_reference(store, "auto", None, "auto")[0] == "all-resident"  # no budget: as before
