"""Serving to clients, proxies and process managers that are not ours, round 14: raw HTTP
connections that never finish their request, what a wrong method is told, a process started
with its standard descriptors closed, and a benchmark stopped by SIGTERM, and the signals of the drain (a second
one, SIGHUP).

The model is the scripted one (tests/_serving_support.py); everything between the socket and the
model is the real code.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pathlib
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from _serving_support import ScriptedModel, byte_tokenizer, raw_request, read_stream, read_to_close, scripted_engine

from asyncside.serving import BackgroundServer, ServeSettings, create_app

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

LONG = "one two three four five six seven eight nine ten " * 2
#: how long a connection gets to send its request, in these tests
READ_TIMEOUT = 0.5
#: what a socket read waits at most before the test says the server held the connection
HELD = 30.0


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackgroundServer]:
    tok = byte_tokenizer(tmp_path_factory.mktemp("tokenizer"))
    model = ScriptedModel(tok, "hello", {"count": LONG}, step_delay=0.02)
    app = create_app(scripted_engine(model), ServeSettings(prompt_cache_size=0, max_tokens_limit=256,
                                                           request_read_timeout=READ_TIMEOUT))
    with BackgroundServer(app) as server:
        yield server


def _connect(srv: BackgroundServer) -> socket.socket:
    sock = socket.create_connection((srv.host, srv.port))
    sock.settimeout(HELD)
    return sock


def _disconnects(srv: BackgroundServer) -> float:
    text = httpx.get(srv.url + "/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("asyncside_client_disconnects_total{"))


@pytest.mark.parametrize("sent", [b"", b"POST /v1/completions HTTP/1.1\r\nHost: t\r\n"],
                         ids=["nothing", "half a request head"])
def test_a_connection_that_never_sends_its_request_is_closed(srv: BackgroundServer, sent: bytes) -> None:
    """uvicorn times out only the gap after an answer: a client that opened a connection and sent
    nothing, or part of a request head, held it (and its file descriptor) for good; enough such
    clients ran the process out of descriptors, and every new client was refused. The connection
    is now closed once the request read timeout has passed, and other clients are served."""
    sock = _connect(srv)
    sock.sendall(sent)
    assert read_to_close(sock) == b""
    sock.close()
    assert httpx.get(srv.url + "/health").status_code == 200


def test_a_request_body_that_stalls_is_closed_and_counted_as_a_client_that_left(srv: BackgroundServer) -> None:
    before = _disconnects(srv)
    sock = _connect(srv)
    whole = raw_request({"model": "scripted", "prompt": "count", "max_tokens": 4})
    sock.sendall(whole[:-10])  # the head and all but the body's last bytes
    assert read_to_close(sock) == b""
    sock.close()
    # The handler waiting for the body saw the client leave: no answer, no request in the engine.
    assert _disconnects(srv) == before + 1
    assert httpx.get(srv.url + "/health").json()["active_requests"] == 0


def test_answers_longer_than_the_read_timeout_and_keep_alive_are_untouched(srv: BackgroundServer) -> None:
    """The timeout bounds sending a request, not answering it: a stream that takes longer ends
    normally, and the connection serves a second request sent at once, and a pipelined one."""
    sock = _connect(srv)
    stream = raw_request({"model": "scripted", "prompt": "count", "max_tokens": 60, "stream": True})
    short = raw_request({"model": "scripted", "prompt": "count", "max_tokens": 3}, extra="Connection: close\r\n")
    sock.sendall(stream)
    got = b""
    while b"data: [DONE]" not in got:
        data = sock.recv(65536)
        assert data, got[-300:]
        got += data
    events = [json.loads(line[6:]) for line in got.decode().split("\r\n") if line.startswith("data: {")]
    assert "".join(e["choices"][0]["text"] for e in events) == LONG[:60]
    sock.sendall(stream + short)  # a second stream, and a request pipelined behind it
    got = read_to_close(sock).decode()
    assert got.count("data: [DONE]") == 1 and got.count("HTTP/1.1 200 OK") == 2, got[-400:]
    assert json.loads(got[got.rindex("\r\n\r\n") + 4:])["choices"][0]["text"] == LONG[:3]
    sock.close()


@pytest.mark.parametrize("method, path, allowed", [("DELETE", "/health", {"GET", "HEAD"}),
                                                   ("GET", "/v1/completions", {"POST"}),
                                                   ("PUT", "/v1/chat/completions", {"POST"})])
def test_a_wrong_method_is_told_which_methods_the_route_takes(srv: BackgroundServer, method: str, path: str,
                                                              allowed: set[str]) -> None:
    """A 405 must carry ``Allow`` (HTTP): the server's own error handler dropped Starlette's."""
    r = httpx.request(method, srv.url + path)
    assert r.status_code == 405 and r.json()["error"]["message"] == f"method {method} not allowed on {path}"
    assert {m.strip() for m in r.headers["allow"].split(",")} == allowed


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("closed", [(0,), (1,), (0, 1, 2)], ids=["stdin", "stdout", "all three"])
def test_serve_started_with_its_standard_descriptors_closed_serves_and_exits_0(
        quick_store: pathlib.Path, closed: tuple[int, ...]) -> None:
    """A daemonizing script or process manager that starts ``asyncside serve`` with stdin or stdout
    closed (``<&- >&-``): the event loop's first descriptors took their numbers and libuv, which
    asserts that it never closes one of those, aborted the process (SIGABRT, a core dump): with
    stdout closed at startup, with stdin closed at the SIGTERM that should have been a clean exit."""
    port = _free_port()
    err = tempfile.TemporaryFile()
    redirects = " ".join(f"{fd}<&-" for fd in closed)  # as the shell closes them
    proc = subprocess.Popen(["sh", "-c", f'exec "$@" {redirects}', "sh", sys.executable, "-m", "asyncside", "serve",
                             "--model", str(quick_store), "--port", str(port), "--no-access-log"], stderr=err)
    try:
        up = False
        while not up and proc.poll() is None:
            try:
                up = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
            except httpx.TransportError:
                time.sleep(0.2)
        assert up, "the server died before it served"
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err.seek(0)
    said = err.read().decode(errors="replace")
    assert proc.returncode == 0, said[-2000:]


def _signals_by_default() -> None:
    """In a child about to run: the signals these tests send at their default disposition. A test
    runner started in the background (``nohup``, ``&`` in a script) hands its children SIGHUP or
    SIGINT ignored, which asyncside keeps ignored, as a supervisor's choice; the tests ask for the
    case where they are not."""
    for sig in (signal.SIGHUP, signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in pathlib.Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _alive(pid: int) -> bool:
    try:
        return pathlib.Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][:1] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the children from /proc")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_to_bench_serve_stops_its_mlx_lm_server_child(quick_store: pathlib.Path, tmp_path: pathlib.Path,
                                                              sig: int) -> None:
    """``kill PID`` (or a supervisor's terminate()) on ``asyncside bench serve`` ended it where it
    stood and left its ``mlx_lm.server`` child running, its model loaded and its port held, for
    good (SIGHUP, the terminal gone, too). Either now stops the bench as Ctrl-C does: the child is
    stopped, also while it loads."""
    model_dir = tmp_path / "mlx-lm-model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")  # a directory mlx_lm.server takes a while to fail on
    proc = subprocess.Popen([sys.executable, "-m", "asyncside", "bench", "serve", "--model", str(quick_store),
                             "--mlx-lm-model", str(model_dir), "--clients", "1", "--duration", "30",
                             "--max-tokens", "2", "--prompt-lengths", "4"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, preexec_fn=_signals_by_default,
                            env={**os.environ, "TMPDIR": str(tmp_path)})  # the child's log, if any, here
    children: list[int] = []
    try:
        while not children and proc.poll() is None:
            children = [c for c in _children(proc.pid)
                        if "mlx_lm.server" in pathlib.Path(f"/proc/{c}/cmdline").read_text(errors="replace")]
            time.sleep(0.05)
        assert children, f"no mlx_lm.server child started: {proc.stderr.read() if proc.stderr else ''}"
        proc.send_signal(sig)
        _, stderr = proc.communicate(timeout=90)
        assert proc.returncode == 128 + sig, stderr
        assert not [c for c in children if _alive(c)], "mlx_lm.server outlived the bench"
        # Interrupted, not failed: its log said only that it was stopped.
        assert not list(tmp_path.glob("asyncside-bench-mlx-lm-*.log"))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for c in children:
            if _alive(c):
                os.kill(c, signal.SIGKILL)


SERVER_SCRIPT = textwrap.dedent("""
    import sys, uvloop
    sys.path.insert(0, {tests!r})
    from _serving_support import ScriptedModel, byte_tokenizer, raw_request, read_to_close, scripted_engine
    from asyncside.serving import ServeSettings, create_app, serve

    model = ScriptedModel(byte_tokenizer({tmp!r}), "hello", {{"count": {long!r}}}, step_delay=0.05)
    app = create_app(scripted_engine(model), ServeSettings(prompt_cache_size=0, max_tokens_limit=256,
                                                           shutdown_grace={grace}))
    uvloop.run(serve(app, "127.0.0.1", 0, on_ready=lambda url: print(url, flush=True)))
    print("clean exit", flush=True)
""")


def _stream(url: str, started: threading.Event, out: list[dict[str, Any]]) -> None:
    out.append(read_stream(url, started, max_tokens=256, timeout=120))


@contextlib.contextmanager
def _server_process(argv: list[str]) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """A server started by ``argv`` (a script printing its URL first), and that URL; killed on the
    way out if it has not exited by then."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}, preexec_fn=_signals_by_default)
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:"), url
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _assert_clean_exit(proc: subprocess.Popen[str], stdout: str, stderr: str) -> None:
    assert proc.returncode == 0 and "clean exit" in stdout, stderr[-2000:]
    assert "Traceback" not in stderr, stderr[-2000:]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_second_signal_ends_the_streams_with_their_error_event_at_once(tmp_path: pathlib.Path, sig: int) -> None:
    """A second SIGTERM or Ctrl-C during the drain "skips what is left of the grace" (the docs): it
    cancelled the drain itself, so nothing ended the requests in flight; uvicorn waited its own
    timeout, then cut every stream off mid-body (no error event, no [DONE]) and logged a
    traceback for each. Now they get the error event and [DONE] at once, and the process exits 0."""
    script = SERVER_SCRIPT.format(tests=str(pathlib.Path(__file__).parent), tmp=str(tmp_path), long=LONG * 6,
                                  grace=600)
    out: list[dict[str, Any]] = []
    with _server_process([sys.executable, "-c", script]) as (proc, url):
        threads = []
        for _ in range(4):
            started = threading.Event()
            threads.append(threading.Thread(target=_stream, args=(url, started, out), daemon=True))
            threads[-1].start()
            assert started.wait(60), "a stream never sent its first chunk"
        proc.send_signal(sig)
        while httpx.post(url + "/v1/completions", json={"model": "scripted", "prompt": "hi"}).status_code != 503:
            time.sleep(0.02)  # until the drain refuses new requests
        proc.send_signal(sig)
        stdout, stderr = proc.communicate(timeout=120)
        for t in threads:
            t.join(60)
    _assert_clean_exit(proc, stdout, stderr)
    assert len(out) == 4
    for r in out:
        assert r["done"], r["events"][-1:]
        assert r["events"][-1]["error"]["code"] == "server_shutting_down"


@pytest.fixture(scope="module")
def pipeline_store(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    from _models_support import byte_model_store

    return byte_model_store(tmp_path_factory.mktemp("pipeline"))


def test_a_pipeline_whose_rank_dies_tells_its_clients_which_rank(pipeline_store: pathlib.Path) -> None:
    """``serve --pipeline``: when another rank died (killed, out of memory) rank 0's streams ended
    with "generation failed: AsyncsideError: the server is shutting down", as if someone had shut
    the server down on purpose (a client would retry later); only rank 0's log said that rank 1 had
    gone. They now end with the lost peer's error, naming the rank."""
    from asyncside.distributed.launcher import LocalLaunch, free_ports

    port = free_ports(1)[0]
    cmd = [sys.executable, "-c", "import sys; from asyncside.cli import main; sys.exit(main())",
           "serve", str(pipeline_store), "--pipeline", "--port", str(port), "--join-timeout", "30"]
    out: list[dict[str, Any]] = []
    with LocalLaunch([cmd, cmd]) as launch:
        url = f"http://127.0.0.1:{port}"
        while url not in launch.output(0):
            assert launch.running(0) and launch.running(1), launch.output(0, "err") + launch.output(1, "err")
            time.sleep(0.1)
        model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]

        def stream(i: int, started: threading.Event) -> None:
            events: list[Any] = []
            with httpx.stream("POST", url + "/v1/completions", timeout=60,
                              json={"model": model, "prompt": f"route {i}", "max_tokens": 400, "stream": True}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        events.append(json.loads(line[len("data: "):]))
                        started.set()
            out.append({"events": events})

        threads = []
        for i in range(2):
            started = threading.Event()
            threads.append(threading.Thread(target=stream, args=(i, started), daemon=True))
            threads[-1].start()
            assert started.wait(60), "a stream never sent its first chunk"
        launch.kill(1, signal.SIGTERM)
        res = launch.wait(60)
        for t in threads:
            t.join(60)
    assert not res.ok and "rank 0 exited with status 3" in res.reason, res.reason
    assert len(out) == 2
    for r in out:
        said = r["events"][-1]["error"]["message"]
        assert "rank 1" in said and "closed its control link" in said and "shutting down" not in said, said


def test_sighup_drains_the_server_unless_the_parent_ignored_it(tmp_path: pathlib.Path) -> None:
    """SIGHUP (the terminal or ssh session gone) ended ``serve`` where it stood, every stream cut off
    mid-body, the engine and runtime never closed; every other asyncside command turns it into its
    orderly exit. It now drains as SIGTERM does (error event and [DONE], status 0); started under
    ``nohup`` (SIGHUP ignored) the server keeps serving."""
    script = SERVER_SCRIPT.format(tests=str(pathlib.Path(__file__).parent), tmp=str(tmp_path), long=LONG * 6,
                                  grace=0.3)
    for ignored in (False, True):
        trap = 'trap "" HUP; ' if ignored else ""  # as nohup leaves it: ignored, and inherited
        out: list[dict[str, Any]] = []
        with _server_process(["sh", "-c", f'{trap}exec "$@"', "sh", sys.executable, "-c", script]) as (proc, url):
            started = threading.Event()
            thread = threading.Thread(target=_stream, args=(url, started, out), daemon=True)
            thread.start()
            assert started.wait(60), "the stream never sent its first chunk"
            proc.send_signal(signal.SIGHUP)
            if ignored:
                thread.join(120)
                assert proc.poll() is None and httpx.get(url + "/health").status_code == 200
                proc.send_signal(signal.SIGTERM)
            stdout, stderr = proc.communicate(timeout=120)
            thread.join(60)
        _assert_clean_exit(proc, stdout, stderr)
        assert len(out) == 1 and out[0]["done"], out
        last = out[0]["events"][-1]
        if ignored:  # it ran to its end
            assert last["choices"][0]["finish_reason"] == "length", last
        else:
            assert last["error"]["code"] == "server_shutting_down", last


def test_a_path_cannot_write_lines_of_its_own_into_the_access_log(srv: BackgroundServer,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    """The access log wrote the percent-decoded path: ``GET /x%0a<a forged line>`` put a line of the
    client's making into the log (a request that never happened, for whoever reads or parses it).
    The line now shows the path as sent."""
    forged = "2026-01-01 00:00:00,000 asyncside.access INFO 10.0.0.1:1 \"POST /v1/completions\" 200 0.1s"
    with caplog.at_level(logging.INFO, logger="asyncside.access"):
        r = httpx.get(srv.url + "/x%0a" + forged.replace(" ", "%20").replace('"', "%22") + "%0d%0a")
        assert r.status_code == 404
        deadline = time.monotonic() + HELD
        while not [rec for rec in caplog.records if rec.name == "asyncside.access"]:
            assert time.monotonic() < deadline, "no access-log line"
            time.sleep(0.01)
    [line] = [rec.getMessage() for rec in caplog.records if rec.name == "asyncside.access"]
    assert "\n" not in line and "\r" not in line, line
    assert '"GET /x%0a2026-01-01%2000:00:00,000%20asyncside.access' in line and '" 404 ' in line, line


def test_an_ipv6_host_may_be_bracketed_as_in_a_url() -> None:
    """``--host [::1]`` (an address copied from a URL) was looked up as a host name and the server
    exited with "cannot bind [::1]:8000: Name or service not known"; it binds ::1 now."""
    from asyncside.cli import build_parser

    for given, bound in (("[::1]", "::1"), ("::1", "::1"), ("[::]", "::"), ("127.0.0.1", "127.0.0.1")):
        assert build_parser(["serve"]).parse_args(["serve", "--host", given]).host == bound


def test_a_port_in_use_is_one_plain_line_and_status_1(quick_store: pathlib.Path) -> None:
    """A port another process listens on: the line read "asyncside serve: [Errno 98] cannot bind
    127.0.0.1:8000: Address already in use" (an errno for the user to decode, nothing on what to
    do); it says what to do now, and no model is loaded first."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "asyncside", "serve", "--model", str(quick_store),
                               "--port", str(port)], capture_output=True, text=True, timeout=120,
                              stdin=subprocess.DEVNULL)
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"asyncside serve: cannot bind 127.0.0.1:{port}: Address already in use (another process listens there: "
        "choose another port, or 0 for a free one)"], done.stderr


@pytest.mark.asyncio
async def test_a_stream_waiting_for_its_tokens_sends_comments_a_proxy_sees_as_traffic(
        tmp_path: pathlib.Path) -> None:
    """Behind a proxy with a read timeout (nginx's proxy_read_timeout, a load balancer's idle
    timeout), a stream that sent nothing for that long (queued behind others, a long prompt's
    prefill) was ended by the proxy. A stream now sends an SSE comment after ``sse_heartbeat_s``
    without an event; clients skip it (the openai client's text is the same)."""
    import openai

    tok = byte_tokenizer(tmp_path)
    model = ScriptedModel(tok, "hello", {"count": LONG}, step_delay=0.25)
    app = create_app(scripted_engine(model), ServeSettings(prompt_cache_size=0, max_tokens_limit=256,
                                                           sse_heartbeat_s=0.05))
    body = {"model": "scripted", "prompt": "count", "max_tokens": 6, "stream": True}
    with BackgroundServer(app) as server:
        async with httpx.AsyncClient(timeout=60) as http, http.stream("POST", server.url + "/v1/completions",
                                                                      json=body) as r:
            lines = [line async for line in r.aiter_lines() if line]
        comments = [line for line in lines if line.startswith(":")]
        assert comments and set(comments) == {": keep-alive"}, lines
        data = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        assert "".join(d["choices"][0]["text"] for d in data) == LONG[:6] and lines[-1] == "data: [DONE]"
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused")
        stream = await client.completions.create(model="scripted", prompt="count", max_tokens=6, stream=True)
        assert "".join([c.choices[0].text async for c in stream]) == LONG[:6]
