"""The larger-than-memory path on inputs the repository never made: numbers typed at the options,
shapes and routing traces written by hand, budgets from absurd to roomy. Every bad input is a
one-line usage error (exit status 2) naming the option or the file; nothing ends in a traceback.
"""

from __future__ import annotations

import argparse
import pathlib

import pytest
from _cli_support import offload_args, run_cli

from asyncside import cli
from asyncside.bench import offload

MB = 1_000_000


@pytest.mark.parametrize(("option", "value"), [
    ("--seconds", "0"), ("--seconds", "-1"), ("--seconds", "nan"), ("--seconds", "inf"),
    ("--tokens", "0"), ("--tokens", "-3"), ("--timeout", "0"), ("--timeout", "nan"),
    ("--store-ratio", "0"), ("--store-ratio", "-1"), ("--store-ratio", "nan"), ("--store-ratio", "many"),
])
def test_offload_numbers_are_checked_when_parsed(option: str, value: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A zero, negative or NaN --seconds/--tokens/--timeout/--store-ratio was taken (a ratio of 0 then
    divided by zero, NaN failed converting to an int, after the shapes were built): a usage error."""
    rc, err = run_cli(capsys, "bench", "offload", "--shapes", "no-such-shape:2", option, value)
    assert rc == 2, err
    last = err.strip().splitlines()[-1]
    assert option in last and value in last and "Traceback" not in err


@pytest.mark.parametrize(("argv", "words"), [
    (["--localities", "lowish"], ["--localities", "lowish", "low, middle, high"]),
    (["--systems", "vllm"], ["--systems", "vllm", "asyncside"]),
    (["--localities", ""], ["--localities", "--routing"]),
])
def test_offload_unknown_names_are_usage_errors(argv: list[str], words: list[str],
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """An unknown preset or system, or nothing to replay, exited with status 1 like a failed run."""
    rc, err = run_cli(capsys, "bench", "offload", "--shapes", "no-such-shape:2", *argv)
    assert rc == 2, err
    assert len(err.strip().splitlines()) == 1 and all(w in err for w in words), err


def test_python_m_offload_says_a_usage_error_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """``python -m asyncside.bench.offload`` refuses as ``asyncside bench offload`` does (no traceback)."""
    rc = offload.main(["--systems", "vllm"])
    err = capsys.readouterr().err
    assert rc == 2 and "--systems" in err and "Traceback" not in err, err


def _shape(layers: int, *, experts: int = 64, top_k: int = 8, record_mb: float = 10.0, max_layers: int = 48,
           spec: str | None = "/models/my-moe") -> dict[str, object]:
    """A shape's row as bench offload makes it: ``layers`` MoE layers of ``experts`` records of
    ``record_mb``, 50 MB of other weights, built from ``spec`` (as typed), of ``max_layers`` at most."""
    expert = int(layers * experts * record_mb * MB)
    return {"shape": "my-moe", "spec": spec, "moe_layers": layers, "max_layers": max_layers, "top_k": top_k,
            "record_bytes": int(record_mb * MB), "experts_per_layer": experts, "store_bytes": expert + 50 * MB,
            "expert_bytes": expert, "store": "/stores/my-moe"}


def _budget_args(memory: int | None = None, ratio: float = 4.0, stores: bool = False) -> argparse.Namespace:
    return argparse.Namespace(memory=memory, store_ratio=ratio, stores=["x"] if stores else None)


def _layers_said(message: str, spec: str) -> int:
    import re

    found = re.search(re.escape(f"(--shapes {spec}:") + r"(\d+)\)", message)
    assert found, message
    return int(found.group(1))


@pytest.mark.parametrize("memory", [None, 3000 * MB])
def test_a_store_too_small_for_the_budget_says_the_layers_that_fit(memory: int | None) -> None:
    """The refusal named `--shapes my-moe:N` (the config's label, not the path typed, and no N) and
    advised `less --memory` where the budget was no --memory but asyncside's smallest plan. It now
    names the shape as typed and the layer count that passes, and is a usage error (a ValueError
    naming the option: exit status 2)."""
    small = _shape(2)
    with pytest.raises(ValueError) as info:
        offload.choose_budget(_budget_args(memory), [small], False)
    message = str(info.value)
    assert message.startswith("--"), message
    n = _layers_said(message, "/models/my-moe")
    assert n > 2
    if memory is None:
        assert "less --memory" not in message
    # What it says fits does, and one layer fewer does not (the count is the least).
    assert offload.choose_budget(_budget_args(memory), [_shape(n)], False) > 0
    with pytest.raises(ValueError):
        offload.choose_budget(_budget_args(memory), [_shape(n - 1)], False)


def test_a_shape_whose_top_k_is_a_quarter_of_its_experts_never_fits_four_budgets() -> None:
    """Mixtral's 8 experts top-2: the smallest pools are a quarter of every layer already, so no
    layer count makes the store 4x asyncside's smallest plan; the refusal says so and names the
    --store-ratio that can pass, instead of sending the user after more layers."""
    mixtral = _shape(2, experts=8, top_k=2, record_mb=110.0, max_layers=32)
    with pytest.raises(ValueError) as info:
        offload.choose_budget(_budget_args(), [mixtral], False)
    message = str(info.value)
    assert "no number of layers" in message and "--store-ratio" in message and "top-2 of 8" in message, message


def test_more_layers_than_the_model_has_is_said() -> None:
    """A layer count above the model's own is not advised as if it could be built."""
    few = _shape(2, max_layers=3)
    with pytest.raises(ValueError) as info:
        offload.choose_budget(_budget_args(), [few], False)
    message = str(info.value)
    assert "has 3 MoE layers" in message and "(--shapes /models/my-moe:" not in message, message


def test_stores_too_small_name_the_store_and_the_way_out() -> None:
    with pytest.raises(ValueError) as info:
        offload.choose_budget(_budget_args(stores=True), [_shape(2, spec=None)], False)
    message = str(info.value)
    assert message.startswith("--stores /stores/my-moe") and "--store-ratio" in message, message


def test_a_refused_run_keeps_the_whole_refusal_in_its_status() -> None:
    """A run refused at start (an --memory below asyncside's plan) ends in a traceback whose last
    line is the refusal; the status kept the last 400 characters of the last three lines, so it
    began mid-word ('r: the pools need ...'). It is now the error itself, whole: its type and message."""
    import sys

    reason = "the pools need 45.0 MiB and 256.0 MiB of headroom, " + "so the budget must leave more; " * 12 + "end"
    script = (f"import sys; print('PHASE loading', file=sys.stderr, flush=True)\n"
              f"class AsyncsideError(Exception): pass\n"
              f"raise AsyncsideError({reason!r})")
    run = offload._child({"system": "probe"}, None, 60, command=[sys.executable, "-c", script])
    assert run["status"] == f"exit status 1 while loading: AsyncsideError: {reason}", run["status"]


def test_a_bench_offload_where_no_run_finished_fails() -> None:
    """``--memory 100M``: every run refused or killed by the OOM killer printed a table of failures
    and exited 0 ("tokens identical", having compared none). No run finished: exit status 1."""
    from asyncside.bench import BENCHES

    ok = BENCHES["offload"].ok
    killed = {"status": "killed by the cgroup's OOM killer while loading (limit 105 MB)", "tokens": []}
    assert not ok({"tokens_identical": True, "runs": [killed, dict(killed)]})
    assert ok({"tokens_identical": True, "runs": [killed, {"status": "ok", "tokens": [1, 2]}]})
    assert not ok({"tokens_identical": False, "runs": [{"status": "ok", "tokens": [1, 2]}]})


@pytest.mark.parametrize(("argv", "said", "unsaid"), [
    # One condition broken: the message named both, the one that holds as if it did not.
    (["--experts", "4", "--top-k", "8"], "--top-k 8 must be at most --experts 4", "--sequences"),
    (["--tokens", "3", "--sequences", "5"], "--tokens 3 must be at least --sequences 5", "--experts"),
    # Past the format's limit: named '<in memory> [n_experts]' rather than the option.
    (["--experts", "2000000"], "--experts", "<in memory>"),
])
def test_routing_preset_names_the_option_at_fault(argv: list[str], said: str, unsaid: str, tmp_path: pathlib.Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    rc, err = run_cli(capsys, "routing", "preset", "low", str(tmp_path / "out.npz"), *argv)
    assert rc == 2, err
    last = err.strip().splitlines()[-1]
    assert said in last and unsaid not in last, last
    assert not (tmp_path / "out.npz").exists()


def test_min_starts_from_the_rows_a_run_starts_with() -> None:
    """Belady's MIN from empty rows is beaten by a runtime whose rows start warm: a hand-written
    trace of one token (every position the same experts) gave asyncside 'of MIN' 1.05x. MIN given
    the same starting contents is the bound again."""
    from asyncside.models.trace import belady

    demands = [{1, 2}] * 6
    assert belady(demands, [], 2).misses == 2  # from empty: both cold
    assert belady(demands, [], 2, initial=[1]).misses == 1
    assert belady(demands, [], 2, initial=[1, 2]).misses == 0
    # Starting contents never used again are worth nothing and make room as empty rows do.
    assert belady([{3, 4}, {3, 4}], [], 2, initial=[1, 2]).misses == 2


def test_of_min_is_at_most_one_on_a_one_token_trace(quick_store: pathlib.Path, tmp_path: pathlib.Path) -> None:
    """End to end under a cgroup: a trace whose single token repeats at every position (the rows
    the runtime warms at start may already hold some of its experts)."""
    import numpy as np
    from _offload_support import offload_budget

    budget = offload_budget(700 * 2**20)
    ok, why = offload.check_cgroups(budget)
    if not ok:
        pytest.skip(f"no memory cgroup can be made here: {why}")
    trace = tmp_path / "one.npz"
    np.savez(trace, ids=np.array([[[0, 1, 2, 3]] * 2], dtype=np.int64), n_experts=32)
    res = offload.run_offload_bench(offload_args("--stores", str(quick_store), "--memory", str(budget),
                                                  "--store-ratio", "0.001", "--seconds", "2", "--tokens", "8",
                                                  "--systems", "asyncside", "--routing", str(trace), "--quiet"))
    (run,) = res["runs"]
    assert run["status"] == "ok" and run["tokens_match_reference"] is True, run
    assert run["of_min"] is not None and run["of_min"] <= 1.0, (run["hit_rate"], run["belady"], run.get("warm_experts"))


def test_demo_says_how_a_trace_of_another_shape_is_replayed(quick_store: pathlib.Path, tmp_path: pathlib.Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """40 one-token sequences of a 3-layer, 128-expert top-8 trace on a smaller model: the demo
    replayed sequence 0 (one token, at every position) mapped onto the model and said neither; its
    JSON held the file's meta alone. It now says the sequence, the wrap and the mapping."""
    import json

    import numpy as np

    rng = np.random.default_rng(0)
    ids = np.stack([np.stack([rng.choice(128, 8, replace=False) for _ in range(3)]) for _ in range(40)])
    trace = tmp_path / "short.npz"
    np.savez(trace, ids=ids, n_experts=128, lengths=np.ones(40, dtype=np.int64))
    rc = cli.main(["demo", "--model", str(quick_store), "--routing", str(trace), "--tokens", "3", "--json",
                   "--reference", "none"])
    out = capsys.readouterr().out
    assert rc == 0
    routing = json.loads(out)["routing"]
    assert routing["sequence"] == 0 and routing["sequences"] == 40 and routing["sequence_tokens"] == 1
    assert routing["source_shape"] == {"n_layers": 3, "n_experts": 128, "top_k": 8}
    assert routing["mapped_from"] == routing["source_shape"]
    assert "sequence 0 of 40" in routing["note"] and "mapped onto" in routing["note"]


def _write_config(directory: pathlib.Path, **fields: object) -> pathlib.Path:
    import json

    config: dict[str, object] = {
        "model_type": "qwen3_moe", "hidden_size": 256, "intermediate_size": 1024, "moe_intermediate_size": 128,
        "num_hidden_layers": 8, "num_experts": 16, "num_experts_per_tok": 2, "num_attention_heads": 8,
        "num_key_value_heads": 2, "vocab_size": 512, "rope_theta": 1e6, "rms_norm_eps": 1e-6}
    config.update(fields)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_a_shape_too_large_to_build_says_the_layers_that_fit(tmp_path: pathlib.Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The refusal said '(fewer layers: --layers N)', even where one layer alone does not fit (a
    config of 100,000 experts a layer). It now names the most layers that fit, or says none does."""
    import types

    import asyncside.memory
    from asyncside.bench import shapes
    from asyncside.memory import MemoryBudget

    monkeypatch.setattr(shapes.shutil, "disk_usage", lambda path: types.SimpleNamespace(free=10**13))
    monkeypatch.setattr(asyncside.memory, "available_memory", lambda: MemoryBudget(24 * 2**30, "MemAvailable"))
    with pytest.raises(shapes.ShapeTooLargeError) as info:
        shapes.ensure_shape("mixtral-8x7b", vocab=512, cache_dir=tmp_path, progress=False)
    import re

    found = re.search(r"--layers (\d+) or fewer", str(info.value))
    assert found, str(info.value)
    k = int(found.group(1))
    need = [shapes.estimate_bytes(shapes.shape_spec("mixtral-8x7b", layers=n, vocab=512))["build_memory"]
            for n in (k, k + 1)]
    assert need[0] <= 24 * 2**30 < need[1]

    huge = _write_config(tmp_path / "huge", num_experts=100_000)
    with pytest.raises(shapes.ShapeTooLargeError) as info:
        shapes.ensure_shape(str(huge), layers=2, vocab=512, cache_dir=tmp_path, progress=False)
    assert "even one layer" in str(info.value) and "--layers N" not in str(info.value), str(info.value)

    monkeypatch.setattr(shapes.shutil, "disk_usage", lambda path: types.SimpleNamespace(free=10**9))
    with pytest.raises(shapes.ShapeTooLargeError, match=r"--layers \d+ or fewer"):
        shapes.ensure_shape("qwen3-30b-a3b", layers=8, vocab=512, cache_dir=tmp_path / "fresh", progress=False)
    assert not any(p.name.startswith("shape-") for p in tmp_path.iterdir())


@pytest.mark.parametrize("argv", [["bench", "offload", "--localities", "low", "--stores"],
                                  ["bench", "generate", "--tokens", "2", "--model"]])
@pytest.mark.parametrize("what", ["missing", "model dir", "empty dir"])
def test_a_path_that_is_no_store_is_a_usage_error(argv: list[str], what: str, tmp_path: pathlib.Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """`--stores DIR` / `--model DIR` naming no expert store ended 'DIR/manifest.json: manifest is
    missing' with exit status 1, as a failed run; demo --model says what the path is, exit 2."""
    path = tmp_path / "nothing"
    if what == "model dir":
        _write_config(path)
    elif what == "empty dir":
        path.mkdir()
    rc, err = run_cli(capsys, *argv, str(path))
    assert rc == 2, err
    assert len(err.strip().splitlines()) == 1 and str(path) in err and "not an expert store" in err, err
    assert "asyncside convert" in err or what == "missing", err


def test_bench_generate_records_how_a_trace_is_replayed(quick_store: pathlib.Path, tmp_path: pathlib.Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """bench generate --routing: its JSON's routing held the file and its meta alone."""
    import json

    import numpy as np

    trace = tmp_path / "five.npz"
    np.savez(trace, ids=np.array([[[0, 1, 2, 3, 4, 5]] * 3] * 5, dtype=np.int64) + np.arange(5)[:, None, None],
             n_experts=64)
    rc = cli.main(["bench", "generate", "--model", str(quick_store), "--routing", str(trace), "--tokens", "2",
                   "--repeats", "1", "--cold-repeats", "0", "--residency", "0.5", "--plot", "none", "--json"])
    routing = json.loads(capsys.readouterr().out)["routing"]
    assert rc == 0
    assert routing["sequences"] == 1 and routing["sequence_tokens"] == 5
    assert routing["mapped_from"] == {"n_layers": 3, "n_experts": 64, "top_k": 6}
    assert "mapped onto" in routing["note"]


def test_a_killed_build_leaves_nothing_the_next_one_keeps(tmp_path: pathlib.Path) -> None:
    """`timeout 120 asyncside bench offload --shapes qwen3-30b-a3b:6` killed mid-build (SIGTERM: no
    `finally` runs) left its .tmp- directory, gigabytes, forever: no later build removed it. A
    build now removes every stale one (a build of any tag whose lock no process holds), never
    one a running build holds."""
    import fcntl

    from asyncside.bench import shapes

    stale = tmp_path / ".shape-gone-L6-V512-0123.tmp-abcd1234"
    (stale / "store").mkdir(parents=True)
    (stale / "store" / "blob").write_bytes(b"x" * 4096)
    busy = tmp_path / ".shape-busy-L2-V512-4567.tmp-efgh5678"
    busy.mkdir()
    with open(tmp_path / ".shape-busy-L2-V512-4567.lock", "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another process building that tag right now
        config = _write_config(tmp_path / "tiny", num_hidden_layers=1)
        shapes.ensure_shape(str(config), vocab=512, cache_dir=tmp_path, progress=False)
        assert not stale.exists()
        assert busy.exists()


@pytest.mark.parametrize("text", ["qwen3-30b-a3b:", "qwen3-30b-a3b:2,olmoe-1b-7b:", "/models/my-moe:"])
def test_a_trailing_colon_is_no_layer_count(text: str) -> None:
    """`--shapes qwen3-30b-a3b:` (a count forgotten) was read as every layer: a 48-layer, 18 GB
    build started. An empty count is refused as any bad count is."""
    from asyncside.bench import shapes

    with pytest.raises(shapes.ShapeError, match="LAYERS must be a positive integer"):
        shapes.parse_shape_list(text)


@pytest.mark.parametrize(("text", "value"), [("small", 512), ("full", None), ("600", 600), ("512", 512)])
def test_offload_vocab_takes_what_its_message_names(text: str, value: int | None) -> None:
    """A bad --vocab is refused as "an integer >= 258, 'small' or 'full'", yet bench offload's
    --vocab refused 'small' and 'full' as invalid ints (bench generate takes them)."""
    assert offload_args("--vocab", text).vocab == value


@pytest.mark.parametrize("text", ["100", "tiny", "-1", "nan"])
def test_offload_vocab_refused_when_parsed(text: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        offload_args("--vocab", text)
    assert "--vocab" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "resident"), [(["--memory", "400M"], "auto"), (["--memory", "400M", "--resident",
                                                 "0.3"], 0.3), ([], 0.25), (["--resident", "auto"], "auto")])
def test_serve_under_a_budget_sizes_its_pools_as_demo_does(argv: list[str], resident: object) -> None:
    """`serve --memory 400M` took a quarter of every layer's experts and was refused ("use a smaller
    resident fraction, resident='auto', ...") where `demo --memory 400M` runs: without --resident a
    budget now sizes the pools (auto), as demo's does; --resident given still wins."""
    from asyncside.cli import build_parser
    from asyncside.serving.cli import resident_of

    args = build_parser(["serve", *argv]).parse_args(["serve", *argv])
    assert resident_of(args) == resident


def test_a_budget_above_the_machine_is_said(monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """`bench offload --memory 100T`: every run's cgroup limit and plan took 100 TB (the plan capped
    it to MemAvailable quietly, the table's title said a 100 TB budget). A warning now says the runs
    are not bounded by it and what the machine has."""
    import asyncside.memory
    from asyncside.memory import MemoryBudget

    monkeypatch.setattr(asyncside.memory, "available_memory", lambda: MemoryBudget(8 * 2**30, "MemAvailable"))
    shape = _shape(64)
    assert offload.choose_budget(_budget_args(memory=10**14, ratio=1e-9), [shape], True) == 10**14
    err = capsys.readouterr().err
    assert "above what this machine has" in err and "8590 MB" in err and "MemAvailable" in err, err
    assert offload.choose_budget(_budget_args(memory=4 * 2**30, ratio=1e-9), [shape], True) == 4 * 2**30
    assert "above" not in capsys.readouterr().err


def test_routing_info_says_a_cache_raised_to_the_top_k(tmp_path: pathlib.Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """16 experts top-8: "caches of 25% (8 rows)" and "50% (8 rows)" printed the same figures under
    two shares with nothing saying the quarter (4 rows) cannot serve a token of 8."""
    import numpy as np

    rng = np.random.default_rng(0)
    ids = np.stack([np.stack([rng.choice(16, 8, replace=False) for _ in range(2)]) for _ in range(20)])
    np.savez(tmp_path / "wide.npz", ids=ids, n_experts=16)
    assert cli.main(["routing", "info", str(tmp_path / "wide.npz"), "--no-min"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "caches of 25%" in line]
    assert len(lines) == 1 and "8 rows" in lines[0] and "raised to the top-8" in lines[0], lines


def test_a_trace_too_narrow_to_widen_is_not_sent_to_widen() -> None:
    """A 4-expert top-2 trace on a top-8 model: the refusal advised `routing widen --top-k 8`, which
    then refuses too (a trace of 4 experts cannot route 8). It says no widening can."""
    import numpy as np

    from asyncside.routing import RoutingTrace

    narrow = RoutingTrace(np.array([[[0, 1]], [[2, 3]]], dtype=np.int32), np.array([2]), 4, {})
    with pytest.raises(ValueError) as info:
        narrow.map_to(1, 64, 8)
    assert "4 experts" in str(info.value) and "routing widen" not in str(info.value), str(info.value)
    wide_enough = RoutingTrace(np.array([[[0, 1]], [[2, 3]]], dtype=np.int32), np.array([2]), 16, {})
    with pytest.raises(ValueError, match=r"routing widen FILE OUT --top-k 8` adds them \(docs/routing-traces.md\)"):
        wide_enough.map_to(1, 64, 8)


def test_an_unreachable_hub_is_not_a_repo_without_config(monkeypatch: pytest.MonkeyPatch,
                                                          tmp_path: pathlib.Path) -> None:
    """`--shape allenai/OLMoE-1B-7B-0924` with no network said "the Hugging Face repo has no
    config.json": huggingface_hub's LocalEntryNotFoundError (no connection, nothing cached)
    derives from EntryNotFoundError (no such file). It now says the config could not be fetched."""
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    from asyncside.bench import shapes

    def unreachable(*args: object, **kwargs: object) -> str:
        raise LocalEntryNotFoundError("cannot reach the Hub and nothing in the cache")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", unreachable)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with pytest.raises(shapes.ShapeError) as info:
        shapes.describe_shape("some-org/some-moe")
    assert "could not be fetched" in str(info.value) and "has no config.json" not in str(info.value), str(info.value)


@pytest.mark.parametrize("command", [["preset", "low"], ["widen", "TRACE", "--top-k", "9"]])
def test_routing_seed_is_checked_when_parsed(command: list[str], tmp_path: pathlib.Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """`routing preset --seed -5` ended in numpy's traceback; `routing widen --seed -1` blamed
    --top-k ('--top-k: expected non-negative integer')."""
    import numpy as np

    trace = tmp_path / "t.npz"
    np.savez(trace, ids=np.arange(16, dtype=np.int32).reshape(2, 1, 8), n_experts=64)
    argv = [str(trace) if a == "TRACE" else a for a in command]
    rc, err = run_cli(capsys, "routing", *argv, str(tmp_path / "out.npz"), "--seed", "-5")
    last = err.strip().splitlines()[-1]
    assert rc == 2 and "--seed" in last and "--top-k" not in last and "Traceback" not in err, err


@pytest.mark.parametrize("text", ["[" * 100_000 + "]" * 100_000, '{"a": NaN}', '{"a": Infinity}'])
def test_meta_that_is_no_plain_json_is_refused_by_field(text: str, tmp_path: pathlib.Path) -> None:
    """A deeply nested meta ended in a RecursionError traceback; NaN / Infinity (not JSON, which
    json.loads takes) were loaded, and a later --json or save of the trace fails or writes non-JSON."""
    import numpy as np

    from asyncside.errors import TraceError
    from asyncside.routing import RoutingTrace

    path = tmp_path / "meta.npz"
    np.savez(path, ids=np.arange(16, dtype=np.int32).reshape(2, 1, 8), n_experts=64, meta=np.array(text))
    with pytest.raises(TraceError) as info:
        RoutingTrace.load(path)
    assert info.value.field == "meta" and str(path) in str(info.value)


def test_a_trace_never_saves_meta_it_would_not_load() -> None:
    import math

    import numpy as np

    from asyncside.errors import TraceError
    from asyncside.routing import RoutingTrace

    with pytest.raises(TraceError, match="meta"):
        RoutingTrace(np.arange(8, dtype=np.int32).reshape(1, 1, 8), np.array([1]), 64, {"skew": math.nan})


def test_two_configs_of_one_name_get_distinct_labels() -> None:
    """`--shapes a/my-moe:1,b/my-moe:1` (two configs, one directory name) gave two rows labelled
    'my-moe' alike in the table and the JSON; a repeated label gets -2 as a repeated routing stem does."""
    assert offload.distinct_labels(["my-moe", "my-moe", "qwen3-30b-a3b", "my-moe"]) == [
        "my-moe", "my-moe-2", "qwen3-30b-a3b", "my-moe-3"]


def test_a_shape_that_cannot_pass_the_ratio_is_refused_before_building(monkeypatch: pytest.MonkeyPatch) -> None:
    """`bench offload --shapes mixtral-8x7b:2` built 1.8 GB of Mixtral records (minutes), then
    refused them: a top-2 of 8 store is never 4x asyncside's smallest plan. The estimate of the
    build says so before anything is built."""
    from asyncside.bench import shapes

    def no_build(*args: object, **kwargs: object) -> None:
        raise AssertionError("built a shape the ratio refuses")

    monkeypatch.setattr(shapes, "ensure_shape", no_build)
    with pytest.raises(ValueError, match="no number of layers") as info:
        offload.run_offload_bench(offload_args("--shapes", "mixtral-8x7b:2", "--localities", "low", "--quiet"))
    assert str(info.value).startswith("--shapes mixtral-8x7b:2"), str(info.value)


def test_a_budget_raised_for_another_shape_names_it() -> None:
    """Several shapes share one budget, raised to the largest smallest plan: the refusal of the
    small store said "raised to asyncside's smallest plan" as if it were its own."""
    wide = dict(_shape(64, record_mb=40.0), shape="wide", spec="wide")
    with pytest.raises(ValueError) as info:
        offload.choose_budget(_budget_args(), [_shape(2), wide], False)
    assert "smallest plan for wide" in str(info.value), str(info.value)


@pytest.mark.parametrize("option", ["--routing", "--rows-profile"])
def test_bench_generate_refuses_a_bad_trace_before_building(option: str, tmp_path: pathlib.Path,
                                                            monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """bench generate --shape S --routing BAD built S (minutes for a large shape) before reading
    the file; --rows-profile BAD was read after the warm-up. Both are read first, as bench offload's are."""
    import numpy as np

    from asyncside.bench import shapes

    def no_build(*args: object, **kwargs: object) -> None:
        raise AssertionError("built a shape before reading the trace")

    monkeypatch.setattr(shapes, "ensure_shape", no_build)
    bad = tmp_path / "bad.npz"
    np.savez(bad, ids=np.zeros((3, 1, 2), dtype=np.int32), n_experts=64)  # an expert twice in a token
    rc, err = run_cli(capsys, "bench", "generate", "--shape", "qwen3-30b-a3b", "--layers", "1", "--vocab", "small",
                      option, str(bad), "--plot", "none")
    assert rc == 2 and str(bad) in err and "[ids]" in err, err


def test_offload_refuses_a_narrow_trace_before_building(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A top-2 trace for a top-8 shape not built yet: the shape was built, then the trace refused."""
    import numpy as np

    from asyncside.bench import shapes
    from asyncside.models.forcing import RoutingReplayError

    def no_build(*args: object, **kwargs: object) -> None:
        raise AssertionError("built a shape before fitting the trace")

    monkeypatch.setattr(shapes, "ensure_shape", no_build)
    narrow = tmp_path / "top2.npz"
    np.savez(narrow, ids=np.array([[[0, 1]], [[2, 3]]], dtype=np.int32), n_experts=128)
    with pytest.raises(RoutingReplayError, match="top-2"):
        offload.run_offload_bench(offload_args("--shapes", "qwen3-30b-a3b:8", "--routing", str(narrow), "--quiet"))


def test_generate_refuses_a_narrow_trace_before_building(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    import numpy as np

    from asyncside.bench import shapes

    def no_build(*args: object, **kwargs: object) -> None:
        raise AssertionError("built a shape before fitting the trace")

    monkeypatch.setattr(shapes, "ensure_shape", no_build)
    narrow = tmp_path / "top2.npz"
    np.savez(narrow, ids=np.array([[[0, 1]], [[2, 3]]], dtype=np.int32), n_experts=128)
    rc, err = run_cli(capsys, "bench", "generate", "--shape", "qwen3-30b-a3b", "--layers", "1", "--vocab", "small",
                      "--routing", str(narrow), "--plot", "none")
    assert rc == 2 and str(narrow) in err and "top-2" in err and "top-8" in err, err
