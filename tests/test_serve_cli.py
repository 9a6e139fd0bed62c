"""`asyncside serve` arguments are checked when parsed: a bad value is an argparse error (exit 2,
one line naming the option and the choices), never a traceback or a server that starts and fails."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

from asyncside.cli import build_parser
from asyncside.serving.cli import settings_from_args


@pytest.mark.parametrize("argv, words", [
    (["--predictor", "bogus"], ["--predictor", "unknown predictor 'bogus'", "lookahead"]),
    (["--policy", "bogus"], ["--policy", "unknown policy 'bogus'", "lfu"]),
    (["--resident", "1.5"], ["--resident", "[0, 1]"]),
    (["--port", "70000"], ["--port", "65535"]),
    (["--max-batch", "0"], ["--max-batch", ">= 1"]),
    (["--request-timeout", "-3"], ["--request-timeout", "positive"]),
    (["--temp", "9"], ["--temp", "[0, 2]"]),
    (["--reader", "nope"], ["--reader", "invalid choice"]),
    (["--host-tier", "2QB"], ["--host-tier", "host tier '2QB'", "800M"]),
    (["--prompt-cache-bytes", "1e300T"], ["--prompt-cache-bytes", "finite"]),
    (["--mlx-cache-limit=-2G"], ["--mlx-cache-limit", ">= 0"]),
])
def test_bad_serve_arguments_are_parse_errors(argv: list[str], words: list[str],
                                              capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["serve", *argv])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    for w in words:
        assert w in err, (w, err)


@pytest.mark.parametrize("option", ["--predictor", "--policy"])
def test_bogus_names_fail_before_anything_starts(option: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "asyncside.cli", "serve", option, "bogus"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and f"argument {option}: unknown" in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert "Traceback" not in proc.stderr and lines[0].startswith("usage: asyncside serve")  # usage + one error line
    assert lines[-1].startswith("asyncside serve: error: argument")


def test_serve_options_become_settings() -> None:
    args = build_parser().parse_args(["serve", "--predictor", "temporal", "--policy", "LRU", "--max-batch", "8",
                                      "--max-queue", "0", "--prefill-chunk", "64", "--prompt-cache-size", "0",
                                      "--request-timeout", "none", "--temp", "0.7", "--allow-origin", "*",
                                      "--no-access-log", "--max-tokens-limit", "100"])
    s = settings_from_args(args)
    assert (s.predictor, s.max_batch, s.max_queue, s.prefill_chunk, s.prompt_cache_size) == ("temporal", 8, 0, 64, 0)
    assert (s.request_timeout, s.default_temperature, s.allow_origins, s.access_log, s.max_tokens_limit) == (
        None, 0.7, ("*",), False, 100)
    assert args.policy == "LRU"
    assert args.host_tier == "auto" and build_parser().parse_args(["serve", "--host-tier", "1G"]).host_tier == 1 << 30
    # The cache sizes take every SIZE spelling (T included: it was refused there alone).
    big = build_parser().parse_args(["serve", "--prompt-cache-bytes", "1T", "--mlx-cache-limit", "2GiB"])
    assert (big.prompt_cache_bytes, big.mlx_cache_bytes) == (1 << 40, 2 << 30)
    assert not s.joint_prefill  # off unless asked for (a seeded request's draws never depend on its neighbours)
    joint = build_parser().parse_args(["serve", "--joint-prefill"])
    assert settings_from_args(joint).joint_prefill
    assert build_parser().parse_args(["bench", "serve", "--joint-prefill"]).joint_prefill


def test_the_trace_predictor_without_a_trace_to_replay_fails_at_start(
        tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--predictor trace`` prefetches a replayed trace's predictions: without ``--routing``, or with a
    trace that carries none, `asyncside serve` exits 2 at start naming the flag and what it expects
    (it used to start and then fail every request)."""
    from asyncside.routing import synthetic
    from asyncside.serving.cli import predictor_routing_problem, serve_main

    def serve(*argv: str) -> tuple[int, str]:
        code = serve_main(build_parser().parse_args(["serve", "--model", str(tmp_path / "no-such-model"), *argv]))
        return code, capsys.readouterr().err

    code, err = serve("--predictor", "trace")
    assert code == 2 and "Traceback" not in err, err
    assert "--predictor trace needs --routing TRACE.npz" in err and "lookahead, temporal or none" in err, err
    assert "no-such-model" not in err  # refused before the model is looked for

    plain, predicted = tmp_path / "plain.npz", tmp_path / "predicted.npz"
    kw: dict = dict(tokens=8, n_layers=2, n_experts=8, top_k=2, skew=0.5, overlap=0.5, layer_corr=0.0, seed=0)
    synthetic(**kw).save(plain)
    synthetic(**kw, prediction_precision=0.5).save(predicted)
    code, err = serve("--predictor", "trace", "--routing", str(plain))
    assert code == 2 and f"the routing trace {plain} carries no predictions (no 'predicted' array" in err, err
    broken = tmp_path / "broken.npz"
    broken.write_bytes(b"not a zip")
    code, err = serve("--predictor", "trace", "--routing", str(broken))
    assert code == 2 and "--routing: " in err and "broken.npz" in err and "Traceback" not in err, err

    # A trace with predictions, or another predictor, passes the check (and the model is looked for next).
    for argv in (["--predictor", "trace", "--routing", str(predicted)], ["--predictor", "lookahead"], []):
        assert predictor_routing_problem(build_parser().parse_args(["serve", *argv])) is None, argv
    code, err = serve("--predictor", "trace", "--routing", str(predicted))
    assert code == 2 and "no-such-model" in err and "--predictor" not in err, err
    # `bench serve` takes the same model options and refuses the same before any server starts.
    from asyncside.bench.serve import _check

    with pytest.raises(ValueError, match="--predictor trace needs --routing TRACE.npz"):
        _check(build_parser().parse_args(["bench", "serve", "--predictor", "trace"]))
    _check(build_parser().parse_args(["bench", "serve", "--predictor", "trace", "--routing", str(predicted)]))
    # Under --pipeline the trace predictor has no routing to replay (--routing is refused there).
    problem = predictor_routing_problem(build_parser().parse_args(["serve", "--pipeline", "--predictor", "trace"]))
    assert problem is not None and "not supported with --pipeline" in problem


@pytest.mark.parametrize("argv, words", [
    (["--pipeline", "--memory", "4G"], "--memory is not supported with --pipeline"),
    (["--pipeline", "--resident", "auto"], "--resident auto is not supported with --pipeline"),
    # The ranks keep no host tier: an explicit --host-tier (even auto) was ignored without a word.
    (["--pipeline", "--host-tier", "1G"], "--host-tier is not supported with --pipeline"),
    (["--pipeline", "--host-tier", "auto"], "--host-tier is not supported with --pipeline"),
    (["--pipeline", "--split", "two,one"], "--split 'two,one': expected comma-separated layer counts"),
    (["--pipeline", "--split", "0,5"], "--split 0,5: expected a count >= 1 of decoder layers for each rank"),
    (["--pipeline", "--side-rows", "-3"], "--side-rows -3: expected a number of rows >= 0"),
    (["--pipeline", "--join-timeout", "-1"], "--join-timeout -1: expected a finite number of seconds > 0"),
    (["--pipeline", "--peer-timeout", "nan"], "--peer-timeout nan: expected a finite number of seconds > 0"),
    (["--split", "2,1"], "--split only applies with --pipeline"),
    (["--backend", "ring", "--side-rows", "4"], "--backend, --side-rows only apply with --pipeline"),
])
def test_pipeline_option_combinations_are_refused_before_anything_loads(
        argv: list[str], words: str, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``serve --pipeline`` checked --memory, --resident auto and --routing only once the model was
    found (or converted), and --split and the timeouts only after the launch environment (each rank
    then failed with exit status 1); a pipeline option without --pipeline was ignored and a plain
    server started. Now one usage error before the model is looked for or any rank launches."""
    from _cli_support import run_cli

    rc, err = run_cli(capsys, "serve", "--model", str(tmp_path / "no-such-model"), *argv)
    assert rc == 2 and err.count("\n") == 1 and words in err, err
    assert "no-such-model" not in err and "launch environment" not in err and "Traceback" not in err, err


def test_pipeline_settings_are_checked_before_the_ranks_launch(tmp_path: pathlib.Path,
                                                               monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """The server's settings (an API key from the environment) were checked under --pipeline only
    on rank 0, after the ranks had met and loaded their stages."""
    from _cli_support import run_cli

    from asyncside.serving.cli import pipeline_problem

    monkeypatch.setenv("ASYNCSIDE_API_KEY", "two words")
    rc, err = run_cli(capsys, "serve", "--model", str(tmp_path / "no-such-model"), "--pipeline")
    assert rc == 2 and err.count("\n") == 1 and "api_key must be" in err and "no-such-model" not in err, err
    monkeypatch.delenv("ASYNCSIDE_API_KEY")
    for argv in ([], ["--pipeline"],
                 ["--pipeline", "--split", "2,1", "--side-rows", "0", "--join-timeout", "30", "--backend", "ring"]):
        assert pipeline_problem(build_parser().parse_args(["serve", *argv])) is None, argv
