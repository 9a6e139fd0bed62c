"""Unseen inputs, round 17 (c): what a user's ``python -O`` strips. An assert that checked input or
state a user can reach vanished under ``-O`` and the user got a worse crash later; each such check
is a real one now, and each test here runs its case in a child ``python -O``."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import textwrap

TESTS = pathlib.Path(__file__).resolve().parent


def _run_optimized(script: str, tmp_path: pathlib.Path) -> str:
    """Run ``script`` in a child ``python -O`` (asserts stripped) and return its stdout."""
    proc = subprocess.run([sys.executable, "-O", "-c", textwrap.dedent(script)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "TMPDIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_an_app_served_without_its_lifespan_answers_503_saying_so(tmp_path: pathlib.Path) -> None:
    """The app of ``create_app`` starts its engine in its lifespan. Served without it (mounted in
    another app, whose lifespan does not run a mounted one's; a test client outside its ``with``),
    every request but /metrics was a 500 "internal error: AssertionError: " (an empty message), and
    under ``python -O`` an AttributeError of the missing engine. Each is a 503 that says the server
    is not running and why."""
    out = _run_optimized(f"""
        import json, sys
        assert False, "asserts are not stripped"
        sys.path.insert(0, {str(TESTS)!r})
        import anyio, httpx
        from _serving_support import ScriptedModel, byte_tokenizer, scripted_engine
        from asyncside.serving import ServeSettings, create_app

        app = create_app(scripted_engine(ScriptedModel(byte_tokenizer({str(tmp_path)!r}), "hello", {{}})),
                         ServeSettings())

        async def main():
            got = {{}}
            transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
                for method, path, body in [("GET", "/health", None), ("GET", "/v1/models", None),
                                           ("GET", "/v1/models/scripted", None),
                                           ("POST", "/v1/completions", {{"prompt": "hi", "max_tokens": 2}}),
                                           ("POST", "/v1/chat/completions",
                                            {{"messages": [{{"role": "user", "content": "hi"}}]}}),
                                           ("GET", "/metrics", None)]:
                    r = await client.request(method, path, json=body)
                    got[path] = [r.status_code, r.json()["error"] if path != "/metrics" else r.text]
            print(json.dumps(got))

        anyio.run(main)
    """, tmp_path)
    got = json.loads(out)
    metrics = got.pop("/metrics")
    assert metrics[0] == 200
    for path, (status, error) in got.items():
        assert status == 503, (path, status, error)
        assert error["code"] == "server_not_running", (path, error)
        assert error["message"].startswith("the server is not running: the app's lifespan"), (path, error)
    # Answered by the server, and counted as such.
    assert 'endpoint="/v1/completions",status="503"' in metrics[1]


def test_a_hidden_message_without_its_payload_is_a_protocol_error(tmp_path: pathlib.Path) -> None:
    """A stage runs its layers on the hidden state a HIDDEN message carries. One without a payload
    (a peer of another version, a corrupt frame) decoded as well-formed, and only an assert in the
    stage stood between it and the layers: under ``python -O`` they ran on None. The header is
    refused as the other malformed ones are, with a ProtocolError naming the message."""
    out = _run_optimized("""
        from asyncside.distributed.boundary import HIDDEN, Message, decode_header, encode_header
        from asyncside.distributed.errors import ProtocolError

        assert False, "asserts are not stripped"
        try:
            got = decode_header(encode_header(Message(HIDDEN, 7, step=2, seq=1)))
        except ProtocolError as exc:
            print("refused:", exc)
        else:
            print("decoded:", got[0].describe())
    """, tmp_path)
    assert out.strip() == ("refused: a hidden message without its payload (req=7, step=2, seq=1): it carries the "
                           "hidden state to the next stage"), out


def test_the_soak_without_the_bench_extra_says_which_extra_in_one_line() -> None:
    """``python -m asyncside.serving.soak`` (docs/serving.md) talks HTTP through httpx, which only
    the bench extra installs: without it the soak ended in a ModuleNotFoundError's traceback. It
    says in one line which extra installs it, and exits 1."""
    code = ("import runpy, sys; sys.modules['httpx'] = None; sys.argv = ['soak', '--duration', '1']; "
            "runpy.run_module('asyncside.serving.soak', run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-2000:])
    assert proc.stderr == ("python -m asyncside.serving.soak needs httpx, which is not installed: "
                           "pip install 'asyncside[bench]'\n"), proc.stderr[-2000:]
    assert proc.stdout == ""


def test_the_module_commands_run_under_python_OO() -> None:
    """``python -OO`` (PYTHONOPTIMIZE=2) strips docstrings too: the soak and the model report took
    their description from the module's docstring and failed with an AttributeError of None before
    parsing a single option. Both parse and answer ``--help``."""
    for module in ("asyncside.serving.soak", "asyncside.models.report"):
        proc = subprocess.run([sys.executable, "-OO", "-m", module, "--help"], capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0, (module, proc.stderr[-2000:])
        assert proc.stdout.startswith(f"usage: python -m {module} "), (module, proc.stdout[:300])
        assert proc.stderr == "", (module, proc.stderr[-2000:])
