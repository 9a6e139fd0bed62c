"""Inputs the repository never made, fifth sweep: a negative size after its option as people type it
(``--memory -1G``, not ``--memory=-1G``), and an ``--mlx-lm-model`` directory mlx_lm.server cannot load
(a config.json and no weights, a model type it does not know). What is refused is one line naming
the option or directory and what went wrong, at once.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import pytest
from _cli_support import run_cli

#: every option of every command that takes a SIZE, with the command that has it
SIZE_OPTIONS = [
    (("demo",), "--memory", "memory"), (("demo",), "--host-tier", "host tier"),
    (("serve",), "--memory", "memory"), (("serve",), "--host-tier", "host tier"),
    (("serve",), "--prompt-cache-bytes", "size"), (("serve",), "--mlx-cache-limit", "size"),
    (("bench", "serve"), "--memory", "memory"), (("bench", "serve"), "--host-tier", "host tier"),
    (("bench", "serve"), "--prompt-cache-bytes", "size"), (("bench", "serve"), "--mlx-cache-limit", "size"),
    (("bench", "offload"), "--memory", "memory"),
]


@pytest.mark.parametrize(("command", "option", "what"), SIZE_OPTIONS)
@pytest.mark.parametrize("value", ["-1G", "-.5G", "-1e3M"])
def test_a_negative_size_after_its_option_says_what_is_wrong(command: tuple[str, ...], option: str, what: str,
                                                            value: str, capsys: pytest.CaptureFixture[str]) -> None:
    """``asyncside demo --memory -1G`` said "argument --memory: expected one argument": argparse took
    ``-1G`` for an option (only ``-1`` and ``-.5`` look like numbers to it). It says what
    ``--memory=-1G`` says."""
    rc, err = run_cli(capsys, *command, option, value)
    assert rc == 2, err
    line = err.strip().splitlines()[-1]
    assert line == f"asyncside {' '.join(command)}: error: argument {option}: {what} '{value}': expected a size >= 0"
    rc, joined = run_cli(capsys, *command, f"{option}={value}")
    assert rc == 2 and joined.strip().splitlines()[-1] == line, joined


def test_an_abbreviated_size_option_is_read_as_argparse_reads_it(capsys: pytest.CaptureFixture[str]) -> None:
    rc, err = run_cli(capsys, "demo", "--mem", "-1G")
    assert rc == 2 and err.strip().endswith("error: argument --memory: memory '-1G': expected a size >= 0"), err


@pytest.mark.parametrize("argv", [["demo", "--memory", "--tokens", "4"], ["demo", "--memory"],
                                  ["serve", "--prompt-cache-bytes", "--port", "0"]])
def test_a_size_option_followed_by_an_option_still_needs_its_value(argv: list[str],
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    rc, err = run_cli(capsys, *argv)
    assert rc == 2 and err.strip().endswith(f"error: argument {argv[1]}: expected one argument"), err


def test_a_negative_number_after_any_other_option_is_left_to_argparse(capsys: pytest.CaptureFixture[str]) -> None:
    """Only SIZE options are joined with their value: ``--tokens -1`` is argparse's own negative number."""
    rc, err = run_cli(capsys, "demo", "--tokens", "-1")
    assert rc == 2 and "argument --tokens" in err and "expected one argument" not in err, err
    rc, err = run_cli(capsys, "demo", "--memory", "1G", "--", "-1G")
    assert rc == 2 and "unrecognized arguments:" in err and "memory" not in err, err


def _commands(parser: argparse.ArgumentParser, name: str = "asyncside") -> list[tuple[str, argparse.ArgumentParser]]:
    found = [(name, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, p in action.choices.items():
                found += _commands(p, f"{name} {sub}")
    return found


def test_every_size_option_is_shown_as_size() -> None:
    """The parser joins the value of an option shown as SIZE: an option taking a size (``1G`` is a
    GiB) shown otherwise would say "expected one argument" to ``-1G`` again."""
    from asyncside.argtypes import CommandParser
    from asyncside.cli import build_parser

    sized = []
    for name, parser in _commands(build_parser()):
        assert isinstance(parser, CommandParser), name
        for action in parser._actions:
            try:
                takes_size = callable(action.type) and action.type("1G") == 1 << 30
            except (argparse.ArgumentTypeError, ValueError, TypeError):
                takes_size = False
            if takes_size:
                assert action.metavar == "SIZE", (name, action.option_strings)
                sized.append((name, action.option_strings[0]))
    assert len(sized) >= len(SIZE_OPTIONS), sized


def _model_dir(tmp_path: pathlib.Path, what: str) -> pathlib.Path:
    """An mlx-lm model directory mlx_lm.server cannot load: the embedded model's config.json alone,
    or with a weights file and a model type mlx-lm does not have."""
    from asyncside.models.embedded import DEFAULT_CONFIG

    model = tmp_path / what
    model.mkdir()
    config = dict(DEFAULT_CONFIG)
    if what == "bad-type":
        import mlx.core as mx

        config["model_type"] = "no_such_architecture"
        mx.save_safetensors(str(model / "model.safetensors"), {"x": mx.zeros(1)})
    (model / "config.json").write_text(json.dumps(config))
    return model


@pytest.mark.parametrize(("what", "said"), [
    ("no-weights", "FileNotFoundError: No safetensors found in {model}"),
    ("bad-type", "ValueError: Model type no_such_architecture not supported."),
])
def test_bench_serve_stops_at_once_where_mlx_lm_cannot_load_the_model(
        what: str, said: str, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """``bench serve --mlx-lm-model DIR`` of a directory with a config.json that mlx-lm cannot load
    waited out its ten-minute startup timeout: mlx_lm.server's loading thread died, the process lived
    on and its /health answered 503. The real mlx_lm.server runs here (what it logs is what is read),
    a few seconds: it fails before it serves anything; the embedded model serves asyncside's side."""
    model = _model_dir(tmp_path, what)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    rc, err = run_cli(capsys, "bench", "serve", "--mlx-lm-model", str(model), "--clients", "1", "--duration", "1",
                      "--warmup", "0", "--max-tokens", "2", "--prompt-lengths", "4", "--long-prompt", "0")
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"asyncside bench serve: error: --mlx-lm-model {model}: mlx_lm.server could not load it: "
                          f"{said.format(model=model)} (its log: {tmp_path}/asyncside-bench-mlx-lm-"), err
    assert "--no-mlx-lm" in err, err


def test_an_mlx_lm_server_that_exits_is_told_by_its_last_line(tmp_path: pathlib.Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A server that exited was "mlx_lm.server exited with 3; see LOG", a RuntimeError's traceback
    from the command: the directory and the server's own line now, as an AsyncsideError."""
    from asyncside.bench.serve import MlxLmServer, MlxLmServerError

    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'some warning'\necho 'error: the server said no' >&2\nexit 3\n")
    fake.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(fake))
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    with pytest.raises(MlxLmServerError) as caught, MlxLmServer(str(tmp_path / "model")):
        pass
    assert str(caught.value) == (f"mlx_lm.server could not serve {tmp_path / 'model'}: it exited with status 3: "
                                 f"error: the server said no (its log: {caught.value.log})")


def test_the_load_error_is_the_last_exception_of_a_chained_traceback() -> None:
    from asyncside.bench.serve import load_error

    log = ("2026-01-01 00:00:00,000 - ERROR - mlx_lm.server generation thread died: Model type x not supported.\n"
           "Traceback (most recent call last):\n  File \"a.py\", line 1, in f\n    import x\n"
           "ModuleNotFoundError: No module named 'mlx_lm.models.x'\n\n"
           "The above exception was the direct cause of the following exception:\n\n"
           "Traceback (most recent call last):\n  File \"b.py\", line 2, in g\n    raise ValueError(msg) from e\n"
           "ValueError: Model type x not supported.\n")
    assert load_error(log) == "ValueError: Model type x not supported."
    assert load_error(log.split("\n")[0]) == "Model type x not supported."  # the traceback not written yet
    assert load_error("Starting httpd at 127.0.0.1 on port 1...\n") is None
