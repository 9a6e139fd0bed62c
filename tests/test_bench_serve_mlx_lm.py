"""`bench serve`'s mlx_lm.server child: it counts as up once it answers a completion.

mlx_lm.server loads its model in its generation thread and its /health answers 200 while that
thread lives, loading included; timing clients against it from then on would time the load too.
A stand-in server (a script run as the "python" that starts mlx_lm.server) says when it was asked.
"""

from __future__ import annotations

import pathlib
import sys
import textwrap

import pytest

pytest.importorskip("httpx")

from asyncside.bench.serve import MlxLmServer

#: answers /health at once; a completion only once the file "loaded" exists, and notes each one
STAND_IN = textwrap.dedent('''
    import http.server, json, pathlib, sys
    port = int(sys.argv[sys.argv.index("--port") + 1])
    here = pathlib.Path(__file__).parent

    class H(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _send(self, code, body):
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self._send(200 if self.path == "/health" else 404, {"status": "ok"})

        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            with open(here / "asked", "a") as fh:
                fh.write(self.path + "\\n")
            loaded = (here / "loaded").exists()
            (here / "loaded").touch()  # the "model" loads on the first request's try
            self._send(200 if loaded else 503, {"choices": [{"text": "x"}]})

    http.server.ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
''')


def test_the_server_is_up_once_it_answered_a_completion(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    fake = tmp_path / "python"
    fake.write_text(f'#!/bin/sh\nshift 2\nexec {sys.executable} {script} "$@"\n')  # drops "-m mlx_lm.server"
    fake.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(fake))
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    with MlxLmServer(str(tmp_path / "model"), startup_timeout=60):
        # /health said 200 at once; it was up only once a completion was answered (the second try).
        assert (tmp_path / "asked").read_text().splitlines() == ["/v1/completions", "/v1/completions"]


def test_a_server_that_served_leaves_no_log_and_one_that_failed_keeps_it(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every bench serve run left its mlx_lm.server log in the temporary directory: one that served
    now removes it; one whose block raised keeps it (it is what tells why)."""
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    (tmp_path / "loaded").touch()
    fake = tmp_path / "python"
    fake.write_text(f'#!/bin/sh\nshift 2\nexec {sys.executable} {script} "$@"\n')
    fake.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(fake))
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    with MlxLmServer(str(tmp_path / "model"), startup_timeout=60) as served:
        assert served.log.exists()
    assert not served.log.exists()
    with pytest.raises(RuntimeError, match="a client failed"), \
            MlxLmServer(str(tmp_path / "model"), startup_timeout=60) as failed:
        raise RuntimeError("a client failed")
    assert failed.log.exists()
